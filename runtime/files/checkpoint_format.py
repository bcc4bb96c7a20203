"""What a checkpoint directory holds and how its tensors are named, for every writer and reader (training, offloaded
experts, inference). Tensors are keyed by kind and *global* expert index, so any expert-parallel size can read them:

  KIND.PARAM        dense parameter PARAM (KIND: model, exp_avg, exp_avg_sq, step)
  KIND.PARAM.G      global expert G of the stacked expert parameter PARAM
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

from runtime.errors import UserError
from runtime.files.run_dir import CHECKPOINTS

if TYPE_CHECKING:
    import torch

MODEL = "model"
STATE_KEYS = ("exp_avg", "exp_avg_sq")
META = "meta.json"
FILES = "files"
"""meta.json's list of the checkpoint's tensor files (RNG states aside), so that a reader names one that is gone."""
PARTIAL = ".tmp-"
"""The prefix of a checkpoint's directory while it is written (CHECKPOINTS/.tmp-step_N), renamed when complete."""


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete, damaged or does not match the model."""


def tensor_key(kind: str, param: str, expert: int | None = None) -> str:
    return f"{kind}.{param}" if expert is None else f"{kind}.{param}.{expert}"


def tensor_files(directory: Path) -> list[str]:
    """The names of the safetensors files in `directory` that hold model or optimizer tensors (not RNG states)."""
    return sorted(p.name for p in Path(directory).glob("*.safetensors") if not p.name.startswith("rng-"))


def check_complete(path: Path) -> None:
    """Raise CheckpointError naming the tensor files the checkpoint's meta.json lists that are not there (a deleted
    expert file would otherwise be reported as a missing tensor). Checkpoints without the list pass."""
    try:
        listed = json.loads((Path(path) / META).read_text()).get(FILES) or []
    except (OSError, ValueError, AttributeError):
        return
    missing = [name for name in listed if not (Path(path) / name).is_file()]
    if missing:
        raise CheckpointError(f"{path} is missing {', '.join(missing)} (its meta.json lists the file); restore it, "
                              "or use an older checkpoint")


def missing_tensor(path: Path, key: str) -> CheckpointError:
    """The error for a tensor `key` the checkpoint in `path` does not hold: the expert file that held it, when that
    file is gone (a checkpoint written without a file list in meta.json), else the files it has."""
    path = Path(path)
    try:
        meta = json.loads((path / META).read_text())
        experts, ranks = int(meta["num_experts"]), int(meta["expert_parallel"])
        expert = int(key.rpartition(".")[2]) if key.count(".") >= 2 else None
    except (OSError, ValueError, KeyError, TypeError):
        expert = None
    if expert is not None and ranks > 0 and experts % ranks == 0 and expert < experts:
        rank = expert // (experts // ranks)
        name = f"experts-ep{rank}"  # experts-epP.safetensors, or experts-epP-L*.safetensors for offloaded layers
        if not any(f == f"{name}.safetensors" or f.startswith(f"{name}-") for f in tensor_files(path)):
            return CheckpointError(f"{path} is missing {name}.safetensors, which holds expert {expert} "
                                   f"({key}); restore it, or use an older checkpoint")
    return CheckpointError(f"{path} has no tensor {key} in {', '.join(tensor_files(path)) or 'any file'}; was it "
                           "written by a different model config?")


def read_meta(path: Path) -> dict:
    try:
        return json.loads((Path(path) / META).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {Path(path) / META}: {exc}") from None


class CheckpointReader:
    """Finds a tensor by key across the checkpoint's safetensors files (memory-mapped, read lazily); every file's
    checksum is verified when the reader opens it, so a damaged file is named before anything loads from it."""

    def __init__(self, path: Path):
        from runtime.files.tensorfile import verify  # torch: only readers of tensors load it

        self.path = Path(path)
        self.where = {}
        check_complete(self.path)
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
            raise missing_tensor(self.path, key)
        return self.where[key].get_tensor(key)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None. Temporary directories of killed writes are ignored."""
    root = Path(run_dir) / CHECKPOINTS
    pointer = root / "latest"
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / "meta.json").exists() else None


def remove_partial_checkpoints(run_dir: Path) -> None:
    """Remove the directories of checkpoints whose writing failed or was killed: nothing resumes from them, and on a
    full disk they hold the space that the error report needs."""
    for partial in (Path(run_dir) / CHECKPOINTS).glob(f"{PARTIAL}*"):
        shutil.rmtree(partial, ignore_errors=True)
