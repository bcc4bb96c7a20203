"""Gradient accumulation of offloaded experts (train.grad_accum_steps): one layer's gradients summed over the
micro-batches of an optimizer step on the device, in fp32, by local expert, so that they go home and are stepped once
a step, never once a micro-batch (Megatron's main_grad buffers do the same for resident weights).
Legend: e local experts of the layer, P elements of an expert's slot, u experts that got tokens this step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.storage.expert_slots import ExpertSlot, SlotLayout
from runtime.storage.tiers import Tiers


class LayerGradSum:
    """The [e, P] fp32 sum of one layer's expert gradients this step, and the experts that have a row in it."""

    def __init__(self, layer: int, layout: SlotLayout, num_local: int, first_global: int, device: torch.device,
                 tiers: Tiers):
        self.layer, self.layout, self.first = layer, layout, first_global
        self.flat_eP = torch.empty(num_local, layout.numel, dtype=torch.float32, device=device)
        tiers.device.allocate(self.flat_eP.numel() * 4)
        self.slots: dict[int, ExpertSlot] = {}
        """Local expert -> its slot, for each expert with a row this step (rows of the others hold stale data)."""

    def __bool__(self) -> bool:
        return bool(self.slots)

    def add(self, keys: list, slots: list[ExpertSlot], rows: list[int], grads: dict[str, Tensor]) -> None:
        """Add one micro-batch's gradients: expert keys[i]'s are row rows[i] of each of `grads` ([n, *shape])."""
        local = [key[1] - self.first for key in keys]
        new = [i for i, j in enumerate(local) if j not in self.slots]
        old = [i for i, j in enumerate(local) if j in self.slots]
        device = self.flat_eP.device
        for i in new:
            self.slots[local[i]] = slots[i]
        sums = self.layout.views(self.flat_eP)
        for picked, write in ((new, "index_copy_"), (old, "index_add_")):
            if not picked:
                continue
            into = torch.tensor([local[i] for i in picked], device=device)
            source = torch.tensor([rows[i] for i in picked], device=device)
            for name, total in sums.items():
                part = grads[name].index_select(0, source).to(torch.float32)
                getattr(total, write)(0, into, part)

    def take(self, dtype: torch.dtype) -> tuple[list, list[ExpertSlot], Tensor]:
        """(keys, slots, [u, P] sums in `dtype`) of the experts with a row, in local order; the sum is empty after."""
        order = sorted(self.slots)
        index = torch.tensor(order, device=self.flat_eP.device)
        packed_uP = self.flat_eP.index_select(0, index)
        packed_uP = packed_uP if dtype == torch.float32 else packed_uP.to(dtype)
        keys = [(self.layer, self.first + j) for j in order]
        slots = [self.slots[j] for j in order]
        self.slots.clear()
        return keys, slots, packed_uP
