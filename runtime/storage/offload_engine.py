"""Training with expert states off the device (the paper's section 3.2: expert states on CPU or SSD, 2D prefetch,
the CPU optimizer where the states live).

`install_offload(model, ...)` (runtime/storage/offload_install.py) swaps every MoE layer's GroupedExperts for
OffloadedGroupedExperts (same call signature). A forward of such a layer sends its active experts' weights to the
device (TransferEngine) from their host slots (a HostHome or an SSDHome); its backward sends their gradients home,
where the HostOptimizer takes them in while the backward goes on, and updates them once the trainer has the global
norm (`step`); the micro-batches of one step (train.grad_accum_steps) first sum them on the device (LayerGradSum).
Experts that get no tokens are neither moved nor stepped: they apply the zero-gradient AdamW steps they missed when
next used, so offloaded training equals resident training bit for bit.
Legend: R routed rows, D model dim, e local experts, a active local experts.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain

import torch
from torch import Tensor, nn

from runtime.host.timeline import Timeline, by_kind, host_cost
from runtime.moe.experts import expert_ffn, output_dtype
from runtime.plan.budget import STORED_SPARSE_BYTES
from runtime.storage.expert_slots import ExpertSlot, SlotLayout, needs_separate_stage, refresh_stages, step_counts
from runtime.storage.expert_store import ExpertKey
from runtime.storage.grad_sum import LayerGradSum
from runtime.storage.host_adamw import HostOptimizer, LayerGrads, squares
from runtime.storage.host_home import ExpertHome
from runtime.storage.optim import AdamWHyper, catch_up
from runtime.storage.replica_grads import average_over_replicas
from runtime.storage.tiers import Tiers
from runtime.storage.transfers import DeviceCopy, TransferEngine

InitialExpert = Callable[[str, dict, int], dict]
"""initial(experts module name, {tensor: per-expert shape}, global expert) -> the expert's fp32 tensors by name."""
STALLS = ("wait_update", "wait_prefetch", "acquire", "h2d")
"""Critical spans that count as the forward or backward waiting for experts (offload/fetch_stall_s)."""
UPDATE_POLL_S = 0.1
"""Seconds between looks at whether the update a forward waits for failed (it returns at once when it is done)."""


@dataclass(frozen=True)
class LayerSpec:
    """One offloaded MoE layer: which global experts this rank holds and how to run them."""

    index: int
    param_prefix: str
    """Qualified name of the layer's experts module (`blocks.0.ffn.experts`): checkpoint keys use it."""
    num_local: int
    first_global: int
    layout: SlotLayout
    kind: str
    impl: str

    @property
    def names(self) -> tuple[str, ...]:
        return self.layout.names

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's stored states (fp32 master and two moments, and the step)."""
        return STORED_SPARSE_BYTES * self.params + 4

    @property
    def frozen_bytes(self) -> int:
        """Bytes of one frozen expert's stored states: its fp32 weights and step."""
        return 4 * self.params + 4

    @property
    def params(self) -> int:
        return sum(torch.Size(s).numel() for s in self.layout.shapes)

    def key(self, local: int) -> ExpertKey:
        return (self.index, self.first_global + local)


class OffloadedGroupedExperts(nn.Module):
    """Stands in for MoELayer.experts: forward(x_RD, tokens_per_expert_e) -> y_RD, weights moved per call."""

    def __init__(self, engine: OffloadEngine, spec: LayerSpec):
        super().__init__()
        self.engine, self.spec = engine, spec
        self.num_experts = spec.num_local

    def forward(self, x_RD: Tensor, tokens_per_expert_e: Tensor) -> Tensor:
        return self.engine.run_layer(self.spec.index, x_RD, tokens_per_expert_e)

    def extra_repr(self) -> str:
        return f"layer={self.spec.index}, num_experts={self.spec.num_local}, offloaded"


