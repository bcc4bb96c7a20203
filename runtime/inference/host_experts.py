"""auto's streamed (hybrid) experts in the host tier on CUDA: pinned copies of the checkpoint's, so a copy to the
device runs on a side stream without the host waiting, and a streamed layer's one synchronisation, which brings
its row counts and its rows to the host together. Without a GPU the host is the device: nothing is copied."""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.inference.expert_source import ExpertSource, ExpertWeights
from runtime.inference.step_counts import host_list


class HostExperts:
    """Streamed experts where the CPU computes them and copies start from (pinned on CUDA), and the moves of rows
    and weights between host and device that a streamed layer makes."""

    def __init__(self, source: ExpertSource, layers: list[int], device: torch.device):
        self.source, self.device = source, device
        self.cuda = device.type == "cuda"
        self.pinned: dict[tuple[int, int], ExpertWeights] = {}
        if self.cuda:  # read once from the checkpoint's mapped files into page-locked memory
            for m in layers:
                for j in range(source.num_experts):
                    self.pinned[(m, j)] = {k: v.pin_memory() for k, v in source.expert(m, j).items()}
        self.stream: torch.cuda.Stream | None = torch.cuda.Stream(device) if self.cuda else None

    def expert(self, m: int, j: int) -> ExpertWeights:
        """Expert j of streamed layer m in host memory, as stored (pinned on CUDA, the mapped file's pages else)."""
        return self.pinned.get((m, j)) or self.source.expert(m, j)

    def rows_to_host(self, tokens_per_expert_e: Tensor, x_RD: Tensor) -> tuple[list[int], Tensor]:
        """(row counts per expert, the rows on the host): both copied together and waited for once, the layer's one
        synchronisation (on the CPU, one read of the counts)."""
        if not self.cuda:
            return host_list(tokens_per_expert_e), x_RD
        counts = torch.empty(tokens_per_expert_e.shape, dtype=tokens_per_expert_e.dtype, pin_memory=True)
        rows = torch.empty(x_RD.shape, dtype=x_RD.dtype, pin_memory=True)
        counts.copy_(tokens_per_expert_e, non_blocking=True)
        rows.copy_(x_RD, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()  # the profiler sees it (cudaEventSynchronize); the read below is of host memory
        return counts.tolist(), rows

    def rows_to_device(self, y_ND: Tensor, out_ND: Tensor) -> None:
        """Write rows the CPU computed into their place on the device without the host waiting (staged through
        pinned memory, which the caching host allocator keeps until the copy is done)."""
        if not self.cuda:
            out_ND.copy_(y_ND)
            return
        staged = torch.empty(y_ND.shape, dtype=y_ND.dtype, pin_memory=True)
        staged.copy_(y_ND)
        out_ND.copy_(staged, non_blocking=True)

    def fetch(self, weights: ExpertWeights, dtype: torch.dtype) -> tuple[ExpertWeights, object, object]:
        """(weights on the device, copy start, copy end): copied on the side stream; the compute stream waits for
        the copy on the device, the host does not."""
        if not self.cuda:
            return {k: v.to(self.device, dtype, copy=True) for k, v in weights.items()}, None, None
        assert self.stream is not None, "a CUDA device has a copy stream"
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # the rows and buffers the copy may reuse are ready
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record()
            placed = {k: v.to(self.device, dtype, non_blocking=True) for k, v in weights.items()}
            done.record()
        compute.wait_event(done)
        for t in placed.values():
            t.record_stream(compute)  # freed by the compute stream's use, not the copy stream's
        return placed, start, done
