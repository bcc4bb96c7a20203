"""Every released family against transformers' own implementation, each from a tiny random model transformers builds
from its config class and saves in shards: (a) the import gives transformers' logits and greedy tokens; (b) one
AdamW step from the import equals transformers' own step (loss, every gradient and every parameter); (c) the
family's router loss is transformers' pooled load-balancing loss, with the coefficient config.json gives; (d) the
export in the family's own format loads in transformers with the same logits, tensor names and tokenizer files.
Errors name the key."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from runtime.hf.checkpoint import HFCheckpoint, load_hf_model
from runtime.hf.files import HFCheckpointError
from runtime.inference.export import export_checkpoint
from runtime.model.transformer import Transformer
from runtime.moe.losses import expert_load, pooled_load_balancing_loss
from tests.hf_families import FAMILIES, TOKENS, load_transformers, max_diff, save_sharded, tiny_model

pytest.importorskip("transformers", reason="transformers is not installed")
PARAMETRIZE = pytest.mark.parametrize("family", list(FAMILIES))
PARTS = {  # what each family's import must turn on: the parts come from config.json
    "mixtral": dict(moe_layers=None, normalize_top_k=True),
    "qwen3_moe": dict(qk_norm="head", head_dim=32, moe_layers=[0, 2, 3], dense_ffn_hidden_size=96,
                      normalize_top_k=True),
    "olmoe": dict(qk_norm="full", normalize_top_k=False),
    "qwen2_moe": dict(attention_bias="qkv", shared_expert_hidden_size=48, shared_expert_gate=True, moe_layers=[1, 3],
                      normalize_top_k=False),
    "ernie4_5_moe": dict(shared_expert_hidden_size=64, router_score_bias=True, moe_layers=[1, 2, 3],
                         tie_embeddings=True),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tmp_path_factory):
    family = request.param
    path = save_sharded(tiny_model(family), tmp_path_factory.mktemp(family) / "model")
    return family, path


def test_import_gives_transformers_logits_and_greedy_tokens(saved):
    family, path = saved
    reference = load_transformers(path)
    cfg, model = load_hf_model(path)
    assert cfg.family == family and all(getattr(cfg, k) == v for k, v in PARTS[family].items()), cfg
    with torch.no_grad():
        diff = max_diff(model(TOKENS).logits, reference(input_ids=TOKENS).logits)
        ours = TOKENS[:1, :8]
        for _ in range(8):
            ours = torch.cat([ours, model(ours).logits[:, -1:].argmax(-1)], dim=1)
        theirs = reference.generate(TOKENS[:1, :8], max_new_tokens=8, do_sample=False, pad_token_id=0)
    print(f"{family}: import logits max abs diff {diff:.2e}")
    assert diff <= 1e-5
    assert torch.equal(ours, theirs)


def in_moesys_layout(reference, value, where):
    """value(p) of each of transformers' parameters p (zeros for None), under moesys's names and layout: written in
    the parameters' place by save_pretrained and read back by moesys's loader."""
    holder = copy.deepcopy(reference)
    with torch.no_grad():
        for mine, theirs in zip(holder.parameters(), reference.parameters()):
            got = value(theirs)
            mine.copy_(got if got is not None else torch.zeros_like(mine))
    holder.save_pretrained(where)
    return dict(load_hf_model(where)[1].named_parameters())


def test_one_adamw_step_from_the_import_equals_transformers_step(saved, tmp_path):
    family, path = saved
    reference = load_transformers(path).train()
    _, model = load_hf_model(path)
    model.train()
    ours_opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    theirs_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.0)

    out = model(TOKENS)
    loss = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), TOKENS[:, 1:].flatten()) + out.aux_loss
    theirs = reference(input_ids=TOKENS, labels=TOKENS).loss  # output_router_logits off: no router loss
    assert out.aux_loss.item() == 0.0
    loss.backward()
    theirs.backward()
    grads = in_moesys_layout(reference, lambda p: p.grad, tmp_path / "grads")
    grad_diffs = {name: max_diff(p.grad if p.grad is not None else torch.zeros_like(p), grads[name])
                  for name, p in model.named_parameters()}
    ours_opt.step()
    theirs_opt.step()

    reference.save_pretrained(tmp_path / "stepped")
    _, stepped = load_hf_model(tmp_path / "stepped")
    after = dict(stepped.named_parameters())
    diffs = {name: max_diff(p, after[name]) for name, p in model.named_parameters()}
    worst = max(diffs, key=diffs.get)
    worst_grad = max(grad_diffs, key=grad_diffs.get)
    print(f"{family}: step loss diff {abs(loss.item() - theirs.item()):.2e}, worst gradient {worst_grad} "
          f"{grad_diffs[worst_grad]:.2e}, worst parameter {worst} {diffs[worst]:.2e}")
    assert abs(loss.item() - theirs.item()) <= 1e-6
    assert grad_diffs[worst_grad] <= 1e-6  # AdamW's first step is about lr x sign(g): the gradients themselves too
    assert diffs[worst] <= 1e-5
    before = dict(load_hf_model(path)[1].named_parameters())
    moved = [n for n, p in model.named_parameters() if max_diff(p, before[n]) > 0]
    assert len(moved) > len(diffs) // 2  # the step did change the model


@PARAMETRIZE
def test_pooled_router_loss_is_transformers_load_balancing_loss_func(family):
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    gen = torch.Generator().manual_seed(5)
    logits = tuple(torch.randn(37, 8, generator=gen) * 2 for _ in range(3))
    for k in (1, 2, 4):
        theirs = module.load_balancing_loss_func(logits, 8, k)
        ours = pooled_load_balancing_loss([expert_load(torch.softmax(x, -1), k) for x in logits])
        assert abs(ours.item() - theirs.item()) <= 1e-6
    plain = sum(8 * ((torch.softmax(x, -1).topk(2).indices[..., None] == torch.arange(8)).sum((0, 1)).float()
                     / 111 * torch.softmax(x, -1).sum(0) / 111).sum() for x in logits) / 3  # mean of per-layer
    assert abs(plain.item() - module.load_balancing_loss_func(logits, 8, 2).item()) > 1e-3  # not the same thing


@PARAMETRIZE
def test_router_loss_weight_and_form_come_from_config_json(family, tmp_path):
    path = save_sharded(tiny_model(family, output_router_logits=True, router_aux_loss_coef=0.05), tmp_path / "m",
                        tokenizer=False)
    reference = load_transformers(path).train()
    cfg, model = load_hf_model(path)
    assert (cfg.load_balancing, cfg.aux_loss_weight) == ("pooled", 0.05)
    model.train()
    out = model(TOKENS)
    ours = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), TOKENS[:, 1:].flatten()) + out.aux_loss
    theirs = reference(input_ids=TOKENS, labels=TOKENS)
    assert abs(out.aux_loss.item() - 0.05 * theirs.aux_loss.item()) <= 1e-6
    assert abs(ours.item() - theirs.loss.item()) <= 1e-6
    ours.backward()
    theirs.loss.backward()
    i = next(i for i in range(cfg.num_layers) if cfg.is_moe_layer(i))  # the router's gradient has the balancing loss
    hf_gate = reference.get_parameter(f"model.layers.{i}.mlp.gate.weight")
    assert max_diff(model.get_parameter(f"layers.{i}.ffn.router.gate.weight").grad, hf_gate.grad) <= 1e-6


def test_export_in_the_family_format_loads_in_transformers(saved, tmp_path):
    family, path = saved
    _, model = load_hf_model(path)
    out = tmp_path / "export"
    summary = export_checkpoint(path, out, "hf", max_shard_gb=0.0001)
    assert len(summary["files"]) > 1 and summary["optimizer_state"] is False
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == family
    source_names = set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"])
    assert set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]) == source_names
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (path / name).read_bytes()
    exported = load_transformers(out)
    with torch.no_grad():
        diff = max_diff(exported(input_ids=TOKENS).logits, model(TOKENS).logits)
    print(f"{family}: export logits max abs diff {diff:.2e}")
    assert diff <= 1e-5


def test_transformers_5_fused_module_layout_loads_too(tmp_path):
    """A state dict of transformers 5's modules (fused gate_up_proj / down_proj, ERNIE's score bias under the gate)
    saved as it is: the same model."""
    from safetensors.torch import save_file

    for family in ("qwen3_moe", "ernie4_5_moe"):
        reference = tiny_model(family)
        where = tmp_path / family
        where.mkdir()
        state = {k: v.contiguous() for k, v in reference.state_dict().items() if k != "lm_head.weight"
                 or not reference.config.tie_word_embeddings}
        assert any(k.endswith("experts.gate_up_proj") for k in state)
        save_file(state, str(where / "model.safetensors"))
        reference.config.save_pretrained(where)
        _, model = load_hf_model(where)
        with torch.no_grad():
            assert max_diff(model(TOKENS).logits, reference(input_ids=TOKENS).logits) <= 1e-5


@pytest.mark.parametrize("edit,message", [
    ({"model_type": "llama"}, "model_type='llama' is not one of mixtral, qwen2_moe"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type='yarn' is not supported"),
    ({"use_sliding_window": True}, "use_sliding_window=True is not supported"),
    ({"num_experts": None, "num_local_experts": None}, "missing key 'num_experts'"),
])
def test_config_json_errors_name_the_key(tmp_path, edit, message):
    path = save_sharded(tiny_model("qwen3_moe"), tmp_path / "m", tokenizer=False)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(HFCheckpointError, match=message):
        HFCheckpoint(path)


def test_a_model_its_family_cannot_express_is_refused_before_writing(tmp_path):
    from runtime.hf.save import save_hf_model

    path = save_sharded(tiny_model("olmoe"), tmp_path / "m", tokenizer=False)
    cfg, model = load_hf_model(path)
    cfg.qk_norm = "head"
    with pytest.raises(HFCheckpointError, match=r"model.qk_norm='head' \(olmoe needs 'full'\)"):
        save_hf_model(model, cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_rank_s_part_of_the_model_is_filled_expert_by_expert(tmp_path):
    """copy_into: a rank of expert parallel 2 gets its block of each layer's experts (global experts 4..7) and the
    dense weights, from the files, into the model it built on the meta device."""
    from runtime.parallel.expert_parallel import shard_experts

    path = save_sharded(tiny_model("qwen3_moe"), tmp_path / "m", tokenizer=False)
    checkpoint = HFCheckpoint(path)
    _, full = load_hf_model(path)
    with torch.device("meta"):
        part = Transformer(checkpoint.config)
    shard_experts(part, 2, 1, None, None)
    part.to_empty(device="cpu")
    checkpoint.copy_into(part)
    full_params = dict(full.named_parameters())
    for name, p in part.named_parameters():
        want = full_params[name][4:] if ".experts." in name else full_params[name]
        assert torch.equal(p, want), name


def test_a_hugging_face_directory_exports_to_moesys_format_too(tmp_path):
    """export.format=moesys of a released model: a moesys checkpoint `moesys infer` and `serve` read, the same
    model, that exports back to the family's own tensors bit for bit."""
    from safetensors.torch import load_file

    from runtime.inference.load import load_model

    path = save_sharded(tiny_model("ernie4_5_moe"), tmp_path / "m")
    export_checkpoint(path, tmp_path / "moesys", "moesys")
    loaded = load_model(tmp_path / "moesys")
    assert loaded.model.cfg.family == "ernie4_5_moe" and loaded.tokenizer is not None
    _, model = load_hf_model(path)
    with torch.no_grad():
        assert torch.equal(loaded.model(TOKENS).logits, model(TOKENS).logits)
    export_checkpoint(tmp_path / "moesys", tmp_path / "back", "hf")
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    source = {}
    for shard in set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values()):
        source.update(load_file(str(path / shard)))
    assert back.keys() == source.keys() and all(torch.equal(back[k], source[k]) for k in source)
