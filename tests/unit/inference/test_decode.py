"""The static decode step: no host synchronisation and at most 40 operators a layer per token (torch.profiler),
the static cache reused across generations, sampling on the device that draws what torch.multinomial draws, and
the step compiled whole (fullgraph, no recompilation across positions) with the eager step's tokens in every mode."""

import copy
from dataclasses import replace

import pytest
import torch
from torch._dynamo.utils import counters

from runtime.bench.forward_step import ForwardStep
from runtime.config import ModelConfig
from runtime.inference.auto import AutoOffloader, ExpertCosts
from runtime.inference.decode import DecodeStep, compile_options
from runtime.inference.expert_source import ExpertSource
from runtime.inference.generate import generate
from runtime.inference.sampling import sample_next
from runtime.inference.errors import InferError
from runtime.inference.offloaders import make_offloader
from runtime.inference.step_counts import count_decode
from runtime.model.transformer import Transformer

CPU = torch.device("cpu")
MIXTRAL = ModelConfig(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=96, ffn_hidden_size=64,
                      num_experts=4, top_k=2, expert_type="swiglu", norm="rmsnorm", bias=False, position="rope",
                      tie_embeddings=False, max_seq_len=64)
PROMPT = [[3, 14, 15, 92, 65, 35]]


def _model(cfg: ModelConfig = MIXTRAL, dtype: torch.dtype = torch.float32) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(cfg).eval().to(dtype)
    with torch.no_grad():  # router weights larger than the init's, so tokens route to different experts
        for layer in model.moe_layers():
            layer.router.gate.weight.normal_(0, 1.0)
    return model


def test_resident_decode_token_has_no_host_sync_and_at_most_40_operators_a_layer():
    """In bf16, whose router and combine add casts an fp32 model does not have."""
    model = _model(dtype=torch.bfloat16)
    offloader = make_offloader(model, "none", CPU)
    step = DecodeStep(model)
    counts = count_decode(lambda n: generate(model, PROMPT, n, offloader=offloader, step=step), MIXTRAL.num_layers)
    assert counts.host_syncs_per_token == 0
    assert 20 <= counts.ops_per_layer_token <= 40


def test_offloaded_decode_synchronises_only_where_it_streams(tmp_path):
    """ring gathers from its slots on the device: no sync; auto reads each streamed layer's routing once."""
    for mode, slots, syncs in (("ring", 2, 0), ("auto", 1, 3)):
        model = _model()
        offloader = make_offloader(model, mode, CPU, slots, cache_dir=tmp_path / mode)
        counts = count_decode(lambda n: generate(model, PROMPT, n, offloader=offloader), MIXTRAL.num_layers)
        offloader.close()
        assert counts.host_syncs_per_token == syncs, mode


@pytest.mark.parametrize("costs", [ExpertCosts(0.0, 0.0, 1.0), ExpertCosts(1.0, 0.0, 0.0)], ids=["cpu", "fetch"])
def test_hybrid_decode_reads_the_host_once_per_streamed_layer_whatever_the_cost_model_picks(costs):
    """auto's CUDA policy run on the CPU: the counts and rows come to the host together, once a streamed layer,
    whether the CPU computes the routed experts or they are fetched (the fetch waits on the device, not the host)."""
    reference = generate(_model(), PROMPT, 6).tokens
    model = _model()
    offloader = AutoOffloader(model, CPU, ExpertSource.from_model(model), 2, streamed_policy="hybrid", costs=costs)
    assert offloader.placement == ["resident", "hybrid", "hybrid", "hybrid"]
    assert generate(model, PROMPT, 6, offloader=offloader).tokens == reference
    counts = count_decode(lambda n: generate(model, PROMPT, n, offloader=offloader), MIXTRAL.num_layers)
    assert counts.host_syncs_per_token == 3
    offloader.close()


def test_every_mode_decodes_with_the_resident_arithmetic_bit_for_bit(tmp_path):
    """In bf16, where rounding differences part greedy tokens of a random model: ring's slots and auto's streamed
    layers (weights read from the host tier into the gathered layout) give the resident step's logits exactly.
    Wide enough (D=256) that a per-expert matmul rounds differently from the gathered one."""
    base = _model(replace(MIXTRAL, hidden_size=256, ffn_hidden_size=512), dtype=torch.bfloat16)
    logits = {}
    for mode, slots in (("none", 2), ("ring", 2), ("auto", 1)):
        model = copy.deepcopy(base)
        offloader = make_offloader(model, mode, CPU, slots, cache_dir=tmp_path / mode)
        logits[mode] = generate(model, PROMPT, 12, offloader=offloader, keep_logits=True).logits[0]
        offloader.close()
    assert torch.equal(logits["ring"], logits["none"]) and torch.equal(logits["auto"], logits["none"])


def test_static_cache_is_reused_and_its_stale_slots_never_seen():
    """A second generation in the same cache (longer prompt, then a shorter one) gives a fresh step's tokens."""
    model = _model()
    step = DecodeStep(model)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42]]
    reused = [generate(model, [p], 8, step=step).tokens for p in prompts]
    cache = step.cache
    again = generate(model, [prompts[1]], 8, step=step).tokens
    assert step.cache is cache and cache.capacity == 64  # one bucket serves all three
    assert reused == [generate(model, [p], 8, step=DecodeStep(model)).tokens for p in prompts]
    assert again == reused[1]


