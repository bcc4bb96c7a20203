"""Sizes of the token embedding under partitioning (the paper's "Embedding Partition in Data Parallelism"), without
torch: the planner uses them."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.config import MoesysConfig
from runtime.plan.budget import DENSE_STATE_BYTES


def check_divisible(hidden: int, n: int) -> None:
    """One-line error unless the N ranks can each hold hidden/N columns."""
    if n < 1 or hidden % n:
        raise ValueError(f"model.embedding_partition needs model.hidden_size={hidden} divisible by the "
                         f"{n} data-parallel ranks")


@dataclass(frozen=True)
class EmbeddingBytes:
    """Per-rank bytes of the token embedding's training state (weight, gradient, Adam moments)."""

    replicated: int
    partitioned: int

    @property
    def saving(self) -> int:
        return self.replicated - self.partitioned


def embedding_bytes_per_rank(cfg: MoesysConfig, dp_size: int) -> EmbeddingBytes:
    """Training-state bytes of the [V, H] token embedding on one rank, replicated vs partitioned over dp_size.

    `partitioned` equals `replicated` when model.embedding_partition is off. Counts DENSE_STATE_BYTES per element
    (as Eq. 1 does); the tied head's transient gathered table (see PartitionedTiedHead) is not persistent state.
    """
    m = cfg.model
    replicated = DENSE_STATE_BYTES * m.vocab_size * m.hidden_size
    if not m.embedding_partition:
        return EmbeddingBytes(replicated, replicated)
    check_divisible(m.hidden_size, dp_size)
    return EmbeddingBytes(replicated, replicated // dp_size)
