"""moesys runtime: everything that computes. Imports torch and itself, never Hydra, OmegaConf, Typer or rich."""
