"""Runs timed side by side: taking turns round after round, so that a machine whose speed drifts (other work, memory
bandwidth, frequency) slows every run of a round alike, and each round's ratio is kept (the median of those ratios
is the figure, not the ratio of medians)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping


def alternate(runs: Mapping[str, Callable[[], object]], reset: Callable[[], None], sync: Callable[[], None],
              repeats: int, warmup: int) -> dict[str, list[float]]:
    """Seconds of each run per round (`warmup` rounds not kept), each run after `reset` and between `sync`s."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(warmup + repeats):
        for name, fn in runs.items():
            reset()
            sync()
            start = time.perf_counter()
            fn()
            sync()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    reset()
    return times


def paired_ratios(times: dict[str, list[float]], tokens: int, first: str = "moe") -> dict:
    """Tokens/s of each run, and for every other run `first`'s speed-up over it in each round and their median."""
    out: dict = {f"{name}_tokens_per_s": tokens / statistics.median(ts) for name, ts in times.items()}
    for name, ts in times.items():
        if name != first:
            rounds = [theirs / mine for mine, theirs in zip(times[first], ts, strict=True)]
            out[f"{first}_vs_{name}"] = statistics.median(rounds)
            out[f"{first}_vs_{name}_rounds"] = rounds
    out["median_s"] = {name: statistics.median(ts) for name, ts in times.items()}
    return out
