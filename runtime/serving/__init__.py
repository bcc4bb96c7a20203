"""`moesys serve`: one model behind an OpenAI-compatible completions endpoint (seed 004 section 3.3.1, figure 1's
request/response deployment), placed with the same offload modes as `moesys infer`."""
