"""The sparse (vertical) half of 2D prefetch: while layer i computes, the states of the experts that layer i+1..i+depth
will route to move SSD -> CPU on a background thread (the paper's "2D Prefetch Scheduling"; the ZeRO-3 offloading
thesis, "Dynamic Fetching and Offloading").

The routing of layer i+1 is not known while layer i computes, so the request is the one the paper uses: the
experts each layer activated in the previous step ("recorded expert selection results"), which needs no extra
communication. Prefetched states wait in a staging area; the cache takes them on the real request, so Algorithm 2's
hit counts see only real requests. States of experts that were not requested are dropped at the end of the step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

Key = TypeVar("Key", bound=Hashable)
State = TypeVar("State")


class SparsePrefetcher(Generic[Key, State]):
    """Stages states of predicted experts. `read(key)` reads from SSD; `cached(key)` says the CPU cache holds it;
    `ready(layer)` blocks until the layer's states on SSD are final (its optimizer step finished); `hint(keys)`,
    if given, asks the disk for all of a layer's files at once before they are read one by one, so the disk works
    on the next ones while the first is copied."""

    def __init__(self, read: Callable[[Key], State], cached: Callable[[Key], bool],
                 ready: Callable[[int], None], depth: int, lock: threading.RLock,
                 hint: Callable[[list[Key]], None] | None = None):
        self.read, self.cached, self.ready, self.hint = read, cached, ready, hint
        self.depth = depth
        self.lock = lock
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moesys-prefetch")
        self.staged: dict[Key, State] = {}
        self.futures: dict[int, Future] = {}
        self.history: dict[int, list[Key]] = {}
        self.prefetched = 0

    def record(self, layer: int, keys: list[Key]) -> None:
        """The experts `layer` activated this step: next step's prediction."""
        self.history[layer] = list(keys)

    def schedule(self, layers: list[int]) -> None:
        """Start staging the predicted experts of `layers` (each at most once per step)."""
        for layer in layers:
            if layer in self.futures or layer not in self.history:
                continue
            self.futures[layer] = self.pool.submit(self._stage, layer, list(self.history[layer]))

    def _stage(self, layer: int, keys: list[Key]) -> None:
        self.ready(layer)
        if self.hint is not None:
            with self.lock:
                wanted = [k for k in keys if not self.cached(k) and k not in self.staged]
            self.hint(wanted)
        for key in keys:
            with self.lock:
                if self.cached(key) or key in self.staged:
                    continue
            state = self.read(key)
            with self.lock:
                if not self.cached(key):
                    self.staged[key] = state
                    self.prefetched += 1

    def wait(self, layer: int) -> float:
        """Block until `layer`'s staging finished; returns the seconds spent waiting (the stall)."""
        future = self.futures.get(layer)
        if future is None or future.done():
            if future is not None:
                future.result()
            return 0.0
        began = time.perf_counter()
        future.result()
        return time.perf_counter() - began

    def wait_all(self) -> None:
        """Block until every staging started so far finished (the states stay staged)."""
        for future in list(self.futures.values()):
            future.result()

    def take(self, key: Key) -> State | None:
        """The staged states of `key` (removed from staging), or None."""
        with self.lock:
            return self.staged.pop(key, None)

    def end_step(self) -> list[State]:
        """Wait for outstanding staging, forget this step's schedule and return the staged states nobody
        requested (dropped)."""
        self.wait_all()
        with self.lock:
            unused = list(self.staged.values())
            self.staged.clear()
            self.futures.clear()
        return unused

    def close(self) -> None:
        self.pool.shutdown(wait=True)
