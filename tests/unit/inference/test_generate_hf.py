"""`run_inference` on a tiny Hugging Face Mixtral saved by transformers: every offload mode gives transformers'
own greedy tokens; a directory without a tokenizer needs token ids."""

import pytest
import torch

from runtime.inference.generate import run_inference
from runtime.inference.load import InferError

IDS = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38]]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    config = transformers.MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("hf")
    model.save_pretrained(path, safe_serialization=True)
    with torch.no_grad():  # transformers' own greedy tokens are the reference for every offload mode
        expected = model.generate(torch.tensor(IDS), max_new_tokens=5, do_sample=False, pad_token_id=0)[:, 5:]
    assert run_inference(path, {"max_new_tokens": 5}, prompt_ids=IDS, offload="none")["tokens"] == expected.tolist()
    return path, expected.tolist()


@pytest.mark.parametrize("offload,slots", [("ondemand", 1), ("ring", 1), ("ring", 3)])
def test_hf_mixtral_offload_modes_match_none_and_transformers(hf_dir, offload, slots):
    path, expected = hf_dir
    got = run_inference(path, {"max_new_tokens": 5, "ring_slots": slots}, prompt_ids=IDS, offload=offload)
    assert got["tokens"] == expected and got["kind"] == "hf" and got["text"] is None


def test_hf_without_tokenizer_needs_ids(hf_dir):
    with pytest.raises(InferError, match=r"has no tokenizer; give the prompt as ids: infer.prompt_ids"):
        run_inference(hf_dir[0], prompts=["hello"])
