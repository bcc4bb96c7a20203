"""`run_inference` on a tiny Hugging Face Mixtral saved by transformers, as one file and as several shards with an
index: every offload mode gives transformers' own greedy tokens, the auto placement's CUDA policy (hybrid) too,
run here on the CPU with each of its choices forced; a directory without a tokenizer needs token ids."""

import pytest
import torch

from runtime.inference.auto import AutoOffloader, ExpertCosts
from runtime.inference.generate import generate, run_inference
from runtime.inference.errors import InferError
from runtime.inference.load import open_checkpoint

IDS = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38]]
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=["single", "sharded"])
def hf_dir(tmp_path_factory, request):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    config = transformers.MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("hf")
    if request.param == "sharded":
        model.save_pretrained(path, safe_serialization=True, max_shard_size="100KB")
        assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 2
    else:
        model.save_pretrained(path, safe_serialization=True)
    with torch.no_grad():  # transformers' own greedy tokens are the reference for every offload mode
        expected = model.generate(torch.tensor(IDS), max_new_tokens=5, do_sample=False, pad_token_id=0)[:, 5:]
    assert run_inference(path, {"max_new_tokens": 5}, prompt_ids=IDS, offload="none")["tokens"] == expected.tolist()
    return path, expected.tolist()


@pytest.mark.parametrize("offload,slots", [("ondemand", 1), ("ring", 1), ("ring", 3), ("auto", 1), ("auto", 2),
                                           ("auto", 3)])
def test_hf_mixtral_offload_modes_match_none_and_transformers(hf_dir, offload, slots):
    path, expected = hf_dir
    got = run_inference(path, {"max_new_tokens": 5, "ring_slots": slots}, prompt_ids=IDS, offload=offload)
    assert got["tokens"] == expected and got["kind"] == "hf" and got["text"] is None


@pytest.mark.parametrize("costs,used", [
    (ExpertCosts(cpu_s=0.0, cpu_s_per_row=0.0, fetch_s=1.0), {"cpu_computes"}),
    (ExpertCosts(cpu_s=1.0, cpu_s_per_row=0.0, fetch_s=0.0), {"fetched_experts", "cache_hits"}),
    # one row (decode) on the CPU, a prompt's rows fetched: both paths inside one generation
    (ExpertCosts(cpu_s=0.0, cpu_s_per_row=1.0, fetch_s=0.5), {"cpu_computes", "fetched_experts", "cache_hits"}),
])
def test_hybrid_placement_computes_on_cpu_or_fetches_and_matches_transformers(hf_dir, costs, used):
    path, expected = hf_dir
    loaded = open_checkpoint(path)
    offloader = AutoOffloader(loaded.model, CPU, loaded.experts, num_slots=2, streamed_policy="hybrid", costs=costs)
    assert offloader.placement == ["resident", "hybrid", "hybrid"]  # one slot is the fetched experts' cache
    got = generate(loaded.model, IDS, 5, offloader=offloader)
    stats = offloader.stats()
    offloader.close()
    assert got.tokens == expected
    counters = ("cpu_computes", "fetched_experts", "cache_hits")
    assert {k for k in counters if stats[k]} == used
    assert len(offloader.cache) <= offloader.cache_capacity == 4
    # the CUDA path's accounting, as on the CPU: the device holds K=2 layers' worth (one resident, one cache of
    # fetched experts) and the host tier the two layers that are not resident
    layer = loaded.experts.layer_bytes(0)
    assert stats["expert_device_bytes"] == 2 * layer
    assert stats["expert_host_bytes"] == sum(loaded.experts.layer_bytes(m, stored=True) for m in (1, 2))


def test_hf_without_tokenizer_needs_ids(hf_dir):
    with pytest.raises(InferError, match=r"has no tokenizer; give the prompt as ids: infer.prompt_ids"):
        run_inference(hf_dir[0], prompts=["hello"])


def test_hybrid_measures_its_costs_when_placed(hf_dir):
    path, expected = hf_dir
    loaded = open_checkpoint(path)
    offloader = AutoOffloader(loaded.model, CPU, loaded.experts, num_slots=1, streamed_policy="hybrid")
    costs = offloader.costs
    assert costs is not None and costs.cpu_s > 0 and costs.fetch_s > 0 and costs.cpu_s_per_row >= 0
    assert generate(loaded.model, IDS, 5, offloader=offloader).tokens == expected
    offloader.close()
