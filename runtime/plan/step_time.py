"""The time of a training step, bounded and predicted from the same terms: the device's compute (the resident step),
the PCIe bytes each way, the host optimizer over the offloaded active parameters and the disk's bytes (ZeRO-Offload's
and MegaTrain's calculators count the same). With GPUs the step costs at least the largest term; without them the
model and the host optimizer share the CPU cores, so those two add up. One formula for `moesys plan` and for the
benchmarks' `bound_s` fields.

Legend: T tokens a rank computes in an optimizer step, N parameters a token touches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from runtime.config import ModelConfig, MoesysConfig
from runtime.plan.budget import STORED_SPARSE_BYTES
from runtime.plan.params import count_parameters
from runtime.plan.step_memory import compute_bytes

GB = 1e9
TERMS = ("gpu", "pcie", "cpu_optimizer", "disk")
"""The bound's terms, in the order reports list them (`gpu`: the resident step's compute, on the CPU without GPUs)."""


def matmul_flops_per_token(m: ModelConfig) -> float:
    """Forward and backward FLOPs of one token through the weights it touches (6 per parameter, PaLM appendix B):
    the embedding lookup is not a matmul, the output head is."""
    p = count_parameters(m)
    return 6.0 * (p.active - p.embedding + m.vocab_size * m.hidden_size)


def training_flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Forward and backward FLOPs of one token: its matmuls and attention over `seq_len` positions."""
    return matmul_flops_per_token(m) + 12.0 * m.num_layers * m.hidden_size * seq_len


def recompute_flops_per_token(m: ModelConfig, seq_len: int, recompute: str) -> float:
    """FLOPs train.recompute adds to a token's step: a second forward of every block (block: a third of the matmul
    and attention FLOPs, less the output head's), or of the experts' FFNs (moe: 2 per expert parameter it reads)."""
    if recompute == "block":
        head = 6.0 * m.vocab_size * m.hidden_size
        return (training_flops_per_token(m, seq_len) - head) / 3
    if recompute == "moe":
        p = count_parameters(m)
        return 2.0 * m.top_k * p.per_expert * p.moe_layers
    return 0.0


@dataclass(frozen=True)
class Rates:
    """What one node moves and computes per second, and whether a GPU computes (else the CPU cores share it all)."""

    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    adamw_params_per_s_per_core: float
    cores: int
    disk_read_bytes_per_s: float
    disk_write_bytes_per_s: float
    gemm_flops: float
    """Dense GEMM FLOP/s of one GPU, or of the node's CPU cores together without GPUs."""
    resident_mfu: float
    gpus: bool
    sources: tuple[tuple[str, str], ...] = ()
    """(rate, where its value came from: key, profile or default), for the plan's assumptions."""


@dataclass(frozen=True)
class StepWork:
    """What one rank computes and moves in one optimizer step."""

    compute_s: float
    """The resident step's time (measured by a benchmark, or the FLOPs over the rate a plan assumes)."""
    h2d_bytes: float = 0.0
    d2h_bytes: float = 0.0
    optimizer_params: float = 0.0
    """Offloaded parameters the host optimizer steps (the active ones)."""
    host_cores: float = 1.0
    """Cores this rank's host optimizer runs on."""
    disk_read_bytes: float = 0.0
    disk_write_bytes: float = 0.0


@dataclass(frozen=True)
class StepBound:
    """The terms of a step (seconds each) and how they combine."""

    terms_s: dict[str, float]
    shared_cores: bool
    """No GPU: the compute and the host optimizer run on the same cores and add up."""

    @property
    def bound_s(self) -> float:
        t = self.terms_s
        if self.shared_cores:
            return max(t["gpu"] + t["cpu_optimizer"], t["pcie"], t["disk"])
        return max(t.values())

    @property
    def bound_term(self) -> str:
        """The term that bounds the step (the larger of compute and host work when they share the cores)."""
        return max(TERMS, key=lambda name: self.terms_s[name])

    def vs(self, measured_s: float) -> float:
        """bound / measured: 1 at the bound, lower the further a measured step is above it."""
        return self.bound_s / measured_s if measured_s > 0 else 0.0

    def to_dict(self, measured_s: float | None = None) -> dict:
        """The report fields: bound_s, bound_term, bound_terms_s and, for a measured step, vs_bound."""
        out = {"bound_s": self.bound_s, "bound_term": self.bound_term, "bound_terms_s": dict(self.terms_s)}
        if measured_s is not None:
            out["vs_bound"] = self.vs(measured_s)
        return out


