"""The host optimizer's update is the same whether a layer's gradients come home per tensor (without a GPU: the
leaves' own gradients) or in one [n, P] buffer (a GPU's d2h staging, stepped one whole slot per expert), and
whether bf16 gradients are widened to fp32 a chunk at a time or given in fp32: AdamW is elementwise, so they must
agree bit for bit, with catch-up steps and a gradient scale."""

from __future__ import annotations

import pytest
import torch

from runtime.storage import optim
from runtime.storage.optim import AdamWHyper
from runtime.storage.expert_slots import SlotLayout, new_slots
from runtime.storage import host_adamw
from runtime.storage.host_adamw import HostOptimizer
from runtime.storage.host_home import initial_slot
from runtime.host.timeline import Timeline

LAYOUT = SlotLayout.of({"w1": (32, 16), "w2": (16, 32), "b1": (32,)})


def update(grads_flat: torch.Tensor, flat: bool, step: int, released: list | None = None) -> list:
    """Three experts' slots after one update at `step` (0-based) from rows 2, 0, 3 of grads_flat [4, P] (a copy:
    the kernel unscales gradients in place); `released` collects the calls that give the gradients' buffer back.
    The update writes the bf16 stages as it goes."""
    grads_flat = grads_flat.clone()
    torch.manual_seed(0)
    slots = [initial_slot(s, LAYOUT, {n: torch.randn(shape) for n, shape in zip(LAYOUT.names, LAYOUT.shapes)})
             for s in new_slots(LAYOUT.numel, 3, torch.bfloat16, True)]
    slots[1].step.fill_(step)  # up to date; the others catch up first
    opt = HostOptimizer({0: LAYOUT}, AdamWHyper(), lambda s: 1e-2 / (1 + s), Timeline())
    opt.inline = True
    opt.take_in(0, ["a", "b", "c"], slots, LAYOUT.views(grads_flat), [2, 0, 3], None, [],
                grads_flat if flat else None, None if released is None else lambda: released.append(1))
    opt.submit(opt.gathered(), step, 1e-2, 0.5, 2, lambda lg: None, stages=lambda lg: None)
    opt.wait()
    return [(s.master.clone(), s.exp_avg.clone(), s.exp_avg_sq.clone(), float(s.step), s.stage.clone())
            for s in slots]


