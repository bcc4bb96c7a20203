"""`--offload auto`: a placement per MoE layer chosen from the budget of K layer-sized device slots, and experts
fetched only when the routing selects them.

Layers 0..K-1 keep their experts resident on the device. Every other layer is *streamed*: a forward computes only
the experts its tokens were routed to, reading their weights from the checkpoint's memory map.
- Without a GPU the host tier and the device are the same RAM, so a streamed expert is read where it lies, the
  mapped file, whose page cache holds what is hot (policy `inplace`): a prompt computes on the mapped pages; a
  decode token computes its routed experts there too, with the arithmetic of a resident layer's decode, so every
  mode gives the same tokens.
- On CUDA a streamed layer keeps one slot as a cache of fetched experts (so K-1 layers are resident) and each
  routed expert missing from it is either computed on the CPU from pinned host memory, with only its rows crossing
  the bus (as llama.cpp's --n-cpu-moe and Fiddler do), or copied to the device on a side stream, whichever a cost
  model measured on this machine at start says is faster for the rows at hand (policy `hybrid`): decode's few
  rows go to the CPU, prefill's many rows fetch the weights. The layer synchronises once (host_experts.py).
The ring's whole-layer copies (the paper's ring memory) remain `--offload ring`; with K = N every mode is resident.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.inference.expert_source import ExpertSource, ExpertWeights
from runtime.inference.host_experts import HostExperts
from runtime.inference.offload import Offloader
from runtime.inference.step_counts import host_list
from runtime.model.transformer import Transformer
from runtime.moe.dispatch import LocalDispatcher
from runtime.moe.experts import ffn_one
from runtime.moe.routed import combine_choices, listed_ffn, row_ffn

RESIDENT, INPLACE, HYBRID = "resident", "inplace", "hybrid"


def _cast(weights: ExpertWeights, dtype: torch.dtype) -> ExpertWeights:
    """The weights in `dtype` (no operator for those already in it: a decode token counts them)."""
    return {k: v if v.dtype == dtype else v.to(dtype) for k, v in weights.items()}


@dataclass(frozen=True)
class ExpertCosts:
    """Seconds to run one expert on the CPU (intercept + per row) and to copy one expert to the device."""

    cpu_s: float
    cpu_s_per_row: float
    fetch_s: float

    def cpu_is_faster(self, rows: int) -> bool:
        return self.cpu_s + self.cpu_s_per_row * max(0, rows - 1) < self.fetch_s


def _median_s(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_costs(weights: ExpertWeights, kind: str, device: torch.device, dtype: torch.dtype) -> ExpertCosts:
    """Time one expert on this machine: on the CPU at 1 and 32 rows, and its copy to `device` (warm pages)."""
    hidden = weights["w1"].shape[1]
    cpu = _cast(weights, dtype)
    x1, x32 = torch.randn(1, hidden, dtype=dtype), torch.randn(32, hidden, dtype=dtype)
    ffn_one(x32, **cpu, kind=kind)  # warm-up: pages in, kernels chosen
    one = _median_s(lambda: ffn_one(x1, **cpu, kind=kind))
    many = _median_s(lambda: ffn_one(x32, **cpu, kind=kind))

    def fetch() -> None:
        {k: v.to(device, dtype, copy=True) for k, v in weights.items()}
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fetch()
    return ExpertCosts(one, max(0.0, many - one) / 31, _median_s(fetch))


class StreamedExperts(nn.Module):
    """Stands in for a streamed layer's GroupedExperts: its offloader computes the routed experts."""

    def __init__(self, offloader: AutoOffloader, index: int):
        super().__init__()
        self.offloader, self.index = offloader, index

    def forward(self, x_RD: Tensor, tokens_per_expert_e: Tensor) -> Tensor:
        return self.offloader.compute(self.index, x_RD, tokens_per_expert_e)

    @torch.compiler.disable  # reads which experts were routed on the host: runs outside a compiled decode step
    def routed(self, x_TD: Tensor, expert_ids_TK: Tensor, weights_TK: Tensor) -> Tensor:
        """RoutedExperts: `AutoOffloader.routed`, one host read this layer."""
        return self.offloader.routed(self.index, x_TD, expert_ids_TK, weights_TK)


