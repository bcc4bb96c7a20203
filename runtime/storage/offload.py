"""Training with expert states off the device: SSD store -> LFU CPU cache -> device, CPU AdamW where the states live
(seed 004 section 3.2, Algorithm 2 and the sparse half of 2D prefetch; seed 002 section 4.2: fetch only experts
that receive tokens, write back and step only those).

`install_offload(model, ...)` swaps every MoE layer's GroupedExperts for an OffloadedExperts (same call signature)
that fetches the active experts' fp32 weights through the cache and runs `expert_ffn` on them. The device copies are
autograd leaves whose storage is freed after the layer's forward and refilled when its backward starts, so the
device tier holds one layer's active experts at a time. After backward the trainer calls `finish_backward()`,
`grad_sq()` and `step(lr, coef)`.
Legend: R routed rows, D model dim, e local experts, a active local experts.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from runtime.checkpoint_format import MODEL, STATE_KEYS, CheckpointReader, tensor_key
from runtime.model.init import init_expert
from runtime.moe.experts import GroupedExperts, expert_ffn
from runtime.moe.layer import EXPERT_PARAM_NAMES
from runtime.optim import AdamWHyper, catch_up, expert_adamw_step, lr_at
from runtime.prefetch.sparse import SparsePrefetcher
from runtime.storage.budget import STORED_SPARSE_BYTES
from runtime.storage.cache import LFUCache
from runtime.storage.expert_store import ExpertKey, ExpertState, ExpertStore, new_state, state_bytes
from runtime.storage.tiers import Tiers
from runtime.storage.write_behind import WriteBehind
from runtime.tensorfile import spec_of, write_tensors


@dataclass(frozen=True)
class LayerSpec:
    """One offloaded MoE layer: which global experts this rank holds and how to run them."""

    index: int
    param_prefix: str
    """Qualified name of the layer's experts module (`blocks.0.ffn.experts`): checkpoint keys use it."""
    num_local: int
    first_global: int
    names: tuple[str, ...]
    kind: str
    impl: str
    expert_bytes: int

    def key(self, local: int) -> ExpertKey:
        return (self.index, self.first_global + local)


@dataclass
class _Live:
    """A layer's fetched experts this step: keys, their CPU states and the device leaves autograd fills.

    Between the layer's forward and its backward the leaves' storage is released (resident False), so the device
    tier holds only the layers computing now; backward fetches them again from the host states."""

    keys: list[ExpertKey]
    states: list[ExpertState]
    leaves: dict[str, Tensor]
    device_bytes: int
    resident: bool = True
    grads_arrived: int = 0
    hooks: list = field(default_factory=list)
    """Handles of the leaves' hooks, which refer back to this object: a cycle through C++ that Python's garbage
    collector cannot see, so `finish_backward` removes them (else every step's leaves and gradients leak)."""


class OffloadedExperts(nn.Module):
    """Replaces MoELayer.experts: forward(x_RD, tokens_per_expert_e) -> y_RD, weights fetched per call."""

    def __init__(self, manager: "OffloadManager", spec: LayerSpec):
        super().__init__()
        self.manager, self.spec = manager, spec
        self.num_experts = spec.num_local

    def forward(self, x_RD: Tensor, tokens_per_expert_e: Tensor) -> Tensor:
        return self.manager.run_layer(self.spec.index, x_RD, tokens_per_expert_e)

    def extra_repr(self) -> str:
        return f"layer={self.spec.index}, num_experts={self.spec.num_local}, offloaded"


