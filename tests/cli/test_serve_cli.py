"""The real `moesys serve` command: prints the address it listens on (--port 0), serves a Hugging Face Mixtral
directory without a tokenizer (token-id prompts), and on SIGTERM finishes the request in flight and exits 0."""

import http.client
import json
import signal
from urllib.parse import urlsplit

import pytest
import torch

from moesys_cli.serve import parse_serve_args
from runtime.errors import UserError
from runtime.inference.generate import run_inference
from runtime.inference.random_checkpoint import write_random_mixtral
from tests.cli.conftest import run_moesys, serving

PROMPT = [5, 17, 99, 3]


def test_sigterm_drains_the_request_in_flight_and_exits_0(tmp_path):
    checkpoint = tmp_path / "mixtral"
    write_random_mixtral(checkpoint, hidden=32, ffn=64, layers=2, experts=4, vocab=128, heads=2,
                         dtype=torch.float32, max_seq_len=128)
    expected = run_inference(checkpoint, {"max_new_tokens": 100, "ring_slots": 1}, prompt_ids=[PROMPT],
                             offload="ring")["tokens"][0]
    log = tmp_path / "serve.log"  # a file, not a pipe: nothing is read from it until the end
    with serving([f"checkpoint={checkpoint}", "--offload", "ring", "infer.ring_slots=1"], log) as (proc, address):
        url = urlsplit(address)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": PROMPT, "max_tokens": 100,
                                                                 "stream": True}))
        response = conn.getresponse()
        assert response.status == 200
        first = response.readline()
        assert first.startswith(b"data: ")  # the first token is out: the request is in flight
        proc.send_signal(signal.SIGTERM)
        lines = (first + response.read()).split(b"\n")
        events = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
        assert lines[-3] == b"data: [DONE]" and events[-1]["choices"][0]["finish_reason"] == "length"
        proc.wait(60)
    output = log.read_text()
    assert proc.returncode == 0, output
    assert "stopped: 1 requests completed, 0 cancelled, 0 failed" in output
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == expected
    assert all(e["choices"][0]["text"] is None for e in events)  # no tokenizer: ids only


def test_a_bad_setting_is_refused_in_one_line_before_the_model_loads():
    done = run_moesys("serve", "checkpoint=/nowhere", "serve.max_batch_size=0")
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "serve.max_batch_size must be >= 1" in done.stderr


def test_serve_arguments_split_into_checkpoint_and_section_overrides():
    assert parse_serve_args(["checkpoint=/a", "infer.top_k=4", "serve.host=::1", "checkpoint=/b"]) == (
        "/b", {"top_k": 4}, {"host": "::1"})
    for bad, message in [(["serve.port=1"], "no checkpoint"), (["checkpoint=/a", "serve.a.b=1"], "unknown argument"),
                         (["checkpoint=/a", "train.steps=1"], "unknown argument"), (["checkpoint"], "not key=value")]:
        with pytest.raises(UserError, match=message):
            parse_serve_args(bad)
