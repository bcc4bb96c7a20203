"""Building offloaded training: the MoE layers' experts swapped for stand-ins whose states live in a HostHome
(storage.offload=cpu) or an SSDHome (ssd), created straight into their home, and the OffloadEngine that runs them
(runtime/storage/offload_engine.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch

from runtime.model.init import drawn_in_parallel, init_expert
from runtime.model.transformer import Transformer
from runtime.moe.experts import GroupedExperts
from runtime.moe.layer import EXPERT_PARAM_NAMES, MoELayer
from runtime.plan.modes import OffloadMode
from runtime.storage.expert_slots import SlotLayout
from runtime.storage.expert_store import ExpertStore
from runtime.storage.host_home import ExpertHome, HostHome, initial_slot
from runtime.storage.offload_engine import InitialExpert, LayerSpec, OffloadedGroupedExperts, OffloadEngine
from runtime.storage.optim import AdamWHyper
from runtime.storage.ssd_home import SSDHome
from runtime.storage.tiers import Tiers


def layer_specs(model: Transformer) -> list[tuple[MoELayer, LayerSpec]]:
    """(MoE layer, spec) for every MoE layer of `model`, in forward order (shapes only: works on the meta device)."""
    names = {id(module): name for name, module in model.named_modules()}
    out = []
    for index, layer in enumerate(model.moe_layers()):
        experts = layer.experts
        if not isinstance(experts, GroupedExperts):
            raise TypeError(f"MoE layer {index}'s experts are a {type(experts).__name__}: already offloaded")
        shapes = {n: tuple(getattr(experts, n).shape[1:]) for n in EXPERT_PARAM_NAMES
                  if getattr(experts, n, None) is not None}
        out.append((layer, LayerSpec(index, names[id(experts)], experts.num_experts, experts.first_expert,
                                     SlotLayout.of(shapes), experts.expert_type, experts.impl)))
    return out


def spare_slots(specs: list[LayerSpec], cache_experts: int, prefetch_depth: int, fetch_all: bool) -> int:
    """Released slots an SSD home keeps for the next reads: the experts a step moves through host memory beside the
    cache (read, stepped, written home; the plan's host term counts them on their way home while the next step
    reads its own), at least the read-ahead's."""
    local = sum(s.num_local for s in specs)
    ahead = max(1, prefetch_depth) * max((s.num_local for s in specs), default=0)
    return max(ahead, local - (0 if fetch_all else cache_experts))


def _draw_local(make: InitialExpert, spec: LayerSpec, shapes: dict, j: int) -> dict:
    """Local expert j of `spec`'s layer, drawn by `make` under its global index."""
    return make(spec.param_prefix, shapes, spec.key(j)[1])


