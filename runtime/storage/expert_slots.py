"""Host memory of offloaded experts as flat slots: one expert's fp32 master weights, AdamW moments and step count,
and the copy in the compute dtype that the device reads (ZeRO-Offload's flat buffers; the paper's CPU tier).

An expert's tensors (w1, w2, w3, b1, ...) sit side by side in one run of P elements, so one copy moves an expert
between tiers and one fused AdamW call steps it. Each tensor starts on an ALIGN-element boundary: the fused kernel
then treats every element as it does in the resident model's stacked tensor (same vector lanes, no scalar tail),
which keeps offloaded training equal to resident training bit for bit.
Legend: P elements of one expert's slot, e experts.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

ALIGN = 16
"""Elements: 64 bytes of fp32, the widest vector the CPU kernels use."""
IO_BLOCK = 4096
"""Bytes: what direct I/O asks of a buffer's address and length and of a file offset."""


@dataclass(frozen=True)
class SlotLayout:
    """Where each of an expert's tensors lies in its slot."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    numel: int
    """P: the slot's elements, padding included."""

    @classmethod
    def of(cls, shapes: dict[str, tuple[int, ...]]) -> SlotLayout:
        offsets, at = [], 0
        for shape in shapes.values():
            offsets.append(at)
            at += math.ceil(math.prod(shape) / ALIGN) * ALIGN
        return cls(tuple(shapes), tuple(tuple(s) for s in shapes.values()), tuple(offsets), at)

    @property
    def dense(self) -> bool:
        """No padding: the tensors fill the slot, so a flat [P] is the expert's tensors and nothing else."""
        return self.numel == sum(math.prod(shape) for shape in self.shapes)

    def views(self, flat: Tensor) -> dict[str, Tensor]:
        """name -> view of `flat` ([P] -> [*shape], [a, P] -> [a, *shape]); differentiable views of a leaf."""
        lead = flat.shape[:-1]
        return {name: flat[..., o:o + math.prod(shape)].view(*lead, *shape)
                for name, shape, o in zip(self.names, self.shapes, self.offsets, strict=True)}

    def pack(self, tensors: dict[str, Tensor], out: Tensor) -> Tensor:
        """Write one expert's tensors (by name) into the slot-shaped `out` [P]; padding is zeroed."""
        out.zero_()
        for name, view in self.views(out).items():
            view.copy_(tensors[name])
        return out