class AutoOffloader(Offloader):
    """Layers 0..K-1 resident (K-1 on CUDA, whose last slot caches fetched experts); the rest streamed."""

    mode = "auto"
    source: ExpertSource

    def __init__(self, model: Transformer, device: torch.device, source: ExpertSource, num_slots: int,
                 streamed_policy: str | None = None, costs: ExpertCosts | None = None,
                 predict_ahead: bool = False):
        """streamed_policy and costs default to this machine's (inplace without a GPU; hybrid with measured costs
        on CUDA); tests set them to run the hybrid path on the CPU."""
        super().__init__(model, device, source)
        self.num_slots = self.budget_slots = num_slots
        streamed_policy = streamed_policy or (HYBRID if device.type == "cuda" else INPLACE)
        resident = self.num_layers if num_slots >= self.num_layers else (
            num_slots - 1 if streamed_policy == HYBRID else num_slots)
        self.placement = [RESIDENT if m < resident else streamed_policy for m in range(self.num_layers)]
        self.kind = source.expert_type
        self.resident_bytes = 0
        for m, layer in enumerate(model.moe_layers()):
            if self.placement[m] == RESIDENT:
                source.place_resident(layer.experts, m, device)
                self.resident_bytes += source.layer_bytes(m)  # in the dtype placed, not the stored one
            else:
                layer.experts = StreamedExperts(self, m)
                source.random_access(m)  # read expert by expert: no readahead into unrouted neighbours
        self.dispatcher = LocalDispatcher(source.num_experts)
        self.cache: dict[tuple[int, int], ExpertWeights] = {}
        self.uses: Counter[tuple[int, int]] = Counter()
        self.cache_capacity = source.num_experts if HYBRID in self.placement else 0
        """Fetched experts kept on the device: one layer's worth (the slot the resident layers left free)."""
        streamed = [m for m, policy in enumerate(self.placement) if policy == HYBRID]
        self.host = HostExperts(source, streamed, device)
        self.cpu_threads = torch.get_num_threads()
        """Threads the CPU computes streamed experts with (the process's intra-op pool, set by the caller)."""
        if costs is None and streamed:  # timed here, not inside the first (timed) forward
            dtype = model.tok_embeddings.weight.dtype
            costs = measure_costs(self.host.expert(streamed[0], 0), self.kind, device, source.dtype or dtype)
        self.costs = costs
        self.predict_ahead = predict_ahead
        """Prefetch a streamed (inplace) layer's guessed experts while the streamed layer before it computes (CPU;
        off by default, see infer.prefetch). The guess is made in a streamed layer's compute, so the first streamed
        layer after the resident ones is never prefetched."""
        moe = model.moe_layers()
        self.gates = [layer.router.gate.weight for layer in moe]
        self.top_k = moe[0].router.top_k if moe else 1
        self.predicted: dict[int, set[int]] = {}
        self.reset_stats()

    # ---- compute ----

    def compute(self, m: int, x_RD: Tensor, tokens_per_expert_e: Tensor) -> Tensor:
        """Rows grouped by expert -> outputs in the same order; only experts with rows are read. The layer's one
        synchronisation brings its row counts (and, on CUDA, its rows, for the experts the CPU computes) to the
        host; nothing after it waits for the device."""
        counts, x_host_RD = self.host.rows_to_host(tokens_per_expert_e, x_RD)
        routed = [j for j, n in enumerate(counts) if n]
        self._score_prediction(m, routed)
        self.source.will_need(m, [j for j in routed if (m, j) not in self.cache])
        if self.predict_ahead and m + 1 < self.num_layers and self.placement[m + 1] == INPLACE:
            self._prefetch_predicted(m + 1, x_RD)
        y_RD = torch.empty_like(x_RD)
        start = 0
        for j, n in enumerate(counts):
            if n:
                self._expert(m, j, x_RD[start:start + n], x_host_RD[start:start + n], y_RD[start:start + n])
                start += n
        return y_RD

    def routed(self, m: int, x_TD: Tensor, expert_ids_TK: Tensor, weights_TK: Tensor) -> Tensor:
        """A decode step's few tokens. inplace: each (token, choice) computed on its expert's weights where the
        mapped files hold them (`row_ffn`, or for one token `listed_ffn`, its K experts in one kernel call per
        projection: the arithmetic of a resident layer's decode, so that every mode gives the same tokens). hybrid:
        rows grouped by expert, as prefill groups them, then `compute`. Either reads the host once: the routed ids,
        or the row counts."""
        if self.placement[m] != INPLACE:
            x_RD, tokens_per_expert_E, meta = self.dispatcher.permute(
                x_TD.reshape(-1, x_TD.shape[-1]), expert_ids_TK.reshape(-1, expert_ids_TK.shape[-1]),
                weights_TK.reshape(-1, weights_TK.shape[-1]))
            return self.dispatcher.unpermute(self.compute(m, x_RD, tokens_per_expert_E), meta).view(x_TD.shape)
        chosen = host_list(expert_ids_TK.reshape(-1))
        routed = sorted(set(chosen))
        self._score_prediction(m, routed)
        self.source.will_need(m, routed)
        if self.predict_ahead and m + 1 < self.num_layers and self.placement[m + 1] == INPLACE:
            self._prefetch_predicted(m + 1, x_TD.reshape(-1, x_TD.shape[-1]))
        self.streamed_bytes += len(routed) * self.source.expert_bytes(m, stored=True)  # a layer's experts: one size
        self.inplace_computes += len(routed)
        x_ND = x_TD.reshape(-1, x_TD.shape[-1])
        K = expert_ids_TK.shape[-1]
        experts = [_cast(self.source.expert(m, j), x_TD.dtype) for j in chosen]
        y_RD = listed_ffn(x_ND, experts, self.kind) if x_ND.shape[0] == 1 else None
        if y_RD is None:
            y_RD = torch.cat([row_ffn(x_ND[i // K:i // K + 1], **e, kind=self.kind) for i, e in enumerate(experts)])
        return combine_choices(y_RD.view(*expert_ids_TK.shape, -1), weights_TK)

    def _prefetch_predicted(self, m: int, x_RD: Tensor) -> None:
        """Guess layer m's experts by applying its gate to the previous layer's expert inputs (the residual stream
        changes little between layers) and start reading them while this layer computes."""
        gate_ED = self.gates[m]
        top_k = min(self.top_k, gate_ED.shape[0])
        guess = host_list(F.linear(x_RD.to(gate_ED.dtype), gate_ED).topk(top_k, dim=-1).indices.unique())
        self.predicted[m] = set(guess)
        self.source.will_need(m, guess)

    def _score_prediction(self, m: int, routed: list[int]) -> None:
        guess = self.predicted.pop(m, None)
        if guess is not None:
            self.predicted_hits += len(guess.intersection(routed))
            self.predicted_needed += len(routed)
            self.predicted_wasted += len(guess.difference(routed))

    def _expert(self, m: int, j: int, x_ND: Tensor, x_host_ND: Tensor, y_ND: Tensor) -> None:
        """Expert j of layer m on its rows x_ND (x_host_ND: the same rows on the host), written into y_ND."""
        if self.placement[m] == INPLACE:
            self.streamed_bytes += self.source.expert_bytes(m, j, stored=True)  # read from the files as stored
            self.inplace_computes += 1
            y_ND.copy_(ffn_one(x_ND, **_cast(self.source.expert(m, j), x_ND.dtype), kind=self.kind))
            return
        self.uses[(m, j)] += 1
        cached = self.cache.get((m, j))
        if cached is not None:
            self.cache_hits += 1
            y_ND.copy_(ffn_one(x_ND, **cached, kind=self.kind))
            return
        self.streamed_bytes += self.source.expert_bytes(m, j, stored=True)
        assert self.costs is not None, "costs are measured or given whenever a layer is hybrid"
        if self.costs.cpu_is_faster(x_ND.shape[0]):
            self.cpu_computes += 1
            weights = _cast(self.host.expert(m, j), x_host_ND.dtype)
            self.host.rows_to_device(ffn_one(x_host_ND, **weights, kind=self.kind), y_ND)
            return
        y_ND.copy_(ffn_one(x_ND, **self._fetch(m, j, x_ND.dtype), kind=self.kind))

    def _fetch(self, m: int, j: int, dtype: torch.dtype) -> ExpertWeights:
        """Copy expert j of layer m to the device (on CUDA from pinned memory on a side stream, which compute waits
        for on the device); cache it if it is used more often than the least used cached expert. Streamed layers
        are visited in a cycle, which LRU would turn into a miss on every visit once they hold more experts than
        the cache; counting uses keeps the popular ones."""
        before = self.timeline.mark()
        weights, start, end = self.host.fetch(self.host.expert(m, j), dtype)
        if start is None:  # the copy ran on this stream: compute stood still for it
            start, end = before, self.timeline.mark()
        self.timeline.add("copy", start, end)
        self.timeline.add("wait", before, end, critical=True)
        self.copied_bytes += sum(w.numel() * w.element_size() for w in weights.values())  # as placed
        self.copies += 1
        if len(self.cache) >= self.cache_capacity:
            coldest = min(self.cache, key=self.uses.__getitem__, default=None)
            if coldest is None or self.uses[coldest] >= self.uses[(m, j)]:
                return weights
            del self.cache[coldest]
        self.cache[(m, j)] = weights
        return weights

    # ---- accounting ----

    @property
    def expert_device_bytes(self) -> int:
        cache = self.cache_capacity * self.source.expert_bytes(0) if self.cache_capacity else 0
        return self.resident_bytes + cache

    @property
    def expert_host_bytes(self) -> int:
        """The streamed layers as stored: N-K of them without a GPU, N-K+1 on CUDA, whose K-th slot caches fetched
        experts instead of holding a layer."""
        return sum(self.source.layer_bytes(m, stored=True) for m, p in enumerate(self.placement) if p != RESIDENT)

    def reset_stats(self) -> None:
        super().reset_stats()
        self.streamed_bytes = self.inplace_computes = self.cpu_computes = self.cache_hits = 0
        self.predicted_hits = self.predicted_needed = self.predicted_wasted = 0

    def mode_fields(self, stats: dict[str, Any]) -> dict[str, Any]:
        return {"experts_computed": {k: stats[k] for k in ("inplace_computes", "cpu_computes", "fetched_experts",
                                                           "cache_hits")},
                "expert_costs": stats["costs"], "cpu_threads": stats["cpu_threads"], "prefetch": stats["prefetch"]}

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out.update({"store_bytes": self.streamed_bytes,
                    "inplace_computes": self.inplace_computes, "cpu_computes": self.cpu_computes,
                    "fetched_experts": self.copies, "cache_hits": self.cache_hits,
                    "prefetch": {"predicted_right": self.predicted_hits, "routed": self.predicted_needed,
                                 "predicted_wrong": self.predicted_wasted},
                    "costs": None if self.costs is None else vars(self.costs), "cpu_threads": self.cpu_threads})
        return out