class OffloadEngine:
    """Runs the offloaded layers of one rank and owns their step: the home of the expert states, the transfers, the
    host optimizer, and the events that order them."""

    def __init__(self, specs: list[LayerSpec], device: torch.device, lr_schedule: Callable[[int], float],
                 adamw: AdamWHyper, tiers: Tiers, groups, compute_dtype: torch.dtype, delayed_update: bool,
                 window: int, make_home: Callable[[OffloadEngine], ExpertHome], trainable: bool = True):
        """trainable=False: the experts are frozen (train.freeze=[experts]): their slots hold no moments, no gradient
        comes home, nothing is stepped or written back; a layer's copy is kept until the backward has passed
        through it (the input's gradient needs the weights)."""
        self.specs = {s.index: s for s in specs}
        self.order = [s.index for s in specs]
        self.layouts = {s.index: s.layout for s in specs}
        self.device, self.lr_schedule, self.adamw, self.tiers, self.groups = device, lr_schedule, adamw, tiers, groups
        self.compute_dtype, self.delayed, self.trainable = compute_dtype, delayed_update, trainable
        self.separate_stage = needs_separate_stage(compute_dtype, delayed_update)
        self.steps_done = 0
        """Updates submitted so far (the trainer's step)."""
        self.timeline = Timeline()
        self._updated = {i: threading.Event() for i in self.order}
        """Set when the layer's last update is applied and settled: a forward (or an SSD read) may use it."""
        self._stage_free = {i: threading.Event() for i in self.order}
        """Delayed update: set when the step running beside the update no longer reads the layer's stages."""
        for event in chain(self._updated.values(), self._stage_free.values()):
            event.set()
        self._use_lock = threading.Lock()
        self._in_use: set[ExpertKey] = set()
        self._in_flight: set[ExpertKey] = set()
        self._copies: dict[int, DeviceCopy] = {}
        self._history: dict[int, list[ExpertKey]] = {}
        self._pending: list[LayerGrads] = []
        self._caught_up = self._copied0 = self._home0 = 0
        self._step_keys: set[ExpertKey] = set()
        """Experts that computed rows since the metrics were last taken (experts_active)."""
        self.accumulating = False
        """A micro-batch before the last of an optimizer step runs: gradients are summed on the device, not sent."""
        self._sums: dict[int, LayerGradSum] = {}
        self._held: dict[ExpertKey, ExpertSlot] = {}
        """Slots the training forwards of this optimizer step acquired (a later micro-batch reuses them)."""
        self.last_spans: list = []
        """The timeline of the step whose metrics were taken last (the benchmark draws it)."""
        self.ffn = expert_ffn
        """The experts' FFN on the fetched weights (train.recompute=moe wraps it: runtime/train/recompute.py)."""
        self.home = make_home(self)
        self.transfers = TransferEngine(device, compute_dtype, self.layouts, window, tiers, self.timeline)
        self.transfers.layer_elements = {s.index: s.num_local * s.layout.numel for s in specs}
        self.optimizer = HostOptimizer(self.layouts, adamw, lr_schedule, self.timeline,
                                       threads=1 if device.type == "cpu" else None)

    # ---- what the homes ask ----

    def wait_updated(self, layer: int) -> None:
        """Block until the layer's last update is done; raise instead if the update failed (its layer would never
        be done)."""
        while not self._updated[layer].wait(UPDATE_POLL_S):
            self.optimizer.raise_if_failed()

    def in_use(self, key: ExpertKey) -> bool:
        with self._use_lock:
            return key in self._in_use

    @property
    def fetch_all(self) -> bool:
        return getattr(self.home, "fetch_all", False)

    @contextlib.contextmanager
    def accumulate(self):
        """The micro-batches run inside sum their experts' gradients on the device (LayerGradSum); the next backward
        outside sends the sums home, once a layer, for one update."""
        self.accumulating = True
        try:
            yield
        finally:
            self.accumulating = False

    # ---- forward ----

    def run_layer(self, layer: int, x_RD: Tensor, tokens_per_expert_e: Tensor) -> Tensor:
        spec = self.specs[layer]
        with self.timeline.span("route_to_host", True):  # which experts to move: one small copy per layer
            counts_e = tokens_per_expert_e.detach().to("cpu", torch.long)
        routed = torch.nonzero(counts_e).flatten().tolist()
        active = list(range(spec.num_local)) if self.fetch_all else routed
        keys = [spec.key(j) for j in active]
        training = torch.is_grad_enabled()  # an evaluation's forward is neither counted nor learned
        if training:
            self.home.before_layer(layer, keys)
            self._history[layer] = keys
            self._step_keys.update(spec.key(j) for j in routed)
        if not active:  # no rows here; stay in the graph so this rank's backward runs the same AlltoAlls as its peers
            return x_RD[:0].to(output_dtype(x_RD)) * 0
        if not self.delayed:
            with self.timeline.span("wait_update", True):
                self.wait_updated(layer)
        with self._use_lock:  # before the acquire: an expert it loads and then evicts for the next is still in use
            self._in_use.update(keys)
        slots = self._acquire(keys) if training else self.home.acquire(keys)
        self._catch_up(keys, slots)
        grad = torch.is_grad_enabled()
        block = None if self.transfers.cuda else self.home.layer_slots(layer)
        if block is not None:  # host memory is the device's: compute every local expert in place, idle ones on 0 rows
            moved_keys, moved, rows, counts = [spec.key(j) for j in range(spec.num_local)], block, active, counts_e
        else:
            moved_keys, moved, rows, counts = keys, slots, list(range(len(keys))), counts_e[active]
        copy = self.transfers.to_device(layer, moved_keys, moved, grad and self.trainable)
        copy.active = (keys, slots, rows)
        self._prefetch_after(layer)
        counts = counts.to(x_RD.device, non_blocking=True)
        y_RD = self.ffn(x_RD, counts, **copy.leaves, kind=spec.kind, impl=spec.impl)
        if not grad or not y_RD.requires_grad:
            self._done_reading(copy)
            self.home.release_unused(keys, slots)
            with self._use_lock:
                self._in_use.difference_update(keys)
            return y_RD
        self._copies[layer] = copy
        copy.hooks.append(y_RD.register_hook(lambda grad, copy=copy: self._backward_starts(copy)))
        if not self.trainable:  # nothing goes home: the copy goes once the input's gradient is made
            copy.hooks.append(x_RD.register_hook(lambda grad, copy=copy: self._frozen_done(copy)))
            return y_RD
        for leaf in copy.leaves.values():
            copy.hooks.append(leaf.register_post_accumulate_grad_hook(lambda leaf, copy=copy: self._grad_arrived(copy)))
        return y_RD

    def _acquire(self, keys: list[ExpertKey]) -> list[ExpertSlot]:
        """The slots of a training forward: those an earlier micro-batch of this step acquired, the rest from home."""
        fresh = [key for key in keys if key not in self._held]
        self._held.update(zip(fresh, self.home.acquire(fresh), strict=True))
        return [self._held[key] for key in keys]

    def _catch_up(self, keys: list[ExpertKey], slots: list[ExpertSlot]) -> None:
        """Bring experts idle since their last update to the step this forward must see (with a delayed update,
        the one before the update in flight, which catches up the experts it steps itself)."""
        if not self.trainable:  # frozen experts are never stepped
            return
        target = self.steps_done - 1 if self.delayed and self.steps_done else self.steps_done
        with self.timeline.span("catch_up", True), torch.no_grad():
            behind = [(slot, done) for key, slot, done in zip(keys, slots, step_counts(slots), strict=True)
                      if done < target and key not in self._in_flight]
            if behind:
                late = [slot for slot, _ in behind]
                self._caught_up += catch_up(late, target, self.lr_schedule, self.adamw, [d for _, d in behind])
                refresh_stages(late)

    def _prefetch_after(self, layer: int) -> None:
        """Start moving the next layer's experts, predicted from its last step, while this layer computes."""
        if not self.transfers.cuda:
            return
        pos = self.order.index(layer)
        if pos + 1 == len(self.order):
            return
        nxt = self.order[pos + 1]
        keys = self._history.get(nxt)
        if not keys or not (self.delayed or self._updated[nxt].is_set()):
            return
        slots = self.home.peek(keys)
        if slots is not None and all(int(s.step) >= self.steps_done - int(self.delayed) or k in self._in_flight
                                     for k, s in zip(keys, slots, strict=True)):
            self.transfers.prefetch(nxt, keys, slots, computing=layer)

    # ---- backward ----

    def _backward_starts(self, copy: DeviceCopy) -> None:
        with self.timeline.span("refetch", True):
            self.transfers.ensure_resident(copy)
            self.transfers.prefetch_backward(copy.layer)

    def _grad_arrived(self, copy: DeviceCopy) -> None:
        """Once every leaf of the layer has its gradient, send them home and free the device copy; while accumulating
        add them to the layer's sum instead, and send the sum with the last micro-batch's."""
        copy.grads_arrived += 1
        if copy.grads_arrived < len(copy.leaves):
            return
        summed = self._sums.get(copy.layer)
        if self.accumulating or summed:
            keys, slots, rows = copy.active
            self._sum_of(copy.layer).add(keys, slots, rows, copy.grads())
            self._copies.pop(copy.layer, None)
            if self.accumulating:  # the stages are read again by the next micro-batch: not free yet
                self.transfers.release(copy)
            else:
                self._send_sum(copy.layer)
                self._done_reading(copy)
            return
        sums = self._squares(copy.grads())
        grads, flat, landed, release = self.transfers.grads_home(copy)
        self._take_in(copy, grads, landed, sums, flat, release)

    def _sum_of(self, layer: int) -> LayerGradSum:
        if layer not in self._sums:
            spec = self.specs[layer]
            self._sums[layer] = LayerGradSum(layer, spec.layout, spec.num_local, spec.first_global,
                                             self.transfers.device, self.tiers)
        return self._sums[layer]

    def _send_sum(self, layer: int) -> None:
        """The layer's gradients summed over this step's micro-batches go home, in the compute dtype from a GPU."""
        keys, slots, packed = self._sums[layer].take(self.compute_dtype if self.transfers.cuda else torch.float32)
        grads, flat, landed, release = self.transfers.packed_home(layer, packed)
        self.optimizer.take_in(layer, keys, slots, grads, list(range(len(keys))), landed,
                               self._squares(self.layouts[layer].views(packed)),
                               flat if self.layouts[layer].dense else None, release)

    def _squares(self, grads: dict[str, Tensor]) -> list[Tensor]:
        """The gradients' shares of the global norm, computed where they were made (on a GPU, not by the host);
        none for experts with replicas, whose norm counts once they are averaged."""
        replicated = self.groups is not None and self.groups.edp_size > 1
        return [] if replicated else squares(grads)

    def _take_in(self, copy: DeviceCopy, grads: dict[str, Tensor], landed, sums: list[Tensor],
                 flat: Tensor | None = None, release=None) -> None:
        keys, slots, rows = copy.active
        self.optimizer.take_in(copy.layer, keys, slots, grads, rows, landed, sums, flat, release)
        self._copies.pop(copy.layer, None)
        self._done_reading(copy)

    def _frozen_done(self, copy: DeviceCopy) -> None:
        """A frozen layer's backward is past its experts: let go of their copy and slots (a later micro-batch
        acquires them again)."""
        keys, slots, _ = copy.active
        for key in keys:
            self._held.pop(key, None)
        self._copies.pop(copy.layer, None)
        self._done_reading(copy)
        self.home.release_unused(keys, slots)
        with self._use_lock:
            self._in_use.difference_update(keys)

    def _done_reading(self, copy: DeviceCopy) -> None:
        self.transfers.release(copy)
        self._stage_free[copy.layer].set()

    def finish_backward(self) -> None:
        """After backward: every active expert's gradient is home and taken in (averaged over expert replicas)."""
        for copy in list(self._copies.values()):  # a layer whose output did not reach the loss: zero gradients
            if not self.trainable:
                self._frozen_done(copy)
                continue
            if self._sums.get(copy.layer):
                self._copies.pop(copy.layer)
                self._done_reading(copy)
                continue
            zeros = {n: torch.zeros_like(leaf) for n, leaf in copy.leaves.items()}
            self._take_in(copy, zeros, None, self._squares(zeros))
        for layer, summed in self._sums.items():  # no rows in the last micro-batch: the earlier ones' sum
            if summed:
                self._send_sum(layer)
        self.transfers.end_step()
        for event in self._stage_free.values():
            event.set()
        self._pending = self.optimizer.gathered()
        g = self.groups
        if g is not None and g.edp_size > 1:
            self._reduce_over_replicas(g)

    def _reduce_over_replicas(self, g) -> None:
        """Replicas of an expert may route different tokens: agree on the union of active experts, average grads."""
        def acquire(missing: list[ExpertKey]) -> list[ExpertSlot]:
            with self._use_lock:
                self._in_use.update(missing)
            return self.home.acquire(missing)

        all_keys = [s.key(j) for s in self.specs.values() for j in range(s.num_local)]
        self._pending = average_over_replicas(self._pending, all_keys, self.order, self.layouts, acquire,
                                              g.edp_group, g.edp_size)

    def grad_sq(self) -> Tensor:
        """Sum of squared expert gradients held by this rank, as the resident experts' reduction leaves them
        (divided by the expert-parallel size); add before the EP all-reduce of the global norm."""
        ep = self.groups.ep_size if self.groups is not None else 1
        return sum((sq / ep ** 2 for lg in self._pending for sq in lg.squares), torch.zeros(()))

    # ---- the update ----

    def step(self, lr: float, multiplier: float | None = None) -> None:
        """Start the update of every expert that got a gradient, on the optimizer's thread. Gradients are divided
        by the expert-parallel size (as the resident experts' reduction does; inside the kernel) and multiplied by
        `multiplier` (the clip coefficient, over the loss scale with fp16)."""
        self.optimizer.wait()
        self.home.end_step()
        self._held.clear()
        layers, self._pending = self._pending, []
        ep = self.groups.ep_size if self.groups is not None else 1
        for lg in layers:
            self._updated[lg.layer].clear()
        if self.delayed:  # the next step reads the stages the update would refresh: it must finish with them first
            for event in self._stage_free.values():
                event.clear()
        self._in_flight = {key for lg in layers for key in lg.keys}
        self.optimizer.submit(layers, self.steps_done, lr, multiplier, ep, self._finish_layer,
                              None if self.delayed else self._stages_unread)
        self.steps_done += 1
        if hasattr(self.home, "after_update"):
            self.home.after_update()

    def skip_step(self) -> None:
        """Drop this step's gradients (an fp16 overflow). The step still counts: every expert applies it later as
        a zero-gradient step, like one it was idle for."""
        self.optimizer.wait()
        self.home.end_step()
        self._held.clear()
        for lg in self._pending:
            lg.applied()
            self.home.settle(lg.keys, lg.slots)
            with self._use_lock:
                self._in_use.difference_update(lg.keys)
        self._pending = []
        self.steps_done += 1
        if hasattr(self.home, "after_update"):
            self.home.after_update()

    def _stages_unread(self, lg: LayerGrads) -> None:
        """Before an update that writes the stages as it goes (not delayed: this step's copies were its last)."""
        self.transfers.wait_stage_read(lg.layer)

    def _finish_layer(self, lg: LayerGrads) -> None:
        """On the optimizer's thread, after a layer's update: with a delayed update, refresh the stages the device
        copies from once the step beside it no longer reads them (else the update wrote them); settle the experts
        in their home, and let the layer's next forward go."""
        if self.delayed:
            with self.timeline.span("wait_stage_free", False):
                self._stage_free[lg.layer].wait()
            self.transfers.wait_stage_read(lg.layer)
            with self.timeline.span("refresh", False):
                refresh_stages(lg.slots)
        self.home.settle(lg.keys, lg.slots)
        with self._use_lock:
            self._in_use.difference_update(lg.keys)
        self._updated[lg.layer].set()

    def wait_step(self) -> None:
        """Wait for the update in flight, between steps: a delayed one is completed now, as no step runs beside it
        any more (else it would wait for that step to free the stages, and so would this)."""
        for event in self._stage_free.values():
            event.set()
        self.optimizer.wait()

    # ---- metrics, checkpoints ----

    def step_metrics(self) -> dict[str, float]:
        """Per-step numbers for metrics.jsonl (counters reset)."""
        spans = self.timeline.take()
        kinds = by_kind(spans)
        cost = host_cost(spans)
        out = {"experts_active": len(self._step_keys), "grad_home_bytes": self.transfers.grad_home_bytes - self._home0,
               "fetch_stall_s": sum(s.seconds for s in spans if s.critical and s.kind in STALLS),
               "catch_up_steps": self._caught_up + self.optimizer.caught_up,
               "host_work_s": cost["work_s"], "host_idle_wait_s": cost["idle_wait_s"], "host_cost_s": cost["cost_s"],
               "host_exposed_s": cost["exposed_s"], "host_hidden_share": cost["hidden_share"],
               "copied_bytes": self.transfers.copied_bytes - self._copied0,
               **{f"time_{kind}_s": seconds for kind, seconds in sorted(kinds.items())},
               **self.home.metrics(), **self.tiers.step_metrics()}
        self._step_keys.clear()
        self._caught_up = self.optimizer.caught_up = 0
        self._copied0, self._home0 = self.transfers.copied_bytes, self.transfers.grad_home_bytes
        self.last_spans = spans
        return {f"offload/{k}": v for k, v in out.items()}

    def drain(self) -> None:
        """Wait for all background work: the update (wait_step), the SSD reads and the write-behind queue."""
        self.wait_step()
        self.home.drain()

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self.transfers.end_step()
            self.optimizer.close()
            self.home.close()