class OffloadManager:
    """Owns the store, the cache, the prefetcher, the tiers and the CPU optimizer of every offloaded layer."""

    def __init__(self, specs: list[LayerSpec], store: ExpertStore, cache_experts: int, hit_threshold: float,
                 decay_beta: float, decay_every: int, prefetch_depth: int, device: torch.device,
                 lr_schedule: Callable[[int], float], adamw: AdamWHyper = AdamWHyper(),
                 tiers: Tiers | None = None, groups=None, fetch_all: bool = False):
        self.specs = {s.index: s for s in specs}
        self.order = [s.index for s in specs]
        self.store, self.device, self.adamw, self.lr_schedule = store, device, adamw, lr_schedule
        self.steps_done = 0
        """Optimizer steps applied so far (the trainer's step); experts idle meanwhile catch up before use."""
        self.tiers = tiers or Tiers.with_budgets()
        self.groups = groups
        self.fetch_all = fetch_all
        self.cache: LFUCache[ExpertKey, ExpertState] = LFUCache(
            cache_experts, hit_threshold, decay_beta, decay_every, self._load, self._write_back)
        self.prefetcher = SparsePrefetcher(self._read, lambda k: k in self.cache, self._wait_updated,
                                           prefetch_depth, self.cache.lock, self._hint)
        self._opt_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moesys-cpu-adamw")
        self.writes = WriteBehind()
        self._opt_future: Future | None = None
        self._updated = {i: threading.Event() for i in self.order}
        self._in_memory = {i: threading.Event() for i in self.order}
        for event in (*self._updated.values(), *self._in_memory.values()):
            event.set()
        self._live: dict[int, _Live] = {}
        self._grads: dict[ExpertKey, dict[str, Tensor]] = {}
        self._states: dict[ExpertKey, ExpertState] = {}
        self._on_host: dict[int, int] = {}
        self._host_lock = threading.Lock()
        self._stall = 0.0
        self._active = 0
        self._caught_up = 0
        self._ssd_read0 = self._ssd_written0 = 0

    # ---- SSD callbacks (host tier accounting) ----

    def _read(self, key: ExpertKey) -> ExpertState:
        self.writes.wait_for(key)
        state = self.store.read(key)
        nbytes = state_bytes(state)
        with self._host_lock:
            self.tiers.host.allocate(nbytes)
            self._on_host[id(state)] = nbytes
        self.tiers.host.moved(nbytes)
        return state

    def _hint(self, keys: list[ExpertKey]) -> None:
        """The prefetcher is about to read `keys`: start the disk reads of those whose file is final."""
        self.store.will_need([k for k in keys if not self.writes.pending(k)])

    def _drop_host(self, state: ExpertState) -> None:
        """The states left host memory (evicted, written back after a bypass, or unused); idempotent."""
        with self._host_lock:
            nbytes = self._on_host.pop(id(state), 0)
            self.tiers.host.release(nbytes)

    def _load(self, key: ExpertKey) -> ExpertState:
        staged = self.prefetcher.take(key)
        return staged if staged is not None else self._read(key)

    def _write_back(self, key: ExpertKey, state: ExpertState) -> None:
        """The cache evicts or flushes `key`: hand its states to the write-behind thread. An expert this step
        uses is skipped: its optimizer update is pending, and `_settle` writes it once updated."""
        if key in self._states or any(key in live.keys for live in self._live.values()):
            return
        self._write_behind([(key, state)], drop=key not in self.cache.entries, wait_update=True)

    def _write_behind(self, items: list[tuple[ExpertKey, ExpertState]], drop: bool,
                      wait_update: bool = False) -> None:
        """Write the states to SSD as one write-behind job (one file per expert, each in large writes), after their
        layer's CPU optimizer step when wait_update: never write a half-updated expert; drop them from the host
        tier afterwards when `drop`. A reader of any of the keys waits for the whole job."""
        def job() -> None:
            for key, state in items:
                if wait_update:
                    self._in_memory[key[0]].wait()
                self.store.write(key, state)
                self.tiers.ssd.moved(state_bytes(state))
                if drop:
                    self._drop_host(state)

        self.writes.submit_many([key for key, _ in items], job)

    def fetch_everything(self) -> None:
        """Become the ZeRO-3-offload baseline `moesys bench offload` compares with: every local expert fetched,
        stepped and written back each step, nothing kept in the CPU cache."""
        self.fetch_all = True
        self.cache.capacity = 0

    def _wait_updated(self, layer: int) -> None:
        self._updated[layer].wait()

    # ---- forward ----

    def run_layer(self, layer: int, x_RD: Tensor, tokens_per_expert_e: Tensor) -> Tensor:
        spec = self.specs[layer]
        pos = self.order.index(layer)
        self.prefetcher.schedule(self.order[pos + 1: pos + 1 + self.prefetcher.depth])
        counts_e = tokens_per_expert_e.detach().to("cpu", torch.long)
        active = list(range(spec.num_local)) if self.fetch_all else torch.nonzero(counts_e).flatten().tolist()
        keys = [spec.key(j) for j in active]
        self.prefetcher.record(layer, keys)
        self._active += len(active) if not self.fetch_all else int((counts_e > 0).sum())
        if not active:  # no rows here; stay in the graph so this rank's backward runs the same AlltoAlls as its peers
            return x_RD[:0] * 0
        began = time.perf_counter()
        self._updated[layer].wait()
        self.prefetcher.wait(layer)
        self._stall += time.perf_counter() - began
        states = [self.cache.request(k)[0] for k in keys]
        with torch.no_grad():
            for state in states:
                self._caught_up += catch_up(state, spec.names, self.steps_done, self.lr_schedule, self.adamw)
        leaves = {}
        for name in spec.names:
            stacked = torch.stack([s[f"param.{name}"] for s in states]).to(self.device)
            leaves[name] = stacked.requires_grad_(torch.is_grad_enabled())
        nbytes = sum(t.numel() * t.element_size() for t in leaves.values())
        self.tiers.device.allocate(nbytes)
        self.tiers.device.moved(nbytes)
        counts_a = counts_e[active].to(x_RD.device)
        y_RD = expert_ffn(x_RD, counts_a, **leaves, kind=spec.kind, impl=spec.impl)
        if not torch.is_grad_enabled():
            self.tiers.device.release(nbytes)
            self._release_bypassed(keys, states)
            return y_RD
        live = self._live[layer] = _Live(keys, states, leaves, nbytes)
        if y_RD.requires_grad:  # free the device copies until this layer's backward asks for them again
            self._evict_device(live)
            y_RD.register_hook(lambda grad, live=live: self._refetch_device(live))
            for leaf in leaves.values():
                live.hooks.append(leaf.register_post_accumulate_grad_hook(
                    lambda leaf, live=live: self._grad_arrived(live)))
        return y_RD

    def _grad_arrived(self, live: _Live) -> None:
        """Once every leaf of the layer has its gradient, the weights are no longer needed on the device."""
        live.grads_arrived += 1
        if live.grads_arrived == len(live.leaves) and live.resident:
            self._evict_device(live)

    def _evict_device(self, live: _Live) -> None:
        for leaf in live.leaves.values():
            leaf.untyped_storage().resize_(0)
        live.resident = False
        self.tiers.device.release(live.device_bytes)

    def _refetch_device(self, live: _Live) -> None:
        """Backward of the layer starts: copy its experts' weights back from the host states (unchanged until the
        CPU optimizer step, which runs after backward)."""
        began = time.perf_counter()
        self.tiers.device.allocate(live.device_bytes)
        self.tiers.device.moved(live.device_bytes)
        with torch.no_grad():
            for name, leaf in live.leaves.items():
                leaf.untyped_storage().resize_(leaf.numel() * leaf.element_size())
                leaf.data.copy_(torch.stack([s[f"param.{name}"] for s in live.states]))  # no version bump
        live.resident = True
        self._stall += time.perf_counter() - began

    def _release_bypassed(self, keys: list[ExpertKey], states: list[ExpertState]) -> None:
        with self.cache.lock:
            for key, state in zip(keys, states):
                if self.cache.entries.get(key) is not state:
                    self._drop_host(state)

    # ---- backward -> gradients on the host ----

    def finish_backward(self) -> None:
        """Move the active experts' gradients to the host (averaged over expert replicas) and free the device copies."""
        for layer, live in self._live.items():
            for i, (key, state) in enumerate(zip(live.keys, live.states)):
                grads = {}
                for name, leaf in live.leaves.items():
                    g = leaf.grad[i] if leaf.grad is not None else torch.zeros_like(leaf[i])
                    grads[name] = g.detach().to("cpu", torch.float32).contiguous()
                    self.tiers.host.moved(grads[name].numel() * 4)
                self._grads[key] = grads
                self._states[key] = state
            if live.resident:
                self.tiers.device.release(live.device_bytes)
            for hook in live.hooks:
                hook.remove()
            live.leaves.clear()
        self._live.clear()
        g = self.groups
        if g is not None and g.edp_size > 1:
            self._reduce_over_replicas(g)
        if g is not None and g.ep_size > 1:
            for grads in self._grads.values():
                for t in grads.values():
                    t.div_(g.ep_size)

    def _reduce_over_replicas(self, g) -> None:
        """Replicas of an expert may route different tokens: agree on the union of active experts, average grads."""
        all_keys = [s.key(j) for s in self.specs.values() for j in range(s.num_local)]
        mask = torch.tensor([k in self._grads for k in all_keys], dtype=torch.float32)
        dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=g.edp_group)
        union = [k for k, m in zip(all_keys, mask.tolist()) if m > 0]
        for key in union:
            if key not in self._grads:
                state = self.cache.request(key)[0]
                self._states[key] = state
                self._grads[key] = {n: torch.zeros_like(state[f"param.{n}"]) for n in self.specs[key[0]].names}
        flat = [t for k in union for t in self._grads[k].values()]
        if flat:
            buf = torch.cat([t.flatten() for t in flat])
            dist.all_reduce(buf, group=g.edp_group)
            buf.div_(g.edp_size)
            for t, new in zip(flat, torch._utils._unflatten_dense_tensors(buf, flat)):
                t.copy_(new)

    def grad_sq(self) -> Tensor:
        """Sum of squared expert gradients held by this rank (add before the EP all-reduce of the global norm)."""
        return sum((t.pow(2).sum() for grads in self._grads.values() for t in grads.values()), torch.zeros(()))

    # ---- CPU AdamW, overlapped with the next step's device work ----

    def step(self, lr: float, clip_coef: float | None = None) -> None:
        """Start the AdamW step of every expert that got a gradient, on the CPU thread, layer by layer."""
        self.wait_step()
        self._end_prefetch()
        self.writes.check()
        grads, states = self._grads, self._states
        self._grads, self._states = {}, {}
        layers = sorted({k[0] for k in grads})
        for layer in layers:
            self._updated[layer].clear()
            self._in_memory[layer].clear()
        self._opt_future = self._opt_pool.submit(self._step_job, layers, grads, states, lr, clip_coef,
                                                 self.steps_done)
        self.steps_done += 1
        self.cache.end_step()
        self.prefetcher.schedule(self.order[: self.prefetcher.depth])

    def _settle(self, keys: list[ExpertKey], states: dict[ExpertKey, ExpertState]) -> None:
        """One layer's updated experts: those still in the cache become dirty; the others (bypassed, or evicted
        meanwhile) go home to SSD together, as one write-behind job. Holds the cache lock."""
        home = []
        for key in keys:
            if self.cache.entries.get(key) is states[key]:
                self.cache.mark_dirty(key)
            else:
                home.append((key, states[key]))
        if home:
            self._write_behind(home, drop=True)

    def _step_job(self, layers, grads, states, lr, clip_coef, step: int) -> None:
        h = self.adamw
        deferred: list[tuple[int, list[ExpertKey]]] = []
        try:
            for layer in layers:
                keys = [k for k in grads if k[0] == layer]
                names = self.specs[layer].names
                for key in keys:
                    g = [grads[key][n] for n in names]
                    if clip_coef is not None:
                        for t in g:
                            t.mul_(clip_coef)
                    catch_up(states[key], names, step, self.lr_schedule, h)  # a replica's zero-gradient expert
                    expert_adamw_step(states[key], names, g, lr, h)
                self._in_memory[layer].set()
                # The forward thread may hold the cache lock while it waits for a later layer's update (an
                # eviction writing that layer back): never block on the lock before every layer is computed.
                if self.cache.lock.acquire(blocking=False):
                    try:
                        self._settle(keys, states)
                    finally:
                        self.cache.lock.release()
                    self._updated[layer].set()
                else:
                    deferred.append((layer, keys))
            for layer, keys in deferred:
                with self.cache.lock:
                    self._settle(keys, states)
                self._updated[layer].set()
        finally:
            for layer in layers:
                self._in_memory[layer].set()
                self._updated[layer].set()

    def wait_step(self) -> None:
        if self._opt_future is not None:
            self._opt_future.result()
            self._opt_future = None

    # ---- metrics, checkpoints ----

    def step_metrics(self) -> dict[str, float]:
        """Per-step numbers for metrics.jsonl (counters reset)."""
        c = self.cache.counters.snapshot_and_reset()
        requests = c["hits"] + c["misses"]
        out = {"experts_active": self._active, "cache_hit_rate": c["hits"] / requests if requests else 1.0,
               **{f"cache_{k}": v for k, v in c.items()}, "fetch_stall_s": self._stall,
               "ssd_read_bytes": self.store.bytes_read - self._ssd_read0,
               "ssd_write_bytes": self.store.bytes_written - self._ssd_written0,
               "prefetched_experts": self.prefetcher.prefetched, "catch_up_steps": self._caught_up,
               "ssd_bytes": self.store.disk_bytes(),
               **self.tiers.step_metrics()}
        self._ssd_read0, self._ssd_written0 = self.store.bytes_read, self.store.bytes_written
        self._active, self._stall, self.prefetcher.prefetched, self._caught_up = 0, 0.0, 0, 0
        return {f"offload/{k}": v for k, v in out.items()}

    def save(self, directory: Path, step: int) -> list[Path]:
        """Write this rank's experts into the checkpoint being assembled in `directory`: one file per MoE layer,
        streamed one expert at a time (read from the cache or the store, caught up to `step`, written, dropped), so
        host memory holds one expert's states beyond the cache. Keys are those a resident checkpoint uses: the
        checkpoint is a complete, immutable copy that inference and any EP size can load.
        Expert-data-parallel replicas hold equal states, so only the first of them writes."""
        self.drain()
        assert step == self.steps_done, (step, self.steps_done)
        if self.groups is not None and self.groups.edp_rank != 0:
            return []
        ep_rank = self.groups.ep_rank if self.groups is not None else 0
        files = []
        for spec in self.specs.values():
            states = self._caught_up_states(spec, step)
            first = next(states)  # every expert of a layer has its shapes: the header is known from the first
            specs = {k: spec_of(t) for g in range(spec.first_global, spec.first_global + spec.num_local)
                     for k, t in self._checkpoint_items(spec, g, first[1])}
            stream = (item for g, state in chain([first], states)
                      for item in self._checkpoint_items(spec, g, state))
            del first
            files.append(write_tensors(directory / f"experts-ep{ep_rank}-L{spec.index:04d}.safetensors", specs,
                                       stream))
        return files

    def _caught_up_states(self, spec: LayerSpec, step: int) -> Iterator[tuple[int, ExpertState]]:
        """(global expert, states caught up to `step`) of the layer's local experts, read one at a time."""
        for j in range(spec.num_local):
            key = spec.key(j)
            with self.cache.lock:
                state = self.cache.entries.get(key)
            state = state if state is not None else self.store.read(key)
            with torch.no_grad():
                catch_up(state, spec.names, step, self.lr_schedule, self.adamw)
            yield key[1], state

    @staticmethod
    def _checkpoint_items(spec: LayerSpec, g: int, state: ExpertState) -> list[tuple[str, Tensor]]:
        """One expert's states under the checkpoint keys of a resident model (runtime/checkpoint_format.py)."""
        out = []
        for name in spec.names:
            param = f"{spec.param_prefix}.{name}"
            out.append((tensor_key(MODEL, param, g), state[f"param.{name}"]))
            out += [(tensor_key(kind, param, g), state[f"{kind}.{name}"]) for kind in STATE_KEYS]
            out.append((tensor_key("step", param, g), state["step"].reshape(1)))
        return out

    def load(self, reader: CheckpointReader, step: int) -> None:
        """Rebuild this rank's store from a checkpoint (written with offload or without, by any EP size) and drop
        cached states: the run resumes with exactly the expert states of that checkpoint."""
        self.drain()
        self._end_prefetch()
        self.cache.clear()
        with self._host_lock:
            self._on_host.clear()
            self.tiers.host.used = 0
        for spec in self.specs.values():
            for j in range(spec.num_local):
                key = spec.key(j)
                state: ExpertState = {}
                for name in spec.names:
                    param = f"{spec.param_prefix}.{name}"
                    state[f"param.{name}"] = reader.get(tensor_key(MODEL, param, key[1])).float()
                    for kind in STATE_KEYS:
                        state[f"{kind}.{name}"] = reader.get(tensor_key(kind, param, key[1])).float()
                    state["step"] = reader.get(tensor_key("step", param, key[1])).float().reshape(())
                self.store.write(key, state)
        self.store.bytes_written = 0
        self.steps_done = step

    def _end_prefetch(self) -> None:
        for state in self.prefetcher.end_step():
            self._drop_host(state)

    def drain(self) -> None:
        """Wait for all background work: the CPU optimizer step, the prefetches in flight (their states stay
        staged) and the write-behind queue."""
        self.wait_step()
        self.prefetcher.wait_all()
        self.writes.drain()

    def close(self) -> None:
        self.drain()
        self._end_prefetch()
        self.prefetcher.close()
        self.writes.close()
        self._opt_pool.shutdown(wait=True)


