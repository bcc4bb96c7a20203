"""Training data: text and token files, tokenizers, tokenizing, and the windows of a token stream each rank reads."""
