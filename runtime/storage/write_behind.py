"""Write-behind for the SSD tier: expert states leaving the CPU cache are written by one background thread, so an
eviction in the middle of a forward pass costs a queue append instead of serialise + write + fsync on the training
thread (the paper overlaps SSD traffic with compute; seed 004 section 3.2.2).

Order is what keeps it correct: jobs run first in, first out, and a reader of a key calls `wait_for(key)` before
reading its file, so it never sees a version older than the last one handed in.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Hashable


class WriteBehind:
    """A FIFO of write jobs keyed by what they write; errors surface on the next `wait_for`, `check` or `drain`."""

    def __init__(self, name: str = "moesys-write-behind"):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._pending: dict[Hashable, Future] = {}
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    def submit(self, key: Hashable, job: Callable[[], None]) -> None:
        with self._lock:
            future = self._pool.submit(job)
            self._pending[key] = future
        future.add_done_callback(lambda f, key=key: self._done(key, f))

    def _done(self, key: Hashable, future: Future) -> None:
        with self._lock:
            if self._pending.get(key) is future:
                del self._pending[key]
            if future.exception() is not None and self._error is None:
                self._error = future.exception()

    def pending(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._pending

    def wait_for(self, key: Hashable) -> None:
        """Block until the last write of `key` handed in so far is on disk."""
        with self._lock:
            future = self._pending.get(key)
        if future is not None:
            future.result()

    def check(self) -> None:
        """Raise the first error a finished job hit."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def drain(self) -> None:
        """Block until every job handed in so far finished."""
        self._pool.submit(lambda: None).result()
        self.check()

    def close(self) -> None:
        self.drain()
        self._pool.shutdown(wait=True)
