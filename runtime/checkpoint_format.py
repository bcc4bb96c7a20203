"""What a checkpoint directory holds and how its tensors are named, for every writer and reader (training, offloaded
experts, inference). Tensors are keyed by kind and *global* expert index, so any expert-parallel size can read them:

  KIND.PARAM        dense parameter PARAM (KIND: model, exp_avg, exp_avg_sq, step)
  KIND.PARAM.G      global expert G of the stacked expert parameter PARAM
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

from runtime.errors import UserError
from runtime.run_dir import CHECKPOINTS

if TYPE_CHECKING:
    import torch

MODEL = "model"
STATE_KEYS = ("exp_avg", "exp_avg_sq")
META = "meta.json"


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete, damaged or does not match the model."""


def tensor_key(kind: str, param: str, expert: int | None = None) -> str:
    return f"{kind}.{param}" if expert is None else f"{kind}.{param}.{expert}"


def read_meta(path: Path) -> dict:
    try:
        return json.loads((Path(path) / META).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {Path(path) / META}: {exc}") from None


class CheckpointReader:
    """Finds a tensor by key across the checkpoint's safetensors files (memory-mapped, read lazily); every file's
    checksum is verified when the reader opens it, so a damaged file is named before anything loads from it."""

    def __init__(self, path: Path):
        from runtime.tensorfile import verify  # torch: only readers of tensors load it

        self.path = Path(path)
        self.where = {}
        for file in sorted(self.path.glob("*.safetensors")):
            if not file.name.startswith("rng-"):
                verify(file)
                try:
                    handle = safe_open(str(file), framework="pt")
                except Exception as exc:  # safetensors' own error types, for a torn file written without checksum
                    raise CheckpointError(f"{file}: corrupt safetensors file ({str(exc).strip().splitlines()[0]})"
                                          ) from None
                self.where.update({key: handle for key in handle.keys()})

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def get(self, key: str) -> torch.Tensor:
        if key not in self.where:
            raise CheckpointError(f"checkpoint {self.path} has no tensor {key}; was it written by a different "
                                  "model config?")
        return self.where[key].get_tensor(key)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None. Temporary directories of killed writes are ignored."""
    root = Path(run_dir) / CHECKPOINTS
    pointer = root / "latest"
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / "meta.json").exists() else None
