"""The paper's Algorithm 2 on scripted access sequences with hand-computed hits, evictions and decays."""

from __future__ import annotations

import pytest

from runtime.storage.cache import LFUCache


class FakeSSD:
    """Records loads, write-backs and clean entries let go; states are strings naming their key and version."""

    def __init__(self):
        self.loads: list[str] = []
        self.writes: list[tuple[str, str]] = []
        self.forgotten: list[str] = []

    def forget(self, key, state):
        self.forgotten.append(key)

    def load(self, key):
        self.loads.append(key)
        return f"state-{key}"

    def write_back(self, key, state):
        self.writes.append((key, state))


def make(capacity, threshold=1, beta=0.5, every=100):
    ssd = FakeSSD()
    return LFUCache(capacity, threshold, beta, every, ssd.load, ssd.write_back, ssd.forget), ssd


def test_fill_hit_and_evict_least_hit():
    cache, ssd = make(2)
    outcomes = [cache.request(k)[1] for k in "AB"]
    cache.mark_dirty("B")  # updated: SSD's copy is old
    outcomes += [cache.request(k)[1] for k in "AC"]
    assert [(a.hit, a.cached, a.evicted) for a in outcomes] == [
        (False, True, None), (False, True, None), (True, True, None), (False, True, "B")]
    assert ssd.writes == [("B", "state-B")]
    assert cache.hits == {"A": 2, "C": 1}
    state, access = cache.request("B")  # C (1 hit) is now the least-hit entry; unchanged, so not written
    assert state == "state-B" and access.evicted == "C"
    cache.request("A")
    assert cache.hits == {"A": 3, "B": 2} and cache.history == {"C": 1}  # B came back with its count
    assert ssd.loads == ["A", "B", "C", "B"] and ssd.writes == [("B", "state-B")] and ssd.forgotten == ["C"]
    assert cache.counters.snapshot_and_reset() == {
        "hits": 2, "misses": 4, "bypasses": 0, "evictions": 2, "write_backs": 1, "decays": 0}


def test_below_threshold_nothing_is_evicted_and_states_bypass_the_cache():
    cache, ssd = make(2, threshold=2)
    cache.request("A")
    cache.request("B")
    state, access = cache.request("C")  # least hits 1 < threshold 2
    assert state == "state-C" and access == access.__class__("C", hit=False, cached=False)
    assert "C" not in cache and ssd.writes == []
    cache.request("A")
    cache.request("B")  # A and B both at 2 hits; tie goes to the newest entry, B
    _, access = cache.request("C")
    assert access.evicted == "B" and access.cached
    assert cache.hits == {"A": 2, "C": 2}  # C's bypass counted
    assert ssd.loads == ["A", "B", "C", "C"]


def test_a_cycle_over_more_keys_than_the_cache_holds_keeps_hitting_its_residents():
    """A training step asks for each active expert once, layer by layer: with more active than cached, evicting the
    oldest on a tie would evict every entry just before its next use (no hit at all)."""
    cache, _ = make(3)
    for _ in range(5):
        for key in "ABCDEF":
            cache.request(key)
    assert cache.counters.hits == 4 * 2  # after the first round, A and B stay and hit in every round
    assert set(cache.entries) >= {"A", "B"}


def test_an_expert_asked_for_every_step_keeps_its_count_across_an_eviction():
    """Under a skewed load a hot expert evicted once must not restart at one hit, behind entries never asked for
    again: it would be the next victim every time and never hit."""
    cache, _ = make(2)
    for key in "XYZ":  # Y evicted: the newest on the tie
        cache.request(key)
    for step in range(3):
        cache.request("Y")
        cache.request(f"cold{step}")
    assert "Y" in cache and cache.counters.hits == 2


def test_decay_every_k_steps_can_protect_or_expose_entries():
    cache, ssd = make(1, threshold=1, beta=0.5, every=2)
    cache.request("A")
    assert cache.end_step() is False
    cache.request("A")
    assert cache.hits == {"A": 2}
    assert cache.end_step() is True
    assert cache.hits == {"A": 1.0}
    _, access = cache.request("B")  # 1.0 reaches threshold 1
    assert access.evicted == "A"

    cache, ssd = make(1, threshold=1.5, beta=0.5, every=2)
    cache.request("A")
    cache.request("A")
    cache.end_step()
    cache.end_step()  # A: 2 -> 1.0 < 1.5
    _, access = cache.request("B")
    assert not access.cached and cache.hits == {"A": 1.0}
    assert cache.counters.decays == 1


def test_decay_repeats_every_period():
    cache, _ = make(3, beta=0.5, every=3)
    for k in "AAAAB":
        cache.request(k)
    decays = [cache.end_step() for _ in range(7)]
    assert decays == [False, False, True, False, False, True, False]
    assert cache.hits == pytest.approx({"A": 4 * 0.25, "B": 0.25})


def test_zero_capacity_always_bypasses():
    cache, ssd = make(0)
    for k in "AAB":
        assert cache.request(k)[1].cached is False
    assert len(cache) == 0 and ssd.loads == ["A", "A", "B"]


def test_flush_writes_only_dirty_entries_and_keeps_them():
    cache, ssd = make(3)
    for k in "ABC":
        cache.request(k)
    cache.mark_dirty("B")
    cache.mark_dirty("Z")  # not cached: ignored
    assert cache.flush() == 1
    assert ssd.writes == [("B", "state-B")]
    assert len(cache) == 3 and cache.flush() == 0


def test_evicting_a_dirty_entry_writes_it_once():
    cache, ssd = make(1)
    cache.request("A")
    cache.mark_dirty("A")
    cache.request("B")
    assert ssd.writes == [("A", "state-A")]
    assert cache.flush() == 0


def test_override_loader_is_used_for_a_prefetched_miss():
    cache, ssd = make(1)
    state, _ = cache.request("A", load=lambda k: "prefetched")
    assert state == "prefetched" and ssd.loads == []
    state, access = cache.request("A", load=lambda k: "never")
    assert state == "prefetched" and access.hit
