"""Ring-memory expert offloading (the paper's "Ring Memory Offloading").

N MoE layers' experts sit in the layer store, mapped into the host tier; K device layer slots are allocated once and
reused round-robin. The ring turns over *uses*, not layers: use u (layer u mod N, wrapping into the next token's
forward) computes from slot u mod K; when it is done the slot is released and use u+K's layer is copied into it
asynchronously (a CUDA copy stream with events, or a background copy thread on CPU) while uses u+1..u+K-1 compute.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from runtime.inference.errors import InferError
from runtime.inference.expert_source import ExpertSource
from runtime.inference.offload import LayerSlotOffloader, LayerStore
from runtime.inference.store_cache import StoreHold
from runtime.model.transformer import Transformer


class RingOffloader(LayerSlotOffloader):
    """K slots; after use u computes, use u+K's layer is fetched into its slot behind the next K-1 layers."""

    mode = "ring"

    def __init__(self, model: Transformer, device: torch.device, store: LayerStore, num_slots: int,
                 source: ExpertSource | None = None, hold: StoreHold | None = None):
        check_ring_slots(num_slots, len(model.moe_layers()))
        super().__init__(model, device, store, num_slots, source, hold)
        self.budget_slots = num_slots
        self.use = 0
        self.ready: list[Any] = [None] * num_slots  # Future (CPU) or torch.cuda.Event: the slot's copy is done
        if device.type == "cuda":
            self.stream: torch.cuda.Stream | None = torch.cuda.Stream(device)
            self.pool = None
        else:
            self.stream = None
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moesys-ring-copy")
        self.reset()

    # ---- the ring ----

    def acquire(self, layer: int) -> dict[str, Tensor]:
        expected = self.use % self.num_layers
        if layer != expected:
            raise RuntimeError(f"ring out of step: MoE layer {layer} ran, layer {expected} was next (call reset())")
        slot = self.use % self.num_slots
        self._wait(slot)
        assert self.slot_layer[slot] == layer
        return self.slot_views[slot]

    def release(self, layer: int) -> None:
        """Layer's compute is done (queued, on CUDA): refill its slot with the layer needed K uses later."""
        slot = self.use % self.num_slots
        ahead = (self.use + self.num_slots) % self.num_layers
        self.use += 1
        if self.slot_layer[slot] != ahead:  # K = N: every layer keeps its slot, nothing moves
            self._schedule(slot, ahead)

    def _schedule(self, slot: int, layer: int) -> None:
        self.slot_layer[slot] = layer
        if self.stream is None:
            assert self.pool is not None, "without a copy stream the ring copies on its pool"
            self.ready[slot] = self.pool.submit(self.copy_now, slot, layer)
            return
        freed = torch.cuda.Event()
        freed.record()  # the compute stream's last use of the slot
        self.stream.wait_event(freed)
        with torch.cuda.stream(self.stream):
            self.copy_now(slot, layer, self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        self.ready[slot] = done

    def _wait(self, slot: int, record: bool = True) -> None:
        """Block (CPU) or make the compute stream wait (CUDA) until the slot's copy is done; record=False outside
        a forward, where waiting is not compute standing still."""
        pending = self.ready[slot]
        if pending is None:
            return
        self.ready[slot] = None
        if isinstance(pending, Future):
            if pending.done() or not record:
                pending.result()  # re-raises a failed copy
                return
            start = self.timeline.mark()
            pending.result()
        else:
            start = self.timeline.mark()
            torch.cuda.current_stream().wait_event(pending)
        if record:
            self.timeline.add("wait", start, self.timeline.mark(), critical=True)

    def _drain(self) -> None:
        for slot in range(self.num_slots):
            self._wait(slot, record=False)

    def stats(self) -> dict[str, Any]:
        self._drain()  # copies in flight finish, so their bytes and spans are counted
        return super().stats()

    def reset(self) -> None:
        """Finish copies in flight; make the next K uses' layers resident, starting from MoE layer 0."""
        self._drain()
        if self.use % self.num_layers:  # a forward stopped half way
            self.use += self.num_layers - self.use % self.num_layers
        for use in range(self.use, self.use + self.num_slots):
            slot, layer = use % self.num_slots, use % self.num_layers
            if self.slot_layer[slot] != layer:
                self.copy_now(slot, layer)

    def close(self) -> None:
        self._drain()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        super().close()


def check_ring_slots(slots: int, moe_layers: int) -> None:
    if moe_layers < 1:
        raise InferError("the model has no MoE layers to offload; use --offload none")
    if not 1 <= slots <= moe_layers:
        raise InferError(f"infer.ring_slots={slots} must be between 1 and the model's {moe_layers} MoE layers")
