"""The CPU cache of expert states with hit counts, a hit threshold and decay (the paper's "2D Prefetch Scheduling",
Algorithm 2).

Keys are (MoE layer, global expert). Reading of the pseudo-code that this module commits to:
- hit (line 12): hits += 1; miss with room (line 15): hits += 1 (from 0 for a key never seen), load from SSD into
  the cache;
- a key's count outlives its eviction (`history`) and decays with the others: the pseudo-code restarts a returning
  expert at 1, so under a skewed load an expert hot every step but evicted once stayed behind entries never asked
  for again (its count kept at 1, it was the next victim before it could be hit);
- miss with a full cache (lines 19-26): the victim is the cached entry with the smallest hit count (the newest on a
  tie, which the paper leaves open: a training step asks for every active expert once, layer after layer, and when
  more are active than the cache holds, evicting the oldest on a tie evicts each expert just before its next use, a
  0% hit rate, while evicting the newest keeps the others until their next use) and it is evicted only when that
  count reaches the threshold; its states are written back to SSD if they changed since they were read (a clean
  entry is the SSD's copy: writing it would only cost the disk) and the requested states take its place (the
  pseudo-code's loop would evict every entry that becomes the minimum in turn and forgets to count the newcomer;
  the text says one entry, "the lowest hit frequency");
- when the least-hit entry is below the threshold nothing is evicted: the states go SSD -> device without being
  cached (line 31), and their update is written straight back to SSD (a *bypass*);
- decay (lines 27-30): every decay_every calls of end_step() (training steps) every count is multiplied by beta;
- capacity counts experts held, so the cache holds `capacity` entries (line 15's strict `acc + 1 < size` would
  leave one slot unused).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

Key = TypeVar("Key", bound=Hashable)
State = TypeVar("State")


@dataclass(frozen=True)
class Access(Generic[Key]):
    """What one request did."""

    key: Key
    hit: bool
    cached: bool
    """The states now live in the cache (False for a bypass)."""
    evicted: Key | None = None


@dataclass
class CacheCounters:
    """Running totals; `snapshot_and_reset` gives per-step numbers."""

    hits: int = 0
    misses: int = 0
    bypasses: int = 0
    evictions: int = 0
    write_backs: int = 0
    decays: int = 0

    def snapshot_and_reset(self) -> dict[str, int]:
        out = dict(vars(self))
        for name in out:
            setattr(self, name, 0)
        return out


@dataclass
class LFUCache(Generic[Key, State]):
    """Algorithm 2 over opaque states: `load(key)` reads them from SSD, `write_back(key, states)` stores changed
    ones, `forget(key, states)` (optional) lets go of an evicted entry that did not change."""

    capacity: int
    hit_threshold: float
    decay_beta: float
    decay_every: int
    load: Callable[[Key], State]
    write_back: Callable[[Key, State], None]
    forget: Callable[[Key, State], None] | None = None
    hits: dict[Key, float] = field(default_factory=dict)
    """Counts of the cached keys, in the order they entered the cache."""
    history: dict[Key, float] = field(default_factory=dict)
    """Counts of keys asked for before and not cached now."""
    entries: dict[Key, State] = field(default_factory=dict)
    dirty: set = field(default_factory=set)
    counters: CacheCounters = field(default_factory=CacheCounters)
    steps: int = 0

    def __post_init__(self) -> None:
        if self.capacity < 0:
            raise ValueError(f"storage.cpu_cache_experts must be >= 0 (got {self.capacity})")
        if self.decay_every <= 0:
            raise ValueError(f"storage.decay_every must be positive (got {self.decay_every})")
        self.lock = threading.RLock()

    def __contains__(self, key: Key) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def request(self, key: Key, load: Callable[[Key], State] | None = None) -> tuple[State, Access[Key]]:
        """SparseSchedule(i) for one expert: the states to use and what happened. `load` overrides the SSD
        read for this request (a prefetched copy)."""
        load = load or self.load
        with self.lock:
            if key in self.entries:
                self.hits[key] += 1
                self.counters.hits += 1
                return self.entries[key], Access(key, hit=True, cached=True)
            self.counters.misses += 1
            if len(self.entries) < self.capacity:
                state = load(key)
                self.entries[key] = state
                self.hits[key] = self.history.pop(key, 0) + 1
                return state, Access(key, hit=False, cached=True)
            victim = self.victim()
            if victim is None:
                self.counters.bypasses += 1
                self.history[key] = self.history.get(key, 0) + 1
                return load(key), Access(key, hit=False, cached=False)
            self.evict(victim)
            state = load(key)
            self.entries[key] = state
            self.hits[key] = self.history.pop(key, 0) + 1
            return state, Access(key, hit=False, cached=True, evicted=victim)

    def victim(self) -> Key | None:
        """The least-hit entry (newest on a tie) if its hits reach the threshold, else None."""
        if not self.hits:
            return None
        least = min(self.hits.values())
        if least < self.hit_threshold:
            return None
        return next(k for k, h in reversed(self.hits.items()) if h == least)

    def evict(self, key: Key) -> None:
        """Write the entry's states back to SSD if they changed, and forget it (lines 23-25)."""
        with self.lock:
            state = self.entries.pop(key)
            self.history[key] = self.hits.pop(key)
            self.counters.evictions += 1
            if key in self.dirty:
                self.dirty.discard(key)
                self.write_back(key, state)
                self.counters.write_backs += 1
            elif self.forget is not None:
                self.forget(key, state)

    def mark_dirty(self, key: Key) -> None:
        """The cached states changed (an optimizer step) and differ from SSD."""
        with self.lock:
            if key in self.entries:
                self.dirty.add(key)

    def end_step(self) -> bool:
        """Count one step; every decay_every steps multiply all hits by beta (lines 27-30). True if it decayed."""
        with self.lock:
            self.steps += 1
            if self.steps < self.decay_every:
                return False
            for counts in (self.hits, self.history):
                for key in counts:
                    counts[key] *= self.decay_beta
            self.steps = 0
            self.counters.decays += 1
            return True

    def flush(self) -> int:
        """Write every dirty entry back to SSD (the entries stay cached). Returns how many were written."""
        with self.lock:
            dirty = [k for k in self.entries if k in self.dirty]
            for key in dirty:
                self.write_back(key, self.entries[key])
            self.dirty.clear()
            self.counters.write_backs += len(dirty)
            return len(dirty)

    def clear(self) -> None:
        """Drop everything without writing back (after the SSD store was restored from a snapshot)."""
        with self.lock:
            self.entries.clear()
            self.hits.clear()
            self.history.clear()
            self.dirty.clear()
            self.steps = 0
