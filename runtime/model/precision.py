"""The torch dtype of each precision name the config takes (train.precision, export.dtype)."""

from __future__ import annotations

import torch

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
