"""Expert weights to the device and their gradients home, for offloaded training: the sparse half of the paper's
2D prefetch (section 3.2.2, "2D prefetch scheduling") with ZeRO-Offload's transfers.

A layer's active experts go to the device in the compute dtype, one copy per run of consecutive host slots, into one
[a, P] buffer whose per-tensor views are the autograd leaves the experts compute with. On CUDA the copies run on a
side stream from pinned slots, and the next layer's are started while this one computes. The device holds a
window of layers' experts (the plan's device budget): a layer stays from its forward to its backward when the
window allows, and otherwise is evicted and fetched again, ahead of its backward. Gradients go home as soon as a
layer's backward has produced them (pinned buffers, the side stream, an event the optimizer waits on).
Legend: a active experts of a layer, P elements of an expert's slot.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from runtime.host.timeline import Timeline
from runtime.moe.buffer_pool import BufferPool
from runtime.storage.expert_slots import ExpertSlot, SlotLayout, block_of, contiguous_runs, run_states
from runtime.storage.tiers import Tiers


@dataclass(eq=False)
class DeviceCopy:
    """One layer's active experts on the device for one step."""

    layer: int
    keys: list
    slots: list[ExpertSlot]
    buffer: Tensor
    """[a, P] in the compute dtype; the leaves are views of it, so freeing its storage frees them."""
    leaves: dict[str, Tensor] = field(default_factory=dict)
    resident: bool = True
    ready: torch.cuda.Event | None = None
    """CUDA: an event recorded after the copies into `buffer` (the computing stream waits for it)."""
    borrowed: bool = False
    """Without a GPU, slots that lie side by side in one block are the device copy themselves: nothing is
    allocated, copied or evicted."""
    grads_arrived: int = 0
    active: tuple = ()
    """(keys, slots, rows): the experts that computed rows, and their rows of the buffer (the engine's record)."""
    hooks: list = field(default_factory=list)
    """Handles of hooks that refer back to this object (a cycle through C++ the collector cannot see): removed when
    the layer's gradients have gone home."""

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def grads(self) -> dict[str, Tensor]:
        """The leaves' gradients by tensor name, which backward has produced by the time they are read."""
        missing = [name for name, leaf in self.leaves.items() if leaf.grad is None]
        if missing:
            raise RuntimeError(f"layer {self.layer}'s {missing[0]} has no gradient: its backward has not run")
        return {name: leaf.grad for name, leaf in self.leaves.items() if leaf.grad is not None}


