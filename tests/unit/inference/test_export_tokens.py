"""An hf export's special tokens, as transformers reads them: a run with them exports eos (also the pad), no bos,
its stop tokens for generation and the ChatML template; a run of 256 rows (as runs made before the special tokens)
serves chat (ChatML as plain bytes) and exports saying it has no eos, and transformers then generates to the length
`moesys infer` does; a Hugging Face directory's generation_config.json eos ends `moesys infer` where it ends
transformers' generate."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
import urllib.request

import pytest
import torch

from runtime.config import ModelConfig
from runtime.data.chat_template import CHATML
from runtime.inference.export import export_checkpoint
from runtime.inference.generate import run_inference
from runtime.inference.load import open_checkpoint
from runtime.serving.server import BackgroundServer
from runtime.serving.service import open_service
from tests.trained_run import train_run_dir

MIXTRAL = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=320, ffn_hidden_size=48,
                      num_experts=4, max_seq_len=64, expert_type="swiglu", norm="rmsnorm", position="rope",
                      bias=False, tie_embeddings=False)
PROMPT = [[84, 104, 101, 32]]


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers", reason="transformers is not installed")


def _export(tmp_path_factory, model: ModelConfig):
    root = tmp_path_factory.mktemp("run")
    run = train_run_dir(root / "run", model, steps=2, seq_len=32)
    export_checkpoint(run, root / "hf", "hf")
    return run, root / "hf"


def _hf_greedy(transformers, path, max_new_tokens: int, **kwargs) -> list[int]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor(PROMPT), max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    return out[0, len(PROMPT[0]):].tolist()


def test_an_export_names_eos_pad_its_stop_tokens_and_the_chat_template(tmp_path_factory, transformers):
    run, out = _export(tmp_path_factory, MIXTRAL)
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (None, 256, 256)
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"], generation["bos_token_id"]) == ([256, 258], 256,
                                                                                                   None)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token, tok.pad_token_id, tok.bos_token) == (
        "<|endoftext|>", 256, "<|endoftext|>", 256, None)
    assert tok.chat_template == CHATML
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [257, 258]
    assert transformers.GenerationConfig.from_pretrained(str(out)).eos_token_id == [256, 258]
    assert open_checkpoint(run).stop_ids == open_checkpoint(out).stop_ids == (256, 258)


def test_a_run_of_256_rows_exports_without_eos_and_generates_to_its_length(tmp_path_factory, transformers):
    run, out = _export(tmp_path_factory, replace(MIXTRAL, vocab_size=256))
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (None, None, None)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] is None
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] is None and tokenizer_config["pad_token"] is None
    assert transformers.AutoTokenizer.from_pretrained(str(out)).eos_token_id is None
    ours = run_inference(run, {"max_new_tokens": 12}, prompt_ids=PROMPT)
    assert ours["stop_token_ids"] == [] and len(ours["tokens"][0]) == 12
    assert _hf_greedy(transformers, out, 12, pad_token_id=0) == ours["tokens"][0]  # not Mixtral's eos 2
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    with BackgroundServer(open_service(run, {}, {"port": 0})) as url:
        request = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode())
        with urllib.request.urlopen(request, timeout=60) as response:
            chat = json.loads(response.read())
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n".encode()  # the markers as their bytes
    assert chat["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 4, "total_tokens": len(prompt) + 4}
    assert chat["choices"][0]["finish_reason"] == "length"


def test_a_hugging_face_directorys_eos_ends_infer_where_it_ends_transformers(tmp_path_factory, transformers):
    _, out = _export(tmp_path_factory, MIXTRAL)
    free = run_inference(out, {"max_new_tokens": 16}, prompt_ids=PROMPT, offload="none")["tokens"][0]
    stop = free[3]
    hf_dir = out.parent / "stops"
    shutil.copytree(out, hf_dir)
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop, 9999], "pad_token_id": 0}))
    got = run_inference(hf_dir, {"max_new_tokens": 16}, prompt_ids=PROMPT, offload="none")
    assert got["tokens"][0] == free[:free.index(stop) + 1] == _hf_greedy(transformers, hf_dir, 16)
    assert got["text"][0] == open_checkpoint(hf_dir).tokenizer.decode(free[:free.index(stop)])
