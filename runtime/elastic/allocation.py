"""Elastic task-to-GPU allocation minimising the slowest GPU's load (the paper's "Elastic MoE Training";
SE-MoE Table 3).

Heavy tasks scale up (their batch split over several dedicated GPUs, data-parallel sync among them); light
tasks scale down (up to max_tasks_per_gpu whole tasks packed on one shared GPU). The search is exact.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from runtime.errors import UserError

# A task's workload: (batch_size in samples per step, relative cost of one sample).
Workload = tuple[int, float]


class AllocationError(UserError):
    """A workload or GPU count that cannot be allocated; the message is one line."""


@dataclass(frozen=True)
class Allocation:
    """Which GPUs each task runs on and the load every GPU carries per step."""

    assignment: dict[str, list[int]]
    """GPU indices of each task; a shared GPU appears under every task packed on it."""
    batch_per_gpu: dict[str, list[int]]
    """Samples of each task per step on each of its GPUs (aligned with assignment)."""
    load_per_gpu: list[float]
    """Load (samples x cost) of every GPU, idle ones 0."""
    baseline: Allocation | None = field(default=None, compare=False)
    """The naive allocation to compare against (None on a baseline itself)."""

    @property
    def gpus(self) -> dict[str, int]:
        """Number of GPUs each task runs on."""
        return {name: len(ids) for name, ids in self.assignment.items()}

    @property
    def max_load_per_gpu(self) -> float:
        """Load of the slowest GPU: what sets the step time (the cask effect)."""
        return max(self.load_per_gpu)

    @property
    def gpus_used(self) -> int:
        return len({g for ids in self.assignment.values() for g in ids})

    @property
    def shared_gpus(self) -> list[int]:
        """GPUs that host more than one task."""
        counts: dict[int, int] = {}
        for ids in self.assignment.values():
            for g in ids:
                counts[g] = counts.get(g, 0) + 1
        return sorted(g for g, c in counts.items() if c > 1)

    @property
    def efficiency(self) -> float:
        """Total load / (GPUs used x slowest GPU's load): 1.0 means no GPU waits for another."""
        return sum(self.load_per_gpu) / (self.gpus_used * self.max_load_per_gpu)

    @property
    def speedup_per_gpu(self) -> float:
        """Throughput per GPU relative to the baseline (SE-MoE Table 3 reports speed per GPU)."""
        if self.baseline is None:
            return 1.0
        return self.efficiency / self.baseline.efficiency


def _check(tasks: Mapping[str, Workload], num_gpus: int, max_tasks_per_gpu: int) -> None:
    if num_gpus <= 0:
        raise AllocationError(f"need at least one GPU (got {num_gpus})")
    if max_tasks_per_gpu <= 0:
        raise AllocationError(f"max_tasks_per_gpu must be positive (got {max_tasks_per_gpu})")
    if not tasks:
        raise AllocationError("no tasks to allocate")
    for name, (batch, cost) in tasks.items():
        if int(batch) != batch or batch <= 0:
            raise AllocationError(f"tasks.{name}.batch_size must be a positive integer (got {batch})")
        if not cost > 0 or math.isinf(cost):
            raise AllocationError(f"tasks.{name}.cost_per_sample must be positive and finite (got {cost})")
    if len(tasks) > num_gpus * max_tasks_per_gpu:
        raise AllocationError(
            f"{len(tasks)} tasks do not fit on {num_gpus} GPUs with at most {max_tasks_per_gpu} task(s) per GPU")


def _split(batch: int, k: int) -> list[int]:
    """An even split of `batch` samples over k GPUs (the first batch % k GPUs take one more)."""
    return [batch // k + (1 if i < batch % k else 0) for i in range(k)]


def _dedicated_load(batch: int, cost: float, k: int) -> float:
    return -(-batch // k) * cost


def _group_load(tasks: list[Workload]) -> float:
    return sum(b * c for b, c in tasks)


def _build(names: list[str], tasks: Mapping[str, Workload], parts: list[tuple[tuple[int, ...], int]],
           num_gpus: int, baseline: Allocation | None) -> Allocation:
    """Lay out parts (task indices, GPUs) on consecutive GPU indices in the order of each part's first task."""
    assignment: dict[str, list[int]] = {n: [] for n in names}
    batch_per_gpu: dict[str, list[int]] = {n: [] for n in names}
    load = [0.0] * num_gpus
    nxt = 0
    for members, k in sorted(parts, key=lambda p: p[0][0]):
        for i in members:
            batch, cost = tasks[names[i]]
            shares = _split(batch, k)
            assignment[names[i]] = list(range(nxt, nxt + k))
            batch_per_gpu[names[i]] = shares
            for g, s in zip(range(nxt, nxt + k), shares, strict=True):
                load[g] += s * cost
        nxt += k
    return Allocation(assignment, batch_per_gpu, load, baseline)


def baseline_allocation(tasks: Mapping[str, Workload], num_gpus: int, max_tasks_per_gpu: int = 1) -> Allocation:
    """The naive split that ignores load: G // n GPUs per task (the first G % n tasks one more);
    with more tasks than GPUs, tasks are dealt round-robin onto the GPUs."""
    _check(tasks, num_gpus, max_tasks_per_gpu)
    names = list(tasks)
    n = len(names)
    parts: list[tuple[tuple[int, ...], int]]
    if n <= num_gpus:
        parts = [((i,), num_gpus // n + (1 if i < num_gpus % n else 0)) for i in range(n)]
    else:
        groups: dict[int, list[int]] = {}
        for i in range(n):
            groups.setdefault(i % num_gpus, []).append(i)
        parts = [(tuple(m), 1) for m in groups.values()]
    return _build(names, tasks, parts, num_gpus, None)


def _min_gpus_for(bound: float, names: list[str], tasks: Mapping[str, Workload], num_gpus: int,
                  groups: dict[int, float]):
    """Per number of shared GPUs s, the fewest GPUs (and the parts) that keep every GPU's load <= bound.

    Returns {s: (gpus, parts)} over all subsets as a DP on bitmasks: best[mask][s].
    """
    n = len(names)
    full = (1 << n) - 1
    ded: list[int | None] = []
    for name in names:
        batch, cost = tasks[name]
        k = next((k for k in range(1, min(batch, num_gpus) + 1) if _dedicated_load(batch, cost, k) <= bound), None)
        ded.append(k)
    # best[mask] maps shared-count -> (gpus, parts) for covering the tasks in mask.
    best: list[dict[int, tuple[int, list]]] = [dict() for _ in range(full + 1)]
    best[0][0] = (0, [])
    for mask in range(1, full + 1):
        low = (mask & -mask).bit_length() - 1
        rest = mask ^ (1 << low)
        options: list[tuple[int, tuple[int, ...], int, int]] = []
        dedicated = ded[low]
        if dedicated is not None:
            options.append((0, (low,), dedicated, rest))
        sub = rest
        while sub:  # groups of the lowest task plus a non-empty subset of the rest, on one shared GPU
            group = sub | (1 << low)
            if group in groups and groups[group] <= bound:
                members = tuple(i for i in range(n) if group >> i & 1)
                options.append((1, members, 1, mask ^ group))
            sub = (sub - 1) & rest
        table = best[mask]
        for shared, members, k, remain in options:
            for s, (g, parts) in best[remain].items():
                key = s + shared
                if key not in table or g + k < table[key][0]:
                    table[key] = (g + k, parts + [(members, k)])
    return best[full]


def allocate(tasks: Mapping[str, Workload], num_gpus: int, max_tasks_per_gpu: int = 1) -> Allocation:
    """The allocation of `tasks` {name: (batch_size, cost_per_sample)} to `num_gpus` GPUs with the smallest
    slowest-GPU load; ties prefer fewer shared GPUs, then fewer GPUs used (spare GPUs stay idle).

    A task either runs alone on k >= 1 GPUs (batch split evenly, k <= batch_size) or whole on one GPU
    shared with up to max_tasks_per_gpu - 1 other whole tasks (memory permitting).
    """
    _check(tasks, num_gpus, max_tasks_per_gpu)
    names = list(tasks)
    n = len(names)
    groups: dict[int, float] = {}
    if max_tasks_per_gpu > 1:
        for mask in range(1, 1 << n):
            members = [i for i in range(n) if mask >> i & 1]
            if 2 <= len(members) <= max_tasks_per_gpu:
                groups[mask] = _group_load([tasks[names[i]] for i in members])
    candidates = set(groups.values())
    for batch, cost in tasks.values():
        candidates.update(_dedicated_load(batch, cost, k) for k in range(1, min(batch, num_gpus) + 1))
    bounds = sorted(candidates)

    def feasible(bound: float):
        table = _min_gpus_for(bound, names, tasks, num_gpus, groups)
        fits = [(s, g, parts) for s, (g, parts) in table.items() if g <= num_gpus]
        return min(fits, key=lambda f: (f[0], f[1])) if fits else None

    lo, hi = 0, len(bounds) - 1  # the largest bound (every task alone on one GPU) fits when n <= G
    best = feasible(bounds[hi])
    if best is None:
        raise AllocationError(f"no allocation of {n} tasks on {num_gpus} GPUs found")  # unreachable after _check
    while lo < hi:  # feasibility is monotone in the bound
        mid = (lo + hi) // 2
        found = feasible(bounds[mid])
        if found is None:
            lo = mid + 1
        else:
            hi, best = mid, found
    _, _, parts = best
    return _build(names, tasks, parts, num_gpus, baseline_allocation(tasks, num_gpus, max_tasks_per_gpu))
