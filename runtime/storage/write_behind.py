"""Write-behind for the SSD tier: expert states leaving the CPU cache are written by one background thread, so an
eviction in the middle of a forward pass costs a queue append instead of serialise + write on the training thread (the
paper overlaps SSD traffic with compute: "2D Prefetch Scheduling"). A job may write several keys (one
layer's updated experts after its optimizer step), so the disk gets one run of large writes per layer.

Order is what keeps it correct: jobs run first in, first out, and a reader of a key calls `wait_for(key)` before
reading its file, so it never sees a version older than the last one handed in.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor


class WriteBehind:
    """A FIFO of write jobs keyed by what they write; errors surface on the next `wait_for`, `check` or `drain`."""

    def __init__(self, name: str = "moesys-write-behind"):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._pending: dict[Hashable, tuple[int, Future]] = {}
        self._submitted = 0
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    def submit(self, key: Hashable, job: Callable[[], None]) -> None:
        self.submit_many([key], job)

    def submit_many(self, keys: Iterable[Hashable], job: Callable[[], None]) -> None:
        """One job that writes every key of `keys`: a reader of any of them waits for the whole job."""
        keys = list(keys)

        def run(number: int) -> None:
            try:
                job()
            except BaseException as error:  # kept for the caller: nobody reads this thread's futures
                with self._lock:
                    self._error = self._error or error
            finally:  # before the future completes, so a waiter sees the keys settled
                with self._lock:
                    for key in keys:
                        if self._pending.get(key, (None,))[0] == number:
                            del self._pending[key]

        with self._lock:
            self._submitted += 1
            future = self._pool.submit(run, self._submitted)
            for key in keys:
                self._pending[key] = (self._submitted, future)

    @property
    def jobs(self) -> int:
        """Jobs handed in so far (a batch of keys counts once)."""
        with self._lock:
            return self._submitted

    def pending(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._pending

    def wait_for(self, key: Hashable) -> None:
        """Block until the last write of `key` handed in so far finished (and raise if a write failed)."""
        with self._lock:
            entry = self._pending.get(key)
        if entry is not None:
            entry[1].result()
        self.check()

    def check(self) -> None:
        """Raise the first error a finished job hit."""
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def drain(self) -> None:
        """Block until every job handed in so far finished."""
        self._pool.submit(lambda: None).result()
        self.check()

    def close(self) -> None:
        self.drain()
        self._pool.shutdown(wait=True)
