"""Placement of dense and sparse states over device, host and SSD tiers, and a per-rank memory estimate.

`plan_placement(cfg) -> Plan` is pure: it reads the config, counts parameters, evaluates Eq. 1 (budget.py),
picks where expert states live (storage.offload, or the first mode that fits for auto) and says why. With
`purpose=serve` the verdict is the ring-memory inference budget instead (the paper's "Ring Memory Offloading").
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.config import MoesysConfig
from runtime.plan.budget import (
    DENSE_STATE_BYTES,
    GB,
    STORED_SPARSE_BYTES,
    Eq1Budget,
    chosen_resident_layers,
    eq1_budget,
)
from runtime.plan.disk import DiskPlan, disk_plan, disk_problem, fewer_checkpoints, kept_checkpoints, store_file_bytes
from runtime.plan.embedding_bytes import embedding_bytes_per_rank
from runtime.plan.modes import MODES, OffloadMode, TierName, requested_modes
from runtime.plan.params import ParamCounts, count_parameters
from runtime.plan.step_memory import (
    CUDA_CONTEXT_BYTES,
    CUDA_HOST_BYTES,
    CUDA_WORKSPACE_BYTES,
    activation_bytes,
    compute_bytes,
    optimizer_step_bytes,
    step_peak,
    weight_cast_params,
)
from runtime.plan.suggest import changed, first_passing, serving_suggestions, training_suggestions

PROCESS_RUNTIME_BYTES = int(0.30 * GB)
"""Host memory a worker process takes beyond the states and activations the estimate counts, as anonymous RSS (what
the OOM killer weighs; shared library text is file-backed and left out): torch, the process group, the model's
skeleton and the allocator's and autograd's growth, which levels off once the heap is trimmed after each step
(runtime/train/rank_memory.py). The plateau a tiny-recipe CPU worker measured, less its states
(benchmarks/host-memory_*.md). Not unique memory (USS), which counts private file pages too."""

ONEDNN_BF16_BYTES = int(0.70 * GB)
"""Host memory a CPU process that computes in bf16 adds to PROCESS_RUNTIME_BYTES: oneDNN, which runs torch's bf16
matmuls on a CPU, keeps a compiled kernel for every GEMM shape it has run (its primitive cache, 1,024 entries by
default, and the JIT kernels' own cache), and the expert GEMMs of an MoE step take a new shape most steps, as their
token counts change. Both fill up and level off whatever the matrices' sizes; fp32 and fp16 matmuls keep none
(tests/unit/plan/test_onednn_bf16_memory.py). The plateau measured, with a margin
(benchmarks/host-memory_*.md)."""



RECOMPUTE_KEEPS = {"none": "every block's saved tensors, the experts' routed rows and [R, F] intermediates",
                   "moe": "every block's saved tensors and the experts' routed rows, not their [R, F] intermediates "
                          "(recomputed in backward)",
                   "block": "each block's input only, one block's saved tensors at a time in backward"}
"""What a micro-batch keeps for backward under each train.recompute, as the plan's assumptions say it."""

def process_runtime_bytes(cfg: MoesysConfig) -> int:
    """Host memory a worker takes beyond the states, activations and cache the estimate counts: the runtime, CUDA's
    host side with a GPU, oneDNN's bf16 kernels without one."""
    if cfg.topology.gpus_per_node:
        return PROCESS_RUNTIME_BYTES + CUDA_HOST_BYTES
    return PROCESS_RUNTIME_BYTES + (ONEDNN_BF16_BYTES if cfg.train.precision == "bf16" else 0)


LAUNCHER_BYTES = int(0.32 * GB)
"""Host memory of a node's launchers: the `moesys` command and torchrun, as anonymous RSS
(benchmarks/host-memory_*.md)."""


@dataclass(frozen=True)
class RankEstimate:
    """Bytes one rank needs on each tier for one placement mode."""

    device: dict[str, int]
    host: int
    ssd: int
    device_capacity: int
    host_capacity: int
    cache_experts: int
    local_experts: int
    device_total: int
    """The device's peak in a step: not the sum of `device`, whose activations and weight copies are gone by the
    optimizer step and whose gradients do not exist yet when backward starts (step_memory.step_peak)."""
    device_peak_at: str = "backward"
    """When that peak happens: backward (its start) or optimizer step."""
    ram_share: int = 0
    """Without a GPU: the RAM of one rank that its device pool and host cache share."""
    expert_window: int = 0
    """Offloaded modes: MoE layers whose active experts the device holds at once (the layer computing and
    storage.prefetch_depth ahead, more where a GPU has room)."""
    resident_layers: int = 0
    """MoE layers whose expert states stay on the device: every one with offload=none, storage.resident_layers
    with cpu or ssd."""

    @property
    def ok(self) -> bool:
        return self.device_total <= self.device_capacity and self.host <= self.host_capacity


@dataclass(frozen=True)
class Plan:
    params: ParamCounts
    budget: Eq1Budget
    mode: OffloadMode
    """Where the expert states live: storage.offload, or for auto the first of MODES that fits."""
    per_rank: RankEstimate
    world_size: int
    feasible: bool
    problems: list[str] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)
    inference: dict[str, Any] = field(default_factory=dict)
    purpose: str = "train"
    """What feasible, problems and suggestions judge: train, or serve (the `inference` budget)."""
    training_problems: list[str] = field(default_factory=list)
    """Why training does not fit, whatever the purpose."""
    process_host_bytes: int = 0
    """Host RAM one worker process needs (process_host_bytes)."""
    device: str = "gpu"
    """What the device tier is: gpu, or cpu (no GPU: a budgeted pool in host RAM)."""
    disk: DiskPlan = DiskPlan(0, 0, 0)
    """What a training run writes to disk (expert store, checkpoints)."""
    keepable_layers: int = 0
    """Offloaded training on GPUs: the most MoE layers storage.resident_layers could keep on the device with the
    plan still fitting (at least one layer left offloaded); 0 where none could."""


