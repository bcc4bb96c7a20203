"""The CPU optimizer of offloaded experts: ZeRO-Offload's CPU Adam, on torch's fused AdamW kernel.

A layer's gradients are taken in as soon as its backward has sent them home, while the backward of the layers below
goes on (their squared norms come along, summed where the gradients were made). Gradients in the compute dtype stay
in that dtype: the update widens them to fp32 a chunk at a time, in cache. The update needs only the global norm
(clipping stays exact), then steps layer by layer in forward order, so that the next forward finds its first layers
updated first; with a delayed update the whole next step runs beside it (ZeRO-Offload's one-step delayed parameter
update).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import Tensor

from runtime.host.timeline import Timeline
from runtime.storage.expert_slots import ExpertSlot, SlotLayout, refresh_stages, run_states, slot_runs, step_counts
from runtime.storage.optim import AdamWHyper, catch_up, fused_adamw_counted, square_sum


@dataclass(eq=False)
class LayerGrads:
    """One layer's experts that got gradients this step."""

    layer: int
    keys: list
    slots: list[ExpertSlot]
    grads: dict[str, Tensor]
    """fp32 [n, *shape] per tensor name."""
    rows: list[int]
    """The row of `grads` that holds slots[i]'s gradient (the device computed n >= a experts, idle ones too)."""
    squares: list[Tensor] = field(default_factory=list)
    """Per tensor name, the fp32 sum of its squared gradients."""
    flat: Tensor | None = None
    """[n, P] that `grads` are views of, when the gradients came home in one buffer and the slots have no padding:
    the update then takes one (expert, whole slot) pair per expert instead of one per tensor. fp32, or the compute
    dtype they came home in."""
    release: Callable[[], None] | None = None
    """Gives the buffer the gradients came home in back to its pool."""

    def applied(self) -> None:
        """The gradients are no longer needed (the update used them, or they were dropped or copied)."""
        if self.release is not None:
            release, self.release = self.release, None
            release()


WIDEN_CHUNK = 1 << 22
"""Elements of a gradient widened to fp32 at once before the update reads them: 16 MB, which stays in cache between
the widening and the kernel."""
PACK_BELOW = 1 << 15
"""Elements: gradients that come home one tensor per name (without a GPU) are packed into one [a, P] buffer at intake
when their experts' tensors are smaller than this on average (fine-grained experts: 128 x 3 tensors of a few
thousand elements a layer), one gather per name. The update then makes one kernel call whose tensors are runs of
consecutive slots instead of (expert, tensor) pairs, each of which costs the kernel microseconds (a fork and join of
the intra-op threads), for one memcpy of the gradients; larger tensors are stepped where they lie."""


def _worth_packing(layout: SlotLayout, rows: list[int]) -> bool:
    """Pack per-name gradients (see PACK_BELOW): small tensors in a dense layout."""
    return bool(rows) and layout.dense and layout.numel < PACK_BELOW * len(layout.names)


def squares(grads: dict[str, Tensor]) -> list[Tensor]:
    """Each tensor's fp32 sum of squares, reduced as the resident model's norm reduces its stacked gradient (so a
    layer computed in place gives the very same numbers)."""
    return [square_sum(g) for g in grads.values()]


