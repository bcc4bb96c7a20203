"""Checkpoints that survive faults and reshard: safetensors files keyed by *global* expert index.

checkpoints/step_00000020/
  dense.safetensors        model.NAME, exp_avg.NAME, exp_avg_sq.NAME, step.NAME for every non-expert parameter
  experts-ep{p}.safetensors the same keys per global expert g: model.NAME.{g} ... (written by expert-parallel rank p)
  rng-rank{r}.safetensors  each rank's RNG state
  tokenizer.json           the run's tokenizer (what its exports and inference read)
  meta.json                step, world and expert-parallel sizes, the config
checkpoints/latest         name of the newest complete checkpoint
A checkpoint is written into .tmp-step_N, fsynced, then renamed: a killed job never leaves a torn one.
Files are written and read tensor by tensor (an expert's slice at a time), so saving or loading needs memory for one
tensor beyond the model and its optimizer state, not a second copy of them.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from runtime.config import MoesysConfig
from runtime.data.tokenizer import run_tokenizer
from runtime.errors import UserError
from runtime.files.checkpoint_format import (MODEL, STATE_KEYS, CheckpointError, CheckpointReader, checkpoint_meta,
                                             commit_checkpoint, latest_checkpoint, read_meta, remove_old_checkpoints,
                                             tensor_key, tensor_files)
from runtime.files.paths import CHECKPOINTS, DENSE, PARTIAL, TOKENIZER_FILE, experts_file, rng_file, step_name
from runtime.files.resume import skip_hint
from runtime.files.tensorfile import TensorSpec, open_tensors, read_shapes, save_tensors, verify, write_tensors
from runtime.io import atomic_write_text
from runtime.moe.layer import is_expert_param
from runtime.parallel.embedding_partition import gather_columns, partitioned_parameters, shard_of
from runtime.parallel.groups import ParallelGroups, group_size
from runtime.plan.disk import kept_checkpoints

__all__ = ["CheckpointError", "check_fits", "latest_checkpoint", "load_checkpoint", "save_checkpoint"]


def _barrier(groups: ParallelGroups) -> None:
    if groups.world_size > 1:
        dist.barrier()


Entry = tuple[str, TensorSpec, Callable[[], torch.Tensor]]
"""A tensor to write: its key, dtype and shape for the header, and how to produce it when its turn comes."""


def _kinds(param: torch.Tensor, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor | None]:
    """model/optimizer tensors of one parameter by kind; None for a moment AdamW has not created yet (saved as
    zeros)."""
    state = optimizer.state.get(param, {})
    return {MODEL: param.detach(), **{k: state.get(k) for k in STATE_KEYS}}


def _step(param: torch.Tensor, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    step = optimizer.state.get(param, {}).get("step", torch.tensor(0.0))
    return torch.as_tensor(step, dtype=torch.float32).reshape(1)


def _dense_entries(model: nn.Module, optimizer, groups: ParallelGroups, held: set[str]) -> list[Entry]:
    """Every non-expert parameter's tensors; a partitioned table is gathered whole (a collective) when produced."""
    shards = dict(partitioned_parameters(model))
    out: list[Entry] = []
    for pname, param in model.named_parameters():
        if pname in held or is_expert_param(pname):
            continue
        for kind, t in _kinds(param, optimizer).items():
            def make(t=t, param=param) -> torch.Tensor:
                return t if t is not None else torch.zeros_like(param)
            shape, dtype = tuple(param.shape), (t if t is not None else param).dtype
            if pname in shards:  # the full [V, H] table and moments, loadable into any dp size
                shape = (shape[0], shape[1] * group_size(groups.dp_group))
                make = (lambda make=make: gather_columns(make(), groups.dp_group))
            out.append((tensor_key(kind, pname), (dtype, shape), make))
        out.append((tensor_key("step", pname), (torch.float32, (1,)), lambda p=param: _step(p, optimizer)))
    return out


