"""The same code on CUDA: MoE layer, training step with NCCL-free single rank, ring inference with a copy stream,
auto placement with experts computed on the CPU or fetched."""

from __future__ import annotations

import pytest
import torch

from runtime.config import ModelConfig
from runtime.inference.auto import AutoOffloader, ExpertCosts
from runtime.inference.generate import generate, run_inference
from runtime.inference.load import open_checkpoint
from runtime.inference.random_checkpoint import write_random_mixtral
from runtime.inference.offloaders import make_offloader
from runtime.model.transformer import Transformer
from runtime.moe.layer import MoELayer
from tests.unit.train.test_precision import losses

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def test_moe_layer_matches_cpu():
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=64, ffn_hidden_size=128, num_experts=8, top_k=2)
    layer = MoELayer(cfg)
    x = torch.randn(256, 64)
    y_cpu, _ = layer(x)
    y_gpu, _ = layer.to(CUDA)(x.to(CUDA))
    torch.testing.assert_close(y_gpu.cpu(), y_cpu, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_training_on_cuda_tracks_fp32_with_fp32_master_weights(precision):
    ref, _ = losses("fp32", device=CUDA)
    half, master = losses(precision, device=CUDA)
    assert master == torch.float32 and half == pytest.approx(ref, rel=2e-2)


def test_ring_matches_resident_on_cuda(tmp_path):
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=64, num_layers=4, num_heads=4, ffn_hidden_size=128, num_experts=4, top_k=2,
                      vocab_size=256, max_seq_len=64)
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8]]
    tokens = {}
    for mode in ("none", "ondemand", "ring"):
        torch.manual_seed(0)
        model = Transformer(cfg).eval()
        offloader = make_offloader(model, mode, CUDA, ring_slots=2, cache_dir=tmp_path / mode)
        tokens[mode] = generate(model, prompts, 8, offloader=offloader).tokens
    assert tokens["ring"] == tokens["none"] == tokens["ondemand"]


def test_auto_placement_on_cuda_matches_resident(tmp_path):
    """auto on CUDA: resident layers plus hybrid layers (routed experts computed on the CPU from the mapped files or
    fetched into the device cache, by the costs measured on this machine), and each choice forced."""
    path = tmp_path / "mixtral"
    write_random_mixtral(path, hidden=128, ffn=256, layers=4, experts=8, vocab=512, dtype=torch.float32)
    ids = [[3, 14, 15, 92, 65, 35, 89, 79]]
    ref = run_inference(path, {"max_new_tokens": 8}, prompt_ids=ids, offload="none", device=CUDA)["tokens"]
    for slots in (1, 2, 4):
        got = run_inference(path, {"max_new_tokens": 8, "ring_slots": slots}, prompt_ids=ids, offload="auto",
                            device=CUDA)
        assert got["tokens"] == ref, slots
        resident = 4 if slots == 4 else slots - 1  # below K = N one slot is the fetched experts' cache
        assert got["placement"] == ["resident"] * resident + ["hybrid"] * (4 - resident)
    for costs in (ExpertCosts(0.0, 0.0, 1.0), ExpertCosts(1.0, 0.0, 0.0), ExpertCosts(0.0, 1.0, 0.5)):
        loaded = open_checkpoint(path, device=CUDA)
        offloader = AutoOffloader(loaded.model, CUDA, loaded.experts, 2, costs=costs)
        loaded.model.to(CUDA)
        assert generate(loaded.model, ids, 8, offloader=offloader).tokens == ref
        offloader.close()


@pytest.mark.parametrize("offload,resident_layers", [("cpu", 0), ("ssd", 0), ("cpu", 1)])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_offloaded_training_on_cuda_tracks_resident(tmp_path, offload, resident_layers, precision):
    """Experts copied from pinned host slots on the side stream, gradients home on it, the CPU AdamW; with one of
    the two MoE layers kept on the GPU beside them."""
    ref, _ = losses(precision, device=CUDA)
    got, _ = losses(precision, device=CUDA, offload=offload, run_dir=tmp_path, resident_layers=resident_layers)
    assert got == pytest.approx(ref, rel=1e-5 if precision == "fp32" else 2e-2)


@pytest.mark.parametrize("resident_layers", [0, 1])
def test_the_delayed_update_on_cuda_trains_as_on_the_cpu(tmp_path, resident_layers):
    """ZeRO-Offload's one-step delayed update with the copies, stages and events of a GPU gives the CPU device's
    numbers (the same schedule); in bf16 it tracks fp32; with one MoE layer kept on the GPU (plan's fit) too."""
    def run(name, precision, device):
        return losses(precision, steps=4, device=device, offload="cpu", run_dir=tmp_path / name,
                      resident_layers=resident_layers, delayed_update=True)[0]

    on_cpu, on_cuda = run("cpu", "fp32", torch.device("cpu")), run("cuda", "fp32", CUDA)
    exact, _ = losses("fp32", steps=4, device=CUDA, offload="cpu", run_dir=tmp_path / "exact",
                      resident_layers=resident_layers)
    assert on_cuda == pytest.approx(on_cpu, rel=1e-4) and on_cuda != exact
    assert run("bf16", "bf16", CUDA) == pytest.approx(on_cuda, rel=2e-2)