def world_size(cfg: MoesysConfig) -> int:
    return cfg.topology.world_size


def process_host_bytes(cfg: MoesysConfig, est: RankEstimate) -> int:
    """Host RAM one worker process needs: its expert cache, its runtime and, without a GPU, its device tier (with
    one, the CUDA runtime's host memory instead)."""
    return est.host + process_runtime_bytes(cfg) + (0 if cfg.topology.gpus_per_node else est.device_total)


@functools.lru_cache(maxsize=8)
def teacher_parameters(checkpoint: str) -> int:
    """Parameters of a distillation's teacher, counted from the model config its checkpoint recorded (meta.json);
    0 when that cannot be read (moesys distill refuses such a teacher before anything is planned)."""
    from runtime.config import config_from_dict
    from runtime.errors import UserError
    from runtime.files.checkpoint_format import read_meta

    try:
        return count_parameters(config_from_dict(read_meta(Path(checkpoint))["config"]).model).total
    except (UserError, KeyError, TypeError, ValueError, OSError):
        return 0


def host_slot_bytes(cfg: MoesysConfig) -> int:
    """Host bytes of an offloaded expert parameter's slot (runtime/storage/expert_slots.py): fp32 master and
    moments, and the stage the device copies in the compute dtype unless the master itself is that stage (fp32
    training without a delayed update)."""
    width = compute_bytes(cfg)
    separate = width != 4 or cfg.storage.delayed_update
    return STORED_SPARSE_BYTES + (width if separate else 0)


def host_grad_bytes(cfg: MoesysConfig) -> int:
    """Host bytes of an active offloaded parameter's gradient, which comes home in the compute dtype: two steps'
    with a delayed update (step t's are stepped while step t+1's come home)."""
    return compute_bytes(cfg) * (2 if cfg.storage.delayed_update else 1)