def layer_specs(model: nn.Module) -> list[tuple[nn.Module, LayerSpec]]:
    """(MoE layer, spec) for every MoE layer of `model`, in forward order (shapes only: works on the meta device)."""
    names = {id(module): name for name, module in model.named_modules()}
    out = []
    for index, layer in enumerate(model.moe_layers()):
        experts: GroupedExperts = layer.experts
        params = tuple(n for n in EXPERT_PARAM_NAMES if getattr(experts, n, None) is not None)
        nbytes = STORED_SPARSE_BYTES * sum(getattr(experts, n)[0].numel() for n in params) + 4  # + step
        out.append((layer, LayerSpec(index, names[id(experts)], experts.num_experts, experts.first_expert,
                                     params, experts.expert_type, experts.impl, nbytes)))
    return out


def install_offload(model: nn.Module, store: ExpertStore, device: torch.device, *, seed: int, cache_experts: int,
                    hit_threshold: float = 1, decay_beta: float = 0.5, decay_every: int = 10,
                    lr_schedule: Callable[[int], float], prefetch_depth: int = 1, adamw: AdamWHyper = AdamWHyper(),
                    tiers: Tiers | None = None, groups=None, fetch_all: bool = False,
                    write_initial: bool = True) -> OffloadManager:
    """Swap every MoE layer's experts for OffloadedExperts whose states live in `store`.

    With `write_initial` each expert is created in the store one at a time (fp32 master weights drawn from
    (seed, name, global expert) as a resident model draws them, zero moments), so host memory holds one expert's
    states at most; without it the store is filled later (a checkpoint's load). The model may be on the meta device:
    its expert tensors are never read."""
    pairs = layer_specs(model)
    manager = OffloadManager([s for _, s in pairs], store, cache_experts, hit_threshold, decay_beta, decay_every,
                             prefetch_depth, device, lr_schedule, adamw, tiers, groups, fetch_all)
    for layer, spec in pairs:
        experts = layer.experts
        if write_initial:
            shapes = {n: tuple(getattr(experts, n).shape[1:]) for n in spec.names}
            for j in range(spec.num_local):
                key = spec.key(j)
                store.write(key, new_state(init_expert(seed, spec.param_prefix, shapes, key[1])))
        manager.tiers.ssd.allocate(spec.num_local * spec.expert_bytes)
        layer.experts = OffloadedExperts(manager, spec)
    store.bytes_written = 0
    return manager


