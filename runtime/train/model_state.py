"""The model's parameters and their AdamW state as a checkpoint part: every parameter no other part holds.

dense.safetensors (written by rank 0): model.NAME, exp_avg.NAME, exp_avg_sq.NAME, step.NAME of every non-expert
parameter. experts-ep{p}.safetensors (written by one replica of expert-parallel rank p): the same keys per global
expert g, model.NAME.{g} ..., so that any expert-parallel size loads them. A column-partitioned embedding table is
written whole (`PartitionedEmbeddingPart.full`) and each rank loads its own columns (`.local`).
Files are written and read tensor by tensor (an expert's slice at a time): saving or loading needs memory for one
tensor beyond the model and its optimizer state, not a second copy of them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from runtime.files.checkpoint_format import MODEL, STATE_KEYS, CheckpointError, CheckpointReader, tensor_key
from runtime.files.paths import DENSE, experts_file
from runtime.files.tensorfile import TensorSpec, write_tensors
from runtime.moe.layer import is_expert_param
from runtime.parallel.embedding_partition import partitioned_parameters
from runtime.parallel.groups import ParallelGroups
from runtime.train.parts import Part, PartitionedEmbeddingPart


class ModelState(Part):
    """The model's parameters and the resident optimizer's state of them, less what `others` hold (held_params)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, groups: ParallelGroups,
                 others: Sequence[Part] = ()):
        """optimizer None: the weights alone (an export or an evaluation loads no moments)."""
        self.model, self.optimizer, self.groups = model, optimizer, groups
        self.held = {name for part in others for name in part.held_params()}

    def save(self, directory: Path, step: int) -> list[Path]:
        """Collective when the embedding is partitioned: every rank produces the dense tensors in the same order."""
        groups, files = self.groups, []
        dense = _dense_entries(self.model, self.optimizer, groups, self.held)
        experts = _expert_entries(self.model, self.optimizer, groups, self.held)
        if groups.rank == 0:
            files.append(_write(Path(directory) / DENSE, dense))
        else:
            for _, _, make in dense:
                make()
        if groups.edp_rank == 0 and experts:
            files.append(_write(Path(directory) / experts_file(groups.ep_rank), experts))
        return files

    def load(self, reader: CheckpointReader, step: int) -> None:
        """This rank's experts (whatever expert-parallel size wrote them) and every dense parameter, with their
        moments when there is an optimizer and the checkpoint's step count is above 0."""
        path, model, optimizer, groups = reader.path, self.model, self.optimizer, self.groups
        shards = dict(partitioned_parameters(model))
        for pname, param in model.named_parameters():
            if pname in self.held:
                continue
            expert = is_expert_param(pname)
            globals_ = _local_to_global(groups, param.shape[0]) if expert else []
            count = reader.get(tensor_key("step", pname, globals_[0] if expert else None))
            keep = optimizer is not None and float(count) > 0 and param.requires_grad  # frozen: no moments
            if expert:
                moments = _load_experts(reader, path, pname, param, globals_, keep)
            else:
                moments = _load_dense(reader, path, pname, param, groups, pname in shards, keep)
            if keep and optimizer is not None:
                optimizer.state[param] = {"step": count.reshape(()).to(param.device, copy=True), **moments}


Entry = tuple[str, TensorSpec, Callable[[], torch.Tensor]]
"""A tensor to write: its key, dtype and shape for the header, and how to produce it when its turn comes."""


def _full_table(make: Callable[[], torch.Tensor], groups: ParallelGroups) -> torch.Tensor:
    return PartitionedEmbeddingPart.full(make(), groups)


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
                shape = PartitionedEmbeddingPart.full_shape(shape, groups)
                make = functools.partial(_full_table, make, groups)
            out.append((tensor_key(kind, pname), (dtype, shape), make))
        out.append((tensor_key("step", pname), (torch.float32, (1,)), functools.partial(_step, param, optimizer)))
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
            step = functools.partial(_step, param, optimizer)
            out.append((tensor_key("step", pname, g), (torch.float32, (1,)), step))
    return out


def _write(path: Path, entries: list[Entry]) -> Path:
    return write_tensors(path, {key: spec for key, spec, _ in entries}, ((key, make()) for key, _, make in entries))


def _local_to_global(groups: ParallelGroups, local_experts: int) -> list[int]:
    return [groups.ep_rank * local_experts + j for j in range(local_experts)]


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
        return PartitionedEmbeddingPart.local(value, groups) if partitioned else value

    value = get(MODEL)
    if value.shape != param.shape:
        raise _shape_error(pname, path, tuple(value.shape), param.shape)
    with torch.no_grad():
        param.copy_(value)
    del value
    return {k: get(k).to(param.device, param.dtype) for k in STATE_KEYS} if keep else {}
