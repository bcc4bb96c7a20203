"""Run directories and checkpoints on disk: every path name, the safetensors format, checkpoint layout, resume
points."""