def offload_from_config(model: nn.Module, cfg, groups, device: torch.device, placement,
                        write_initial: bool = True) -> OffloadManager | None:
    """The offload runtime of `placement` (runtime/train/decided.py: RUN_DIR/plan.json, decided once by
    `moesys train`), or None when expert states stay on the device.

    Each rank keeps its own store under STORE/ep{r}-of-{n}-edp{k} (STORE: storage.ssd_path, or the run
    directory's expert_store/), owned by this run. With offload=cpu the store backs a host cache that holds every
    local expert once it has been used.
    """
    from runtime.run_dir import expert_store_root

    st = cfg.storage
    if placement.offload not in ("cpu", "ssd"):
        return None
    tiers = Tiers.with_budgets(placement.device_capacity, placement.host_capacity, placement.ssd_capacity)
    ep_rank, ep_size, edp_rank = (groups.ep_rank, groups.ep_size, groups.edp_rank) if groups is not None else (0, 1, 0)
    store = ExpertStore(expert_store_root(cfg) / f"ep{ep_rank}-of-{ep_size}-edp{edp_rank}",
                        owner=str(Path(cfg.train.run_dir).resolve()))
    return install_offload(model, store, device, seed=cfg.train.seed, cache_experts=placement.cpu_cache_experts,
                           hit_threshold=st.hit_threshold, decay_beta=st.decay_beta, decay_every=st.decay_every,
                           prefetch_depth=st.prefetch_depth, lr_schedule=lambda step: lr_at(step, cfg.train),
                           adamw=AdamWHyper(weight_decay=cfg.train.weight_decay), tiers=tiers, groups=groups,
                           write_initial=write_initial)
