"""Training jobs launched and followed: the torchrun command or sbatch script, its processes, a lost node, an
out-of-memory death named."""