def _expert_entries(model: nn.Module, optimizer, groups: ParallelGroups, held: set[str]) -> list[Entry]:
    """Every local expert's tensors under its global index: slices of the stacked parameters and moments (a slice
    of a contiguous stack is contiguous, so it is written without a copy)."""
    out: list[Entry] = []
    for pname, param in model.named_parameters():
        if pname in held or not is_expert_param(pname):
            continue
        kinds = _kinds(param, optimizer)
        for j, g in enumerate(_local_to_global(groups, param.shape[0])):
            for kind, t in kinds.items():
                def make(t=t, j=j, param=param) -> torch.Tensor:
                    return t[j] if t is not None else torch.zeros_like(param[j])
                out.append((tensor_key(kind, pname, g), ((t if t is not None else param).dtype,
                                                         tuple(param.shape[1:])), make))
            out.append((tensor_key("step", pname, g), (torch.float32, (1,)), lambda p=param: _step(p, optimizer)))
    return out


def _write(path: Path, entries: list[Entry]) -> Path:
    return write_tensors(path, {key: spec for key, spec, _ in entries}, ((key, make()) for key, _, make in entries))


def _local_to_global(groups: ParallelGroups, local_experts: int) -> list[int]:
    return [groups.ep_rank * local_experts + j for j in range(local_experts)]


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
    held = {name for part in parts for name in part.held_params()}
    dense, experts = _dense_entries(model, optimizer, groups, held), _expert_entries(model, optimizer, groups, held)
    files = []
    if groups.rank == 0:
        files.append(_write(tmp / DENSE, dense))
    else:  # gathering a partitioned table is collective: every rank produces the dense tensors in the same order
        for _, _, make in dense:
            make()
    if groups.edp_rank == 0 and experts:
        files.append(_write(tmp / experts_file(groups.ep_rank), experts))
    files.append(save_tensors(tmp / rng_file(groups.rank), _rng_state()))
    if groups.rank == 0:  # the checkpoint carries its tokenizer: its exports and inference read it from here
        atomic_write_text(tmp / TOKENIZER_FILE, run_tokenizer(cfg).to_str())
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
    shards = dict(partitioned_parameters(model))
    held = {name for part in parts for name in part.held_params()}
    for pname, param in model.named_parameters():
        if pname in held:
            continue
        expert = is_expert_param(pname)
        globals_ = _local_to_global(groups, param.shape[0]) if expert else []
        step = reader.get(tensor_key("step", pname, globals_[0] if expert else None))
        keep = optimizer is not None and float(step) > 0
        if expert:
            moments = _load_experts(reader, path, pname, param, globals_, keep)
        else:
            moments = _load_dense(reader, path, pname, param, groups, pname in shards, keep)
        if keep:
            optimizer.state[param] = {"step": step.reshape(()).to(param.device, copy=True), **moments}
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


def _shape_error(pname: str, path: Path, found: tuple, expected: torch.Size) -> CheckpointError:
    return CheckpointError(f"{pname} has shape {found} in {path}, the model expects {tuple(expected)}")


def _load_experts(reader: CheckpointReader, path: Path, pname: str, param: torch.Tensor, globals_: list[int],
                  keep: bool) -> dict[str, torch.Tensor]:
    """Copy the local experts' weights into `param` expert by expert; with `keep`, also their moments into tensors
    allocated once (the moments the optimizer will hold). Returns the moments."""
    moments = {k: torch.zeros_like(param) for k in STATE_KEYS} if keep else {}
    with torch.no_grad():
        for j, g in enumerate(globals_):
            value = reader.get(tensor_key(MODEL, pname, g))
            if value.shape != param.shape[1:]:
                raise _shape_error(pname, path, (len(globals_), *value.shape), param.shape)
            param[j].copy_(value)
            for kind, moment in moments.items():
                moment[j].copy_(reader.get(tensor_key(kind, pname, g)))
    return moments


def _load_dense(reader: CheckpointReader, path: Path, pname: str, param: torch.Tensor, groups: ParallelGroups,
                partitioned: bool, keep: bool) -> dict[str, torch.Tensor]:
    """Copy one dense parameter (this rank's columns of a partitioned table); with `keep` return its moments."""
    def get(kind: str) -> torch.Tensor:
        value = reader.get(tensor_key(kind, pname))
        return shard_of(value, groups.dp_ranks.index(groups.rank), groups.dp_size) if partitioned else value

    value = get(MODEL)
    if value.shape != param.shape:
        raise _shape_error(pname, path, tuple(value.shape), param.shape)
    with torch.no_grad():
        param.copy_(value)
    del value
    return {k: get(k).to(param.device, param.dtype) for k in STATE_KEYS} if keep else {}


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
