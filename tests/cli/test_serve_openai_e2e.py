"""The official `openai` client against one real `moesys serve` process: models, completions (greedy, sampled with
n and logprobs, stop strings), chat through the tokenizer's chat template (whole and streamed), an error object,
the request log and /metrics. Every answer is compared with `run_inference` (what `moesys infer` runs)."""

import json
import signal
import urllib.request

import pytest
import torch

from runtime.data.tokenizer import byte_tokenizer_json, hf_tokenizer_config
from runtime.inference.generate import generate, run_inference
from runtime.inference.load import open_checkpoint
from runtime.inference.offloaders import make_offloader
from runtime.inference.random_checkpoint import write_random_mixtral
from tests.cli.conftest import run_moesys, serving

openai = pytest.importorskip("openai")
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def _checkpoint(path):
    write_random_mixtral(path, hidden=32, ffn=64, layers=2, experts=4, vocab=256, heads=2, dtype=torch.float32,
                         max_seq_len=128)
    (path / "tokenizer.json").write_text(byte_tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps({**hf_tokenizer_config(128), "chat_template": TEMPLATE}))


_LOADED = {}


def _infer(checkpoint, text, max_tokens, temperature=0.0, seed=0):
    """What `moesys infer` answers alone: its generate call on the checkpoint as it loads it (loaded once)."""
    if checkpoint not in _LOADED:
        loaded = _LOADED[checkpoint] = open_checkpoint(checkpoint)
        make_offloader(loaded.model, "none", torch.device("cpu"), source=loaded.experts)  # experts: read them in
    loaded = _LOADED[checkpoint]
    tokens = generate(loaded.model, [loaded.tokenizer.encode(text)], max_tokens, temperature, 0, seed).tokens[0]
    return loaded.tokenizer.decode(tokens)


def test_the_openai_client_gets_moesys_infer_answers(tmp_path):
    checkpoint = tmp_path / "tiny-mixtral"
    _checkpoint(checkpoint)
    log = tmp_path / "serve.log"
    with serving([f"checkpoint={checkpoint}", "--offload", "none"], log) as (proc, url):
        hello = run_inference(checkpoint, {"max_new_tokens": 8}, prompts=["Hello"], offload="none")["text"][0]
        assert _infer(checkpoint, "Hello", 8) == hello  # the reference below is moesys infer's answer
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["tiny-mixtral"]

        done = client.completions.create(model="whatever", prompt="Hello", max_tokens=8, temperature=0)
        assert done.model == "tiny-mixtral" and done.choices[0].text == _infer(checkpoint, "Hello", 8)
        assert done.usage.prompt_tokens == 5 and done.usage.completion_tokens == 8

        sampled = client.completions.create(model="m", prompt="Hi", max_tokens=6, temperature=0.8, seed=4, n=2,
                                            logprobs=2)
        assert [c.text for c in sampled.choices] == [_infer(checkpoint, "Hi", 6, 0.8, 4),
                                                     _infer(checkpoint, "Hi", 6, 0.8, 5)]
        lp = sampled.choices[0].logprobs
        assert len(lp.token_logprobs) == 6 and all(len(top) <= 2 for top in lp.top_logprobs)

        whole = _infer(checkpoint, "Hello", 8)
        stop = whole[2:4]
        stopped = client.completions.create(model="m", prompt="Hello", max_tokens=8, temperature=0, stop=[stop])
        assert stopped.choices[0].text == whole[:whole.find(stop)] and stopped.choices[0].finish_reason == "stop"

        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        expected = _infer(checkpoint, "<system>Be brief.\n<user>Hi\n<assistant>", 8)
        chat = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0)
        assert chat.choices[0].message.content == expected and chat.model == "tiny-mixtral"
        streamed = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0,
                                                  stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected

        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="m", messages=[{"role": "wizard", "content": "x"}], max_tokens=2)
        assert refused.value.body["param"] == "messages" and refused.value.body["type"] == "invalid_request_error"

        metrics = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
        assert 'moesys_requests_total{route="/v1/chat/completions",status="400"} 1.0' in metrics
        assert 'moesys_requests_total{route="/v1/completions",status="200"} 3.0' in metrics
        assert "moesys_time_to_first_token_seconds_bucket" in metrics and "moesys_queue_depth 0.0" in metrics
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    output = log.read_text()
    assert proc.returncode == 0, output
    lines = [line for line in output.splitlines() if " request id=" in line]
    assert len(lines) == 7 and "route=/v1/models status=200" in lines[0]
    assert "route=/v1/completions status=200 prompt_tokens=5 completion_tokens=8 ttft_ms=" in lines[1]
    assert "route=/v1/chat/completions status=400" in lines[-1]


