"""Single-process tests of runtime/parallel/embedding_partition.py: sharding helpers, N=1 equivalence, plan bytes.

The multi-rank AlltoAll paths are tested with torchrun in tests/distributed/test_embedding_partition_gloo.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runtime.config import ModelConfig, MoesysConfig
from runtime.model.transformer import Transformer
from runtime.parallel.embedding_partition import (
    PartitionedEmbedding, PartitionedTiedHead, full_table_from_shards, gather_columns, partition_embedding,
    partitioned_grad_sq, partitioned_parameters, shard_of)
from runtime.plan.embedding_bytes import check_divisible, embedding_bytes_per_rank
from runtime.plan.budget import DENSE_STATE_BYTES


def _table(v: int = 11, h: int = 12) -> torch.Tensor:
    return torch.randn(v, h, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6])
def test_shards_rebuild_the_table(n):
    full = _table()
    shards = [shard_of(full, r, n) for r in range(n)]
    assert all(s.shape == (11, 12 // n) and s.is_contiguous() for s in shards)
    assert torch.equal(full_table_from_shards(shards), full)
    # Column c lives on rank c // (H/n) at local column c % (H/n).
    c = 7
    assert torch.equal(shards[c // (12 // n)][:, c % (12 // n)], full[:, c])


@pytest.mark.parametrize("src,dst", [(2, 4), (4, 2), (3, 2), (1, 6)])
def test_a_table_written_by_one_rank_count_loads_into_another(src, dst):
    """A checkpoint holds the whole table gathered from `src` ranks; `dst` ranks each keep their columns of it."""
    full = _table()
    saved = full_table_from_shards([shard_of(full, r, src) for r in range(src)])
    assert all(torch.equal(shard_of(saved, r, dst), full[:, r * 12 // dst:(r + 1) * 12 // dst]) for r in range(dst))


def test_hidden_not_divisible_is_one_line_error():
    with pytest.raises(ValueError, match=r"model.hidden_size=12 divisible by the 5 data-parallel ranks") as err:
        check_divisible(12, 5)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="divisible"):
        shard_of(_table(), 0, 5)


def test_single_rank_matches_nn_embedding_forward_and_grad():
    full = _table()
    ref = nn.Embedding.from_pretrained(full.clone(), freeze=False)
    emb = PartitionedEmbedding.from_full(full)
    ids = torch.tensor([[1, 4, 4, 10], [0, 3, 9, 1]])
    g = torch.randn(2, 4, 12)
    (ref(ids) * g).sum().backward()
    out = emb(ids)
    (out * g).sum().backward()
    assert out.shape == (2, 4, 12)
    assert torch.equal(out, ref(ids))
    assert torch.allclose(emb.weight.grad, ref.weight.grad)
    assert emb(torch.zeros(0, dtype=torch.long)).shape == (0, 12)


def test_a_wrong_shard_shape_is_rejected_and_a_full_table_round_trips():
    with pytest.raises(ValueError, match="expected"):
        PartitionedEmbedding(11, 12, weight_VC=torch.zeros(11, 6))
    full = _table()
    assert torch.equal(gather_columns(PartitionedEmbedding.from_full(full).weight), full)


@pytest.mark.parametrize("tie", [True, False])
def test_partitioned_transformer_matches_unpartitioned_on_one_rank(tie):
    cfg = ModelConfig(hidden_size=16, num_layers=2, num_heads=2, vocab_size=40, num_experts=2, top_k=1,
                      max_seq_len=16, tie_embeddings=tie)
    torch.manual_seed(0)
    ref = Transformer(cfg)
    part = partition_embedding(copy.deepcopy(ref))
    assert isinstance(part.tok_embeddings, PartitionedEmbedding)
    assert isinstance(part.output, PartitionedTiedHead) == tie
    tokens = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(1))
    losses = []
    for m in (ref, part):
        out = m(tokens)
        loss = F.cross_entropy(out.logits.flatten(0, 1), tokens.flatten()) + out.aux_loss
        loss.backward()
        losses.append(loss.detach())
    assert torch.allclose(losses[0], losses[1], atol=1e-6)
    assert torch.allclose(part.tok_embeddings.weight.grad, ref.tok_embeddings.weight.grad, atol=1e-6)
    # The shard is registered once, under its own name, and the parameter count is unchanged on one rank.
    assert [n for n, _ in partitioned_parameters(part)] == ["tok_embeddings.weight"]
    assert sum(p.numel() for p in part.parameters()) == sum(p.numel() for p in ref.parameters())
    assert "output._embedding" not in dict(part.named_parameters())
    assert torch.allclose(partitioned_grad_sq(part), ref.tok_embeddings.weight.grad.pow(2).sum())


def test_partition_twice_is_an_error():
    cfg = ModelConfig(hidden_size=8, num_layers=1, num_heads=2, vocab_size=30, num_experts=0, max_seq_len=8)
    model = partition_embedding(Transformer(cfg))
    with pytest.raises(TypeError, match="already partitioned"):
        partition_embedding(model)


def test_embedding_bytes_per_rank():
    cfg = MoesysConfig(model=ModelConfig(vocab_size=50304, hidden_size=2048))
    off = embedding_bytes_per_rank(cfg, 8)
    assert off.replicated == off.partitioned == DENSE_STATE_BYTES * 50304 * 2048 and off.saving == 0
    cfg.model.embedding_partition = True
    on = embedding_bytes_per_rank(cfg, 8)
    assert on.partitioned * 8 == on.replicated and on.saving == on.replicated * 7 // 8
    assert embedding_bytes_per_rank(cfg, 1).saving == 0
    with pytest.raises(ValueError, match="divisible"):
        embedding_bytes_per_rank(cfg, 3)