def test_each_active_expert_crosses_the_bus_once_a_step_in_bf16_and_its_gradient_once(tmp_path):
    from runtime.config import MoesysConfig, StorageConfig, TopologyConfig, TrainConfig
    from runtime.parallel.groups import build_groups
    from runtime.train.build import build_components
    from runtime.train.loop import forward_backward, optimizer_step

    cfg = MoesysConfig(model=ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_experts=4, max_seq_len=32),
                       topology=TopologyConfig(gpus_per_node=1, gpu_memory_gb=16, nproc_per_node=1),
                       storage=StorageConfig(offload="cpu"),
                       train=TrainConfig(seq_len=16, micro_batch_size=4, precision="bf16", run_dir=str(tmp_path)))
    groups = build_groups(1, 0, 1, 1)
    c = build_components(cfg, groups, CUDA)
    numel = c.offload.specs[0].layout.numel
    for step in range(3):
        forward_backward(c, cfg, groups, step, CUDA)
        optimizer_step(c, cfg, groups, step)
        m = c.offload.step_metrics()
        assert m["offload/device_in_bytes"] == m["offload/experts_active"] * numel * 2
        assert m["offload/copied_bytes"] == 2 * m["offload/device_in_bytes"]  # weights in, gradients home
    c.offload.wait_step()
    # gradients land in pinned buffers given back after the update: pinned in the first step, not in every step
    assert c.offload.transfers.grad_staging.made < 3 * len(c.offload.specs)
    c.offload.close()


def _mixtral(device):
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=96, ffn_hidden_size=64,
                      num_experts=4, top_k=2, expert_type="swiglu", norm="rmsnorm", bias=False, position="rope",
                      tie_embeddings=False, max_seq_len=64)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for layer in model.moe_layers():
            layer.router.gate.weight.normal_(0, 1.0)
    return model.to(device)


def test_decode_step_on_cuda_has_no_synchronisation_and_cuda_graphs_give_the_eager_tokens():
    """The eager step launches without the host waiting; compiled (reduce-overhead: CUDA graphs) it replays the
    same graph at every position, with the eager tokens."""
    from torch._dynamo.utils import counters

    from runtime.inference.decode import DecodeStep
    from runtime.inference.step_counts import count_decode

    model = _mixtral(CUDA)
    prompt = [[3, 14, 15, 92, 65, 35]]
    eager_step = DecodeStep(model)
    counts = count_decode(lambda n: generate(model, prompt, n, step=eager_step), 4, cuda=True)
    assert counts.host_syncs_per_token == 0 and counts.ops_per_layer_token <= 40
    eager = generate(model, prompt, 33, step=eager_step).tokens
    step = DecodeStep(model, compile=True)
    generate(model, prompt, 3, step=step)
    counters.clear()
    assert generate(model, prompt, 33, step=step).tokens == eager
    assert counters["frames"]["total"] == 0
    assert count_decode(lambda n: generate(model, prompt, n, step=step), 4, cuda=True).host_syncs_per_token == 0


def test_gathered_experts_compile_into_cuda_graphs_with_the_eager_tokens():
    """experts_form=gather on CUDA: inductor's coordinate-descent reductions in place of the grouped GEMM, one graph
    replayed at every position, no host sync, greedy tokens as the eager step's (bf16, the bench's dtype)."""
    from torch._dynamo.utils import counters

    from runtime.inference.decode import DecodeStep
    from runtime.inference.step_counts import count_decode

    model = _mixtral(CUDA).to(torch.bfloat16)
    prompt = [[3, 14, 15, 92, 65, 35]]
    eager = generate(model, prompt, 17, step=DecodeStep(model)).tokens
    step = DecodeStep(model, compile=True, experts_form="gather")
    generate(model, prompt, 3, step=step)
    counters.clear()
    assert generate(model, prompt, 17, step=step).tokens == eager
    assert counters["frames"]["total"] == 0
    assert count_decode(lambda n: generate(model, prompt, n, step=step), 4, cuda=True).host_syncs_per_token == 0


@pytest.mark.parametrize("costs", [ExpertCosts(0.0, 0.0, 1.0), ExpertCosts(1.0, 0.0, 0.0)], ids=["cpu", "fetch"])
def test_hybrid_decode_synchronises_at_most_once_per_streamed_layer(costs):
    """Streamed experts pinned in host memory; routed ones computed on the CPU (rows back without a wait) or copied
    on the side stream (compute waits on the device): one synchronisation a streamed layer, the resident tokens."""
    from runtime.inference.expert_source import ExpertSource
    from runtime.inference.step_counts import count_decode

    prompt = [[3, 14, 15, 92, 65, 35]]
    reference = generate(_mixtral(CUDA), prompt, 8).tokens
    model = _mixtral("cpu")
    source = ExpertSource.from_model(model)
    offloader = AutoOffloader(model, CUDA, source, 2, costs=costs)
    model.to(CUDA)
    assert offloader.placement == ["resident", "hybrid", "hybrid", "hybrid"]
    assert all(t.is_pinned() for t in offloader.host.expert(1, 0).values())
    assert generate(model, prompt, 8, offloader=offloader).tokens == reference
    counts = count_decode(lambda n: generate(model, prompt, n, offloader=offloader), 4, cuda=True)
    assert counts.host_syncs_per_token <= 3
    offloader.close()


