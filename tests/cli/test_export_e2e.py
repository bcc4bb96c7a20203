"""`moesys export` as a user runs it: the quickstart's `moesys train recipe=tiny` (2 processes, expert parallel 2)
exported to hf loads in transformers, which gives `moesys infer`'s greedy ids and, from its chat template, the ids
`moesys serve` prompts with; a run of the same recipe with dense sharding and a partitioned embedding, fused into one
model: the moesys export gives the run's logits, the hf export (sharded, with an index) transformers' same logits and
greedy tokens; an export streams (its memory does not grow with the model); a GPT-style model refuses hf in one
line."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest
import torch

from runtime.inference.load import load_model, open_checkpoint
from runtime.inference.sampling import Sampling
from runtime.serving.chat import parse_chat
from runtime.serving.protocol import Defaults
from tests.cli.conftest import FAST_TINY, run_moesys, serving
from tests.static_graph import StaticDenseModel

IDS = [[60, 61, 62, 63, 70, 71, 72, 104, 101]]
CHAT = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What moves the wind?"},
        {"role": "assistant", "content": "Air pressure."}, {"role": "user", "content": "And rain, naïve?"}]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("export") / "run"
    done = run_moesys("train", *FAST_TINY, "train.max_steps=30", f"train.run_dir={run_dir}", "storage.dense_shard=true",
                      "model.embedding_partition=true")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((run_dir / "checkpoints" / "step_00000030" / "meta.json").read_text())["expert_parallel"] == 2
    return run_dir


def test_the_quickstarts_model_exports_to_hf_and_transformers_gives_infers_and_serves_ids(tmp_path):
    """`moesys train recipe=tiny` as the README runs it (fewer steps), `moesys export ... export.format=hf`: the
    export carries eos, the pad and the chat template; transformers' greedy ids are `moesys infer`'s, and its
    apply_chat_template gives the ids `moesys serve` prompts with and the answer it serves."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    run_dir, out = tmp_path / "run", tmp_path / "hf"
    trained = run_moesys("train", "recipe=tiny", "train.max_steps=10", f"train.run_dir={run_dir}")
    assert trained.returncode == 0, trained.stderr[-2000:]
    done = run_moesys("export", f"checkpoint={run_dir}", f"out={out}", "export.format=hf", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["eos_token"] == "<|endoftext|>"
    assert json.loads((out / "config.json").read_text())["model_type"] == "mixtral"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|endoftext|>", "<|endoftext|>", None)
    infer = run_moesys("infer", f"checkpoint={run_dir}", "prompt=The wind ", "infer.max_new_tokens=24", "--json")
    assert infer.returncode == 0, infer.stderr[-2000:]
    ours = json.loads(infer.stdout)
    ids = tok("The wind ")["input_ids"]
    assert ours["prompt_tokens"] == [ids] and ours["stop_token_ids"] == [256, 258]
    with torch.no_grad():  # its generation_config.json: the same stop tokens, the pad
        greedy = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    assert ours["tokens"] == [greedy]

    prompt = tok.apply_chat_template(CHAT, add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    body = {"messages": CHAT, "max_tokens": 12, "temperature": 0}
    served = parse_chat(body, Defaults(12, Sampling(), 0), open_checkpoint(run_dir).tokenizer, 320, 256)
    generation_prompt = tok.encode("<|im_start|>assistant\n")
    assert generation_prompt == [257, *b"assistant\n"]
    assert served.prompts == [prompt] and prompt[-len(generation_prompt):] == generation_prompt
    with torch.no_grad():
        answer = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    answer = answer[:-1] if answer[-1] in (256, 258) else answer
    with serving([f"checkpoint={run_dir}", "--offload", "none"], tmp_path / "serve.log") as (_, url):
        request = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            chat = json.loads(response.read())
    assert chat["usage"]["prompt_tokens"] == len(prompt)
    assert chat["choices"][0]["message"]["content"] == tok.decode(answer)


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits


def test_moesys_export_holds_the_runs_model_without_optimizer_state(run, tmp_path):
    out = tmp_path / "model"
    done = run_moesys("export", f"checkpoint={run}", f"out={out}", "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["files"] == ["model.safetensors"] and summary["bytes"] * 2.5 < summary["checkpoint_bytes"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask  # as mkdir makes it, not mkdtemp's 0700
    exported = load_model(out).model
    assert torch.equal(logits(exported), logits(load_model(run).model))
    # the exported model's dense path as a static graph for the prompt's bucket: the same logits
    assert torch.equal(StaticDenseModel(exported, [(1, len(IDS[0]))])(torch.tensor(IDS)), logits(exported))
    again = run_moesys("export", f"checkpoint={run}", f"out={out}")
    assert again.returncode == 2 and "already exists and is not empty" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1


@pytest.mark.extended
def test_hf_export_loads_in_transformers_with_the_same_logits_and_tokens(run, tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    out = tmp_path / "hf"
    done = run_moesys("export", f"checkpoint={run}", f"out={out}", "export.format=hf", "export.max_shard_gb=0.004",
                      "--json")
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["files"]) > 1 and (out / "model.safetensors.index.json").is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = load_model(run).model
    torch.testing.assert_close(logits(hf), logits(ours), rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        hf_tokens = hf.generate(torch.tensor(IDS), max_new_tokens=8, do_sample=False, pad_token_id=0)[:, len(IDS[0]):]
    infer = run_moesys("infer", f"checkpoint={run}", f"prompt_ids={IDS[0]}", "infer.max_new_tokens=8", "--json")
    assert infer.returncode == 0, infer.stderr[-2000:]
    assert json.loads(infer.stdout)["tokens"] == hf_tokens.tolist()
    half = tmp_path / "hf16"
    assert run_moesys("export", f"checkpoint={run}", f"out={half}", "export.format=hf",
                      "export.dtype=bf16").returncode == 0
    assert json.loads((half / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert (half / "model.safetensors").stat().st_size < sum(f.stat().st_size for f in out.glob("*.safetensors")) / 1.9


@pytest.mark.extended
def test_training_into_an_export_is_refused_and_leaves_it_servable(run, tmp_path):
    """Both formats given as train.run_dir: one line before anything is written; exporting an export says it had no
    optimizer state to leave out."""
    for fmt in ("moesys", "hf"):
        assert run_moesys("export", f"checkpoint={run}", f"out={tmp_path / fmt}",
                          f"export.format={fmt}").returncode == 0
        before = {p.name: p.read_bytes() for p in (tmp_path / fmt).iterdir()}
        refused = run_moesys("train", *FAST_TINY, "train.max_steps=3", f"train.run_dir={tmp_path / fmt}")
        assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
        assert "is not a moesys run directory" in refused.stderr and "choose a new train.run_dir" in refused.stderr
        assert {p.name: p.read_bytes() for p in (tmp_path / fmt).iterdir()} == before
    again = run_moesys("export", f"checkpoint={tmp_path / 'moesys'}", f"out={tmp_path / 'again'}")
    assert again.returncode == 0 and "optimizer state" not in again.stdout and "the source was" in again.stdout


@pytest.mark.extended
def test_export_streams_tensor_by_tensor_and_a_gpt_style_model_refuses_hf(tmp_path):
    """A 400 MB checkpoint (GPT-style: gelu experts) exported by a process whose anonymous memory grows by far less
    than that; asked for the hf layout, the CLI refuses in one line and writes nothing."""
    script = textwrap.dedent(f"""
        import json, torch
        from pathlib import Path
        from runtime.config import MoesysConfig, ModelConfig, config_to_dict
        from runtime.host.memory_probe import PeakMemory, rss_anon_bytes
        from runtime.model.transformer import Transformer
        from runtime.moe.layer import is_expert_param
        from runtime.files.tensorfile import write_tensors
        from runtime.inference.export import export_checkpoint
        import yaml
        step = Path({str(tmp_path)!r}) / "step"
        step.mkdir()
        cfg = MoesysConfig(model=ModelConfig(hidden_size=256, num_layers=4, num_heads=4, ffn_hidden_size=1024,
                                             num_experts=48, vocab_size=512, max_seq_len=256))
        with torch.device("meta"):
            params = dict(Transformer(cfg.model).named_parameters())
        specs = {{}}
        for name, p in params.items():
            if is_expert_param(name):
                specs.update({{f"model.{{name}}.{{g}}": (torch.float32, tuple(p.shape[1:])) for g in range(p.shape[0])}})
            else:
                specs[f"model.{{name}}"] = (torch.float32, tuple(p.shape))
        write_tensors(step / "dense.safetensors", specs, ((k, torch.randn(s)) for k, (_, s) in specs.items()))
        (step / "meta.json").write_text(json.dumps({{"step": 1, "config": config_to_dict(cfg)}}))
        before = rss_anon_bytes()
        with PeakMemory() as peak:
            summary = export_checkpoint(step, step.parent / "out")
        print(json.dumps({{"bytes": summary["bytes"], "growth": peak.peak - before}}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["bytes"] > 350e6 and result["growth"] < result["bytes"] / 10, result

    refused = run_moesys("export", f"checkpoint={tmp_path / 'step'}", f"out={tmp_path / 'x'}", "export.format=hf")
    assert refused.returncode == 2 and not (tmp_path / "x").exists()
    assert "model.expert_type='gelu' (Mixtral needs 'swiglu')" in refused.stderr
    assert "export.format=moesys" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "Traceback" not in refused.stderr


def test_a_missing_checkpoint_is_named_as_missing(tmp_path):
    done = run_moesys("export", f"checkpoint={tmp_path / 'nonexistent'}", f"out={tmp_path / 'x'}")
    assert done.returncode == 2 and "nonexistent: no such directory" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "x").exists()
