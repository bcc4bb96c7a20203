"""Checkpoints that survive faults and reshard: safetensors files keyed by *global* expert index.

checkpoints/step_00000020/
  dense.safetensors        model.NAME, exp_avg.NAME, exp_avg_sq.NAME, step.NAME for every non-expert parameter
  experts-ep{p}.safetensors the same keys per global expert g: model.NAME.{g} ... (written by expert-parallel rank p)
  rng-rank{r}.safetensors  each rank's RNG state
  meta.json                step, world and expert-parallel sizes, the config
checkpoints/latest         name of the newest complete checkpoint
A checkpoint is written into .tmp-step_N, fsynced, then renamed: a killed job never leaves a torn one.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from runtime.checkpoint_format import (STATE_KEYS, CheckpointError, CheckpointReader, latest_checkpoint, read_meta,
                                       tensor_key)
from runtime.config import MoesysConfig
from runtime.io import atomic_write_json, atomic_write_text, fsync_dir
from runtime.moe.layer import is_expert_param
from runtime.parallel.embedding_partition import gather_columns, partitioned_parameters, shard_of
from runtime.parallel.groups import ParallelGroups
from runtime.run_dir import CHECKPOINTS
from runtime.tensorfile import save_tensors, verify

__all__ = ["CheckpointError", "check_fits", "latest_checkpoint", "load_checkpoint", "save_checkpoint"]


def _barrier(groups: ParallelGroups) -> None:
    if groups.world_size > 1:
        dist.barrier()


def _param_state(name: str, param: torch.Tensor, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """model/optimizer tensors of one parameter, keyed by kind."""
    out = {"model": param.detach()}
    state = optimizer.state.get(param, {})
    for key in STATE_KEYS:
        out[key] = state[key] if key in state else torch.zeros_like(param)
    step = state.get("step", torch.tensor(0.0))
    out["step"] = torch.as_tensor(step, dtype=torch.float32).reshape(1)
    return out


def _local_to_global(groups: ParallelGroups, local_experts: int) -> list[int]:
    return [groups.ep_rank * local_experts + j for j in range(local_experts)]


def save_checkpoint(run_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    groups: ParallelGroups, cfg: MoesysConfig, keep: int = 2, parts: Sequence = ()) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint directory.

    Each of `parts` (runtime/train/parts.py) writes its own files into the checkpoint before it is renamed, and
    the model parameters it holds (part.held_params) are left to it."""
    root = Path(run_dir) / CHECKPOINTS
    name = f"step_{step:08d}"
    tmp = root / f".tmp-{name}"
    if groups.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(groups)
    dense: dict[str, torch.Tensor] = {}
    experts: dict[str, torch.Tensor] = {}
    shards = dict(partitioned_parameters(model))
    held = {name for part in parts for name in part.held_params()}
    for pname, param in model.named_parameters():
        if pname in held:
            continue
        tensors = _param_state(pname, param, optimizer)
        if pname in shards:  # collective: the full [V, H] table and moments, loadable into any dp size
            tensors = {k: t if k == "step" else gather_columns(t, groups.dp_group) for k, t in tensors.items()}
        if is_expert_param(pname):
            for g, j in zip(_local_to_global(groups, param.shape[0]), range(param.shape[0])):
                for kind, t in tensors.items():
                    experts[tensor_key(kind, pname, g)] = (t if kind == "step" else t[j]).contiguous().clone()
        else:
            for kind, t in tensors.items():
                dense[tensor_key(kind, pname)] = t.contiguous()
    files = []
    if groups.rank == 0:
        files.append(save_tensors(tmp / "dense.safetensors", dense))
    if groups.edp_rank == 0 and experts:
        files.append(save_tensors(tmp / f"experts-ep{groups.ep_rank}.safetensors", experts))
    files.append(save_tensors(tmp / f"rng-rank{groups.rank}.safetensors", _rng_state()))
    for part in parts:  # may be collective: every rank, every part, in order
        files += part.save(tmp, step)
    _barrier(groups)
    final = root / name
    if groups.rank == 0:
        meta = {"step": step, "world_size": groups.world_size, "expert_parallel": groups.ep_size,
                "num_experts": cfg.model.num_experts, "config": asdict(cfg)}
        atomic_write_json(tmp / "meta.json", meta)
        fsync_dir(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        fsync_dir(root)
        atomic_write_text(root / "latest", name + "\n")
        for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
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
    meta = read_meta(path)
    reader = CheckpointReader(path)
    shards = dict(partitioned_parameters(model))
    held = {name for part in parts for name in part.held_params()}
    for pname, param in model.named_parameters():
        if pname in held:
            continue
        if is_expert_param(pname):
            globals_ = _local_to_global(groups, param.shape[0])
            tensors = {kind: [reader.get(tensor_key(kind, pname, g)) for g in globals_]
                       for kind in ("model", *STATE_KEYS)}
            values = {kind: torch.stack(ts) for kind, ts in tensors.items()}
            step = reader.get(tensor_key("step", pname, globals_[0]))
        else:
            values = {kind: reader.get(tensor_key(kind, pname)) for kind in ("model", *STATE_KEYS)}
            step = reader.get(tensor_key("step", pname))
            if pname in shards:  # this rank's columns of the full table
                values = {k: shard_of(v, groups.dp_ranks.index(groups.rank), groups.dp_size) for k, v in values.items()}
        if values["model"].shape != param.shape:
            raise CheckpointError(f"{pname} has shape {tuple(values['model'].shape)} in {path}, "
                                  f"the model expects {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(values["model"])
        if optimizer is not None and float(step) > 0:
            optimizer.state[param] = {"step": step.reshape(()).clone(),
                                      **{k: values[k].to(param.device, param.dtype) for k in STATE_KEYS}}
    rng_file = path / f"rng-rank{groups.rank}.safetensors"
    if restore_rng and meta["world_size"] == groups.world_size and rng_file.exists():
        verify(rng_file)
        with safe_open(str(rng_file), framework="pt") as f:
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
    for file in sorted(Path(path).glob("*.safetensors")):
        if not file.name.startswith("rng-"):
            with safe_open(str(file), framework="pt") as f:
                shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if k.startswith("model.")})
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
