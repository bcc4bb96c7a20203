"""Released MoE families in their Hugging Face format (config.json and safetensors shards), read and written both
ways: config.json <-> the model section, tensor names <-> moesys parameters, one family table (families.py)."""