def test_openai_clients_default_fields_echo_and_prompt_arrays_against_the_real_server(tmp_path):
    """The fields OpenAI clients send by default, and what an evaluation harness sends: a seeded request with
    top_p, penalties and logit_bias equals `moesys infer` run with the same infer.* settings; several prompts in one
    request, echoed with their log-probabilities (max_tokens=0 scores without generating); best_of; a chat stream
    ending with its usage; every refusal's reason in the request log, and the request's user."""
    checkpoint = tmp_path / "tiny-mixtral"
    _checkpoint(checkpoint)
    settings = {"temperature": 0.9, "top_p": 0.8, "presence_penalty": 0.5, "frequency_penalty": 0.3}
    infer = run_moesys("infer", f"checkpoint={checkpoint}", "prompt=Hello", "--offload", "none", "--json",
                       "infer.max_new_tokens=8", "infer.seed=5", "infer.logit_bias={101: 3.0}",
                       *(f"infer.{k}={v}" for k, v in settings.items()))
    assert infer.returncode == 0, infer.stderr
    expected = json.loads(infer.stdout)["text"][0]
    log = tmp_path / "serve.log"
    with serving([f"checkpoint={checkpoint}", "--offload", "none", "serve.max_batch_size=4"], log) as (proc, url):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        seeded = client.completions.create(model="m", prompt="Hello", max_tokens=8, seed=5, logit_bias={"101": 3},
                                           user="alice", **settings)
        assert seeded.choices[0].text == expected

        prompts = ["Hello", "the weather is", "x"]
        scored = client.completions.create(model="m", prompt=prompts, max_tokens=0, echo=True, logprobs=1)
        assert [c.index for c in scored.choices] == [0, 1, 2] and scored.usage.completion_tokens == 0
        for c, text in zip(scored.choices, prompts):
            assert c.text == text and c.logprobs.tokens == list(text)
            assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.token_logprobs) == len(text)
        echoed = client.completions.create(model="m", prompt=[list(b"Hello"), list(b"Hi")], max_tokens=2, n=2,
                                           echo=True, temperature=0)
        assert [c.text for c in echoed.choices] == [
            t + _infer(checkpoint, t, 2) for t in ("Hello", "Hello", "Hi", "Hi")]
        best = client.completions.create(model="m", prompt="Hi", max_tokens=4, n=2, best_of=4, temperature=1.2,
                                         seed=1)
        candidates = [_infer(checkpoint, "Hi", 4, 1.2, 1 + i) for i in range(4)]
        assert len(best.choices) == 2 and all(c.text in candidates for c in best.choices)

        streamed = list(client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0, stream=True,
            stream_options={"include_usage": True}, top_p=1.0, user="bob"))
        assert streamed[-1].choices == [] and streamed[-1].usage.completion_tokens == 3
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                           tools=[{"type": "function", "function": {"name": "f"}}])
        assert refused.value.body["param"] == "tools" and "not supported" in refused.value.body["message"]
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    output = log.read_text()
    assert proc.returncode == 0, output
    lines = [line for line in output.splitlines() if " request id=" in line]
    assert 'user="alice"' in lines[0] and "status=200 prompt_tokens=5 completion_tokens=8" in lines[0]
    assert "status=200 prompt_tokens=20 completion_tokens=0" in lines[1]
    assert 'status=400' in lines[-1] and 'error="tools is not supported by moesys serve' in lines[-1]
