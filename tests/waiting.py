"""Waiting for an event in a test: a condition polled until it holds. The deadline only turns a hang into a failure
that names what never happened; it is generous and never what a test checks."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

T = TypeVar("T")
POLL_S = 0.02


class Running(Protocol):
    """What brings the awaited event about: a subprocess.Popen, or anything with its `poll()`."""

    def poll(self) -> int | None: ...


def wait_until(condition: Callable[[], T], *, what: str | Callable[[], str], timeout: float = 60.0,
               process: Running | None = None, log: Path | None = None) -> T:
    """Poll `condition` until it returns something truthy, and return that. Fails, naming `what`, when `timeout`
    seconds pass first, or when `process` (the one expected to bring it about) ends first. `what` may be a function,
    called then (to say what is still there); the end of `log`'s text is added to the failure."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        ended = process is not None and process.poll() is not None
        if ended and (value := condition()):  # it happened as the process ended
            return value
        if ended or time.monotonic() > deadline:
            why = f"the process ended first (exit code {process.poll()})" if ended else f"not within {timeout:g} s"
            raise AssertionError(f"waited for {what() if callable(what) else what}: {why}{_tail(log)}")
        time.sleep(POLL_S)


def _tail(log: Path | None, chars: int = 4000) -> str:
    if log is None or not log.exists():
        return ""
    return f"\n--- the end of {log}:\n{log.read_text(errors='replace')[-chars:]}"
