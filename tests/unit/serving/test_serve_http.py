"""`moesys serve`'s HTTP service on a free loopback port of this process: the tokens of `run_inference` (what
`moesys infer` runs) for the same prompt and seed in every offload mode, streamed or not; concurrent clients each
get their own answer; bad input is a 4xx in OpenAI's error shape; a client leaving mid-stream harms nothing."""

import http.client
import json
import socket
import threading
from urllib.parse import urlsplit

import pytest

from runtime.inference.generate import run_inference
from runtime.serving.server import BackgroundServer
from runtime.serving.service import open_service
from tests.trained_run import train_run_dir

INFER = {"max_new_tokens": 6, "ring_slots": 1}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A real moesys run directory (byte tokenizer): one training step of a 2-layer MoE, single process."""
    return train_run_dir(tmp_path_factory.mktemp("run"))


def _server(run_dir, offload="none", **serve):
    return BackgroundServer(open_service(run_dir, INFER, {"port": 0, **serve}, offload=offload))


def _connection(url) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)


def post(url, body, path="/v1/completions", method="POST"):
    """(status, parsed JSON body)."""
    conn = _connection(url)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    status, payload = response.status, json.loads(response.read())
    conn.close()
    return status, payload


def stream(url, body):
    """The parsed chunks of a streamed completion, and whether it ended with `data: [DONE]`."""
    conn = _connection(url)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}))
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("content-type").startswith("text/event-stream")
    events = [line[len(b"data: "):].strip() for line in response.read().split(b"\n") if line.startswith(b"data: ")]
    conn.close()
    return [json.loads(e) for e in events if e != b"[DONE]"], events[-1] == b"[DONE]"


CASES = [
    ({"prompt": "the weather"}, {}),
    ({"prompt": "a machine", "temperature": 0.9, "top_k": 40, "seed": 7}, {"temperature": 0.9, "top_k": 40, "seed": 7}),
    ({"prompt": [104, 105, 115, 116], "max_tokens": 4, "seed": 3}, {"max_new_tokens": 4, "seed": 3}),
]


@pytest.mark.parametrize("offload", ["none", "auto", "ring", "ondemand"])
def test_same_tokens_as_infer_streamed_or_not_in_every_offload_mode(run_dir, offload):
    with _server(run_dir, offload) as url:
        for body, infer in CASES:
            prompt = body["prompt"]
            texts, ids = ([prompt], None) if isinstance(prompt, str) else (None, [prompt])
            expected = run_inference(run_dir, {**INFER, **infer}, prompts=texts, prompt_ids=ids, offload=offload)
            status, got = post(url, body)
            assert status == 200, got
            choice = got["choices"][0]
            assert choice["token_ids"] == expected["tokens"][0] and choice["text"] == expected["text"][0]
            assert got["usage"] == {"prompt_tokens": len(expected["prompt_tokens"][0]),
                                    "completion_tokens": len(choice["token_ids"]),
                                    "total_tokens": len(expected["prompt_tokens"][0]) + len(choice["token_ids"])}
            chunks, done = stream(url, body)
            assert done and chunks[-1]["choices"][0]["finish_reason"] == "length"
            assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
            assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]


def test_concurrent_clients_each_get_their_own_answer(run_dir):
    prompts = ["abc", "xyz", "qrs", "hello", "mixture", "of", "experts!", "abd"]
    bodies = [{"prompt": p, "temperature": 0.7 if i % 3 == 1 else 0.0, "seed": i, "stream": i % 2 == 0}
              for i, p in enumerate(prompts)]
    expected = [run_inference(run_dir, {**INFER, "temperature": b["temperature"], "seed": b["seed"]},
                              prompts=[b["prompt"]], offload="auto")["tokens"][0] for b in bodies]
    results: dict[int, list[int]] = {}

    def client(i):
        for _ in range(3):
            body = bodies[i]
            if body["stream"]:
                chunks, _ = stream(url, body)
                tokens = [t for c in chunks for t in c["choices"][0]["token_ids"]]
            else:
                tokens = post(url, body)[1]["choices"][0]["token_ids"]
            results.setdefault(i, []).append(tokens)

    with _server(run_dir, "auto", max_batch_size=4) as url:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        health = post(url, b"", "/health", "GET")[1]
    assert results == {i: [tokens] * 3 for i, tokens in enumerate(expected)}
    assert health["completed"] == 3 * len(bodies) and health["failed"] == 0


BAD = [
    (b"{not json", 400, "not valid JSON", None),
    (b"[1, 2]", 400, "must be a JSON object", None),
    ({"prompt": "hi", "temprature": 0.5}, 400, "unknown field 'temprature'", "temprature"),
    ({}, 400, "prompt is required", "prompt"),
    ({"prompt": 5}, 400, "prompt must be text or a list of token ids", "prompt"),
    ({"prompt": [1, 256]}, 400, "token id 256 is outside the vocabulary 0..255", "prompt"),
    ({"prompt": ""}, 400, "prompt is empty", "prompt"),
    ({"prompt": "x" * 48}, 400, "prompt of 48 tokens does not fit the model's context of 48 tokens", "prompt"),
    ({"prompt": "hi", "max_tokens": 47}, 400, "exceeds the model's context of 48 tokens (at most 46)", "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens=0 is out of range 1..46", "max_tokens"),
    ({"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens must be an integer", "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature must be a number >= 0", "temperature"),
    ({"prompt": "hi", "top_k": 1.5}, 400, "top_k must be an integer", "top_k"),
    ({"prompt": "hi", "seed": -1}, 400, "seed=-1 is out of range", "seed"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream must be true or false", "stream"),
]


def test_bad_requests_are_4xx_with_one_line_and_the_server_keeps_serving(run_dir):
    with _server(run_dir) as url:
        for body, status, message, param in BAD:
            got_status, got = post(url, body)
            error = got["error"]
            assert (got_status, error["param"]) == (status, param), got
            assert message in error["message"] and "\n" not in error["message"]
            assert error["type"] == "invalid_request_error"
        assert post(url, {"prompt": "hi"}, "/nowhere")[0] == 404
        status, got = post(url, b"", "/v1/completions", "GET")
        assert status == 405 and "error" in got
        status, got = post(url, {"prompt": "hi"})
        assert status == 200 and len(got["choices"][0]["token_ids"]) == INFER["max_new_tokens"]


def _raw(url, head: bytes, body: bytes = b"") -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n" + head
                 + b"\r\n" + body)
    return sock


def test_a_body_larger_than_any_prompt_is_refused_before_it_is_read(run_dir):
    with _server(run_dir) as url, _raw(url, b"Content-Length: 999999999\r\n") as sock:
        assert sock.recv(4096).startswith(b"HTTP/1.1 413")


def test_clients_leaving_mid_answer_harm_nothing_and_the_server_keeps_serving(run_dir):
    with _server(run_dir, "ring") as url:
        for stream_it in (True, False):
            body = json.dumps({"prompt": "x", "max_tokens": 46, "stream": stream_it}).encode()
            with _raw(url, b"Content-Length: %d\r\n" % len(body), body) as sock:
                if stream_it:  # leave after the first token; a plain request is left at once
                    received = b""
                    while b"data: " not in received:
                        received += sock.recv(4096)
                    assert received.startswith(b"HTTP/1.1 200")
        status, got = post(url, {"prompt": "the weather"})
        assert status == 200
        assert got["choices"][0]["token_ids"] == run_inference(run_dir, INFER, prompts=["the weather"],
                                                               offload="ring")["tokens"][0]
        health = post(url, b"", "/health", "GET")[1]
        assert health["status"] == "ok" and health["failed"] == 0
        assert health["completed"] + health["cancelled"] == 3  # each left answer finished or was stopped