@dataclass(eq=False)
class ExpertSlot:
    """One expert's host states."""

    master: Tensor
    """fp32 [P]: the master weights the optimizer updates."""
    exp_avg: Tensor
    exp_avg_sq: Tensor
    step: Tensor
    """0-d fp32: AdamW steps applied (zero-gradient catch-up steps included)."""
    stage: Tensor
    """[P] in the compute dtype: what the device copies. The master itself when the compute dtype is fp32 and
    updates are not delayed; else refreshed from it after each update."""
    pad: Tensor | None = None
    """fp32 run after the step that ends an `io_slot`'s memory on an IO_BLOCK boundary (stored with the states)."""
    row: tuple[int, int] | None = None
    """(block, index): the slot is row `index` of the blocks `new_slots` made together (one per state), so slots of
    one block with consecutive indices are one run of memory in every state; None for a slot of its own."""

    @property
    def has_moments(self) -> bool:
        """False for a frozen expert's slot (train.freeze=[experts]): weights and step only, no AdamW state."""
        return self.exp_avg.numel() > 0

    def views(self, attr: str, layout: SlotLayout) -> dict[str, Tensor]:
        """Per-tensor views of one of the slot's states (master, exp_avg, exp_avg_sq, stage), made once."""
        cache = self.__dict__.setdefault("_views", {})
        if attr not in cache:
            cache[attr] = layout.views(getattr(self, attr))
        return cache[attr]

    @property
    def separate_stage(self) -> bool:
        """The stage is a buffer of its own (not the master itself), written from the master after each update."""
        return self.stage.data_ptr() != self.master.data_ptr()

    def refresh_stage(self) -> None:
        if self.separate_stage:
            self.stage.copy_(self.master)

    def state_tensors(self) -> dict[str, Tensor]:
        """What the SSD store keeps of a slot (the stage is derived from the master)."""
        out = {"master": self.master, **({"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
                                         if self.has_moments else {}), "step": self.step.reshape(1)}
        if self.pad is not None and self.pad.numel():
            out["pad"] = self.pad
        return out

    @property
    def nbytes(self) -> int:
        own = [self.master, self.exp_avg, self.exp_avg_sq, self.step]
        if self.stage.data_ptr() != self.master.data_ptr():
            own.append(self.stage)
        return sum(t.numel() * t.element_size() for t in own)


def refresh_stages(slots: list[ExpertSlot]) -> None:
    """Write the stages of slots that have their own from their masters, in one operator."""
    apart = [slot for slot in slots if slot.separate_stage]
    if apart:
        torch._foreach_copy_([slot.stage for slot in apart], [slot.master for slot in apart])


def slot_bytes(numel: int, compute_dtype: torch.dtype, separate_stage: bool, moments: bool = True) -> int:
    """Host bytes of one slot of `numel` elements (without moments: a frozen expert's)."""
    stage = numel * torch.finfo(compute_dtype).bits // 8 if separate_stage else 0
    return (12 if moments else 4) * numel + 4 + stage


def needs_separate_stage(compute_dtype: torch.dtype, delayed_update: bool) -> bool:
    """The master can be the device's source only when it is in the compute dtype and no update runs while the
    device still reads the previous weights (a delayed update does)."""
    return compute_dtype != torch.float32 or delayed_update


def new_slots(numel: int, count: int, compute_dtype: torch.dtype, separate_stage: bool,
              pin: bool = False, zero: bool = True, moments: bool = True) -> list[ExpertSlot]:
    """`count` slots, each a row of one block per state ([count, P]), so the slots of consecutive experts are
    consecutive in memory; the stage block is pinned when `pin` (asynchronous copies to a GPU). Zeroed unless
    `zero` is false (a slot about to be read into). Without `moments`: a frozen expert's slots, no AdamW state."""
    new = torch.zeros if zero else torch.empty
    master = new(count, numel)
    width = numel if moments else 0
    exp_avg, exp_avg_sq, steps = new(count, width), new(count, width), new(count)
    stage = new(count, numel, dtype=compute_dtype, pin_memory=pin) if separate_stage else master
    block = next(_blocks)
    return [ExpertSlot(master[i], exp_avg[i], exp_avg_sq[i], steps[i], stage[i], row=(block, i)) for i in range(count)]


_blocks = itertools.count()


def runs_where(count: int, joins: Callable[[int], bool]) -> list[tuple[int, int]]:
    """[start, stop) ranges that cut 0..count-1 wherever `joins(i)` (item i continues item i - 1's range) is false."""
    runs: list[tuple[int, int]] = []
    for i in range(count):
        if i and joins(i):
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def slot_runs(slots: list[ExpertSlot], rows: list[int] | None = None) -> list[tuple[int, int]]:
    """[start, stop) ranges of `slots` that are consecutive rows of one `new_slots` block (in every state, the step
    included) and, when `rows` is given, whose `rows` are consecutive too: each range is one run of memory that one
    kernel call can take. Decided from the slots' `row` records, without reading a tensor."""
    def joins(i: int) -> bool:
        prev, row = slots[i - 1].row, slots[i].row
        return prev is not None and row == (prev[0], prev[1] + 1) and (rows is None or rows[i] == rows[i - 1] + 1)

    return runs_where(len(slots), joins)


def io_slot(numel: int, compute_dtype: torch.dtype, separate_stage: bool, pin: bool = False,
            zero: bool = True, run_of: ExpertSlot | None = None, moments: bool = True) -> ExpertSlot:
    """One slot whose master, moments and step follow each other in one run of memory that starts and ends on an
    IO_BLOCK boundary, so the SSD store moves it with direct I/O, straight between that memory and the disk (no
    page-cache copy). Tensors keep the offsets of a `new_slots` row (the fused kernel sees the same lanes).
    `run_of`: a released io_slot of the same size whose run this one takes over (no fresh pages for the kernel to
    fault in and zero on the next read); its stage is not reused (a copy to the device may still read it).
    Without `moments` the run holds the master and step only (a frozen expert's)."""
    new = torch.zeros if zero else torch.empty
    if run_of is not None:
        states = (run_of.master, run_of.exp_avg, run_of.exp_avg_sq, run_of.step)
        if zero:
            for t in states:
                t.zero_()
        master, exp_avg, exp_avg_sq, step = states
        pad = run_of.pad
    else:
        per_block, kept = IO_BLOCK // 4, 3 if moments else 1
        length = -(-(kept * numel + 1) // per_block) * per_block
        raw = new(length + per_block)
        start = (-raw.data_ptr() % IO_BLOCK) // 4
        run = raw[start:start + length]
        master, step = run[:numel], run[kept * numel]
        exp_avg, exp_avg_sq = (run[numel:2 * numel], run[2 * numel:3 * numel]) if moments else (run[:0], run[:0])
        pad = run[kept * numel + 1:]
        pad.zero_()  # stored with the states: no stray bytes of this process in the file
    stage = new(numel, dtype=compute_dtype, pin_memory=pin) if separate_stage else master
    return ExpertSlot(master, exp_avg, exp_avg_sq, step, stage, pad)


def contiguous_runs(slots: list[ExpertSlot], attr: str = "stage") -> list[tuple[int, int]]:
    """[start, stop) index ranges of `slots` whose `attr` tensors follow each other in one block of memory, so each
    range moves in one copy."""
    return runs_where(len(slots), lambda i: _follows(slots[i - 1], slots[i], attr))


def _follows(prev: ExpertSlot, slot: ExpertSlot, attr: str) -> bool:
    """`slot`'s `attr` tensor starts where `prev`'s ends, in the same memory: told by the slots' `row` records where
    both have one (no tensor touched), else by their addresses."""
    if prev.row is not None and slot.row is not None:
        return slot.row == (prev.row[0], prev.row[1] + 1)
    t, p = getattr(slot, attr), getattr(prev, attr)
    return (t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
            and t.data_ptr() == p.data_ptr() + p.numel() * p.element_size())


def block_of(slots: list[ExpertSlot], start: int, stop: int, attr: str = "stage") -> Tensor:
    """The [stop - start, P] tensor over a contiguous run of slots (see contiguous_runs)."""
    first = getattr(slots[start], attr)
    return first.as_strided((stop - start, first.numel()), (first.numel(), 1))


def step_counts(slots: list[ExpertSlot]) -> list[float]:
    """Each slot's step count, in one host read for all of them: of the span of their block when the slots are rows
    of one `new_slots` block (one view, however many experts), else of their counts stacked."""
    if not slots:
        return []
    rows = [slot.row for slot in slots if slot.row is not None]
    if len(rows) == len(slots) and all(row[0] == rows[0][0] for row in rows):
        first = min(range(len(slots)), key=lambda i: rows[i][1])
        lo, hi = rows[first][1], max(row[1] for row in rows)
        counts = slots[first].step.as_strided((hi - lo + 1,), (1,)).tolist()
        return [counts[row[1] - lo] for row in rows]
    return torch.stack([slot.step for slot in slots]).tolist()


def run_states(slots: list[ExpertSlot], runs: list[tuple[int, int]], *attrs: str) -> list[list[Tensor]]:
    """For each of `attrs` (master, exp_avg, exp_avg_sq, stage, step), the flat tensor of that state over each run of
    contiguous slots (see contiguous_runs), made so that the operators of a layer's update do not grow with its
    experts: runs of one `new_slots` block, in the block's order, are pieces of one split of the block's span (two
    operators a state, however many runs; the split's sizes worked out once for all of them); else a lone slot's own
    tensor (no operator) or one view over the run."""
    rows = [row for start, _ in runs if (row := slots[start].row) is not None]
    if len(runs) > 1 and len(rows) == len(runs) and all(row[0] == rows[0][0] for row in rows):
        ends = [row[1] + stop - start for row, (start, stop) in zip(rows, runs, strict=True)]
        if all(rows[i][1] >= ends[i - 1] for i in range(1, len(runs))):
            gaps_and_runs = []  # in slots: the gap before each run, then the run
            for i, (row, end) in enumerate(zip(rows, ends, strict=True)):
                gaps_and_runs += [row[1] - (ends[i - 1] if i else row[1]), end - row[1]]
            out = []
            for attr in attrs:
                first = getattr(slots[runs[0][0]], attr)
                sizes = [n * first.numel() for n in gaps_and_runs]
                out.append(list(first.as_strided((sum(sizes),), (1,)).split_with_sizes(sizes)[1::2]))
            return out
    out = []
    for attr in attrs:
        out.append([])
        for start, stop in runs:
            first = getattr(slots[start], attr)
            out[-1].append(first if stop - start == 1 else first.as_strided(((stop - start) * first.numel(),), (1,)))
    return out
