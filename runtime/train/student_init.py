"""The student's starting point for `moesys distill`: in each MoE layer, the teacher's most used experts (top-k
selections counted on held-out text) with their router rows, and every dense weight, written as the student run's
step-0 checkpoint. Workers start from it as from any checkpoint, so a resume never comes back here.

Legend: E teacher experts, K student experts, D model dim.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import torch
from torch import nn

from runtime.config import MoesysConfig
from runtime.errors import UserError
from runtime.files.checkpoint_format import (
    MODEL,
    STATE_KEYS,
    CheckpointReader,
    checkpoint_meta,
    commit_checkpoint,
    latest_checkpoint,
    tensor_key,
)
from runtime.files.paths import CHECKPOINTS, DENSE, SELECTION, experts_file, rng_file, step_name
from runtime.files.tensorfile import save_tensors, write_tensors
from runtime.host.io import atomic_write_json
from runtime.model.transformer import Transformer
from runtime.moe.layer import MoELayer, is_expert_param
from runtime.train.distill import heldout_windows, load_frozen, split_heldout, teacher_checkpoint


@torch.no_grad()
def expert_usage(model: nn.Module, windows_NS: torch.Tensor, batch_size: int = 16) -> list[torch.Tensor]:
    """Per MoE layer (model order), how many times each expert was among a token's top-k choices over the windows'
    inputs ([E] int64 counts); `model` in eval mode, so routing has no noise."""
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    counts = [torch.zeros(layer.cfg.num_experts, dtype=torch.int64) for layer in layers]

    def counter(i: int):
        def hook(router, inputs, routing) -> None:
            counts[i] += torch.bincount(routing.expert_ids_TK.flatten().cpu(), minlength=counts[i].numel())
        return hook

    handles = [layer.router.register_forward_hook(counter(i)) for i, layer in enumerate(layers)]
    try:
        device = next(model.parameters()).device
        for chunk in windows_NS.split(batch_size):
            model(chunk[:, :-1].to(device))
    finally:
        for handle in handles:
            handle.remove()
    return counts


def most_used(usage_E: torch.Tensor, k: int) -> list[int]:
    """The k most used experts (ties: the lower index), in ascending order: student expert j is the j-th of them."""
    ranked = sorted(range(usage_E.numel()), key=lambda e: (-int(usage_E[e]), e))
    return sorted(ranked[:k])


def moe_layer_names(model: nn.Module) -> list[str]:
    """Module names of the MoE layers in model order ("layers.0.ffn", ...)."""
    return [name for name, mod in model.named_modules() if isinstance(mod, MoELayer)]


def start_student(cfg: MoesysConfig, run_dir: Path) -> dict | None:
    """Unless `run_dir` holds a checkpoint already (a resume: the student continues from it): count the teacher's
    expert usage on the held-out windows, keep each layer's student.num_experts most used, record them in
    RUN_DIR/distill.json and write the step-0 checkpoint. Returns the record, or None on a resume."""
    run_dir = Path(run_dir)
    if latest_checkpoint(run_dir) is not None:
        return None
    text = split_heldout(cfg)
    windows = heldout_windows(text.heldout, cfg.train.seq_len, cfg.distill.heldout_windows)
    teacher = load_frozen(teacher_checkpoint(cfg), torch.device("cpu"))
    usage = expert_usage(teacher, windows)
    k = cfg.student.num_experts
    kept = [most_used(u, k) for u in usage]
    layers = [{"layer": name, "usage": u.tolist(), "kept": j}
              for name, u, j in zip(moe_layer_names(teacher), usage, kept, strict=True)]
    record = {
        "teacher": cfg.distill.teacher, "teacher_experts": int(usage[0].numel()), "student_experts": k,
        "heldout": {"source": text.source, "windows": int(windows.shape[0]), "tokens": int(windows[:, 1:].numel())},
        "layers": layers,
    }
    del teacher
    atomic_write_json(run_dir / SELECTION, record)  # before the checkpoint: a checkpoint always has its record
    write_student_checkpoint(Path(teacher_checkpoint(cfg)), kept, cfg, run_dir)
    return record


def write_student_checkpoint(teacher_step: Path, kept: list[list[int]], cfg: MoesysConfig, run_dir: Path) -> Path:
    """The student's step-0 checkpoint in the training format (runtime/train/checkpoint.py), streamed tensor by
    tensor from the teacher's: dense weights copied, each MoE layer's router rows and experts of `kept` (student
    expert j = teacher expert kept[layer][j]), AdamW moments and step counts zero (a fresh optimizer), each rank's
    RNG seeded as a fresh run seeds it. Written into a temporary directory and renamed, like every checkpoint."""
    reader = CheckpointReader(Path(teacher_step))
    with torch.device("meta"):
        student = Transformer(cfg.model)
    layers = moe_layer_names(student)
    gates = {f"{name}.router.gate.weight": kept[i] for i, name in enumerate(layers)}
    expert_layers = {f"{name}.experts": kept[i] for i, name in enumerate(layers)}
    dense: dict[str, tuple] = {}
    experts: dict[str, tuple] = {}
    for pname, param in student.named_parameters():
        if is_expert_param(pname):
            chosen = expert_layers[pname.rsplit(".", 1)[0]]
            for j, g in enumerate(chosen):
                source = tensor_key(MODEL, pname, g)
                _check_shape(_shape(reader, source), tuple(param.shape[1:]), pname)
                _add_param(experts, pname, j, param[0], lambda s=source, d=param.dtype: reader.get(s).to(d))
        else:
            source, rows = tensor_key(MODEL, pname), gates.get(pname)
            found = _shape(reader, source)
            if rows is None:
                _check_shape(found, tuple(param.shape), pname)
            else:  # a router: the kept experts' rows
                _check_shape(found[1:], tuple(param.shape[1:]), pname)
            _add_param(dense, pname, None, param, functools.partial(_read, reader, source, param.dtype, rows))
    return _write_checkpoint(Path(run_dir), cfg, dense, experts)


def _read(reader: CheckpointReader, key: str, dtype: torch.dtype, rows: list[int] | None) -> torch.Tensor:
    """Tensor `key` of the teacher's checkpoint (its rows `rows` when given) in `dtype`."""
    t = reader.get(key)
    return (t if rows is None else t[rows]).to(dtype)


