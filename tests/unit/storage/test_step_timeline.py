"""The host cost of an offloaded step from its timeline: work on every thread, plus the training path's waits with
no host work running; background I/O counts its CPU time, not the time its disk took."""

from __future__ import annotations

import time

import pytest

from runtime.storage.step_timeline import Span, StepTimeline, by_kind, host_cost


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


def test_an_io_span_records_the_threads_cpu_time_beside_its_wall_time():
    timeline = StepTimeline()
    with timeline.io_span("ssd_write"):
        time.sleep(0.2)  # a thread blocked on its disk
    with timeline.io_span("ssd_read"):
        end = time.thread_time() + 0.1
        while time.thread_time() < end:  # a thread copying
            pass
    sleep, busy = timeline.take()
    assert sleep.seconds >= 0.2 and sleep.cpu < 0.05
    assert busy.cpu >= 0.1 and not busy.critical and not busy.is_wait


def test_io_on_the_training_path_is_work_for_its_cpu_time_and_an_idle_wait_for_the_rest():
    spans = [Span("adamw", False, 0.0, 1.0, "optimizer"),
             Span("acquire", True, 0.0, 2.0, "main", cpu=0.5),  # a read nobody predicted: 1.5 s off the CPU
             Span("h2d", True, 2.0, 2.5, "main")]
    cost = host_cost(spans)
    assert cost["work_s"] == pytest.approx(1.0 + 0.5 + 0.5)
    assert cost["idle_wait_s"] == pytest.approx(1.5 * 0.5)  # the AdamW ran through half of it
    assert cost["exposed_s"] == pytest.approx(2.5)
    assert by_kind(spans)["acquire"] == pytest.approx(0.5)
    timeline = StepTimeline()
    with timeline.io_span("acquire", critical=True):
        time.sleep(0.05)
    (read,) = timeline.take()
    assert read.critical and read.cpu < read.seconds
