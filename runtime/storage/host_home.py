"""Where an offloaded rank's expert states live between uses. `HostHome` (storage.offload=cpu) keeps every local
expert in host memory for the whole run, the paper's CPU tier; `SSDHome` (runtime/storage/ssd_home.py) keeps them
on SSD behind the LFU cache of Algorithm 2. Both hand out ExpertSlots; the training engine does not know which."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from runtime.storage.expert_slots import ExpertSlot, SlotLayout, new_slots
from runtime.storage.expert_store import ExpertKey
from runtime.storage.tiers import Tiers


class ExpertHome(Protocol):
    """The host side of offloaded experts, as the training engine uses it."""

    def acquire(self, keys: list[ExpertKey]) -> list[ExpertSlot]:
        """The slots of experts a forward computes (read from SSD where they are not in memory)."""

    def layer_slots(self, layer: int) -> list[ExpertSlot] | None:
        """Every local expert's slot of `layer`, side by side in one block, or None when the home has no such block
        (without a GPU such a block is used in place: idle experts compute no rows)."""

    def before_layer(self, layer: int, keys: list[ExpertKey]) -> None:
        """`layer` is about to run with experts `keys` (what an SSD prefetch of the next step predicts from)."""

    def release_unused(self, keys: list[ExpertKey], slots: list[ExpertSlot]) -> None:
        """A forward without backward is done with these experts: nothing will update them."""

    def settle(self, keys: list[ExpertKey], slots: list[ExpertSlot]) -> None:
        """These experts were updated: keep or write them home."""

    def checkpoint_slot(self, key: ExpertKey) -> ExpertSlot:
        """The expert's slot to write into a checkpoint (a fresh read for one that is not in memory)."""

    def peek(self, keys: list[ExpertKey]) -> list[ExpertSlot] | None:
        """The slots of `keys` if every one is in host memory now, else None; counts nothing (a prefetch's look)."""

    def restore_target(self, key: ExpertKey) -> ExpertSlot:
        """A slot to fill with the expert's states (from a checkpoint, or initial ones) for `restore`."""

    def restore(self, key: ExpertKey, slot: ExpertSlot) -> None:
        """Make the filled `slot` the expert's states."""

    def end_step(self) -> None: ...

    def metrics(self) -> dict[str, float]: ...

    def drain(self) -> None:
        """Wait for background work (reads, writes)."""

    def close(self) -> None: ...


class HostHome:
    """Every local expert in host memory: one block of slots per MoE layer (consecutive experts are consecutive in
    memory, so a layer whose experts are all active moves in one copy)."""

    def __init__(self, first_expert: dict[int, int], layouts: dict[int, SlotLayout], num_local: dict[int, int],
                 compute_dtype: torch.dtype, separate_stage: bool, pin: bool, tiers: Tiers, moments: bool = True):
        """moments=False: frozen experts (train.freeze=[experts]), weights and step only."""
        self.first = first_expert
        self.slots = {layer: new_slots(layouts[layer].numel, num_local[layer], compute_dtype, separate_stage, pin,
                                       moments=moments) for layer in layouts}
        tiers.host.allocate(sum(slot.nbytes for slots in self.slots.values() for slot in slots))

    def _slot(self, key: ExpertKey) -> ExpertSlot:
        layer, expert = key
        return self.slots[layer][expert - self.first[layer]]

    def acquire(self, keys: list[ExpertKey]) -> list[ExpertSlot]:
        return [self._slot(key) for key in keys]

    def layer_slots(self, layer: int) -> list[ExpertSlot] | None:
        return self.slots[layer]

    def before_layer(self, layer: int, keys: list[ExpertKey]) -> None:
        pass

    def release_unused(self, keys: list[ExpertKey], slots: list[ExpertSlot]) -> None:
        pass

    def settle(self, keys: list[ExpertKey], slots: list[ExpertSlot]) -> None:
        pass

    def checkpoint_slot(self, key: ExpertKey) -> ExpertSlot:
        return self._slot(key)

    def peek(self, keys: list[ExpertKey]) -> list[ExpertSlot] | None:
        return self.acquire(keys)

    def restore_target(self, key: ExpertKey) -> ExpertSlot:
        return self._slot(key)  # filled in place

    def restore(self, key: ExpertKey, slot: ExpertSlot) -> None:
        assert slot is self._slot(key)

    def end_step(self) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


def fill_slot(slot: ExpertSlot, layout: SlotLayout, named: dict[str, dict[str, Tensor]], step: float) -> ExpertSlot:
    """Write one expert's tensors by name and kind (model, exp_avg, exp_avg_sq; the model alone into a slot without
    moments) and its step count into `slot`."""
    kinds = (("master", "model"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"))
    for attr, kind in kinds if slot.has_moments else kinds[:1]:
        layout.pack({name: named[name][kind] for name in layout.names}, getattr(slot, attr))
    slot.step.fill_(step)
    slot.refresh_stage()
    return slot


def initial_slot(slot: ExpertSlot, layout: SlotLayout, params: dict[str, Tensor]) -> ExpertSlot:
    """An expert before its first step: `params` as master weights, zero moments, step 0."""
    layout.pack(params, slot.master)
    for t in (slot.exp_avg, slot.exp_avg_sq, slot.step):
        t.zero_()
    slot.refresh_stage()
    return slot
