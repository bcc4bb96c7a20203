"""The decoder-only transformer (GPT and Mixtral families) with dense and MoE blocks: see transformer.py."""
