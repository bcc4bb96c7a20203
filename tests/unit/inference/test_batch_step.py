"""The continuous batch's compiled decode step: rows at their own positions through `Transformer.decode`, padded to
a batch-size bucket, compiled with a dynamic batch (no recompilation as rows join, leave and move on), each row's
greedy tokens its lone run's. CUDA graphs per bucket: tests/gpu/test_cuda.py."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from runtime.config import ModelConfig
from runtime.inference.decode import BatchDecodeStep
from runtime.inference.generate import generate
from runtime.model.transformer import Transformer
from runtime.serving.batch import ContinuousBatch, Sequence

GPT = dict(hidden_size=64, num_layers=2, num_heads=4, vocab_size=256, ffn_hidden_size=128, num_experts=4, top_k=2,
           max_seq_len=128, position="learned", norm="layernorm", bias=True, tie_embeddings=True, expert_type="gelu")
MIXTRAL = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=256, ffn_hidden_size=128,
               num_experts=4, top_k=2, max_seq_len=128, position="rope", norm="rmsnorm", bias=False,
               tie_embeddings=False, expert_type="swiglu")
PROMPTS = [[3, 14, 15], [92, 65, 35, 89, 79, 32, 38], [46], [26, 43, 38, 32, 79]]
LENGTHS = [9, 4, 12, 6]


def _model(family: dict) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**family)).eval()
    with torch.no_grad():
        for layer in model.moe_layers():
            layer.router.gate.weight.normal_(0, 1.0)
    return model


def batched(model: Transformer, step: BatchDecodeStep) -> list[list[int]]:
    """PROMPTS through a continuous batch of 4 rows with `step`: all join, each leaves after its LENGTHS tokens
    (rows move as the batch shrinks, and the bucket with them)."""
    batch = ContinuousBatch(model, 4, step=step)
    seqs = [Sequence(p, n) for p, n in zip(PROMPTS, LENGTHS)]
    for seq in seqs:
        batch.join(seq)
    while batch.rows:
        batch.step()
        for seq in [s for s in batch.rows if s.full]:
            batch.leave(seq)
    return [s.tokens for s in seqs]


@pytest.mark.parametrize("family", [GPT, MIXTRAL], ids=["gpt", "mixtral-gqa"])
def test_rows_at_their_own_positions_give_their_lone_runs_greedy_tokens(family):
    model = _model(family)
    lone = [generate(model, [p], n).tokens[0] for p, n in zip(PROMPTS, LENGTHS)]
    assert batched(model, BatchDecodeStep(model, 4)) == lone


def test_buckets_are_powers_of_two_up_to_the_batch():
    step = BatchDecodeStep(_model(GPT), 6)
    assert step.buckets == [1, 2, 4, 6] and [step.bucket(n) for n in (1, 2, 3, 5, 6)] == [1, 2, 4, 6, 6]


def test_the_compiled_step_compiles_two_graphs_for_every_bucket_and_gives_the_eager_tokens():
    """4, 3, 2 and 1 rows decode at buckets 4, 2 and 1: one graph with a dynamic batch serves 4 and 2, one the single
    row; a second pass compiles nothing."""
    model = _model(MIXTRAL)
    eager = batched(model, BatchDecodeStep(model, 4))
    step = BatchDecodeStep(model, 4, compile=True, backend="aot_eager")
    torch._dynamo.reset()
    counters.clear()
    assert batched(model, step) == eager
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]
    counters.clear()
    assert batched(model, step) == eager
    assert counters["frames"]["total"] == 0
