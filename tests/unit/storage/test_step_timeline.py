"""The host cost of an offloaded step from its timeline: work on every thread, plus the training path's waits with
no host work running; background I/O counts its CPU time, not the time its disk took."""

from __future__ import annotations

import pytest

from runtime.storage import step_timeline
from runtime.storage.step_timeline import Span, StepTimeline, by_kind, host_cost


class Clocks:
    """The wall clock and the thread's CPU clock, moved by the test: a thread blocked on its disk moves only the
    first, a thread copying moves both."""

    def __init__(self):
        self.wall = self.cpu = 0.0

    def perf_counter(self) -> float:
        return self.wall

    def thread_time(self) -> float:
        return self.cpu

    def blocked_on_disk(self, seconds: float) -> None:
        self.wall += seconds

    def copying(self, seconds: float) -> None:
        self.wall += seconds
        self.cpu += seconds


def test_the_host_cost_counts_work_and_idle_waits_and_io_by_its_cpu_time():
    spans = [Span("adamw", False, 0.0, 1.0, "optimizer"),  # background work
             Span("wait_prefetch", True, 0.5, 2.0, "main"),  # half a second of it covered by the AdamW above
             Span("ssd_read", False, 1.0, 3.0, "reader", cpu=0.25),  # 2 s for the disk, 0.25 s of CPU
             Span("h2d", True, 2.0, 2.5, "main")]
    cost = host_cost(spans)
    assert cost["work_s"] == pytest.approx(1.0 + 0.25 + 0.5)
    assert cost["idle_wait_s"] == pytest.approx(1.0)  # a read waiting for its disk does not fill the wait
    assert cost["cost_s"] == pytest.approx(2.75)
    assert cost["exposed_s"] == pytest.approx(2.0)
    assert cost["hidden_share"] == pytest.approx(1 - 2.0 / 2.75)
    assert by_kind(spans) == pytest.approx({"adamw": 1.0, "wait_prefetch": 1.5, "ssd_read": 0.25, "h2d": 0.5})


def test_an_io_span_records_the_threads_cpu_time_beside_its_wall_time(monkeypatch):
    clocks = Clocks()
    monkeypatch.setattr(step_timeline, "time", clocks)  # only these two clocks: the span reads no other
    timeline = StepTimeline()
    with timeline.io_span("ssd_write"):
        clocks.blocked_on_disk(0.2)
    with timeline.io_span("ssd_read"):
        clocks.copying(0.1)
    blocked, busy = timeline.take()
    assert (blocked.seconds, blocked.cpu) == pytest.approx((0.2, 0.0))
    assert (busy.seconds, busy.cpu) == pytest.approx((0.1, 0.1)) and not busy.critical and not busy.is_wait


def test_io_on_the_training_path_is_work_for_its_cpu_time_and_an_idle_wait_for_the_rest(monkeypatch):
    spans = [Span("adamw", False, 0.0, 1.0, "optimizer"),
             Span("acquire", True, 0.0, 2.0, "main", cpu=0.5),  # a read nobody predicted: 1.5 s off the CPU
             Span("h2d", True, 2.0, 2.5, "main")]
    cost = host_cost(spans)
    assert cost["work_s"] == pytest.approx(1.0 + 0.5 + 0.5)
    assert cost["idle_wait_s"] == pytest.approx(1.5 * 0.5)  # the AdamW ran through half of it
    assert cost["exposed_s"] == pytest.approx(2.5)
    assert by_kind(spans)["acquire"] == pytest.approx(0.5)
    clocks = Clocks()
    monkeypatch.setattr(step_timeline, "time", clocks)
    timeline = StepTimeline()
    with timeline.io_span("acquire", critical=True):
        clocks.copying(0.01)
        clocks.blocked_on_disk(0.05)
    (read,) = timeline.take()
    assert read.critical and (read.seconds, read.cpu, read.work) == pytest.approx((0.06, 0.01, 0.01))
