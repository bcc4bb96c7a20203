"""The torch-free planner: parameter counts, Eq. 1, per-rank memory, disk, suggestions and the recorded placement."""
