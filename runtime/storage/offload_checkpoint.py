"""Offloaded experts in a checkpoint: written from their home (host memory or the SSD store) one expert at a time,
each caught up to the checkpoint's step, under the keys a resident model's checkpoint uses; read back into their
home from a checkpoint written with offload or without, by any expert-parallel size."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import chain
from pathlib import Path

import torch
from torch import Tensor

from runtime.files.checkpoint_format import MODEL, STATE_KEYS, CheckpointReader, tensor_key
from runtime.files.paths import experts_file
from runtime.files.tensorfile import spec_of, write_tensors
from runtime.storage.expert_slots import ExpertSlot
from runtime.storage.host_home import fill_slot
from runtime.storage.offload_engine import LayerSpec, OffloadEngine
from runtime.storage.optim import catch_up
from runtime.storage.ssd_home import SSDHome


def save_offloaded(engine: OffloadEngine, directory: Path, step: int) -> list[Path]:
    """Write this rank's experts into the checkpoint being assembled in `directory`: one file per MoE layer,
    streamed one expert at a time, each caught up to `step`. Keys are those a resident checkpoint uses: the
    checkpoint is a complete, immutable copy that inference and any EP size can load. Expert-data-parallel
    replicas hold equal states, so only the first of them writes."""
    engine.drain()
    assert step == engine.steps_done, (step, engine.steps_done)
    if engine.groups is not None and engine.groups.edp_rank != 0:
        return []
    ep_rank = engine.groups.ep_rank if engine.groups is not None else 0
    files = []
    for spec in engine.specs.values():
        slots = _caught_up_slots(engine, spec, step)
        first = next(slots)  # every expert of a layer has its shapes: the header is known from the first
        specs = {k: spec_of(t) for g in range(spec.first_global, spec.first_global + spec.num_local)
                 for k, t in _checkpoint_items(spec, g, first[1])}
        stream = (item for g, slot in chain([first], slots) for item in _checkpoint_items(spec, g, slot))
        del first
        files.append(write_tensors(directory / experts_file(ep_rank, spec.index), specs,
                                   stream))
    return files


def _caught_up_slots(engine: OffloadEngine, spec: LayerSpec, step: int) -> Iterator[tuple[int, ExpertSlot]]:
    for j in range(spec.num_local):
        key = spec.key(j)
        slot = engine.home.checkpoint_slot(key)
        with torch.no_grad():
            if engine.trainable and catch_up([slot], step, engine.lr_schedule, engine.adamw):
                slot.refresh_stage()
        yield key[1], slot


def _checkpoint_items(spec: LayerSpec, g: int, slot: ExpertSlot) -> list[tuple[str, Tensor]]:
    """One expert's states under the checkpoint keys of a resident model (runtime/files/checkpoint_format.py); a
    frozen expert's moments are zeros, as a resident frozen parameter's."""
    views = {attr: slot.views(attr, spec.layout) for attr in ("master", *(STATE_KEYS if slot.has_moments else ()))}
    out = []
    for name in spec.names:
        param = f"{spec.param_prefix}.{name}"
        master = views["master"][name]
        out.append((tensor_key(MODEL, param, g), master))
        out += [(tensor_key(kind, param, g), views[kind][name] if kind in views else torch.zeros_like(master))
                for kind in STATE_KEYS]
        out.append((tensor_key("step", param, g), slot.step.reshape(1)))
    return out


def load_offloaded(engine: OffloadEngine, reader: CheckpointReader, step: int) -> None:
    """Restore this rank's experts from a checkpoint (written with offload or without, by any EP size): the run
    resumes with exactly the expert states of that checkpoint."""
    engine.drain()
    if hasattr(engine.home, "forget"):
        engine.home.forget()
    for spec in engine.specs.values():
        for j in range(spec.num_local):
            key = spec.key(j)
            named = {}
            for name in spec.names:
                param = f"{spec.param_prefix}.{name}"
                named[name] = {kind: reader.get(tensor_key(kind, param, key[1])).float()
                               for kind in ((MODEL, *STATE_KEYS) if engine.trainable else (MODEL,))}
            count = float(reader.get(tensor_key("step", spec.param_prefix + "." + spec.names[0], key[1])))
            engine.home.restore(key, fill_slot(engine.home.restore_target(key), spec.layout, named, count))
    if isinstance(engine.home, SSDHome):
        engine.home.store.bytes_written = 0
    engine.steps_done = step
