"""The smallest changes that make a plan fit: what `moesys plan` prints after `try:`.

Each knob is searched where the estimate is monotone in it (more nodes, a smaller micro-batch or sequence, fewer
ring slots), so a binary search over the valid values costs O(log n) estimates however large the model. A line with
`key=value` pairs names overrides under which the plan fits; a line without `=` says why nothing in reach fits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial

from runtime.config import ConfigError, MoesysConfig, validate
from runtime.plan.budget import GB, Eq1Budget
from runtime.plan.modes import AUTO, OffloadMode, TierName

MAX_NODES = 1 << 20
"""The node-count search stops here (a million nodes: far past any cluster, so 'no node count fits')."""

Problems = Callable[[MoesysConfig, OffloadMode], list]
"""Every reason a config does not fit with an offload mode (empty: it fits)."""


def _passes(problems: Problems, base: MoesysConfig, modes: tuple, nodes: int) -> bool:
    """Whether `base` on `nodes` nodes has no problem in one of `modes`."""
    return any(not problems(changed(base, "topology", nodes=nodes), m) for m in modes)


def first_passing(values: Sequence[int], ok: Callable[[int], bool]) -> int | None:
    """The first of `values` for which `ok` holds, when ok is monotone over them (False ... False True ... True)."""
    if not values or not ok(values[-1]):
        return None
    lo, hi = 0, len(values) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(values[mid]):
            hi = mid
        else:
            lo = mid + 1
    return values[lo]


def _valid(cfg: MoesysConfig) -> bool:
    try:
        validate(cfg)
    except ConfigError:
        return False
    return True


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def node_counts(cfg: MoesysConfig) -> Sequence[int]:
    """Node counts above the current one that keep the config valid, ascending: topology.expert_parallel divides
    the world size, and with model.embedding_partition the world size divides model.hidden_size."""
    t = cfg.topology
    per_node = t.processes_per_node
    step = t.expert_parallel // math.gcd(t.expert_parallel, per_node)
    first = (t.nodes // step + 1) * step
    if not cfg.model.embedding_partition:
        return range(first, MAX_NODES + 1, step)
    hidden = cfg.model.hidden_size
    if hidden % per_node:
        return []
    return [n for n in _divisors(hidden // per_node) if first <= n <= MAX_NODES and n % step == 0]


def changed(cfg: MoesysConfig, section: str, **changes) -> MoesysConfig:
    """A copy of `cfg` with fields of one section changed (the plan's trials of other settings)."""
    return replace(cfg, **{section: replace(getattr(cfg, section), **changes)})


def training_suggestions(cfg: MoesysConfig, budget: Eq1Budget, mode: OffloadMode, modes: Sequence[OffloadMode],
                         problems: Problems) -> list[str]:
    """Another of `modes` (offload modes), dense sharding, or the fewest nodes; failing those, a smaller
    micro-batch or sequence; failing that, why nothing fits (naming every Eq. 1 tier that holds at no node count).
    Every suggested config passes validate() (unless the config itself does not: then nothing is filtered)."""
    strict = _valid(cfg)

    def usable(trial: MoesysConfig) -> bool:
        return not strict or _valid(trial)

    order = tuple(m for m in dict.fromkeys((mode, *modes)) if usable(changed(cfg, "storage", offload=m.value)))

    def fitting(trial: MoesysConfig) -> OffloadMode | None:
        return next((m for m in order if not problems(trial, m)), None)

    out = [f"storage.offload={m} fits" for m in order if m != mode and not problems(cfg, m)][:1]
    sharded = changed(cfg, "storage", dense_shard=True)
    if not cfg.storage.dense_shard and usable(sharded) and not problems(sharded, mode):
        out.append("storage.dense_shard=true fits")
    t = cfg.topology
    wider = next((ep for ep in _wider_expert_parallel(cfg) if t.world_size % ep == 0
                  and usable(changed(cfg, "topology", expert_parallel=ep))
                  and not problems(changed(cfg, "topology", expert_parallel=ep), mode)), None)
    if wider:
        out.append(f"topology.expert_parallel={wider} fits")
    nodes = _more_nodes(cfg, mode, order, problems, usable)
    if nodes:
        out.append(nodes)
    if out:
        return out
    smaller = _smaller_run(cfg, fitting, usable)
    if smaller:
        return [smaller]
    return [_nothing_fits(cfg, budget)]


def _wider_expert_parallel(cfg: MoesysConfig) -> list[int]:
    """Multiples of topology.expert_parallel that divide model.num_experts (fewer experts on each rank), each at
    least twice the one before, so that there are at most log2(num_experts) of them to search."""
    ep, experts = cfg.topology.expert_parallel, cfg.model.num_experts
    out: list[int] = []
    for e in range(2 * ep, experts + 1, ep) if ep > 0 and experts > 0 else ():
        if experts % e == 0 and e >= 2 * (out[-1] if out else ep):
            out.append(e)
    return out


def _more_nodes(cfg: MoesysConfig, mode: OffloadMode, order: Sequence[OffloadMode], problems: Problems,
                usable: Callable[[MoesysConfig], bool]) -> str | None:
    """The fewest nodes that fit, with expert_parallel kept or widened to split the experts over more ranks.

    For a fixed expert_parallel, nodes add Eq. 1 capacity and shrink a sharded dense share and nothing per rank
    grows, so fitting is monotone in the node count: bisect it. The expert_parallel kept divides every count tried,
    so `auto` resolves there to a multiple of it, which holds fewer experts per rank and fits too. The offload mode
    in use is kept when it can be."""
    best: tuple[int, int, MoesysConfig] | None = None
    for ep in [cfg.topology.expert_parallel, *_wider_expert_parallel(cfg)]:
        base = changed(cfg, "topology", expert_parallel=ep)
        for tried in (tuple(m for m in order if m == mode), tuple(order)):
            nodes = first_passing(node_counts(base) if tried else [], partial(_passes, problems, base, tried))
            if nodes is not None:
                if best is None or nodes < best[0]:
                    best = (nodes, ep, changed(base, "topology", nodes=nodes))
                break
    if best is None:
        return None
    nodes, ep, trial = best
    found = next(m for m in order if not problems(trial, m))
    if not (usable(trial) and usable(changed(trial, "storage", offload=found.value))):
        return None
    widen = f" topology.expert_parallel={ep}" if ep != cfg.topology.expert_parallel else ""
    return f"topology.nodes={nodes}{widen} with storage.offload={found} fits"


def _smaller_run(cfg: MoesysConfig, fitting: Callable[[MoesysConfig], OffloadMode | None],
                 usable: Callable[[MoesysConfig], bool]) -> str | None:
    """The largest micro-batch below the current one that fits; else micro-batch 1 and the longest sequence that
    fits. Activations grow with both, so the search is monotone; values already at 1 are never suggested."""
    tr = cfg.train

    def note(trial: MoesysConfig) -> str:
        m = fitting(trial)
        return "" if cfg.storage.offload in (AUTO, m) else f" with storage.offload={m}"

    batch = first_passing(range(tr.micro_batch_size - 1, 0, -1),
                          lambda b: fitting(changed(cfg, "train", micro_batch_size=b)) is not None)
    if batch is not None and usable(changed(cfg, "train", micro_batch_size=batch)):
        return f"train.micro_batch_size={batch}{note(changed(cfg, 'train', micro_batch_size=batch))} fits"
    one = changed(cfg, "train", micro_batch_size=1)
    seq = first_passing(range(tr.seq_len - 1, 0, -1), lambda s: fitting(changed(one, "train", seq_len=s)) is not None)
    if seq is None or not usable(changed(one, "train", seq_len=seq)):
        return None
    prefix = "train.micro_batch_size=1 " if tr.micro_batch_size > 1 else ""
    return f"{prefix}train.seq_len={seq}{note(changed(one, 'train', seq_len=seq))} fits"


TIER_KEYS = {TierName.CPU: "topology.cpu_memory_gb", TierName.SSD: "topology.ssd_gb"}


def _nothing_fits(cfg: MoesysConfig, budget: Eq1Budget) -> str:
    t = cfg.topology
    keys = {**TIER_KEYS, TierName.GPU: "topology.gpu_memory_gb" if t.gpus_per_node else "topology.cpu_memory_gb"}
    dead = [f"Eq. 1 {name.upper()} tier holds at no node count ({keys[name]} is 0)" for name in budget.unsatisfiable()]
    why = f" ({'; '.join(dead)})" if dead else ""
    return (f"no node count, offload mode, micro-batch or sequence length makes this fit{why}: "
            "shrink the model or give each rank more memory")


def serving_suggestions(cfg: MoesysConfig, inference: dict, moe_layers: int) -> list[str]:
    """The most ring slots that fit (ring memory keeps the dense weights and K MoE layers' experts on the device),
    or why not even one does."""
    slots = inference["max_ring_slots"]
    if slots >= 1:
        prefix = "" if cfg.infer.offload in ("ring", "auto") else "infer.offload=auto with "
        return [f"{prefix}infer.ring_slots={slots} fits"]
    what, need = "dense weights", inference["dense_bytes"]
    if moe_layers:
        what, need = "dense weights plus one MoE layer's experts", need + inference["expert_layer_bytes"]
    key = "topology.gpu_memory_gb" if cfg.topology.gpus_per_node else "topology.cpu_memory_gb"
    return [f"no ring size fits: {what} need {need / GB:.2f} GB of device memory, {key} gives "
            f"{inference['device_bytes'] / GB:.2f} GB: serve a smaller model or on a larger device"]
