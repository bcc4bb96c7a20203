"""The host work of an offloaded step dispatches a number of operators that does not grow with the experts a layer
activates: 128 fine-grained experts a layer cost the host no more operators per step than 8 coarse ones do, give or
take the runs of several consecutive active experts (one view each). Each operator costs microseconds of Python and
dispatch, which at 128 experts a layer would outweigh the optimizer's arithmetic (runtime/bench/offload.py's
fine-grained variant). Operators are counted, never timed."""

from __future__ import annotations

import contextlib
import threading
from collections import Counter

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from runtime.config import ModelConfig, MoesysConfig
from runtime.host.timeline import Timeline
from tests.unit.storage.test_offload import Run, fine_grained_config


class HostOps(TorchDispatchMode):
    """Counts the operators dispatched inside the offload engine's timeline spans (its host work and waits), by
    the innermost span's kind; the model's own operators, outside every span, are not counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        super().__init__()
        self.by_kind: Counter[str] = Counter()
        local = threading.local()
        span = Timeline.span

        @contextlib.contextmanager
        def counted_span(timeline, kind, critical):
            stack = local.__dict__.setdefault("kinds", [])
            stack.append(kind)
            try:
                with span(timeline, kind, critical):
                    yield
            finally:
                stack.pop()

        self._local = local
        monkeypatch.setattr(Timeline, "span", counted_span)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kinds = getattr(self._local, "kinds", None)
        if kinds:
            self.by_kind[kinds[-1]] += 1
        return func(*args, **(kwargs or {}))


def coarse_config() -> MoesysConfig:
    """fine_grained_config's layers with 8 experts of 16x its ffn size, top-2: as many expert parameters a layer."""
    fine = fine_grained_config()
    return MoesysConfig(
        model=ModelConfig(hidden_size=32, ffn_hidden_size=16 * 16, num_layers=2, num_heads=2, num_experts=8,
                          top_k=2, expert_type="swiglu", bias=False, max_seq_len=32),
        train=fine.train)


def host_ops_per_layer_step(cfg: MoesysConfig, home, monkeypatch, steps: int = 4) -> tuple[float, float, dict]:
    """(host operators, active experts, host operators by span kind) per offloaded layer and step, the optimizer
    run inline (every job on the training thread, so each operator is seen), after a first step that makes the
    buffers."""
    run = Run(cfg, home, cache=64)
    run.mgr.optimizer.inline = True
    run.train(1)
    counter = HostOps(monkeypatch)
    with counter:
        run.train(1 + steps, start=1)
    run.close()
    layer_steps = steps * len(run.mgr.specs)
    active = sum(m["offload/experts_active"] for m in run.metrics[1:]) / layer_steps
    by_kind = {kind: count / layer_steps for kind, count in counter.by_kind.items()}
    return sum(counter.by_kind.values()) / layer_steps, active, by_kind


@pytest.mark.parametrize("home", ["cpu", "ssd"])
def test_host_operators_do_not_grow_with_the_active_experts(tmp_path, home, monkeypatch):
    fine_ops, fine_active, fine_kinds = host_ops_per_layer_step(
        fine_grained_config(), "cpu" if home == "cpu" else tmp_path / "f", monkeypatch)
    coarse_ops, coarse_active, _ = host_ops_per_layer_step(
        coarse_config(), "cpu" if home == "cpu" else tmp_path / "c", monkeypatch)
    assert fine_active > 8 * coarse_active / 2 and fine_active > 32  # many more experts active a layer
    assert fine_ops < 0.5 * fine_active, (fine_ops, fine_active)  # one operator per expert was the old cost
    assert fine_ops < 2 * coarse_ops, (fine_ops, coarse_ops)
    if home == "cpu":  # packed into the layer's own buffer: the index, a slice a name and the buffer's, a gather a name
        assert fine_kinds["intake"] <= 8, fine_kinds
