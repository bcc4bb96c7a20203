"""`moesys serve`: one model behind OpenAI-compatible completions and chat endpoints (the paper's "Graph Optimization",
figure 1's request/response deployment), placed with the same offload modes as `moesys infer`, its requests run by
continuous batching."""