def _ssd_host(cfg: MoesysConfig, p: ParamCounts, local_experts: int, layer_experts: int,
              host_capacity: int) -> tuple[int, int]:
    """storage=ssd: (host bytes, cached experts) of a rank."""
    st = cfg.storage
    # A step keeps every expert it fetched on the host, with its gradient, from its forward to the CPU
    # AdamW step (Eq. 1's CPU tier, 16aS): the cache may be smaller than that, the host may not. Cached
    # experts hold their slots and, when active, a gradient. Those the cache does not keep are still on their way
    # to SSD (write-behind) while the next step fetches its own, and the prefetcher stages the next
    # prefetch_depth layers' experts (runtime/storage/ssd_home.py).
    slot = host_slot_bytes(cfg)
    step_active = math.ceil(st.alpha * local_experts)
    staged = slot * math.ceil(st.alpha * layer_experts) * st.prefetch_depth
    grads = host_grad_bytes(cfg) * step_active
    fit = max(0, host_capacity - (staged + grads) * p.per_expert) // max(slot * p.per_expert, 1)
    cache_experts = st.cpu_cache_experts or int(min(local_experts, fit))
    going_home = slot * max(0, step_active - cache_experts)
    host = int((slot * max(cache_experts, step_active) + grads + going_home + staged) * p.per_expert)
    return host, cache_experts


