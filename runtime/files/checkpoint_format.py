"""What a checkpoint directory holds and how its tensors are named, for every writer and reader (training, offloaded
experts, inference). Tensors are keyed by kind and *global* expert index, so any expert-parallel size can read them:

  KIND.PARAM        dense parameter PARAM (KIND: model, exp_avg, exp_avg_sq, step)
  KIND.PARAM.G      global expert G of the stacked expert parameter PARAM
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.config import MoesysConfig
from runtime.errors import UserError
from runtime.files.paths import (
    CHECKPOINTS,
    LATEST,
    META,
    PARTIAL,
    RNG_PREFIX,
    STEP_PREFIX,
    experts_file,
    experts_file_stem,
)
from runtime.host.io import atomic_write_json, atomic_write_text, fsync_dir

if TYPE_CHECKING:
    import torch

MODEL = "model"
STATE_KEYS = ("exp_avg", "exp_avg_sq")
FILES = "files"
"""meta.json's list of the checkpoint's tensor files (RNG states aside), so that a reader names one that is gone."""


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete, damaged or does not match the model."""


def tensor_key(kind: str, param: str, expert: int | None = None) -> str:
    return f"{kind}.{param}" if expert is None else f"{kind}.{param}.{expert}"


def tensor_files(directory: Path) -> list[str]:
    """The names of the safetensors files in `directory` that hold model or optimizer tensors (not RNG states)."""
    return sorted(p.name for p in Path(directory).glob("*.safetensors") if not p.name.startswith(RNG_PREFIX))


def check_complete(path: Path) -> None:
    """Raise CheckpointError naming the tensor files the checkpoint's meta.json lists that are not there (a deleted
    expert file would otherwise be reported as a missing tensor). Checkpoints without the list pass."""
    try:
        listed = read_meta(path).get(FILES) or []
    except (ValueError, AttributeError):  # CheckpointError is a ValueError
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
        meta = read_meta(path)
        experts, ranks = int(meta["num_experts"]), int(meta["expert_parallel"])
        expert = int(key.rpartition(".")[2]) if key.count(".") >= 2 else None
    except (ValueError, KeyError, TypeError):  # CheckpointError is a ValueError
        expert = None
    if expert is not None and ranks > 0 and experts % ranks == 0 and expert < experts:
        rank = expert // (experts // ranks)
        name = experts_file_stem(rank)  # experts-epP.safetensors, or experts-epP-L*.safetensors for offloaded layers
        if not any(f == experts_file(rank) or f.startswith(f"{name}-") for f in tensor_files(path)):
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
        from runtime.files.tensorfile import open_tensors, verify  # torch: only readers of tensors load it

        self.path = Path(path)
        self.where = {}
        check_complete(self.path)
        for file in sorted(self.path.glob("*.safetensors")):
            if not file.name.startswith(RNG_PREFIX):
                verify(file)
                try:
                    handle = open_tensors(file)
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


def checkpoint_meta(step: int, world_size: int, expert_parallel: int, cfg: MoesysConfig) -> dict:
    """meta.json: the step, the layout that wrote the checkpoint, and the full config."""
    return {"step": step, "world_size": world_size, "expert_parallel": expert_parallel,
            "num_experts": cfg.model.num_experts, "config": asdict(cfg)}


def commit_checkpoint(tmp: Path, meta: dict) -> Path:
    """Make the written directory `tmp` (CHECKPOINTS/.tmp-NAME) the checkpoint NAME: meta.json last (with the list
    of its tensor files), fsync, rename over any earlier one of that name, then `latest`. A crash before the rename
    leaves only a .tmp- directory."""
    root, name = tmp.parent, tmp.name.removeprefix(PARTIAL)
    final = root / name
    atomic_write_json(tmp / META, {**meta, FILES: tensor_files(tmp)})
    fsync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    fsync_dir(root)
    atomic_write_text(root / LATEST, name + "\n")
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None. Temporary directories of killed writes are ignored."""
    root = Path(run_dir) / CHECKPOINTS
    pointer = root / LATEST
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / META).exists() else None


def remove_partial_checkpoints(run_dir: Path) -> None:
    """Remove the directories of checkpoints whose writing failed or was killed: nothing resumes from them, and on a
    full disk they hold the space that the error report needs."""
    for partial in (Path(run_dir) / CHECKPOINTS).glob(f"{PARTIAL}*"):
        shutil.rmtree(partial, ignore_errors=True)


def remove_old_checkpoints(root: Path, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints under `root` (CHECKPOINTS); remove the older ones."""
    for old in sorted(p for p in Path(root).glob(f"{STEP_PREFIX}*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
