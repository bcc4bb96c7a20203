"""The timeline: the record of one offloaded training step's or one decoded token's events. Each span says what was
done (a copy, compute, host work, a wait), whether the training path or the token's compute stood on it, on which
thread, when, and for disk I/O its thread's CPU time. Training's offload engine records its host work with `span`
and `io_span`; inference's offloaders record copies and compute, on CUDA as events on the stream that ran them. From
it the benches read how much host work a step costs and how much of it hid (`host_cost`), and `moesys infer` how
much of its copying hid behind compute (`overlap_s`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Span:
    kind: str
    """What was done. Training: h2d, d2h, intake, adamw, refresh, catch_up, ssd_read, ... or wait_* for a wait;
    inference: copy, compute, or wait (compute stood still for a copy)."""
    critical: bool
    """On the path: the training step's forward, backward or step call waited for it; in inference, a token's compute
    and its waits."""
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


class Timeline:
    """Thread-safe span recorder. A mark is a host clock reading, or on a CUDA timeline an event recorded on a stream
    (resolved to seconds from the timeline's start when read); `take()` hands over what was recorded since the last
    take, `seconds()` and `around_last()` read without taking."""

    def __init__(self, device: torch.device | None = None) -> None:
        """device: a CUDA device times marks with its events; None or another device, with the host clock."""
        self.cuda = device is not None and device.type == "cuda"
        self._marked: list[tuple[str, bool, Any, Any, str, float | None]] = []
        self._lock = threading.Lock()
        self._base = self.mark()

    def mark(self, stream: torch.cuda.Stream | None = None) -> Any:
        """Now: the host clock, or on a CUDA timeline an event recorded on `stream` (else the current one)."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    @contextmanager
    def span(self, kind: str, critical: bool) -> Iterator[None]:
        began = self.mark()
        try:
            yield
        finally:
            self.add(kind, began, self.mark(), critical)

    @contextmanager
    def io_span(self, kind: str, critical: bool = False) -> Iterator[None]:
        """Work that waits on a disk: its work is the thread's CPU time, not the time the disk took (on the training
        path, the rest is a wait)."""
        began, cpu = self.mark(), time.thread_time()
        try:
            yield
        finally:
            self.add(kind, began, self.mark(), critical, time.thread_time() - cpu)

    def add(self, kind: str, start: Any, end: Any, critical: bool = False, cpu: float | None = None) -> None:
        """A span between two marks."""
        marked = (kind, critical, start, end, threading.current_thread().name, cpu)
        with self._lock:
            self._marked.append(marked)

    def _seconds(self, mark: Any) -> float:
        return mark if not self.cuda else self._base.elapsed_time(mark) / 1e3

    def _read(self, take: bool) -> list[tuple[str, bool, Any, Any, str, float | None]]:
        with self._lock:
            marked = list(self._marked)
            if take:
                self._marked = []
        if self.cuda and marked:
            torch.cuda.synchronize()  # every event recorded so far has run
        return marked

    def take(self) -> list[Span]:
        return [Span(k, c, self._seconds(s), self._seconds(e), t, cpu) for k, c, s, e, t, cpu in self._read(True)]

    def seconds(self, kind: str) -> list[tuple[float, float]]:
        """(start, end) of each span of `kind`, in the order recorded."""
        return [(self._seconds(s), self._seconds(e)) for k, _, s, e, _, _ in self._read(False) if k == kind]

    def clear(self) -> None:
        with self._lock:
            self._marked = []

    def around_last(self, kind: str, kinds: tuple[str, ...]) -> dict[str, list[list[float]]]:
        """The spans of `kinds` that overlap the last span of `kind`, in seconds from its start (one begun before it
        starts below 0), as lists (JSON-ready); empty before any span of `kind`."""
        last = self.seconds(kind)
        if not last:
            return {}
        start, end = last[-1]
        return {k: [[round(s - start, 7), round(e - start, 7)] for s, e in self.seconds(k) if e > start and s < end]
                for k in kinds}


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


def overlap_s(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total time covered by both interval lists (each list's intervals are disjoint)."""
    a, b = sorted(a), sorted(b)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total