def step_bound(work: StepWork, rates: Rates) -> StepBound:
    """The bound of a step doing `work` on a machine with `rates`. Without GPUs nothing crosses a bus: the device's
    copies are host memory (pcie 0)."""
    adamw = rates.adamw_params_per_s_per_core * max(work.host_cores, 1e-9)
    terms = {"gpu": work.compute_s,
             "pcie": (max(work.h2d_bytes / rates.h2d_bytes_per_s, work.d2h_bytes / rates.d2h_bytes_per_s)
                      if rates.gpus else 0.0),
             "cpu_optimizer": work.optimizer_params / adamw if work.optimizer_params else 0.0,
             "disk": (work.disk_read_bytes / rates.disk_read_bytes_per_s
                      + work.disk_write_bytes / rates.disk_write_bytes_per_s)}
    return StepBound(terms, shared_cores=not rates.gpus)


def tokens_per_rank(cfg: MoesysConfig, micro_batch_size: int | None = None, accum: int | None = None) -> int:
    """T: tokens one rank computes in an optimizer step (micro-batch x accumulation x sequence)."""
    tr = cfg.train
    return (micro_batch_size or tr.micro_batch_size) * (accum or max(1, tr.grad_accum_steps)) * tr.seq_len


def rank_gemm_flops(cfg: MoesysConfig, gemm_flops: float, gpus: bool) -> float:
    """One rank's share of the GEMM rate: its GPU's, or without GPUs the node's cores divided among its ranks."""
    return gemm_flops if gpus else gemm_flops / max(1, cfg.topology.processes_per_node)


def step_flops(cfg: MoesysConfig, tokens: int) -> float:
    """FLOPs of one rank's step over `tokens`, train.recompute's second forward included."""
    m, tr = cfg.model, cfg.train
    return (training_flops_per_token(m, tr.seq_len) + recompute_flops_per_token(m, tr.seq_len, tr.recompute)) * tokens


def compute_seconds(cfg: MoesysConfig, rates: Rates, tokens: int) -> float:
    """The resident step's time for `tokens` on one rank: its FLOPs over the rank's share of the GEMM rate at the
    resident MFU (which, measured by `moesys plan --measure`, holds the job's collectives and shared cores)."""
    return step_flops(cfg, tokens) / (rank_gemm_flops(cfg, rates.gemm_flops, rates.gpus) * rates.resident_mfu)


def resident_mfu_of(cfg: MoesysConfig, gemm_flops: float, gpus: bool, step_s: float) -> float:
    """The resident MFU for which compute_seconds gives `step_s`, the measured step of `cfg`'s job (compute_seconds'
    inverse: a plan of the measured config predicts the measured step)."""
    return step_flops(cfg, tokens_per_rank(cfg)) / step_s / rank_gemm_flops(cfg, gemm_flops, gpus)


def offloaded_step_work(cfg: MoesysConfig, rates: Rates, offloaded_experts: int, cache_experts: int | None,
                        window: int, offloaded_layers: int, tokens: int) -> StepWork:
    """A rank's step with `offloaded_experts` local experts off the device (storage.alpha of them active): their
    weights cross once a micro-batch (twice when the device's window cannot keep a layer from its forward to its
    backward), their gradients once a step, the host optimizer steps them, and with an SSD cache of `cache_experts`
    the ones it misses are read and written back (12 bytes a parameter each way)."""
    per_expert = count_parameters(cfg.model).per_expert
    active = math.ceil(cfg.storage.alpha * offloaded_experts)
    params = float(active * per_expert)
    width = compute_bytes(cfg)
    crossings = max(1, cfg.train.grad_accum_steps) * (2 if 0 < window < offloaded_layers else 1)
    missed = 0 if cache_experts is None else max(0, active - cache_experts)
    disk = float(missed * per_expert * STORED_SPARSE_BYTES)
    return StepWork(compute_s=compute_seconds(cfg, rates, tokens), h2d_bytes=params * width * crossings,
                    d2h_bytes=params * width, optimizer_params=params,
                    host_cores=rates.cores / max(1, cfg.topology.processes_per_node),
                    disk_read_bytes=disk, disk_write_bytes=disk)