def install_offload(model: Transformer, store: ExpertStore | None, device: torch.device, *, seed: int,
                    lr_schedule: Callable[[int], float], cache_experts: int = 0, hit_threshold: float = 1,
                    decay_beta: float = 0.5, decay_every: int = 10, prefetch_depth: int = 1,
                    adamw: AdamWHyper | None = None, tiers: Tiers | None = None, groups=None,
                    fetch_all: bool = False, write_initial: bool = True, compute_dtype: torch.dtype = torch.float32,
                    delayed_update: bool = False, window: int | None = None,
                    resident_layers: int = 0, initial: InitialExpert | None = None,
                    trainable: bool = True) -> OffloadEngine:
    """Swap every MoE layer's experts but the first `resident_layers` for OffloadedGroupedExperts whose states live
    in host memory (`store` None: storage.offload=cpu) or in `store` behind an LFU cache of `cache_experts` (ssd).

    With `write_initial` each expert is created in its home one at a time (fp32 master weights drawn from
    (seed, name, global expert) as a resident model draws them, or initial(prefix, shapes, global expert) when given:
    read from train.init_from's files; zero moments); without it a checkpoint's load fills them. `window`: layers of
    active experts the device holds at once (default 1 + prefetch_depth). The model may be on the meta device: its
    expert tensors are never read. trainable=False: frozen experts (OffloadEngine)."""
    pairs = layer_specs(model)[resident_layers:]
    specs = [s for _, s in pairs]
    tiers = tiers or Tiers.with_budgets()
    pin = device.type == "cuda"

    def make_home(engine: OffloadEngine) -> ExpertHome:
        if store is None:
            return HostHome({s.index: s.first_global for s in specs}, engine.layouts,
                            {s.index: s.num_local for s in specs}, compute_dtype, engine.separate_stage, pin, tiers,
                            moments=trainable)
        home = SSDHome(store, engine.layouts, engine.order, cache_experts, hit_threshold, decay_beta, decay_every,
                       prefetch_depth, compute_dtype, engine.separate_stage, pin, tiers, engine.timeline,
                       engine.wait_updated, engine.in_use,
                       spare_slots=spare_slots(specs, cache_experts, prefetch_depth, fetch_all), moments=trainable)
        if fetch_all:
            home.fetch_everything()
        return home

    engine = OffloadEngine(specs, device, lr_schedule, adamw or AdamWHyper(), tiers, groups, compute_dtype,
                           delayed_update, window if window is not None else 1 + prefetch_depth, make_home, trainable)
    for layer, spec in pairs:
        if write_initial:
            shapes = dict(zip(spec.names, spec.layout.shapes, strict=True))
            make = initial or (lambda prefix, shapes, g: init_expert(seed, prefix, shapes, g))
            drawn = drawn_in_parallel(functools.partial(_draw_local, make, spec, shapes), range(spec.num_local),
                                      4 * spec.layout.numel)
            for j, params in enumerate(drawn):
                key = spec.key(j)
                engine.home.restore(key, initial_slot(engine.home.restore_target(key), spec.layout, params))
        if store is not None:
            tiers.ssd.allocate(spec.num_local * (spec.expert_bytes if trainable else spec.frozen_bytes))
        layer.experts = OffloadedGroupedExperts(engine, spec)
    if store is not None:
        store.bytes_written = 0
    return engine


def offload_from_config(model: Transformer, cfg, groups, device: torch.device, placement,
                        write_initial: bool = True, initial: InitialExpert | None = None,
                        trainable: bool = True) -> OffloadEngine | None:
    """The offload runtime of `placement` (runtime/plan/placement.py: RUN_DIR/plan.json, decided once by
    `moesys train`), or None when expert states stay on the device.

    With offload=ssd each rank keeps its own store under STORE/ep{r}-of-{n}-edp{k} (STORE: storage.ssd_path, or
    the run directory's expert_store/), owned by this run; with offload=cpu the states stay in host memory."""
    from runtime.files.paths import expert_store_dir, expert_store_root
    from runtime.storage.optim import lr_at

    st = cfg.storage
    if not placement.offload.offloaded:
        return None
    tiers = Tiers.with_budgets(placement.device_capacity, placement.host_capacity, placement.ssd_capacity)
    ep_rank, ep_size, edp_rank = (groups.ep_rank, groups.ep_size, groups.edp_rank) if groups is not None else (0, 1, 0)
    store = None
    if placement.offload is OffloadMode.SSD:
        store = ExpertStore(expert_store_root(cfg) / expert_store_dir(ep_rank, ep_size, edp_rank),
                            owner=str(Path(cfg.train.run_dir).resolve()), direct=st.direct_io)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.train.precision]
    return install_offload(model, store, device, seed=cfg.train.seed, cache_experts=placement.cpu_cache_experts,
                           hit_threshold=st.hit_threshold, decay_beta=st.decay_beta, decay_every=st.decay_every,
                           prefetch_depth=st.prefetch_depth, lr_schedule=lambda step: lr_at(step, cfg.train),
                           adamw=AdamWHyper(weight_decay=cfg.train.weight_decay), tiers=tiers, groups=groups,
                           write_initial=write_initial, compute_dtype=dtype, delayed_update=st.delayed_update,
                           window=placement.device_expert_layers or None, resident_layers=st.resident_layers,
                           initial=initial, trainable=trainable)
