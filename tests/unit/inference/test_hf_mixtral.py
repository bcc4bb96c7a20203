"""Hugging Face Mixtral import/export: logits equal transformers' on both weight layouts, round trip, typed errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.config import ModelConfig
from runtime.inference.hf_mixtral import HFCheckpointError, load_hf_mixtral, save_hf_mixtral
from runtime.model.transformer import Transformer
from tests.references import KVCache

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytestmark = pytest.mark.filterwarnings("ignore")


def tiny_mixtral(seed: int = 0, **overrides):
    cfg = transformers.MixtralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=128, max_position_embeddings=64,
        rope_theta=10000.0, **overrides)
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(cfg).eval()
    with torch.no_grad():  # spread the norms too, so a swapped norm weight would show
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                p.uniform_(0.5, 1.5)
    return model


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=tokens).logits


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    model = tiny_mixtral()
    path = tmp_path_factory.mktemp("hf") / "mixtral"
    model.save_pretrained(path, safe_serialization=True)
    return model, path


TOKENS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))


def test_saved_checkpoint_loads_with_equal_logits_and_round_trips(hf_dir, tmp_path):
    hf_model, path = hf_dir
    cfg, model = load_hf_mixtral(path)
    assert (cfg.num_layers, cfg.num_experts, cfg.kv_heads, cfg.rope_theta) == (2, 4, 2, 10000.0)
    expected = hf_logits(hf_model, TOKENS)
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS).logits, expected, rtol=1e-5, atol=1e-5)

    out = tmp_path / "export"
    save_hf_mixtral(model, cfg, out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left behind
    reloaded = transformers.MixtralForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(hf_logits(reloaded, TOKENS), expected, rtol=1e-5, atol=1e-5)

    with torch.no_grad():
        model.norm.weight.mul_(2)
    save_hf_mixtral(model, cfg, out)  # over an existing checkpoint: files replaced one by one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    _, again = load_hf_mixtral(out)
    torch.testing.assert_close(again.norm.weight, model.norm.weight, rtol=0, atol=0)


def test_fused_expert_layout_of_the_module_state_dict_loads_too(hf_dir, tmp_path):
    hf_model, path = hf_dir
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    fused = [k for k in state if "experts" in k]
    if not any(k.endswith("gate_up_proj") for k in fused):
        pytest.skip("this transformers version has no fused Mixtral experts")
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    _, model = load_hf_mixtral(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS).logits, hf_logits(hf_model, TOKENS), rtol=1e-5, atol=1e-5)


def test_sharded_checkpoint_with_index_and_tied_embeddings(tmp_path):
    hf_model = tiny_mixtral(seed=1, tie_word_embeddings=True)
    hf_model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    cfg, model = load_hf_mixtral(tmp_path)
    assert cfg.tie_embeddings and model.output is None
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS).logits, hf_logits(hf_model, TOKENS), rtol=1e-5, atol=1e-5)


def test_incremental_decoding_of_an_imported_model_matches_full_forward(hf_dir):
    _, model = load_hf_mixtral(hf_dir[1])
    with torch.no_grad():
        full = model(TOKENS).logits
        cache = KVCache(len(model.layers))
        steps = [model(TOKENS[:, :20], cache=cache).logits]
        steps += [model(TOKENS[:, t:t + 1], cache=cache, start_pos=t).logits for t in range(20, 24)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def copy_checkpoint(src, dst):
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_errors_are_typed_and_name_the_file_or_tensor(hf_dir, tmp_path):
    _, path = hf_dir
    with pytest.raises(HFCheckpointError, match="no such checkpoint directory"):
        load_hf_mixtral(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(HFCheckpointError, match="config.json: missing"):
        load_hf_mixtral(tmp_path / "empty")

    llama = copy_checkpoint(path, tmp_path / "llama")
    config = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps(dict(config, model_type="llama")))
    with pytest.raises(HFCheckpointError, match="model_type='llama'"):
        load_hf_mixtral(llama)

    state = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    broken = copy_checkpoint(path, tmp_path / "missing")
    save_file({k: v for k, v in state.items() if k != name}, str(broken / "model.safetensors"))
    with pytest.raises(HFCheckpointError, match=f"missing tensor {name}"):
        load_hf_mixtral(broken)

    wrong = copy_checkpoint(path, tmp_path / "shape")
    save_file(dict(state, **{"model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)}),
              str(wrong / "model.safetensors"))
    with pytest.raises(HFCheckpointError, match=r"k_proj.weight in .*shape \(64, 64\), expected \(32, 64\)"):
        load_hf_mixtral(wrong)
    assert issubclass(HFCheckpointError, ValueError)


def test_exporting_a_non_mixtral_model_is_refused(tmp_path):
    cfg = ModelConfig(hidden_size=32, num_layers=1, num_heads=4, vocab_size=64, num_experts=2, max_seq_len=16)
    with pytest.raises(HFCheckpointError, match="model.expert_type='gelu'"):
        save_hf_mixtral(Transformer(cfg), cfg, tmp_path / "gpt")
    assert not (tmp_path / "gpt").exists()
