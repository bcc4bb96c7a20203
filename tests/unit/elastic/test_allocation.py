"""Elastic allocation: seed Table 3, packing light tasks, optimality against brute force, errors."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.elastic.allocation import AllocationError, allocate, baseline_allocation

TABLE3 = {"task1": (512, 1.0), "task2": (256, 1.0), "task3": (128, 1.0), "task4": (128, 1.0)}


def test_table3_after_scales_heavy_tasks_up():
    alloc = allocate(TABLE3, num_gpus=8)
    assert alloc.gpus == {"task1": 4, "task2": 2, "task3": 1, "task4": 1}
    assert alloc.assignment == {"task1": [0, 1, 2, 3], "task2": [4, 5], "task3": [6], "task4": [7]}
    assert alloc.load_per_gpu == [128.0] * 8 and alloc.max_load_per_gpu == 128.0
    assert alloc.batch_per_gpu["task1"] == [128] * 4 and alloc.shared_gpus == []
    assert alloc.efficiency == 1.0
    # the naive even split of 8 GPUs over 4 tasks leaves the slowest GPU at 256
    assert alloc.baseline.gpus == {"task1": 2, "task2": 2, "task3": 2, "task4": 2}
    assert alloc.baseline.max_load_per_gpu == 256.0 and alloc.speedup_per_gpu == 2.0


def test_table3_before_is_one_gpu_per_task():
    alloc = allocate(TABLE3, num_gpus=4)
    assert alloc.gpus == {"task1": 1, "task2": 1, "task3": 1, "task4": 1}
    assert alloc.load_per_gpu == [512.0, 256.0, 128.0, 128.0] and alloc.max_load_per_gpu == 512.0
    after = allocate(TABLE3, num_gpus=8)
    # throughput per GPU: before 1024 / (4 x 512) = 0.5 of ideal, after 1024 / (8 x 128) = 1.0
    assert (alloc.efficiency, after.efficiency) == (0.5, 1.0)


def test_spare_gpus_stay_idle_when_they_cannot_lower_the_slowest_gpu():
    alloc = allocate(TABLE3, num_gpus=9)
    assert alloc.max_load_per_gpu == 128.0 and alloc.gpus_used == 8 and alloc.load_per_gpu[8] == 0.0


def test_six_tiny_tasks_pack_on_four_gpus():
    tasks = {f"t{i}": (4, 1.0) for i in range(6)}
    alloc = allocate(tasks, num_gpus=4, max_tasks_per_gpu=2)
    assert alloc.max_load_per_gpu == 8.0
    assert len(alloc.shared_gpus) == 2  # as few shared GPUs as the bound allows
    assert sorted(alloc.load_per_gpu) == [4.0, 4.0, 8.0, 8.0]
    assert all(n == 1 for n in alloc.gpus.values())
    with pytest.raises(AllocationError, match="6 tasks do not fit on 4 GPUs"):
        allocate(tasks, num_gpus=4, max_tasks_per_gpu=1)


def test_packing_frees_gpus_for_a_heavy_task():
    tasks = {"big": (600, 1.0), "a": (10, 1.0), "b": (10, 1.0), "c": (10, 1.0), "d": (10, 1.0)}
    packed = allocate(tasks, num_gpus=8, max_tasks_per_gpu=4)
    alone = allocate(tasks, num_gpus=8, max_tasks_per_gpu=1)
    assert packed.gpus["big"] == 7 and packed.max_load_per_gpu == 86.0  # ceil(600 / 7)
    assert alone.gpus["big"] == 4 and alone.max_load_per_gpu == 150.0
    assert packed.batch_per_gpu["big"] == [86, 86, 86, 86, 86, 85, 85]


def test_uneven_costs_and_determinism():
    tasks = {"video": (96, 2.0), "text": (256, 0.5), "image": (128, 1.0)}
    first = allocate(tasks, num_gpus=7)
    assert first == allocate(tasks, num_gpus=7)
    assert first.gpus == {"video": 3, "text": 2, "image": 2}  # loads 192 / 128 / 128 -> 64 each
    assert first.max_load_per_gpu == 64.0
    six = allocate(tasks, num_gpus=6)  # one GPU fewer: video carries 96 per GPU
    assert six.gpus == {"video": 2, "text": 2, "image": 2} and six.max_load_per_gpu == 96.0


def _brute_force(tasks, num_gpus, max_tasks_per_gpu):
    """Min (max load, shared GPUs, GPUs used) over every partition of tasks and every GPU count."""
    items = list(tasks.values())
    best = None

    def partitions(rest):
        if not rest:
            yield []
            return
        first, others = rest[0], rest[1:]
        for p in partitions(others):
            yield [[first]] + p
            for i in range(len(p)):
                yield p[:i] + [[first] + p[i]] + p[i + 1:]

    def counts(blocks, used):
        if not blocks:
            yield []
            return
        block, rest = blocks[0], blocks[1:]
        if len(block) > 1:
            options = [1] if len(block) <= max_tasks_per_gpu else []
        else:
            options = range(1, min(items[block[0]][0], num_gpus - used) + 1)
        for k in options:
            if used + k <= num_gpus:
                for tail in counts(rest, used + k):
                    yield [k] + tail

    for blocks in partitions(list(range(len(items)))):
        blocks = [sorted(b) for b in blocks]
        for ks in counts(blocks, 0):
            loads = []
            for block, k in zip(blocks, ks):
                if len(block) > 1:
                    loads.append(sum(items[i][0] * items[i][1] for i in block))
                else:
                    b, c = items[block[0]]
                    loads.append(-(-b // k) * c)
            key = (max(loads), sum(len(b) > 1 for b in blocks), sum(ks))
            best = key if best is None or key < best else best
    return best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0])), min_size=1, max_size=5),
       st.integers(1, 6), st.integers(1, 3))
def test_matches_brute_force(workloads, num_gpus, max_tasks_per_gpu):
    tasks = {f"t{i}": w for i, w in enumerate(workloads)}
    if len(tasks) > num_gpus * max_tasks_per_gpu:
        with pytest.raises(AllocationError):
            allocate(tasks, num_gpus, max_tasks_per_gpu)
        return
    alloc = allocate(tasks, num_gpus, max_tasks_per_gpu)
    assert (alloc.max_load_per_gpu, len(alloc.shared_gpus), alloc.gpus_used) == \
        _brute_force(tasks, num_gpus, max_tasks_per_gpu)
    # the allocation is what it claims: whole batches placed, loads add up, memory limit kept
    loads = [0.0] * num_gpus
    per_gpu_tasks = [0] * num_gpus
    for name, (batch, cost) in tasks.items():
        ids, shares = alloc.assignment[name], alloc.batch_per_gpu[name]
        assert len(ids) == len(shares) >= 1 and sum(shares) == batch and max(shares) - min(shares) <= 1
        for g, s in zip(ids, shares):
            loads[g] += s * cost
            per_gpu_tasks[g] += 1
    assert loads == pytest.approx(alloc.load_per_gpu)
    assert max(per_gpu_tasks) <= max_tasks_per_gpu
    assert all(len(alloc.assignment[n]) == 1 for n in tasks if set(alloc.assignment[n]) & set(alloc.shared_gpus))
    assert alloc.max_load_per_gpu <= alloc.baseline.max_load_per_gpu


def test_eight_tasks_on_sixty_four_gpus_is_fast_and_balanced():
    tasks = {f"t{i}": (16 * (i + 1) ** 2, 1.0 + i / 4) for i in range(8)}
    alloc = allocate(tasks, num_gpus=64, max_tasks_per_gpu=4)
    assert alloc.gpus_used <= 64
    assert alloc.max_load_per_gpu < baseline_allocation(tasks, 64).max_load_per_gpu / 2


@pytest.mark.parametrize("tasks,num_gpus,message", [
    ({"a": (0, 1.0)}, 2, "tasks.a.batch_size"),
    ({"a": (-3, 1.0)}, 2, "tasks.a.batch_size"),
    ({"a": (4, 0.0)}, 2, "tasks.a.cost_per_sample"),
    ({"a": (4, -1.0)}, 2, "tasks.a.cost_per_sample"),
    ({"a": (4, 1.0)}, 0, "at least one GPU"),
    ({}, 2, "no tasks"),
    ({"a": (4, 1.0), "b": (4, 1.0), "c": (4, 1.0)}, 2, "3 tasks do not fit on 2 GPUs"),
])
def test_errors_are_typed_one_line(tasks, num_gpus, message):
    with pytest.raises(AllocationError, match=message) as err:
        allocate(tasks, num_gpus)
    assert "\n" not in str(err.value) and isinstance(err.value, ValueError)
