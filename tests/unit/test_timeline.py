"""The timeline both offload subsystems record on. Training: the host cost of an offloaded step from its spans, work on
every thread plus the training path's waits with no host work running, background I/O counted by its CPU time, not
the time its disk took. Inference: a token's copy/compute/wait spans and how much copying hid behind compute."""

from __future__ import annotations

import pytest
import torch

from runtime.host import timeline as timeline_module
from runtime.host.timeline import Span, Timeline, by_kind, host_cost, overlap_s


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
    monkeypatch.setattr(timeline_module, "time", clocks)  # only these two clocks: the span reads no other
    timeline = Timeline()
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
    monkeypatch.setattr(timeline_module, "time", clocks)
    timeline = Timeline()
    with timeline.io_span("acquire", critical=True):
        clocks.copying(0.01)
        clocks.blocked_on_disk(0.05)
    (read,) = timeline.take()
    assert read.critical and (read.seconds, read.cpu, read.work) == pytest.approx((0.06, 0.01, 0.01))


def test_overlap_of_interval_lists():
    assert overlap_s([(0, 2), (5, 6)], [(1, 5.5)]) == pytest.approx(1.5)
    assert overlap_s([(0, 1)], [(1, 2)]) == 0.0
    assert overlap_s([(3, 4), (0, 1)], [(0.5, 3.5)]) == pytest.approx(1.0)


def test_a_tokens_spans_are_read_around_its_compute_without_being_taken(monkeypatch):
    clocks = Clocks()
    monkeypatch.setattr(timeline_module, "time", clocks)
    timeline = Timeline(torch.device("cpu"))
    copy_start = timeline.mark()  # a copy started during the token before ...
    clocks.copying(1.0)
    token = timeline.mark()
    clocks.copying(0.5)
    timeline.add("copy", copy_start, timeline.mark())  # ... lands half a second into this token's compute
    wait = timeline.mark()
    clocks.copying(0.25)
    timeline.add("wait", wait, timeline.mark(), critical=True)
    clocks.copying(0.25)
    timeline.add("compute", token, timeline.mark(), critical=True)
    assert timeline.seconds("copy") == [(0.0, 1.5)]
    assert timeline.around_last("compute", ("copy", "compute", "wait")) == {
        "copy": [[-1.0, 0.5]], "compute": [[0.0, 1.0]], "wait": [[0.5, 0.75]]}
    assert timeline.around_last("compute", ("copy", "prefetch")) == {"copy": [[-1.0, 0.5]], "prefetch": []}
    hidden = overlap_s(timeline.seconds("copy"), timeline.seconds("compute"))
    assert hidden == pytest.approx(0.5)
    (copy, wait, compute) = timeline.take()
    assert (copy.kind, copy.critical, wait.is_wait, compute.critical) == ("copy", False, True, True)
    assert timeline.seconds("copy") == [] and timeline.around_last("compute", ("copy",)) == {}