def test_the_bench_baseline_decodes_the_static_steps_tokens_through_the_forward():
    """runtime/bench/forward_step.py: each token through the prompt's forward gives the static step's greedy tokens
    (fp32), and reads the host every token, which the static step does not."""
    model = _model()
    assert generate(model, PROMPT, 8, step=ForwardStep(model)).tokens == \
        generate(model, PROMPT, 8, step=DecodeStep(model)).tokens
    step = ForwardStep(model)
    counts = count_decode(lambda n: generate(model, PROMPT, n, step=step), MIXTRAL.num_layers)
    assert counts.host_syncs_per_token > 0


@pytest.mark.parametrize("top_k", [0, 3])
def test_sampling_draws_what_multinomial_draws_without_reading_the_host(top_k):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    for seed in range(20):
        got = sample_next(logits, 0.7, top_k, torch.Generator().manual_seed(seed))
        scaled = logits / 0.7
        if top_k:
            scaled = scaled.masked_fill(scaled < scaled.topk(top_k, dim=-1).values[:, -1:], float("-inf"))
        want = torch.multinomial(scaled.softmax(-1), 1, generator=torch.Generator().manual_seed(seed)).squeeze(1)
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_step_is_one_graph_for_every_position_and_gives_the_eager_tokens(dtype):
    """fullgraph=True with the inductor backend; after the first step compiles, 32 more positions run the same code
    (no frame is compiled again), and the tokens are the eager step's. In bf16 the logits too, bit for bit: the
    experts' grouped GEMM is the eager one and inductor rounds where eager rounds."""
    model = _model(dtype=dtype)
    eager = generate(model, PROMPT, 33, keep_logits=True)
    step = DecodeStep(model, compile=True)
    assert step.fullgraph
    torch._dynamo.reset()
    counters.clear()
    generate(model, PROMPT, 3, step=step)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    counters.clear()
    compiled = generate(model, PROMPT, 33, step=step, keep_logits=True)
    assert compiled.tokens == eager.tokens
    assert counters["frames"]["total"] == 0 and not counters["recompiles"]
    if dtype == torch.bfloat16:
        assert torch.equal(compiled.logits[0], eager.logits[0])


def test_gathered_experts_give_the_in_place_tokens_eager_and_compiled():
    """experts_form=gather reads each token's routed experts by index where auto reads one token's in place: the
    same products, so the same bf16 logits, eager and traced whole (aot_eager: one graph; inductor's own products
    differ from eager's by rounding). Only CUDA adds coordinate-descent tuning (which makes inductor fuse the gather
    into its one-row reductions)."""
    model = _model(dtype=torch.bfloat16)
    in_place = generate(model, PROMPT, 17, keep_logits=True)
    gathered = DecodeStep(model, experts_form="gather")
    assert {layer.experts.routed_form for layer in model.moe_layers()} == {"gather"}
    eager = generate(model, PROMPT, 17, step=gathered, keep_logits=True)
    assert eager.tokens == in_place.tokens and torch.equal(eager.logits[0], in_place.logits[0])
    step = DecodeStep(model, compile=True, backend="aot_eager", experts_form="gather")
    assert step.fullgraph
    torch._dynamo.reset()
    counters.clear()
    compiled = generate(model, PROMPT, 17, step=step, keep_logits=True)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert compiled.tokens == in_place.tokens and torch.equal(compiled.logits[0], in_place.logits[0])
    assert "coordinate_descent_tuning" not in compile_options(CPU, "gather")
    assert compile_options(torch.device("cuda"), "gather")["coordinate_descent_tuning"] is True
    assert "coordinate_descent_tuning" not in compile_options(torch.device("cuda"))
    with pytest.raises(ValueError, match="experts_form='grouped' is not one of auto, gather"):
        DecodeStep(model, experts_form="grouped")


@pytest.mark.parametrize("mode,slots", [("ring", 2), ("ondemand", 1), ("auto", 1)])
def test_compiled_step_around_offloaded_experts_gives_the_eager_tokens(mode, slots, tmp_path):
    """An offloader's stand-in experts run outside the graph (not fullgraph); the rest compiles, once."""
    base = _model()
    runs = {}
    for compiled in (False, True):
        model = copy.deepcopy(base)
        offloader = make_offloader(model, mode, CPU, slots, cache_dir=tmp_path / f"{mode}{compiled}")
        step = DecodeStep(model, compile=compiled, backend="aot_eager")
        assert step.fullgraph is False
        generate(model, PROMPT, 3, offloader=offloader, step=step)
        counters.clear()
        runs[compiled] = generate(model, PROMPT, 17, offloader=offloader, step=step).tokens
        if compiled:
            assert counters["frames"]["total"] == 0
        offloader.close()
    assert runs[True] == runs[False]


def test_a_compiler_that_fails_is_a_one_line_error():
    def broken(graph, example_inputs):
        raise RuntimeError("no C++ compiler found\nmore detail")

    model = _model()
    with pytest.raises(InferError, match=r"infer.compile=true: torch.compile failed .*set infer.compile=false") as exc:
        generate(model, PROMPT, 3, step=DecodeStep(model, compile=True, backend=broken))
    assert "\n" not in str(exc.value)