class HostOptimizer:
    """Takes in gradients on one thread and updates on another; `finish(layer_grads)` runs after each layer's
    update (the caller refreshes the device copies' source and settles the experts)."""

    def __init__(self, layouts: dict[int, SlotLayout], adamw: AdamWHyper, lr_schedule: Callable[[int], float],
                 timeline: Timeline, threads: int | None = None):
        """threads: intra-op threads of the two background threads (None: torch's default). With the model computing
        on the CPU, 1: a second OpenMP team beside the model's oversubscribes the cores, and from then on every
        parallel kernel of either team pays a sleep and wake-up, which slows the host AdamW several-fold
        (benchmarks/host-costs_*.md)."""
        self.layouts, self.adamw, self.lr_schedule, self.timeline = layouts, adamw, lr_schedule, timeline
        start = None if threads is None else (lambda: torch.set_num_threads(threads))
        self._intake = ThreadPoolExecutor(1, thread_name_prefix="moesys-grad-intake", initializer=start)
        self._update = ThreadPoolExecutor(1, thread_name_prefix="moesys-host-adamw", initializer=start)
        self._taken: dict[int, Future] = {}
        self._job: Future | None = None
        self.inline = False
        """Run every job on the calling thread when it is submitted: a step priced without overlap (the benchmark's
        measure of the host work itself, which two cores shared with the model's compute would inflate)."""
        self.caught_up = 0
        """Zero-gradient catch-up steps applied by updates (read and reset by the metrics)."""
        self.calls = {"take_in": 0, "submit": 0}
        """Layers' gradients taken in and updates started so far (one of each a layer and optimizer step)."""
        self._widened: Tensor | None = None
        self._packs: dict[int, list[tuple[Tensor, dict[str, Tensor]]]] = {}
        """Per layer, the free buffers small gradients are packed into at intake (see PACK_BELOW) with their
        per-name views, reused from step to step (one a layer, two while a delayed update reads one)."""

    def take_in(self, layer: int, keys: list, slots: list[ExpertSlot], grads: dict[str, Tensor], rows: list[int],
                landed: Callable[[], None] | None, sums: list[Tensor], flat: Tensor | None = None,
                release: Callable[[], None] | None = None) -> None:
        """Start taking in a layer's gradients (on the device's copy: `landed` waits for their arrival); slots[i]'s
        are in row rows[i]; `sums`: their squares (see `squares`), or [] when they count in no norm yet; `flat`:
        the [n, P] buffer `grads` are views of, if any; `release` gives it back once it is no longer read."""
        layout = self.layouts[layer]
        self.calls["take_in"] += 1

        def job() -> LayerGrads:
            if landed is not None:
                with self.timeline.span("wait_d2h_landed", False):
                    landed()
            with self.timeline.span("intake", False):
                if flat is not None and layout.dense:
                    return LayerGrads(layer, keys, slots, layout.views(flat), rows, sums, flat, release)
                # (zeros made on the device: none came home)
                on_host = {n: g if g.device.type == "cpu" else g.to("cpu") for n, g in grads.items()}
                if _worth_packing(layout, rows):
                    packed, views, give_back = self._pack(layer, on_host, rows)
                    if release is not None:
                        release()
                    return LayerGrads(layer, keys, slots, views, list(range(len(rows))), sums, packed, give_back)
                return LayerGrads(layer, keys, slots, on_host, rows, sums, release=release)

        self._taken[layer] = self._run(self._intake, job)

    def _pack(self, layer: int, grads: dict[str, Tensor],
              rows: list[int]) -> tuple[Tensor, dict[str, Tensor], Callable]:
        """Rows `rows` of the per-name gradients, in that order, as the first rows of one of the layer's pack
        buffers, with their per-name views and the call that gives the buffer back: one gather per tensor name,
        straight into the buffer, and a handful of operators however many rows. A buffer has a row for every row
        the gradients have (all local experts, when the device computed them all), so that it fits the layer's next
        steps whatever their active experts: it is made once, as a buffer made anew pays a page fault per page, more
        than the gather."""
        free, a = self._packs.setdefault(layer, []), len(rows)
        packs = free.pop() if free else None
        if packs is None or packs[0].shape[0] < a:  # (a smaller one is dropped: the layer's active experts grew)
            first = next(iter(grads.values()))
            flat = first.new_empty(max(a, first.shape[0]), self.layouts[layer].numel)
            packs = (flat, self.layouts[layer].views(flat))
        flat, whole = packs
        index = torch.tensor(rows)
        views = {name: torch.index_select(grads[name], 0, index, out=view[:a]) for name, view in whole.items()}
        return flat[:a], views, lambda: free.append(packs)

    def gathered(self) -> list[LayerGrads]:
        """Every layer taken in this step, in forward order (waits for the intake to finish)."""
        with self.timeline.span("wait_intake", True):
            out = [future.result() for future in self._taken.values()]
        self._taken.clear()
        return sorted(out, key=lambda lg: lg.layer)

    def submit(self, layers: list[LayerGrads], step: int, lr: float, multiplier: float | None, divisor: int,
               finish: Callable[[LayerGrads], None], stages: Callable[[LayerGrads], None] | None = None) -> None:
        """Start the update of step `step` (0-based): each expert first applies the zero-gradient steps it missed
        (catch-up, up to `step`), then AdamW with its gradients multiplied by `multiplier` (the clip coefficient,
        over the loss scale with fp16; None: 1) and divided by `divisor` (the expert-parallel averaging), both
        inside the kernel, the operations the resident experts' gradients go through. With `stages` (which waits
        until no copy reads a layer's stages), the update also writes each slot's stage from its new master, chunk
        by chunk while the master is in cache where it widens gradients, and finishes each layer as it goes. Without
        it `finish` refreshes the stages and may wait for the step running beside the update to stop reading them:
        it then runs once every layer is updated, so that no layer's update waits behind it, last layer first, as
        that step's backward frees them."""
        self.wait()
        self.calls["submit"] += 1
        # the kernel divides the gradients by grad_scale as it reads them: the multiplier folds in (no extra pass)
        factor = divisor if multiplier is None else divisor / multiplier
        scale = None if factor == 1 else torch.tensor(float(factor), dtype=torch.float32)

        def job() -> None:
            for lg in layers:
                if stages is not None:
                    stages(lg)
                self._update_layer(lg, step, lr, scale, stages is not None)
                if stages is not None:
                    finish(lg)
            if stages is None:  # last layer first: the step beside frees stages in its backward's order
                for lg in reversed(layers):
                    finish(lg)

        self._job = self._run(self._update, job)

    def _update_layer(self, lg: LayerGrads, step: int, lr: float, grad_scale: Tensor | None,
                      write_stages: bool = False) -> None:
        with self.timeline.span("catch_up", False):
            self.caught_up += catch_up(lg.slots, step, self.lr_schedule, self.adamw, step_counts(lg.slots))
        widening = any(g.dtype != torch.float32 for g in lg.grads.values())
        runs = slot_runs(lg.slots, lg.rows) if lg.flat is not None else []
        with self.timeline.span("adamw", False):
            if widening:
                self._adamw_widening(lg, runs, lr, grad_scale, write_stages)
            elif lg.flat is not None:  # one kernel call over the runs of whole slots
                self._advance(lg.slots)
                master, exp_avg, exp_avg_sq = run_states(lg.slots, runs, "master", "exp_avg", "exp_avg_sq")
                fused_adamw_counted(master, self._run_grads(lg, runs), exp_avg, exp_avg_sq,
                                    [lg.slots[start].step for start, _ in runs], lr, self.adamw, grad_scale)
            else:
                self._adamw_per_tensor(lg, lr, grad_scale)
        if write_stages and not widening:
            with self.timeline.span("refresh", False):
                refresh_stages(lg.slots)
        lg.applied()

    @staticmethod
    def _advance(slots: list[ExpertSlot]) -> None:
        """Add 1 to the slots' step counts in one operator (the counts of a run are then equal: every expert was
        caught up to this step first, so the run's first count serves the whole run in the kernel)."""
        torch._foreach_add_([slot.step for slot in slots], 1)

    def _adamw_per_tensor(self, lg: LayerGrads, lr: float, grad_scale: Tensor | None) -> None:
        """One kernel call over every (expert, tensor) pair."""
        names = self.layouts[lg.layer].names
        self._advance(lg.slots)
        state = [slot.views(attr, self.layouts[lg.layer]) for slot in lg.slots
                 for attr in ("master", "exp_avg", "exp_avg_sq")]
        rows = {name: lg.grads[name].unbind(0) for name in names}  # one call per tensor, not per row
        fused_adamw_counted([views[name] for views in state[0::3] for name in names],
                            [rows[name][r] for r in lg.rows for name in names],
                            [views[name] for views in state[1::3] for name in names],
                            [views[name] for views in state[2::3] for name in names],
                            [slot.step for slot in lg.slots for _ in names], lr, self.adamw, grad_scale)

    def _adamw_widening(self, lg: LayerGrads, runs: list[tuple[int, int]], lr: float, grad_scale: Tensor | None,
                        write_stages: bool) -> None:
        """Gradients in the compute dtype: each run of whole slots (`runs`, when they came home in one buffer), else
        each expert's tensors, widened to fp32 a chunk at a time into one scratch buffer, then stepped over that chunk
        of its states, whose stage is then written when `write_stages` (widening is exact and AdamW elementwise: the
        numbers of widening them all first, without their fp32 copy or a second pass over memory)."""
        self._advance(lg.slots)
        if lg.flat is not None:
            states = zip(*run_states(lg.slots, runs, "master", "exp_avg", "exp_avg_sq", "stage"),
                         self._run_grads(lg, runs), strict=True)
            groups = [([pieces], lg.slots[start].step) for pieces, (start, _) in zip(states, runs, strict=True)]
        else:
            groups = [(self._tensor_states(lg, slot, row), slot.step)
                      for slot, row in zip(lg.slots, lg.rows, strict=True)]
        if self._widened is None:
            self._widened = torch.empty(WIDEN_CHUNK)
        for pieces, step in groups:
            for master, exp_avg, exp_avg_sq, stage, grad in pieces:
                writes = write_stages and stage.data_ptr() != master.data_ptr()
                for lo in range(0, grad.numel(), WIDEN_CHUNK):
                    part = slice(lo, min(lo + WIDEN_CHUNK, grad.numel()))
                    widened = self._widened[:part.stop - lo].copy_(grad[part])
                    fused_adamw_counted([master[part]], [widened], [exp_avg[part]], [exp_avg_sq[part]], [step],
                                        lr, self.adamw, grad_scale)
                    if writes:
                        stage[part].copy_(master[part])

    @staticmethod
    def _run_grads(lg: LayerGrads, runs: list[tuple[int, int]]) -> list[Tensor]:
        """The flat gradient of each run of slots (see slot_runs: its rows of lg.flat are consecutive too): one
        split of the buffer when the runs fill its rows in order (packed, or come home from a GPU), else a view per
        run."""
        flat, rows = lg.flat, lg.rows
        assert flat is not None, "slot runs exist only over gradients that came home in one flat buffer"
        if rows == list(range(flat.shape[0])):
            return list(flat.view(-1).split([(stop - start) * flat.shape[1] for start, stop in runs]))
        return [flat[rows[start]:rows[start] + stop - start].view(-1) for start, stop in runs]

    def _tensor_states(self, lg: LayerGrads, slot: ExpertSlot, row: int) -> list[tuple[Tensor, ...]]:
        """(master, exp_avg, exp_avg_sq, stage, gradient), flat, for each of a slot's tensors."""
        layout = self.layouts[lg.layer]
        views = [slot.views(attr, layout) for attr in ("master", "exp_avg", "exp_avg_sq", "stage")]
        return [(*(v[name].reshape(-1) for v in views), lg.grads[name][row].reshape(-1)) for name in layout.names]

    def _run(self, pool: ThreadPoolExecutor, job: Callable) -> Future:
        if not self.inline:
            return pool.submit(job)
        done: Future = Future()
        try:
            done.set_result(job())
        except BaseException as error:  # kept for the caller, as the pool would
            done.set_exception(error)
        return done

    def raise_if_failed(self) -> None:
        """Raise the error of the update in flight if it ended with one: the layers it did not finish are never
        marked updated, so whoever waits for them must learn of it here rather than wait forever."""
        job = self._job
        if job is not None and job.done() and job.exception() is not None:
            job.result()

    def wait(self) -> None:
        """Block until the update in flight finished (raises its error)."""
        if self._job is not None:
            with self.timeline.span("wait_update_done", True):
                job, self._job = self._job, None
                job.result()

    def close(self) -> None:
        try:
            for future in self._taken.values():
                future.exception()
            self._taken.clear()
            self.wait()
        finally:
            self._intake.shutdown(wait=True)
            self._update.shutdown(wait=True)

