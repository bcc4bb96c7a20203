"""What a decode token costs the host, counted with torch.profiler over decode steps: host synchronisations (reads
of device values on the host) and operators per layer (the launches a GPU would pay for).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.profiler import ProfilerActivity, profile, record_function

HOST_READ = "moesys::host_read"
"""The profiler mark of a host read moesys makes on purpose (`host_list`): on the CPU `.tolist()` dispatches no
operator the profiler would see, so each such read is marked."""
SYNC_EVENTS = frozenset({"aten::_local_scalar_dense", "aten::nonzero", "aten::bincount", HOST_READ,
                         "cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize"})
"""Events that make the host wait for device values: .item() and bool() end in _local_scalar_dense; nonzero and
bincount size their outputs from the data; CUDA's synchronisations; moesys's marked reads. One inside another (the
CUDA wait of an .item()) is the same synchronisation and counts once."""
DEVICE_OFFSETS_OPS = frozenset({"aten::_grouped_mm"})
"""Operators whose CPU kernel reads its offsets with .item() (on the CPU the host is the device) while the CUDA
kernel reads them on the GPU: their reads are counted apart (`kernel_reads_per_token`), not as the step's syncs."""
VIEW_OPS = frozenset(f"aten::{name}" for name in (
    "view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "select", "slice", "split", "split_with_sizes",
    "chunk", "unbind", "transpose", "t", "permute", "expand", "as_strided", "alias", "detach", "unflatten",
    "flatten", "view_as", "expand_as", "narrow"))
"""Operators that only make a view (no kernel on any device, no bytes moved); `reshape` and `flatten` that copy
count, as the copy is their child."""


def host_list(t: Tensor) -> list:
    """t.tolist(), marked for the profiler as a host read (a synchronisation on a GPU) while it records (the mark is
    an operator call of its own, which a streamed layer would otherwise pay every token)."""
    if not torch._C._autograd._profiler_enabled():
        return t.tolist()
    with record_function(HOST_READ):
        return t.tolist()


@dataclass(frozen=True)
class StepCounts:
    """Per decode token: host synchronisations, and operators per layer."""

    host_syncs_per_token: float
    ops_per_layer_token: float
    kernel_reads_per_token: float = 0.0
    """Reads of offsets inside CPU grouped GEMMs (DEVICE_OFFSETS_OPS): none on a GPU."""


def _is_view(event) -> bool:
    """A view operator whose children (if any) are views too (a reshape that copies is not)."""
    if event.name not in VIEW_OPS:
        return False
    return all(_is_view(child) for child in event.cpu_children if child.name.startswith("aten::"))


def _inside(event, names: frozenset) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in names:
            return True
        parent = parent.cpu_parent
    return False


def _counts(run: Callable[[], object], cuda: bool) -> tuple[Counter, int]:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        run()
    syncs: Counter = Counter()
    ops = 0
    for event in prof.events():
        if event.name in SYNC_EVENTS and not _inside(event, SYNC_EVENTS):
            syncs["kernel" if _inside(event, DEVICE_OFFSETS_OPS) else event.name] += 1
        parent = event.cpu_parent
        top = parent is None or not parent.name.startswith("aten::")
        if top and event.name.startswith("aten::") and not _is_view(event):
            ops += 1
    return syncs, ops


def count_decode(generate_n: Callable[[int], object], num_layers: int, tokens: int = 8,
                 cuda: bool = False) -> StepCounts:
    """Run generate_n(n) (n new tokens each: a prefill and n - 1 decode steps) for 2 and for 2 + tokens new tokens
    under the profiler; the difference is `tokens` decode steps and nothing else. Operators are the top-level aten
    operators (those the step issues; a composite's internals are its own), views left out."""
    generate_n(2)  # warm-up: first-call allocations and lazy initialisation are not a token's
    syncs_a, ops_a = _counts(lambda: generate_n(2), cuda)
    syncs_b, ops_b = _counts(lambda: generate_n(2 + tokens), cuda)
    delta = syncs_b - syncs_a
    kernel = delta.pop("kernel", 0)
    return StepCounts(host_syncs_per_token=sum(delta.values()) / tokens,
                      ops_per_layer_token=(ops_b - ops_a) / tokens / num_layers, kernel_reads_per_token=kernel / tokens)