def _shape(reader: CheckpointReader, key: str) -> tuple[int, ...]:
    if key not in reader:
        raise UserError(f"the teacher's checkpoint {reader.path} has no {key}: the student must keep the teacher's "
                        "model settings other than its number of experts")
    return tuple(reader.where[key].get_slice(key).get_shape())


def _check_shape(found: tuple[int, ...], want: tuple[int, ...], pname: str) -> None:
    if found != want:
        raise UserError(f"{pname} is {found} in the teacher and {want} in the student: the student must keep the "
                        "teacher's model settings other than its number of experts")


def _add_param(entries: dict, pname: str, expert: int | None, like: torch.Tensor, weight) -> None:
    """The four tensors of one parameter (or of one expert's slice): the weight, zero moments, step 0."""
    spec = (like.dtype, tuple(like.shape))
    entries[tensor_key(MODEL, pname, expert)] = (spec, weight)
    for kind in STATE_KEYS:
        entries[tensor_key(kind, pname, expert)] = (spec, lambda s=spec: torch.zeros(s[1], dtype=s[0]))
    entries[tensor_key("step", pname, expert)] = ((torch.float32, (1,)), lambda: torch.zeros(1))


def _write_checkpoint(run_dir: Path, cfg: MoesysConfig, dense: dict, experts: dict) -> Path:
    root = run_dir / CHECKPOINTS
    name = step_name(0)
    tmp = root / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for file, entries in ((DENSE, dense), (experts_file(0), experts)):
        write_tensors(tmp / file, {k: spec for k, (spec, _) in entries.items()},
                      ((k, make()) for k, (_, make) in entries.items()))
    world = cfg.topology.world_size
    for rank in range(world):  # as loop.train seeds a fresh run: router noise differs per rank
        state = torch.Generator().manual_seed(cfg.train.seed + 1 + rank).get_state()
        save_tensors(tmp / rng_file(rank), {"cpu": state})
    return commit_checkpoint(tmp, checkpoint_meta(0, world, cfg.topology.expert_parallel, cfg))
