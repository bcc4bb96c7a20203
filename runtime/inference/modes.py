"""`--offload MODE`: put a model's experts where the mode says, from where they lie (`ExpertSource`).

none: every layer resident on the device. ondemand: one slot, each layer copied just before it runs. ring: K slots
turned over by use (seed 004's ring memory). auto: K-slot budget split into resident layers and layers streamed
expert by expert (runtime/inference/auto.py); K at or above the number of MoE layers keeps them all resident.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path
from typing import Optional

import torch

from runtime.inference.auto import AutoOffloader
from runtime.inference.expert_source import ExpertSource
from runtime.inference.load import InferError
from runtime.inference.offload import MODES, ExpertStore, OnDemandOffloader, Offloader
from runtime.inference.ring import RingOffloader, check_ring_slots
from runtime.model.transformer import Transformer


def default_cache_dir(fingerprint: str) -> Path:
    """Where a checkpoint's per-layer expert store is exported (reused while the checkpoint is unchanged)."""
    digest = hashlib.sha1(fingerprint.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "moesys-experts" / digest


def make_offloader(model: Transformer, mode: str, device: torch.device, ring_slots: int = 2,
                   cache_dir: Optional[Path] = None, fingerprint: str = "",
                   source: Optional[ExpertSource] = None, prefetch: bool = False) -> Offloader:
    """Place `model`'s experts on `device` under offload mode auto, ring, ondemand or none, and move the rest.

    `source` says where the experts lie (a checkpoint opened by `open_checkpoint`, whose model's experts are still
    on the meta device); without it they are the model's own resident experts. ring/ondemand export the experts
    into the on-disk store (cache_dir; default from the fingerprint) one layer at a time; auto computes streamed
    layers from the source itself. auto takes any budget of at least one slot (more slots than MoE layers: all
    resident) and runs a model without MoE layers as none; ring checks 1 <= ring_slots <= MoE layers.
    """
    if mode not in MODES:
        raise InferError(f"--offload {mode!r} is not one of {', '.join(MODES)}")
    device = torch.device(device)
    moe = model.moe_layers()
    if source is None:
        source = ExpertSource.from_model(model)
    if mode == "auto":
        if ring_slots < 1:
            raise InferError(f"infer.ring_slots={ring_slots} must be at least 1")
        if not moe:
            mode = "none"  # nothing to stream: the dense model, resident
    if mode == "none":
        for m, layer in enumerate(moe):
            if layer.experts.w1.is_meta:
                source.fill(layer.experts, m, device)
        resident = Offloader(model.to(device), device)
        resident.source = source  # close() lets go of its mapped files
        return resident
    if mode == "ring":
        check_ring_slots(ring_slots, len(moe))
    elif not moe:
        raise InferError("the model has no MoE layers to offload; use --offload none")
    if mode == "auto":
        slots = min(ring_slots, len(moe))  # K >= N: every layer resident
        offloader: Offloader = AutoOffloader(model, device, source, slots, predict_ahead=prefetch)
        model.to(device)
        return offloader
    scratch = cache_dir is None and not fingerprint  # nothing to key a reusable store on: a private temp dir
    if cache_dir is not None:
        cache = Path(cache_dir)
    else:
        cache = Path(tempfile.mkdtemp(prefix="moesys-experts-")) if scratch else default_cache_dir(fingerprint)
    ExpertStore.export(source, cache, fingerprint)
    store = ExpertStore(cache, len(moe), pin=device.type == "cuda")
    if mode == "ondemand":
        offloader = OnDemandOffloader(model, device, store)
    else:
        offloader = RingOffloader(model, device, store, ring_slots)
    if scratch:
        offloader.scratch_dir = cache  # removed by close(); the mapped pages stay valid until unmapped
    offloader.source = source
    model.to(device)
    return offloader