def _bf16_mixtral_checkpoint(tmp_path):
    path = tmp_path / "mixtral"
    write_random_mixtral(path, hidden=256, ffn=512, layers=4, experts=8, vocab=1024)
    return path


def test_compiled_bf16_step_replays_cuda_graphs_at_static_addresses_without_recompiling(tmp_path):
    """A checkpoint placed on the GPU (bf16, experts resident): the compiled step runs as CUDA graphs (inductor skips
    none: the cache's buffers and the expert weights keep their addresses, and the experts' grouped GEMM reads its
    offsets on the device), a second and third generation in the same cache compile nothing, and the tokens are the
    eager step's."""
    from torch._dynamo.utils import counters

    from runtime.inference.decode import DecodeStep

    loaded = open_checkpoint(_bf16_mixtral_checkpoint(tmp_path), device=CUDA)
    offloader = make_offloader(loaded.model, "none", CUDA, source=loaded.experts)
    prompt = [[3, 14, 15, 92, 65, 35]]
    eager = generate(loaded.model, prompt, 24, step=DecodeStep(loaded.model)).tokens
    step = DecodeStep(loaded.model, compile=True)
    torch._dynamo.reset()
    counters.clear()
    assert generate(loaded.model, prompt, 24, step=step).tokens == eager
    assert counters["inductor"]["cudagraph_skips"] == 0 and not counters["graph_break"]
    counters.clear()
    for _ in range(2):
        assert generate(loaded.model, prompt, 24, step=step).tokens == eager
    assert counters["frames"]["total"] == 0 and not counters["recompiles"]
    offloader.close()


def test_the_serving_batch_replays_one_cuda_graph_set_per_bucket_with_its_lone_greedy_tokens(tmp_path):
    """Rows at their own positions through the compiled batch step: each sequence's greedy tokens are its lone
    run's (bf16 GEMMs over several rows need not round as one-row products do: greedy agreement is the test), and a
    second pass over the same buckets compiles nothing."""
    from torch._dynamo.utils import counters

    from runtime.inference.decode import BatchDecodeStep
    from tests.unit.inference.test_batch_step import LENGTHS, PROMPTS, batched

    loaded = open_checkpoint(_bf16_mixtral_checkpoint(tmp_path), device=CUDA)
    offloader = make_offloader(loaded.model, "none", CUDA, source=loaded.experts)
    model = loaded.model
    lone = [generate(model, [p], n).tokens[0] for p, n in zip(PROMPTS, LENGTHS)]
    step = BatchDecodeStep(model, 4, compile=True)
    counters.clear()
    assert batched(model, step) == lone
    assert counters["inductor"]["cudagraph_skips"] == 0
    counters.clear()
    assert batched(model, step) == lone
    assert counters["frames"]["total"] == 0
    offloader.close()


def test_bench_infer_bounds_a_gpu_token_by_hbm_and_its_streamed_path():
    """The bound instrument on a GPU: HBM read bandwidth, pinned copies, and auto's streamed path the faster of
    the CPU over host memory and PCIe."""
    from runtime.bench.infer_bounds import measure_bandwidths, streamed_path

    bandwidth = measure_bandwidths([1])
    assert bandwidth["device_read_bytes_per_s"] > bandwidth["host_read_bytes_per_s"] > 0
    assert bandwidth["host_to_device_bytes_per_s"] > 0
    path, rate = streamed_path("moesys_auto", bandwidth, bandwidth)
    assert rate == max(bandwidth["host_read_bytes_per_s"], bandwidth["host_to_device_bytes_per_s"])
    assert streamed_path("moesys_ring", bandwidth, bandwidth) == ("pcie_copy", bandwidth["host_to_device_bytes_per_s"])


LARGE_PINNED_PROBE = """
import torch
from runtime.host.pinned import exact_large_pinned_blocks
exact_large_pinned_blocks()
torch.cuda.init()
allocated = lambda: torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
before = allocated()
large = torch.empty(1200 << 20, dtype=torch.uint8, pin_memory=True)
small = torch.empty(600 << 20, dtype=torch.uint8, pin_memory=True)
held = allocated() - before
del large
print(held, allocated() - before)
"""


def test_a_layer_sized_pinned_block_takes_its_size_and_goes_back_when_freed():
    """A block above runtime/host/pinned.py's threshold is allocated at its size (torch's host allocator would round
    1200 MiB up to 2048) and given back when freed; a smaller one keeps the power-of-two rounding and the cache."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", LARGE_PINNED_PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    held, after_free = map(int, out.stdout.split())
    assert held == (1200 << 20) + (1024 << 20), held
    assert after_free == 1024 << 20, after_free