class TransferEngine:
    """Moves experts between host slots and the device, within a window of `window` layers."""

    def __init__(self, device: torch.device, compute_dtype: torch.dtype, layouts: dict[int, SlotLayout],
                 window: int, tiers: Tiers, timeline: Timeline):
        self.device, self.dtype, self.layouts = device, compute_dtype, layouts
        self.window = max(1, window)
        self.tiers, self.timeline = tiers, timeline
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.live: dict[int, DeviceCopy] = {}
        """Layers with experts on the device this step, in forward order (a prefetched one included)."""
        self.copied_bytes = 0
        """Bytes copied between host and device so far (both ways)."""
        self.grad_home_bytes = 0
        """Bytes of gradients sent home so far (without a GPU they are handed over where they lie)."""
        self.grads_sent = 0
        """Layers' gradients sent home so far (one a layer and optimizer step, however many micro-batches)."""
        self.stage_read: dict[int, torch.cuda.Event] = {}
        """CUDA: per layer, an event after the last copy that read its host slots (an update must wait for it)."""
        self._spare: list[torch.UntypedStorage] = []
        """Without a GPU: the memory of released copies, for the next copies to take (spares and copies together
        at most `window`, the device budget): fresh host memory pays a page fault per page on its first write, about
        as much as the copy itself."""
        self._largest = 0
        self.layer_elements: dict[int, int] = {}
        """Elements of every local expert of a layer (its gradients' staging buffers are at least this large)."""
        self.grad_staging = BufferPool(pinned=True)
        """CUDA: the pinned buffers gradients come home in, reused from step to step (given back once the optimizer
        has applied them): pinning a layer's worth anew each time cost more than the backward itself."""

    # ---- host -> device ----

    def to_device(self, layer: int, keys: list, slots: list[ExpertSlot], requires_grad: bool) -> DeviceCopy:
        """The layer's experts `keys` on the device, as leaves: a prefetched copy of the same experts, or copied now."""
        copy = self.live.pop(layer, None)
        if copy is not None and copy.keys != keys:
            self.release(copy)
            copy = None
        if copy is None:
            copy = self._copy(layer, keys, slots, critical=True)
        self.live[layer] = copy
        if not copy.resident:  # prefetched, then evicted by the window
            self.ensure_resident(copy)
        self._wait_ready(copy)
        copy.leaves = {name: view.detach().requires_grad_(requires_grad)
                       for name, view in self.layouts[layer].views(copy.buffer).items()}
        self._keep_window(layer)
        return copy

    def prefetch(self, layer: int, keys: list, slots: list[ExpertSlot], computing: int) -> None:
        """Start copying a layer's experts ahead of its forward while layer `computing` runs (CUDA only: without
        a GPU the copy would take the training thread's time, so nothing is done), if the window holds both."""
        if not self.cuda or layer in self.live or self.window < 2:
            return
        self.live[layer] = self._copy(layer, keys, slots, critical=False, keep=computing)

    def _copy(self, layer: int, keys: list, slots: list[ExpertSlot], critical: bool,
              keep: int | None = None) -> DeviceCopy:
        if not self.cuda and contiguous_runs(slots) == [(0, len(slots))]:  # host memory is the device's
            return DeviceCopy(layer, list(keys), list(slots), block_of(slots, 0, len(slots)), borrowed=True)
        self._keep_window(layer, keep)
        shape = (len(slots), self.layouts[layer].numel)
        with self._on_copy_stream():  # the block belongs to the copy stream; the computing stream is recorded
            buffer = self._new_buffer(shape)
        if self.cuda:
            buffer.record_stream(torch.cuda.current_stream(self.device))
        copy = DeviceCopy(layer, list(keys), list(slots), buffer)
        self.tiers.device.allocate(copy.nbytes)
        self._fill(copy, critical)
        return copy

    def _new_buffer(self, shape: tuple[int, int]) -> Tensor:
        """[a, P] in the compute dtype. Without a GPU: in the smallest spare memory that holds it, else in fresh
        memory as large as the largest copy so far (so that, once spare, it holds any copy)."""
        if self.cuda:
            return torch.empty(shape, dtype=self.dtype, device=self.device)
        nbytes = shape[0] * shape[1] * self.dtype.itemsize
        self._largest = max(self._largest, nbytes)
        fits = [s for s in self._spare if s.nbytes() >= nbytes]
        if fits:
            storage = min(fits, key=lambda s: s.nbytes())
            self._spare.remove(storage)
        else:
            if self._spare:  # too small for copies from now on: freed, the new memory takes its place
                self._spare.remove(min(self._spare, key=lambda s: s.nbytes()))
            storage = torch.UntypedStorage(self._largest, device=self.device)
        # torch's stubs list set_ with a stride or with the storage alone; the stride is optional (contiguous)
        return torch.empty(0, dtype=self.dtype, device=self.device).set_(storage, 0, shape)  # type: ignore[call-overload]

    def _side_stream(self) -> torch.cuda.Stream:
        """The copy stream, which a CUDA device always has."""
        assert self.stream is not None, "only a CUDA device copies on a side stream"
        return self.stream

    def _on_copy_stream(self):
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def _fill(self, copy: DeviceCopy, critical: bool) -> None:
        """Copy the slots' stages into the buffer, through `.data` so that a refill before backward is not an
        in-place change autograd would refuse."""
        target = copy.buffer.data
        with self.timeline.span("h2d", critical), self._on_copy_stream():
            runs = contiguous_runs(copy.slots)
            pieces = list(target.view(-1).split([(stop - start) * target.shape[1] for start, stop in runs]))
            (sources,) = run_states(copy.slots, runs, "stage")
            if self.cuda:  # an asynchronous copy from pinned memory per run
                for piece, source in zip(pieces, sources, strict=True):
                    piece.copy_(source, non_blocking=True)
            else:  # one copy per run, all in one operator
                torch._foreach_copy_(pieces, sources)
            if self.cuda:
                copy.ready = torch.cuda.Event()
                copy.ready.record(self.stream)
                self.stage_read[copy.layer] = copy.ready
        self.tiers.device.moved(copy.nbytes)
        self.copied_bytes += copy.nbytes

    def _wait_ready(self, copy: DeviceCopy) -> None:
        if copy.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(copy.ready)

    # ---- the window ----

    def _keep_window(self, current: int, keep: int | None = None) -> None:
        """Evict the layers needed last (earliest in the forward order: their backward comes last) until the
        window holds `current` with the others; `keep` (a layer computing now) is never evicted."""
        others = sorted(layer for layer, c in self.live.items()
                        if c.resident and not c.borrowed and layer not in (current, keep))
        while others and len(others) + 1 + (keep is not None) > self.window:
            self.evict(self.live[others.pop(0)])

    def evict(self, copy: DeviceCopy) -> None:
        if copy.resident and not copy.borrowed:
            copy.buffer.untyped_storage().resize_(0)
            copy.resident = False
            self.tiers.device.release(copy.nbytes)

    def ensure_resident(self, copy: DeviceCopy) -> None:
        """Before a layer's backward: fetch its experts again if the window evicted them (the same host slots: an
        update waits until this step has read them for the last time)."""
        if not copy.resident:
            self._refill(copy, critical=True)
        self._wait_ready(copy)
        self._keep_window(copy.layer)

    def prefetch_backward(self, layer: int) -> None:
        """While `layer`'s backward runs, fetch the next layer to run backward if it was evicted (CUDA only), if the
        window holds both."""
        earlier = [c for c in self.live.values() if c.layer < layer]
        if self.cuda and self.window >= 2 and earlier and not earlier[-1].resident:
            self._refill(earlier[-1], critical=False, keep=layer)

    def _refill(self, copy: DeviceCopy, critical: bool, keep: int | None = None) -> None:
        self._keep_window(copy.layer, keep)
        self._trim_spares(coming=1)
        self.tiers.device.allocate(copy.nbytes)
        with self._on_copy_stream():
            copy.buffer.untyped_storage().resize_(copy.nbytes)
        if self.cuda:
            copy.buffer.record_stream(torch.cuda.current_stream(self.device))
        copy.resident = True
        self._fill(copy, critical)

    # ---- device -> host ----

    def grads_home(self, copy: DeviceCopy) -> tuple[dict[str, Tensor], Tensor | None, Callable[[], None] | None,
                                                     Callable[[], None] | None]:
        """The layer's gradients in host memory: by tensor name ([a, *shape]), the [a, P] buffer they are views of
        when they came home in one (else None), a wait for their arrival and a call that gives their buffer back
        once they are applied (each None when there is nothing to wait for or give back). Without a GPU they are
        the leaves' own gradients: nothing moves."""
        grads = copy.grads()
        if not self.cuda:
            self._count_home(sum(g.numel() * g.element_size() for g in grads.values()))
            return grads, None, None, None
        stream = self._side_stream()
        with self.timeline.span("d2h", True):
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                # packed on the device first: a tensor's rows are strided in [a, P], and a copy into strided host
                # memory goes through a pageable bounce buffer, synchronously; one [a, P] copy is a pinned DMA
                packed = torch.empty_like(copy.buffer)
                for name, view in self.layouts[copy.layer].views(packed).items():
                    view.copy_(grads[name])
                    grads[name].record_stream(stream)
        return self.packed_home(copy.layer, packed)

    def packed_home(self, layer: int, packed: Tensor) -> tuple[dict[str, Tensor], Tensor | None,
                                                               Callable[[], None] | None, Callable[[], None] | None]:
        """grads_home for gradients already packed in one [n, P] device tensor (an accumulated sum): one pinned
        copy on the side stream into a staging buffer sized for the layer's every expert, so that buffers of a pool
        fit whatever number of experts is active."""
        views = self.layouts[layer].views(packed)
        if not self.cuda:
            self._count_home(packed.numel() * packed.element_size())
            return views, packed, None, None
        with self.timeline.span("d2h", True):
            base, staging = self.grad_staging.take(packed, at_least=self.layer_elements.get(layer, 0))
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                staging.copy_(packed, non_blocking=True)
                packed.record_stream(stream)
                landed = torch.cuda.Event()
                landed.record(stream)
        self.tiers.host.moved(staging.numel() * staging.element_size())
        self.copied_bytes += staging.numel() * staging.element_size()
        self._count_home(staging.numel() * staging.element_size())
        return self.layouts[layer].views(staging), staging, landed.synchronize, lambda: self.grad_staging.give(base)

    def _count_home(self, nbytes: int) -> None:
        self.grad_home_bytes += nbytes
        self.grads_sent += 1

    def release(self, copy: DeviceCopy) -> None:
        """The layer is done with its device copy this step: without a GPU its memory is kept for the next copy
        (`window` at most), else freed."""
        if not self.cuda and copy.resident and not copy.borrowed:
            self._spare.append(copy.buffer.untyped_storage())
            copy.resident = False
            self.tiers.device.release(copy.nbytes)
            self._trim_spares()
        self.evict(copy)
        for hook in copy.hooks:
            hook.remove()
        copy.hooks.clear()
        copy.leaves.clear()
        if self.live.get(copy.layer) is copy:
            del self.live[copy.layer]

    def _trim_spares(self, coming: int = 0) -> None:
        """Free the oldest spares until spares, resident copies and `coming` new ones fit in the window."""
        held = sum(1 for c in self.live.values() if c.resident and not c.borrowed)
        while self._spare and len(self._spare) + held + coming > self.window:
            self._spare.pop(0)

    def end_step(self) -> None:
        """Drop whatever is still on the device (a prefetch that was not used, a forward without backward)."""
        for copy in list(self.live.values()):
            self.release(copy)

    def wait_stage_read(self, layer: int) -> None:
        """Block until the copies that read `layer`'s host slots have run (CUDA copies are asynchronous)."""
        event = self.stage_read.get(layer)
        if event is not None:
            event.synchronize()

