"""Every released family through the real commands: `moesys infer` and `moesys serve` run a tiny random model that
transformers saved (sharded, with a tokenizer and a chat template) and give transformers' greedy tokens; `moesys
export export.format=hf` writes the family's own format, which AutoModelForCausalLM loads with moesys's logits."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from runtime.hf.checkpoint import load_hf_model
from tests.cli.conftest import run_moesys, serving
from tests.hf_families import FAMILIES, load_transformers, save_sharded, tiny_model

pytest.importorskip("transformers", reason="transformers is not installed")
pytestmark = pytest.mark.slow
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]  # "Hello, w" in the byte tokenizer


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


@pytest.mark.parametrize("family", [pytest.param(f, marks=[] if f == "qwen3_moe" else [pytest.mark.extended])
                                    for f in FAMILIES])  # qwen3_moe in CI, the rest extended
def test_infer_serve_and_export_run_the_family(family, tmp_path):
    path = save_sharded(tiny_model(family), tmp_path / family)
    reference = load_transformers(path)
    with torch.no_grad():
        expected = reference.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False,
                                      pad_token_id=0)[0, len(PROMPT):].tolist()

    infer = run_moesys("infer", f"checkpoint={path}", "prompt=Hello, w", "infer.max_new_tokens=8", "--offload", "ring",
                       "--json")  # the prompt through the checkpoint's tokenizer, the experts through the ring
    assert infer.returncode == 0, infer.stderr[-2000:]
    assert json.loads(infer.stdout)["tokens"] == [expected]

    with serving([f"checkpoint={path}"], tmp_path / "serve.log") as (_, url):  # auto placement
        done = post(f"{url}/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
        assert done["choices"][0]["token_ids"] == expected
        chat = post(f"{url}/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                   "max_tokens": 4, "temperature": 0})
        assert chat["usage"]["completion_tokens"] == 4

    out = tmp_path / "export"
    exported = run_moesys("export", f"checkpoint={path}", f"out={out}", "export.format=hf")
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert json.loads((out / "config.json").read_text())["model_type"] == family
    assert (out / "tokenizer_config.json").read_bytes() == (path / "tokenizer_config.json").read_bytes()
    _, ours = load_hf_model(path)
    with torch.no_grad():
        theirs = load_transformers(out)(input_ids=torch.tensor([PROMPT])).logits
        assert (theirs - ours(torch.tensor([PROMPT])).logits).abs().max().item() <= 1e-5
