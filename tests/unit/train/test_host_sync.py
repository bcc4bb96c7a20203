"""On one process with train.log_every=10 the steps between two metrics lines read nothing back to the host: the loss,
the router metrics and the gradient norm stay on the device until a line is written. Two witnesses of the real
training loop: torch's profiler (no operator that hands a tensor's value to the host runs inside such a step's
marker) and a TorchFunctionMode (no Python-level read: tolist, item, bool, int, float, numpy, cpu)."""

from __future__ import annotations

import collections

import torch
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile

from moesys_cli.resolve import resolve_config
from runtime.files.run_dir import read_metrics
from runtime.parallel.groups import build_groups
from runtime.train.loop import train

STEPS, LOG_EVERY = 20, 10
HOST_READ_OPS = {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::nonzero", "aten::equal",
                 "aten::allclose", "aten::unique", "aten::_unique2", "aten::masked_select", "aten::bincount"}
"""Operators whose result is a value on the host, or whose output size depends on the data (a GPU syncs for it)."""
HOST_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
              torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.cpu}


class ReadsPerStep(TorchFunctionMode):
    """Counts host reads by the number of backwards run before them: reads counted under k happened after step k's
    backward and before step k+1's (the next step's forward, or step k's end)."""

    def __init__(self) -> None:
        super().__init__()
        self.backwards = 0
        self.reads: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.backward:
            self.backwards += 1
        elif func in HOST_READS:
            self.reads[self.backwards] += 1
        return func(*args, **(kwargs or {}))


def test_steps_between_metrics_lines_read_nothing_on_the_host(tmp_path):
    cfg = resolve_config(["recipe=tiny", "topology.nproc_per_node=1", "topology.expert_parallel=1",
                          f"train.log_every={LOG_EVERY}", f"train.max_steps={STEPS}", "train.checkpoint_every=0",
                          "train.final_checkpoint=false", "train.seq_len=32", "train.micro_batch_size=2",
                          f"train.run_dir={tmp_path}"])
    mode = ReadsPerStep()
    with profile(activities=[ProfilerActivity.CPU]) as prof, mode:
        train(cfg, tmp_path, build_groups(1, 0, 1, 1), torch.device("cpu"))
    lines = read_metrics(tmp_path)
    assert [m["step"] for m in lines] == [10, 20]  # each line averages its ten steps
    assert all(0 < m["loss"] < 10 and len(m["expert_load"]) == cfg.model.num_moe_layers for m in lines)
    assert mode.backwards == STEPS
    quiet = [k for k in range(1, STEPS) if k % LOG_EVERY]
    assert {k: mode.reads[k] for k in quiet if mode.reads[k]} == {}
    assert mode.reads[LOG_EVERY] > 0  # the line reads what ten steps kept on the device
    events = prof.events()
    markers = {int(e.name.rsplit(" ", 1)[1]): e for e in events if e.name.startswith("moesys.step ")}
    assert sorted(markers) == list(range(1, STEPS + 1))
    for step in quiet:
        assert reads_in(events, markers[step]) == [], f"step {step} read on the host"
    for step in (LOG_EVERY, STEPS):  # the witness sees the reads where they are
        assert reads_in(events, markers[step])


def reads_in(events, marker) -> list[str]:
    """The host-read operators the code called inside a step's marker: not those a CPU kernel runs inside itself (a
    CPU grouped GEMM or AdamW reads its own offsets and step counts where a GPU's kernels read them on the
    device)."""
    span = marker.time_range
    return [e.name for e in events if e.thread == marker.thread and span.start <= e.time_range.start < span.end
            and e.name in HOST_READ_OPS and not (e.cpu_parent and e.cpu_parent.name.startswith("aten::"))]