@pytest.mark.parametrize("chunk", [host_adamw.WIDEN_CHUNK, 100], ids=["one-chunk", "chunks-of-100"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flat_and_per_tensor_gradients_give_the_same_update(dtype, chunk, monkeypatch):
    """Chunks of 100 end off any vector width and leave a tail (P = 1056); the buffer is given back once."""
    monkeypatch.setattr(host_adamw, "WIDEN_CHUNK", chunk)
    assert LAYOUT.dense
    grads = torch.randn(4, LAYOUT.numel, generator=torch.Generator().manual_seed(1)).to(dtype)
    released = []
    per_tensor, whole = update(grads, flat=False, step=3), update(grads, flat=True, step=3, released=released)
    reference = update(grads.float(), flat=True, step=3)  # fp32 gradients: one kernel call over whole slots
    for a, b, ref in zip(per_tensor, whole, reference):
        assert all(torch.equal(x, r) and torch.equal(y, r) for x, y, r in zip(a[:3], b[:3], ref[:3]))
        assert a[3] == b[3] == 4.0
        assert torch.equal(a[4], a[0].bfloat16()) and torch.equal(b[4], b[0].bfloat16())
    assert released == [1]


def test_a_finish_that_waits_for_the_step_beside_holds_up_no_layer_update():
    """A delayed update's finish waits until the next step has read a layer's stages, which that step's backward
    frees last layer first: every layer must be stepped before the first finish blocks, and the finishes go from
    the last layer to the first."""
    import threading

    layers = {i: LAYOUT for i in range(3)}
    opt = HostOptimizer(layers, AdamWHyper(), lambda s: 1e-2, Timeline())
    slots = {i: new_slots(LAYOUT.numel, 1, torch.bfloat16, True) for i in layers}
    for i in layers:
        opt.take_in(i, [(i, 0)], slots[i], LAYOUT.views(torch.ones(1, LAYOUT.numel)), [0], None, [])
    stepped_before_first_finish, finished, read = [], [], threading.Event()

    def finish(lg):
        if not finished:
            stepped_before_first_finish.extend(float(slots[i][0].step) for i in layers)
            assert read.wait(10)
        finished.append(lg.layer)

    opt.submit(opt.gathered(), 0, 1e-2, None, 1, finish)
    read.set()
    opt.wait()
    opt.close()
    assert stepped_before_first_finish == [1.0, 1.0, 1.0] and finished == [2, 1, 0]


@pytest.mark.parametrize("chunk", [optim.CATCH_UP_CHUNK, 64], ids=["one-chunk", "chunks-of-64"])
def test_catch_up_in_chunks_equals_every_missed_step_over_the_whole_slot(monkeypatch, chunk):
    """A catch-up takes each chunk of an expert's states through all of its missed steps at once (one pass over
    memory): the plain reference steps the whole slot once per missed step with the resident optimizer's kernel."""
    monkeypatch.setattr(optim, "CATCH_UP_CHUNK", chunk)
    torch.manual_seed(0)
    lr = lambda s: 1e-2 / (1 + s)  # noqa: E731
    h = AdamWHyper()
    slot = initial_slot(new_slots(LAYOUT.numel, 1, torch.float32, False)[0], LAYOUT,
                        {n: torch.randn(shape) for n, shape in zip(LAYOUT.names, LAYOUT.shapes)})
    slot.exp_avg.normal_()
    slot.exp_avg_sq.uniform_()
    slot.step.fill_(2)
    master, exp_avg, exp_avg_sq, step = (t.clone() for t in (slot.master, slot.exp_avg, slot.exp_avg_sq, slot.step))
    for s in range(2, 7):
        optim.fused_adamw([master], [torch.zeros_like(master)], [exp_avg], [exp_avg_sq], [step], lr(s), h)
    assert optim.catch_up([slot], 7, lr, h) == 5 and optim.catch_up([slot], 7, lr, h) == 0
    assert LAYOUT.numel % 64 and float(slot.step) == float(step) == 7
    for got, want in ((slot.master, master), (slot.exp_avg, exp_avg), (slot.exp_avg_sq, exp_avg_sq)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("chunk", [optim.CATCH_UP_CHUNK, 2 * LAYOUT.numel + 1, 64],
                         ids=["one-piece", "two-experts-a-piece", "chunks-of-64"])
def test_a_layers_experts_caught_up_together_equal_each_caught_up_alone(monkeypatch, chunk):
    """Experts that missed different numbers of steps (one none) are caught up in one call: a kernel call per piece
    and step over every expert still behind at that step. The plain reference steps each expert alone, once per
    missed step, with the resident optimizer's kernel."""
    monkeypatch.setattr(optim, "CATCH_UP_CHUNK", chunk)
    torch.manual_seed(0)
    lr = lambda s: 1e-2 / (1 + s)  # noqa: E731
    h = AdamWHyper()
    slots = new_slots(LAYOUT.numel, 4, torch.float32, False)
    for slot, done in zip(slots, (2, 4, 6, 7), strict=True):
        for t in (slot.master, slot.exp_avg):
            t.normal_()
        slot.exp_avg_sq.uniform_()
        slot.step.fill_(done)
    expected = []
    for slot in slots:
        master, exp_avg, exp_avg_sq, step = (t.clone() for t in (slot.master, slot.exp_avg, slot.exp_avg_sq, slot.step))
        for s in range(int(step), 7):
            optim.fused_adamw([master], [torch.zeros_like(master)], [exp_avg], [exp_avg_sq], [step], lr(s), h)
        expected.append((master, exp_avg, exp_avg_sq, float(step)))
    assert optim.catch_up(slots[::-1], 7, lr, h) == 5 + 3 + 1
    for slot, (master, exp_avg, exp_avg_sq, step) in zip(slots, expected, strict=True):
        assert float(slot.step) == step == 7
        assert all(torch.equal(a, b) for a, b in ((slot.master, master), (slot.exp_avg, exp_avg),
                                                   (slot.exp_avg_sq, exp_avg_sq)))
