"""Byte budgets of the device, host and SSD tiers (the paper's Eq. 1): counted, enforced, peaks reported.

The offload runtime calls `allocate`/`release` whenever it creates or drops expert tensors on a tier and `moved`
for every transfer; a tier whose usage would pass its capacity raises TierBudgetError naming the tier.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from runtime.errors import UserError


class TierBudgetError(UserError):
    """Expert states would exceed a tier's byte budget."""


@dataclass
class Tier:
    """One storage tier. capacity 0 means unbounded (counted, not enforced)."""

    name: str
    capacity: int = 0
    used: int = 0
    peak: int = 0
    moved_in: int = 0
    """Bytes copied into this tier since the last `reset_step`."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def allocate(self, nbytes: int) -> None:
        with self._lock:
            if self.capacity and self.used + nbytes > self.capacity:
                raise TierBudgetError(
                    f"{self.name} tier: {self.used + nbytes} bytes of expert states exceed its budget of "
                    f"{self.capacity} bytes; lower storage.cpu_cache_experts, the micro-batch or "
                    "storage.prefetch_depth, or run `moesys plan` for a placement that fits")
            self.used += nbytes
            self.peak = max(self.peak, self.used)

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes
            if self.used < 0:
                raise RuntimeError(f"{self.name} tier released more bytes than it held")

    def moved(self, nbytes: int) -> None:
        with self._lock:
            self.moved_in += nbytes


@dataclass
class Tiers:
    """The three tiers of one rank."""

    device: Tier
    host: Tier
    ssd: Tier

    @classmethod
    def with_budgets(cls, device: int = 0, host: int = 0, ssd: int = 0) -> Tiers:
        return cls(Tier("device", device), Tier("host", host), Tier("ssd", ssd))

    def __iter__(self):
        return iter((self.device, self.host, self.ssd))

    def step_metrics(self) -> dict[str, int]:
        """Bytes moved into each tier this step, current use and peak; resets the moved counters."""
        out: dict[str, int] = {}
        for tier in self:
            out[f"{tier.name}_in_bytes"] = tier.moved_in
            out[f"{tier.name}_used_bytes"] = tier.used
            out[f"{tier.name}_peak_bytes"] = tier.peak
            tier.moved_in = 0
        return out
