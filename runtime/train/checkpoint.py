"""Checkpoints that survive faults and reshard: safetensors files keyed by *global* expert index.

checkpoints/step_00000020/
  dense.safetensors        model.NAME, exp_avg.NAME, exp_avg_sq.NAME, step.NAME for every non-expert parameter
  experts-ep{p}.safetensors the same keys per global expert g: model.NAME.{g} ... (written by expert-parallel rank p)
  rng-rank{r}.safetensors  each rank's RNG state
  tokenizer.json           the run's tokenizer (what its exports and inference read)
  meta.json                step, world and expert-parallel sizes, the config
checkpoints/latest         name of the newest complete checkpoint
A checkpoint is written into .tmp-step_N, fsynced, then renamed: a killed job never leaves a torn one. Its parts
write and read their own files: the model state first (runtime/train/model_state.py), then each of the step's parts
(runtime/train/parts.py).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from runtime.config import MoesysConfig
from runtime.data.generation_facts import write_facts
from runtime.data.tokenizer import run_tokenizer
from runtime.errors import UserError
from runtime.files.checkpoint_format import (
    MODEL,
    CheckpointError,
    CheckpointReader,
    checkpoint_meta,
    commit_checkpoint,
    latest_checkpoint,
    read_meta,
    remove_old_checkpoints,
    tensor_files,
    tensor_key,
)
from runtime.files.paths import CHECKPOINTS, PARTIAL, TOKENIZER_FILE, rng_file, step_name
from runtime.files.resume import skip_hint
from runtime.files.tensorfile import open_tensors, read_shapes, save_tensors, verify
from runtime.host.io import atomic_write_text
from runtime.moe.layer import is_expert_param
from runtime.parallel.groups import ParallelGroups
from runtime.plan.disk import kept_checkpoints
from runtime.train.model_state import ModelState

__all__ = ["CheckpointError", "check_fits", "latest_checkpoint", "load_checkpoint", "save_checkpoint"]


def _barrier(groups: ParallelGroups) -> None:
    if groups.world_size > 1:
        dist.barrier()


def save_checkpoint(run_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    groups: ParallelGroups, cfg: MoesysConfig, keep: int | None = None, parts: Sequence = ()) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint directory. The newest `keep` complete
    checkpoints stay (default: runtime/plan/disk.kept_checkpoints, the count the plan's disk bytes assume).

    Each of `parts` (runtime/train/parts.py) writes its own files into the checkpoint before it is renamed, and
    the model parameters it holds (part.held_params) are left to it."""
    root = Path(run_dir) / CHECKPOINTS
    name = step_name(step)
    tmp = root / f"{PARTIAL}{name}"
    if groups.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(groups)
    files = ModelState(model, optimizer, groups, parts).save(tmp, step)  # collective with a partitioned table
    files.append(save_tensors(tmp / rng_file(groups.rank), _rng_state()))
    if groups.rank == 0:  # the checkpoint carries its tokenizer and generation facts: exports and inference read them
        tokenizer = run_tokenizer(cfg)
        atomic_write_text(tmp / TOKENIZER_FILE, tokenizer.to_str())
        write_facts(tmp, tokenizer.facts)
    for part in parts:  # may be collective: every rank, every part, in order
        files += part.save(tmp, step)
    _barrier(groups)
    final = root / name
    if groups.rank == 0:
        commit_checkpoint(tmp, checkpoint_meta(step, groups.world_size, groups.ep_size, cfg))
        remove_old_checkpoints(root, kept_checkpoints(cfg) if keep is None else keep)
    _barrier(groups)
    return final


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    groups: ParallelGroups, restore_rng: bool = True, parts: Sequence = ()) -> int:
    """Load model (and optimizer) state for this rank's experts, whatever EP size wrote it, then each part's
    state (runtime/train/parts.py). Returns the step."""
    path = Path(path)
    try:
        meta = read_meta(path)
        reader = CheckpointReader(path)
    except UserError as exc:  # damaged or incomplete (a checksum, a missing file): say how to start without it
        raise CheckpointError(f"{exc}; {skip_hint(path)}") from None
    ModelState(model, optimizer, groups, parts).load(reader, int(meta["step"]))
    rng_path = path / rng_file(groups.rank)
    if restore_rng and meta["world_size"] == groups.world_size and rng_path.exists():
        try:
            verify(rng_path)
        except UserError as exc:
            raise CheckpointError(f"{exc}; {skip_hint(path)}") from None
        with open_tensors(rng_path) as f:
            torch.set_rng_state(f.get_tensor("cpu"))
            if torch.cuda.is_available() and "cuda" in f.keys():
                torch.cuda.set_rng_state(f.get_tensor("cuda"))
    for part in parts:
        part.load(reader, int(meta["step"]))
    return int(meta["step"])


def check_fits(path: Path, cfg: MoesysConfig) -> None:
    """Raise CheckpointError (one line, naming the first mismatch) unless every parameter of the model `cfg`
    describes is in the checkpoint with the same shape. Reads only the files' headers and builds nothing."""
    from runtime.model.transformer import Transformer

    shapes: dict[str, tuple[int, ...]] = {}
    for name in tensor_files(path):
        shapes.update({k: s for k, s in read_shapes(Path(path) / name).items() if k.startswith(f"{MODEL}.")})
    with torch.device("meta"):
        model = Transformer(cfg.model)
    for pname, param in model.named_parameters():
        if is_expert_param(pname):
            key, want = tensor_key("model", pname, 0), tuple(param.shape[1:])
            count = sum(1 for k in shapes if k.startswith(f"model.{pname}."))
            if key in shapes and count != param.shape[0]:
                raise CheckpointError(f"{path} holds {count} experts per layer; this config has "
                                      f"model.num_experts={param.shape[0]}")
        else:
            key, want = tensor_key("model", pname), tuple(param.shape)
        if key not in shapes:
            raise CheckpointError(f"{path} has no {pname}: it was written by a different model config")
        if shapes[key] != want:
            raise CheckpointError(f"{pname} has shape {shapes[key]} in {path}; this config makes {want}")
