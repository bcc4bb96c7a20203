"""`--offload MODE`: the offloader each mode builds, from a table, and the one way a checkpoint is opened and placed
(`moesys infer` and `moesys serve` alike).

none: every layer resident on the device. ondemand: one slot, each layer copied just before it runs. ring: K slots
turned over by use (the paper's ring memory). auto: a K-slot budget split into resident layers and layers streamed
expert by expert (runtime/inference/auto.py); K at or above the number of MoE layers keeps them all resident.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.host.pinned import exact_large_pinned_blocks
from runtime.host.topology import set_cpu_threads
from runtime.inference.auto import AutoOffloader
from runtime.inference.errors import InferError
from runtime.inference.expert_source import ExpertSource
from runtime.inference.load import LoadedModel, open_checkpoint
from runtime.inference.offload import MODES, LayerStore, Offloader, OnDemandOffloader
from runtime.inference.ring import RingOffloader, check_ring_slots
from runtime.inference.store_cache import CACHE_GB, ScratchStore, StoreHold, checkout, default_cache_root, store_bytes
from runtime.model.transformer import Transformer


@dataclass(frozen=True)
class PlaceOptions:
    """What a mode may take beside the model: its budget in layers, where a store is exported (a directory of the
    caller's, else the checkpoint's copy in the bounded cache: cache_root, cache_gb), prefetching."""

    ring_slots: int = 2
    cache_dir: Path | None = None
    fingerprint: str = ""
    prefetch: bool = False
    cache_root: Path | None = None
    cache_gb: float = CACHE_GB


def _resident(model: Transformer, device: torch.device, source: ExpertSource, options: PlaceOptions) -> Offloader:
    for m, layer in enumerate(model.moe_layers()):
        source.place_resident(layer.experts, m, device)
    return Offloader(model.to(device), device, source)


def _auto(model: Transformer, device: torch.device, source: ExpertSource, options: PlaceOptions) -> Offloader:
    moe = model.moe_layers()
    if options.ring_slots < 1:
        raise InferError(f"infer.ring_slots={options.ring_slots} must be at least 1")
    if not moe:  # nothing to stream: the dense model, resident
        return _resident(model, device, source, options)
    slots = min(options.ring_slots, len(moe))  # K >= N: every layer resident
    offloader = AutoOffloader(model, device, source, slots, predict_ahead=options.prefetch)
    model.to(device)
    return offloader


def _store(source: ExpertSource, options: PlaceOptions, moe_layers: int,
           device: torch.device) -> tuple[LayerStore, StoreHold | None]:
    """The experts exported one layer at a time into the on-disk store, and what the offloader lets go of when it
    closes: the checkpoint's copy in the cache (held against eviction meanwhile), a private directory when nothing
    keys a reusable one (removed), or nothing for a directory the caller gave."""
    hold: StoreHold | None
    if options.cache_dir is not None:
        hold, directory = None, Path(options.cache_dir)
    elif not options.fingerprint:
        scratch = ScratchStore()
        hold, directory = scratch, scratch.directory
    else:
        need = store_bytes(source.stacked_specs(m) for m in range(source.num_layers))
        cached = checkout(options.cache_root or default_cache_root(), options.fingerprint, need, options.cache_gb)
        hold, directory = cached, cached.directory
    try:
        LayerStore.export(source, directory, options.fingerprint)
        return LayerStore(directory, moe_layers, pin=device.type == "cuda"), hold
    except BaseException:
        if hold is not None:
            hold.close()
        raise


def _ring(model: Transformer, device: torch.device, source: ExpertSource, options: PlaceOptions) -> Offloader:
    check_ring_slots(options.ring_slots, len(model.moe_layers()))
    store, hold = _store(source, options, len(model.moe_layers()), device)
    offloader = RingOffloader(model, device, store, options.ring_slots, source, hold)
    model.to(device)
    return offloader


def _ondemand(model: Transformer, device: torch.device, source: ExpertSource, options: PlaceOptions) -> Offloader:
    if not model.moe_layers():
        raise InferError("the model has no MoE layers to offload; use --offload none")
    store, hold = _store(source, options, len(model.moe_layers()), device)
    offloader = OnDemandOffloader(model, device, store, source, hold)
    model.to(device)
    return offloader


OFFLOADERS: dict[str, Callable[[Transformer, torch.device, ExpertSource, PlaceOptions], Offloader]] = {
    "auto": _auto, "ring": _ring, "ondemand": _ondemand, "none": _resident}
assert tuple(OFFLOADERS) == MODES


def make_offloader(model: Transformer, mode: str, device: torch.device, ring_slots: int = 2,
                   cache_dir: Path | None = None, fingerprint: str = "",
                   source: ExpertSource | None = None, prefetch: bool = False,
                   cache_root: Path | None = None, cache_gb: float = CACHE_GB) -> Offloader:
    """Place `model`'s experts on `device` under offload mode auto, ring, ondemand or none, and move the rest.

    `source` says where the experts lie (a checkpoint opened by `open_checkpoint`, whose model's experts are still
    on the meta device); without it they are the model's own resident experts. ring/ondemand export the experts
    into the on-disk store one layer at a time: into cache_dir when given, else the fingerprinted checkpoint's copy
    in the cache at cache_root (default_cache_root()) bounded by cache_gb (runtime/inference/store_cache.py), else
    a private directory removed on close; auto computes streamed
    layers from the source itself. auto takes any budget of at least one slot (more slots than MoE layers: all
    resident) and runs a model without MoE layers as none; ring checks 1 <= ring_slots <= MoE layers.
    """
    if mode not in OFFLOADERS:
        raise InferError(f"--offload {mode!r} is not one of {', '.join(MODES)}")
    if torch.device(device).type == "cuda":
        exact_large_pinned_blocks()  # a layer's pinned experts at their size
    source = source if source is not None else ExpertSource.from_model(model)
    options = PlaceOptions(ring_slots, cache_dir, fingerprint, prefetch, cache_root, cache_gb)
    return OFFLOADERS[mode](model, torch.device(device), source, options)


def fingerprint(path: Path) -> str:
    """The checkpoint's identity for the store cache: its weight files' names, sizes and mtimes."""
    files = sorted(path.rglob("*.safetensors"))
    return str(path.resolve()) + "".join(f"|{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)


@dataclass
class Opened:
    """A checkpoint opened for inference (experts not placed yet) and its resolved config."""

    loaded: LoadedModel
    cfg: Any
    device: torch.device

    def place(self, cache_dir: Path | None = None) -> Offloader:
        """Place the experts as cfg.infer says (after the caller has checked its inputs: ring and ondemand export
        a store)."""
        inf = self.cfg.infer
        return make_offloader(self.loaded.model, inf.offload, self.device, inf.ring_slots, cache_dir,
                              fingerprint(self.loaded.path), source=self.loaded.experts, prefetch=inf.prefetch,
                              cache_root=Path(inf.cache_dir) if inf.cache_dir else None, cache_gb=inf.cache_gb)


def open_for_inference(checkpoint: str | Path, resolve: Callable[[dict[str, Any], dict[str, Any]], Any],
                       infer_overrides: dict[str, Any] | None = None, offload: str | None = None,
                       device: str | torch.device | None = None) -> Opened:
    """Open a checkpoint streamed (experts read where they lie) and resolve its config with
    `resolve(config_data, infer overrides)`, `offload` overriding infer.offload: how `moesys infer` and
    `moesys serve` both start. The process's CPUs all go to this one model."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    set_cpu_threads(1)
    loaded = open_checkpoint(checkpoint, device=device)
    overrides = {**(infer_overrides or {}), **({"offload": offload} if offload is not None else {})}
    return Opened(loaded, resolve(loaded.config_data, overrides), device)
