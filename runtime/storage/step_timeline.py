"""The host side of an offloaded training step as a timeline: every piece of work or wait, whether it lay on the
training path (forward, backward, the step call) or ran in the background, and when. From it the benchmark reads
how much host work a step costs and how much of that hid behind the forward and backward passes."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class Span:
    kind: str
    """What was done: h2d, d2h, intake, adamw, refresh, catch_up, ssd_read, ... or wait_* for a wait."""
    critical: bool
    """On the training path: the forward, backward or step waited for it."""
    start: float
    end: float
    thread: str
    cpu: float | None = None
    """CPU seconds of the thread over the span, for work that waits on a device (disk I/O); None: all of the span
    is work."""

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def work(self) -> float:
        """Seconds of host work in the span."""
        return self.seconds if self.cpu is None else self.cpu

    @property
    def is_wait(self) -> bool:
        return self.kind.startswith("wait")


class StepTimeline:
    """Thread-safe span recorder; `take()` hands over what was recorded since the last take."""

    def __init__(self) -> None:
        self._spans: list[Span] = []
        self._lock = threading.Lock()

    @contextmanager
    def span(self, kind: str, critical: bool) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.add(kind, critical, began, time.perf_counter())

    @contextmanager
    def io_span(self, kind: str, critical: bool = False) -> Iterator[None]:
        """Work that waits on a disk: its work is the thread's CPU time, not the time the disk took (on the training
        path, the rest is a wait)."""
        began, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.add(kind, critical, began, time.perf_counter(), time.thread_time() - cpu)

    def add(self, kind: str, critical: bool, start: float, end: float, cpu: float | None = None) -> None:
        span = Span(kind, critical, start, end, threading.current_thread().name, cpu)
        with self._lock:
            self._spans.append(span)

    def take(self) -> list[Span]:
        with self._lock:
            spans, self._spans = self._spans, []
        return spans


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _covered(wait: tuple[float, float], work: list[tuple[float, float]]) -> float:
    """Seconds of `wait` during which some background work ran."""
    a, b = wait
    return _union_length([(max(a, s), min(b, e)) for s, e in work if s < b and e > a])


def host_cost(spans: list[Span]) -> dict[str, float]:
    """work_s: seconds of host work (every thread; I/O counts its CPU time); idle_wait_s: seconds the training path
    waited with no host work running (a copy engine, a disk, another rank; background I/O, which mostly waits for
    its disk, does not count as running; I/O on the training path waits for its time off the CPU); exposed_s:
    seconds the training path spent in the offload machinery, working or waiting; cost_s = work_s + idle_wait_s,
    the host side's cost; hidden_share = the part of it the training path did not see."""
    background = [(s.start, s.end) for s in spans if not s.critical and not s.is_wait and s.cpu is None]
    waits = [(s.start, s.end) for s in spans if s.critical and s.is_wait]
    work = sum(s.work for s in spans if not s.is_wait)
    idle = sum((b - a) - _covered((a, b), background) for a, b in waits)
    for s in spans:  # training-path I/O: the time it was off the CPU is a wait, uncovered in proportion
        if s.critical and s.cpu is not None and s.seconds > 0:
            idle += max(0.0, s.seconds - s.cpu) * (1 - _covered((s.start, s.end), background) / s.seconds)
    exposed = sum(s.seconds for s in spans if s.critical)
    cost = work + idle
    return {"work_s": work, "idle_wait_s": idle, "exposed_s": exposed, "cost_s": cost,
            "hidden_share": 0.0 if cost <= 0 else max(0.0, min(1.0, 1 - exposed / cost))}


def by_kind(spans: list[Span]) -> dict[str, float]:
    """Seconds per kind of span (of work, for I/O)."""
    out: dict[str, float] = {}
    for s in spans:
        out[s.kind] = out.get(s.kind, 0.0) + s.work
    return out