def _rank_estimate(cfg: MoesysConfig, p: ParamCounts, mode: OffloadMode) -> RankEstimate:
    t, st = cfg.topology, cfg.storage
    world = world_size(cfg)
    ep = t.expert_parallel
    # storage.resident_layers: the first MoE layers' experts stay on the device, as with offload=none
    kept = min(chosen_resident_layers(st), p.moe_layers) if mode.offloaded else p.moe_layers
    offloaded_layers = p.moe_layers - kept
    layer_experts = cfg.model.num_experts // ep
    layer_sparse = p.per_expert * layer_experts
    local_experts = offloaded_layers * layer_experts if mode.offloaded else p.moe_layers * layer_experts
    local_sparse = local_experts * p.per_expert
    dense_share = p.dense / world if st.dense_shard else p.dense
    device = {"dense_states": int(DENSE_STATE_BYTES * dense_share), "activations": activation_bytes(cfg)}
    if cfg.distill.teacher:  # every rank holds the whole frozen teacher, fp32 as its checkpoint stores it
        device["teacher_weights"] = 4 * teacher_parameters(cfg.distill.teacher)
    # the paper's "Embedding Partition in Data Parallelism": [V, H/N] per rank
    if cfg.model.embedding_partition and not st.dense_shard:
        device["dense_states"] -= embedding_bytes_per_rank(cfg, world).saving
    if st.dense_shard:
        # runtime/parallel/dense_shard.py keeps a gathered layer (fp32) from its forward until its backward,
        # so at the peak every dense weight is gathered once.
        device["dense_gathered_weights"] = int(4 * p.dense)
    host = ssd = 0
    cache_experts = 0
    ranks_per_node = t.processes_per_node
    # What a rank's states may use of the node's RAM: its share after the launcher's, less its own runtime.
    ram_per_rank = max(0, int((t.cpu_memory_gb * GB - LAUNCHER_BYTES) / ranks_per_node) - process_runtime_bytes(cfg))
    window, layer_active = 0, int(active_expert_bytes(cfg) * st.alpha * layer_sparse)
    resident_experts = kept * layer_sparse
    if resident_experts:
        device["expert_states"] = int(DENSE_STATE_BYTES * resident_experts)
    if mode.offloaded:
        window = min(offloaded_layers, 1 + st.prefetch_depth) or 1
        device["expert_buffers"] = layer_active * window
        if cfg.train.grad_accum_steps > 1:  # the offloaded experts' gradients summed on the device, in fp32
            device["expert_grad_accumulators"] = 4 * local_sparse
    # Parameters with their states and torch's AdamW on this rank (dense share, resident experts), and what a step
    # adds around them (runtime/plan/step_memory.py).
    resident = device["dense_states"] // DENSE_STATE_BYTES + resident_experts
    partitioned = cfg.model.vocab_size * cfg.model.hidden_size // world if cfg.model.embedding_partition else 0
    bucketed = (0 if st.dense_shard else resident - resident_experts - partitioned) + resident_experts
    device["weight_casts"] = 2 * weight_cast_params(cfg, p, resident_experts)
    device["grad_buckets"] = 4 * max(0, bucketed)  # Replicated's flat buffers, allocated for every world size
    device["optimizer_step"] = optimizer_step_bytes(cfg, resident, layer_experts if kept else 0)
    if t.gpus_per_node:
        device["cuda_workspace"] = CUDA_WORKSPACE_BYTES
    device = {k: v for k, v in device.items() if v or k == "activations"}
    grads_at_backward = 4 * resident if cfg.train.grad_accum_steps <= 1 else 0  # accumulating: they are there
    peak, moment = step_peak(device, grads_at_backward)
    # Without a GPU the device tier is a pool in the same RAM as the host tier: the host gets what it leaves.
    host_capacity = ram_per_rank if t.gpus_per_node else max(0, ram_per_rank - peak)
    if mode.offloaded:
        if mode is OffloadMode.CPU:
            host = int((host_slot_bytes(cfg) + host_grad_bytes(cfg)) * local_sparse)  # a gradient each, at most
            cache_experts = local_experts
        else:
            ssd = local_experts * store_file_bytes(p.per_expert)  # one file an expert, in whole I/O blocks
            host, cache_experts = _ssd_host(cfg, p, local_experts, layer_experts, host_capacity)
    # Without a GPU the device pool gets what the host cache leaves of the rank's RAM, never less than nothing.
    device_capacity = (max(0, int(t.gpu_memory_gb * GB) - CUDA_CONTEXT_BYTES) if t.gpus_per_node
                       else max(0, ram_per_rank - host))
    if window and t.gpus_per_node and layer_active:
        # The GPU's spare memory keeps more layers' active experts from their forward to their backward, each
        # then copied once a step (runtime/storage/transfers.py); without a GPU the layers are used in place.
        extra = min(offloaded_layers - window, max(0, device_capacity - peak) // layer_active)
        if extra > 0:
            window += extra
            device["expert_buffers"] = layer_active * window
            peak, moment = step_peak(device, grads_at_backward)
    return RankEstimate(device=device, host=host, ssd=ssd, device_capacity=device_capacity,
                        host_capacity=host_capacity, cache_experts=cache_experts, local_experts=local_experts,
                        device_total=peak, device_peak_at=moment, ram_share=0 if t.gpus_per_node else ram_per_rank,
                        expert_window=window, resident_layers=kept)


def active_expert_bytes(cfg: MoesysConfig) -> int:
    """Device bytes per active expert parameter while a layer computes: the weight and its gradient in the compute
    dtype (Eq. 1's 4 at fp16)."""
    return 2 * (4 if cfg.train.precision == "fp32" else 2)



def _fits(cfg: MoesysConfig, budget: Eq1Budget, est: RankEstimate, mode: OffloadMode) -> list[str]:
    """Every reason the mode does not fit; empty when it fits."""
    problems = []
    if not cfg.topology.gpus_per_node and not est.ok:  # one RAM holds both: one line, not two derived ones
        problems.append(f"per-rank RAM {(est.device_total + est.host) / GB:.2f} GB (device pool "
                        f"{est.device_total / GB:.2f} GB + host cache {est.host / GB:.2f} GB) > "
                        f"{est.ram_share / GB:.2f} GB")
    if cfg.topology.gpus_per_node and not est.device_total <= est.device_capacity:
        problems.append(f"per-rank device memory {est.device_total / GB:.2f} GB > {est.device_capacity / GB:.2f} GB")
    if cfg.topology.gpus_per_node and not est.host <= est.host_capacity:
        problems.append(f"per-rank host memory {est.host / GB:.2f} GB > {est.host_capacity / GB:.2f} GB")
    if mode is OffloadMode.SSD and est.ssd * cfg.topology.processes_per_node > cfg.topology.ssd_gb * GB:
        # every rank of a node writes its experts' store there, replicas included (Eq. 1 assumes them split)
        problems.append(f"per-node expert store {est.ssd * cfg.topology.processes_per_node / GB:.2f} GB "
                        f"({cfg.topology.processes_per_node} ranks x {est.ssd / GB:.2f} GB) > topology.ssd_gb="
                        f"{cfg.topology.ssd_gb:g} GB")
    # Eq. 1's GPU inequality is a floor for every mode; its CPU and SSD ones describe the SSD placement.
    tiers = budget.tiers.items() if mode is OffloadMode.SSD else [(TierName.GPU, budget.gpu)]
    problems += [f"Eq. 1 {name.upper()} tier fails: {tier.formula} "
                 f"({tier.required_bytes / GB:.2f} GB > {tier.capacity_bytes / GB:.2f} GB)"
                 for name, tier in tiers if not tier.ok]
    return problems


def _inference(cfg: MoesysConfig, p: ParamCounts) -> dict[str, Any]:
    """Ring memory (the paper's "Ring Memory Offloading"): fp16 dense weights resident, K slots of one MoE layer's
    experts (infer.offload: ring keeps infer.ring_slots layers on the device, ondemand one, none all of them)."""
    t, inf = cfg.topology, cfg.infer
    device = int(t.gpu_memory_gb * GB if t.gpus_per_node else t.cpu_memory_gb * GB / t.nproc_per_node)
    dense = 2 * p.dense
    layer = 2 * p.per_expert * cfg.model.num_experts
    slots = max(0, (device - dense) // layer) if layer else 0
    resident = {"ring": inf.ring_slots, "ondemand": 1, "none": p.moe_layers}.get(inf.offload, inf.ring_slots)
    resident = min(resident, p.moe_layers)
    required = dense + resident * layer
    return {"dense_bytes": dense, "expert_layer_bytes": layer, "device_bytes": device,
            "max_ring_slots": int(min(slots, p.moe_layers)), "offload": inf.offload,
            "expert_layers_resident": resident, "required_bytes": required, "ok": required <= device}


def _serving_problems(cfg: MoesysConfig, p: ParamCounts, inference: dict[str, Any]) -> list[str]:
    problems = []
    if cfg.infer.offload in ("ring", "auto") and p.moe_layers and cfg.infer.ring_slots > p.moe_layers:
        problems.append(f"infer.ring_slots={cfg.infer.ring_slots} exceeds the model's {p.moe_layers} MoE layers")
    if not inference["ok"]:
        problems.append(f"serving with infer.offload={cfg.infer.offload} needs {inference['required_bytes'] / GB:.2f} "
                        f"GB of device memory (dense weights + {inference['expert_layers_resident']} MoE layers' "
                        f"experts) > {inference['device_bytes'] / GB:.2f} GB")
    return problems


def plan_placement(cfg: MoesysConfig) -> Plan:
    p = count_parameters(cfg.model)
    budget = eq1_budget(cfg, p)
    candidates = requested_modes(cfg.storage.offload)
    chosen, est, problems = candidates[-1], None, []
    for mode in candidates:
        est = _rank_estimate(cfg, p, mode)
        problems = _fits(cfg, budget, est, mode)
        chosen = mode
        if not problems:
            break
    assert est is not None
    inference = _inference(cfg, p)
    disk = disk_plan(cfg, p, chosen, est.ssd)
    no_room = disk_problem(cfg, disk)  # the store and the checkpoints on the node's disk
    suggestions = _training_suggestions(cfg, p, budget, chosen, problems, disk) if problems or no_room else []
    problems = [*problems, *([no_room] if no_room else [])]
    if cfg.purpose == "serve":
        verdict = _serving_problems(cfg, p, inference)
        suggestions = serving_suggestions(cfg, inference, p.moe_layers) if verdict else []
    else:
        verdict = problems
    return Plan(params=p, budget=budget, mode=chosen, per_rank=est, world_size=world_size(cfg),
                feasible=not verdict, problems=verdict, suggestions=suggestions, assumptions=_assumptions(cfg),
                inference=inference, purpose=cfg.purpose, training_problems=problems,
                process_host_bytes=process_host_bytes(cfg, est), device="gpu" if cfg.topology.gpus_per_node else "cpu",
                disk=disk, keepable_layers=0 if problems else keepable_layers(cfg, p, chosen))


def fit_training(cfg: MoesysConfig) -> tuple[OffloadMode, RankEstimate, list[str], ParamCounts]:
    """(the mode storage.offload gives, or auto's first that fits; its per-rank estimate; why training does not fit,
    disk included; the parameter counts): plan_placement's training verdict without its suggestions, for searches
    that try many configs (runtime/plan/schedule.py)."""
    p = count_parameters(cfg.model)
    problems = _problems_of(p)
    mode, est, found = OffloadMode.NONE, None, []
    for mode in requested_modes(cfg.storage.offload):
        est = _rank_estimate(cfg, p, mode)
        found = problems(cfg, mode)
        if not found:
            break
    assert est is not None
    return mode, est, found, p


def keepable_layers(cfg: MoesysConfig, p: ParamCounts, mode: OffloadMode) -> int:
    """The most MoE layers storage.resident_layers could keep on the GPU with `mode`'s plan still fitting, leaving
    at least one offloaded; 0 without GPUs (the device pool is the host's RAM: nothing moves off the CPU). Each
    kept layer's update leaves the CPU optimizer, which bounds an offloaded step on a GPU when most experts are
    active; device memory only grows with the layers kept, so a binary search finds the most."""
    if not (mode.offloaded and cfg.topology.gpus_per_node and p.moe_layers > 1):
        return 0

    problems = _problems_of(p)

    def fits(kept: int) -> bool:
        return not problems(changed(cfg, "storage", offload=mode.value, resident_layers=kept), mode)

    return first_passing(range(p.moe_layers - 1, -1, -1), fits) or 0


def keep_layers_hint(plan: Plan) -> str | None:
    """One line naming the most MoE layers the GPU could keep, when that is more than the plan keeps; else None."""
    kept = plan.per_rank.resident_layers if plan.mode.offloaded else 0
    if plan.keepable_layers <= kept:
        return None
    return (f"the GPU has room to keep {plan.keepable_layers} of the {plan.params.moe_layers} MoE layers' experts: "
            f"storage.resident_layers={plan.keepable_layers} takes their update off the CPU optimizer")


def _problems_of(p: ParamCounts):
    """Every reason a changed config (same model, so same counts p) does not fit in a mode, its disk included."""
    def problems(trial: MoesysConfig, mode: OffloadMode) -> list[str]:
        est = _rank_estimate(trial, p, mode)
        no_room = disk_problem(trial, disk_plan(trial, p, mode, est.ssd))
        return [*_fits(trial, eq1_budget(trial, p), est, mode), *([no_room] if no_room else [])]
    return problems


def _training_suggestions(cfg: MoesysConfig, p: ParamCounts, budget, mode: OffloadMode, memory: list[str],
                          disk: DiskPlan) -> list[str]:
    """`try:` lines under which the whole plan fits. When the checkpoints do not fit the disk, no other knob makes
    room for them: the lines start with the checkpoint settings that do (fewer_checkpoints)."""
    base, prefix = cfg, ""
    if disk_problem(cfg, disk):
        base, prefix = fewer_checkpoints(cfg, disk)
        if not memory:
            written = "only the final checkpoint is" if base.train.final_checkpoint else "no checkpoint is"
            return [f"{prefix} fits ({written} written)"]
        prefix += " "
    lines = training_suggestions(base, budget, mode, MODES, _problems_of(p))
    return [line if line.startswith("no ") else prefix + line for line in lines]


def _assumptions(cfg: MoesysConfig) -> list[str]:
    t = cfg.topology
    out = [
        "bytes per parameter follow Eq. 1: 16 for dense states, 4 for an active expert's fp16 param+grad, "
        "16 for a cached expert, 12 for an expert on SSD",
        f"experts split over topology.expert_parallel={t.expert_parallel} ranks; "
        f"dense states {'sharded over' if cfg.storage.dense_shard else 'replicated on'} the {world_size(cfg)} "
        "data-parallel ranks",
        f"activations: what the model code saves for backward of one micro-batch (train.recompute="
        f"{cfg.train.recompute}: {RECOMPUTE_KEEPS.get(cfg.train.recompute, RECOMPUTE_KEEPS['none'])}; flash or "
        "memory-efficient attention, no S x S scores), fp32 logits' log-softmax and gradients; device total: the "
        "larger of the start of backward (no gradients yet) and the optimizer step (torch AdamW's temporaries), not "
        "the sum of the rows",
        f"token embedding {'split column-wise over' if cfg.model.embedding_partition else 'replicated on'} the "
        "data-parallel ranks (model.embedding_partition)",
        f"prefetch buffers hold {cfg.storage.prefetch_depth} layer(s) ahead",
        f"storage.alpha={cfg.storage.alpha}: share of expert parameters activated per step",
    ]
    if not t.gpus_per_node:
        out.append("no GPU: the device tier is a pool in host RAM; it and the host cache share topology.cpu_memory_gb "
                   "/ nproc_per_node per rank")
    else:
        out.append(f"on a GPU: {CUDA_CONTEXT_BYTES / GB:.1f} GB of each GPU for the CUDA context (not allocatable), "
                   f"{CUDA_WORKSPACE_BYTES / 2**20:.0f} MiB of cuBLAS workspaces; device bytes are CUDA's allocated "
                   "peak, the caching allocator's reserve above it is not counted")
    runtime = process_runtime_bytes(cfg)
    bf16_kernels = runtime > PROCESS_RUNTIME_BYTES and not t.gpus_per_node
    what = " (CUDA included)" if t.gpus_per_node else " (oneDNN's bf16 kernels included)" if bf16_kernels else ""
    out.append(f"each worker process needs {runtime / GB:.1f} GB of host RAM for its runtime{what} besides the states "
               "counted here")
    out.append(f"disk: the expert store is each rank's experts at 12 bytes a parameter (storage.offload=ssd; cpu "
               f"writes none); a checkpoint is every parameter at 12 bytes, {kept_checkpoints(cfg)} kept and one more "
               "while the next is written; judged against topology.ssd_gb per node")
    if cfg.purpose == "serve":
        out.append("serving: fp16 weights, KV cache and activations not counted; the experts of every MoE layer "
                   "live in the host tier (a memory-mapped store on disk)")
    return out


def plan_to_dict(plan: Plan) -> dict:
    """The plan as plain data: the public `moesys plan --json` contract."""
    p, b, r = plan.params, plan.budget, plan.per_rank
    return {
        "params": {"total": p.total, "dense": p.dense, "sparse": p.sparse, "active": p.active,
                   "embedding": p.embedding, "per_expert": p.per_expert, "moe_layers": p.moe_layers},
        "budget": {
            "alpha": b.alpha, "layers": b.layers, "nodes": b.nodes, "ok": b.ok,
            "tiers": {str(name): {"required_bytes": t.required_bytes, "capacity_bytes": t.capacity_bytes,
                                  "ok": t.ok, "formula": t.formula} for name, t in b.tiers.items()},
            "min_nodes": b.min_nodes(),
            "unsatisfiable": [str(name) for name in b.unsatisfiable()],
        },
        "placement": {"offload": str(plan.mode), "dense": str(TierName.GPU), "sparse": str(plan.mode.home),
                      "device": plan.device,
                      "cpu_cache_experts": r.cache_experts, "local_experts": r.local_experts,
                      "device_expert_layers": r.expert_window, "resident_layers": r.resident_layers,
                      "resident_layers_fit": plan.keepable_layers},
        "per_rank": {"world_size": plan.world_size, "device": r.device, "device_total": r.device_total,
                     "device_capacity": r.device_capacity, "device_peak_at": r.device_peak_at,
                     "host": r.host, "host_capacity": r.host_capacity,
                     "ssd": r.ssd, "ok": r.ok, "process_host_bytes": plan.process_host_bytes},
        "disk": {"expert_store_bytes": plan.disk.store_bytes, "checkpoint_bytes": plan.disk.checkpoint_bytes,
                 "checkpoints_on_disk": plan.disk.checkpoints, "checkpoints_bytes": plan.disk.checkpoints_bytes,
                 "total_bytes": plan.disk.total_bytes},
        "inference": plan.inference,
        "purpose": plan.purpose,
        "training": {"feasible": not plan.training_problems, "problems": plan.training_problems},
        "feasible": plan.feasible,
        "problems": plan.problems,
        "suggestions": plan.suggestions,
        "assumptions": plan.assumptions,
    }
