"""`moesys serve`'s HTTP service on a free loopback port of this process: the tokens of `run_inference` (what
`moesys infer` runs) for the same prompt and seed in every offload mode, streamed or not; concurrent clients each
get their own answer; bad input is a 4xx in OpenAI's error shape; a client leaving mid-answer cancels its
generation and harms nothing; a dead worker is a 503, on /health too."""

import http.client
import json
import socket
import threading
from urllib.parse import urlsplit

import pytest

from runtime.inference.generate import run_inference
from runtime.serving import app
from runtime.serving.server import BackgroundServer
from runtime.serving.service import open_service
from tests.trained_run import train_run_dir
from tests.waiting import wait_until

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


def _answers(run_dir, bodies) -> dict[int, list[list[int]]]:
    """Each body's possible answers: run alone (what `moesys infer` gives), or, for a greedy prompt of the same
    length as another one, as a row of their batch (in either order), whose float rounding can flip a near-tie."""
    answers = {i: [run_inference(run_dir, {**INFER, "temperature": b["temperature"], "seed": b["seed"]},
                                 prompts=[b["prompt"]], offload="auto")["tokens"][0]] for i, b in enumerate(bodies)}
    by_length: dict[int, list[int]] = {}
    for i, b in enumerate(bodies):
        if b["temperature"] == 0:
            by_length.setdefault(len(b["prompt"].encode()), []).append(i)
    pairs = [group for group in by_length.values() if len(group) > 1]
    assert pairs and all(len(group) == 2 for group in pairs)  # what the batches of two below cover
    for a, b in pairs:
        for order in ((a, b), (b, a)):
            batch = run_inference(run_dir, {**INFER, "temperature": 0.0}, prompts=[bodies[k]["prompt"] for k in order],
                                  offload="auto")["tokens"]
            for k, tokens in zip(order, batch):
                answers[k].append(tokens)
        assert not any(t in answers[b] for t in answers[a])  # so a row given to the wrong client still fails
    return answers


def test_concurrent_clients_each_get_their_own_answer(run_dir):
    prompts = ["abc", "xyz", "qrs", "hello", "mixture", "of", "experts!", "abd"]
    # "abc" and "qrs", greedy and of one length, batch together: one streamed, one not
    bodies = [{"prompt": p, "temperature": 0.7 if i % 3 == 1 else 0.0, "seed": i, "stream": i % 4 < 2}
              for i, p in enumerate(prompts)]
    answers = _answers(run_dir, bodies)
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
        assert not any(t.is_alive() for t in threads)
        health = post(url, b"", "/health", "GET")[1]
    assert sorted(results) == list(range(len(bodies))) and all(len(got) == 3 for got in results.values())
    assert all(tokens in answers[i] for i, got in results.items() for tokens in got), (results, answers)
    assert health["completed"] == 3 * len(bodies) and health["failed"] == 0


BAD = [
    (b"{not json", 400, "not valid JSON", None),
    (b"[1, 2]", 400, "must be a JSON object", None),
    ({"prompt": "hi", "temprature": 0.5}, 400, "unknown field 'temprature'", "temprature"),
    ({}, 400, "prompt is required", "prompt"),
    ({"prompt": 5}, 400, "prompt must be text, a list of token ids, or a list of texts or of token id", "prompt"),
    ({"prompt": ["hi", [1]]}, 400, "prompt must be text, a list of token ids, or a list of", "prompt"),
    ({"prompt": [[1], []]}, 400, "prompt[1] is empty", "prompt"),
    ({"prompt": [[1], [300]]}, 400, "prompt[1] token id 300 is outside the vocabulary 0..255", "prompt"),
    ({"prompt": [[1]] * 20, "n": 13}, 400,
     "20 prompts x 13 choices = 260 sequences exceed serve.max_sequences_per_request=256", "prompt"),
    ({"prompt": "x" * 48, "echo": True, "max_tokens": 1}, 400, "with a token to generate (echo with max_tokens=0",
     "prompt"),
    ({"prompt": "x" * 49, "echo": True, "max_tokens": 0}, 400, "prompt of 49 tokens does not fit", "prompt"),
    ({"prompt": "hi", "echo": "yes"}, 400, "echo must be true or false", "echo"),
    ({"prompt": "hi", "echo": True, "stream": True}, 400, "echo cannot be streamed", "echo"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p must be a number in (0, 1]", "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p must be a number in (0, 1]", "top_p"),
    ({"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty must be a number between -2 and 2",
     "presence_penalty"),
    ({"prompt": "hi", "frequency_penalty": "x"}, 400, "frequency_penalty must be a number between -2 and 2",
     "frequency_penalty"),
    ({"prompt": "hi", "logit_bias": [1]}, 400, "logit_bias must be an object of token id: bias", "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"999": 1}}, 400, 'logit_bias key "999" is not a token id 0..255', "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias must be a number between -100 and 100",
     "logit_bias"),
    ({"prompt": "hi", "user": 5}, 400, "user must be a string", "user"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options needs stream=true",
     "stream_options"),
    ({"prompt": "hi", "stream": True, "stream_options": {"x": 1}}, 400, "stream_options takes only include_usage",
     "stream_options"),
    ({"prompt": "hi", "n": 2, "best_of": 1}, 400, "best_of=1 must be >= n=2", "best_of"),
    ({"prompt": "hi", "best_of": 3, "stream": True}, 400, "best_of > n cannot be streamed", "best_of"),
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
    (b'{"prompt": "hi", "temperature": ' + b"9" * 400 + b"}", 400, "temperature must be a number >= 0",
     "temperature"),
    (b'{"prompt": "\\ud800"}', 400, "prompt is not valid Unicode text", "prompt"),
    (b'{"prompt": [' + b"1" * 5000 + b"]}", 400, "not valid JSON", None),
    ({"prompt": "hi", "n": 0}, 400, "n=0 is out of range 1..16", "n"),
    ({"prompt": "hi", "stop": [""]}, 400, "stop must be a non-empty string", "stop"),
    ({"prompt": "hi", "stop": ["a"] * 5}, 400, "stop takes at most 4 strings", "stop"),
    ({"prompt": "hi", "logprobs": -1}, 400, "logprobs=-1 is out of range 0..20", "logprobs"),
]
CHAT = "/v1/chat/completions"
BAD_CHAT = [
    ({}, "messages is required", "messages"),
    ({"messages": []}, "messages is required", "messages"),
    ({"messages": [{"role": "user"}]}, "messages[0].content must be text", "messages"),
    ({"messages": [{"role": "king", "content": "x"}]}, "messages[0] must be an object whose role", "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "prompt": "x"}, "unknown field 'prompt'", "prompt"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs must be true or false", "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs needs logprobs=true",
     "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "max_completion_tokens": 2},
     "not both", "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 17}, "n=17 is out of range 1..16", "n"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "tools is not supported by moesys serve", "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
     "response_format is not supported", "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "best_of": 2}, "unknown field 'best_of'", "best_of"),
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
        for body, message, param in BAD_CHAT:
            got_status, got = post(url, body, CHAT)
            assert (got_status, got["error"]["param"]) == (400, param), got
            assert message in got["error"]["message"] and "\n" not in got["error"]["message"]
        assert post(url, b"", "/v1/models", "POST")[0] == 405
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


def test_a_body_that_does_not_arrive_is_refused_in_time(run_dir, monkeypatch):
    monkeypatch.setattr(app, "BODY_TIMEOUT_S", 0.5)
    with _server(run_dir) as url, _raw(url, b"Content-Length: 10\r\n", b"{") as sock:
        assert sock.recv(4096).startswith(b"HTTP/1.1 408")


def _outlasting(server: BackgroundServer, monkeypatch) -> threading.Event:
    """While the returned event is set, an answer stops after its first token (its prefill) until its client has
    gone and its job is cancelled: it outlasts its client however fast the machine."""
    worker = server.service.worker
    submit, decode, jobs, holding = worker.submit, worker.batch.step, [], threading.Event()

    def submitted(job):
        jobs.append(job)
        submit(job)

    def held_decode():
        if holding.is_set():
            job = jobs[-1]
            wait_until(lambda: job.cancelled, what="the client to leave and its answer to be cancelled")
        return decode()

    monkeypatch.setattr(worker, "submit", submitted)
    monkeypatch.setattr(worker.batch, "step", held_decode)
    holding.set()
    return holding


def test_clients_leaving_mid_answer_cancel_it_and_the_server_keeps_serving(run_dir, monkeypatch):
    server = _server(run_dir, "ring")
    holding = _outlasting(server, monkeypatch)
    with server as url:
        for left, stream_it in enumerate((True, False), 1):
            body = json.dumps({"prompt": "x", "max_tokens": 46, "stream": stream_it}).encode()
            with _raw(url, b"Content-Length: %d\r\n" % len(body), body) as sock:
                if stream_it:  # leave after the first token
                    received = b""
                    while b"data: " not in received:
                        chunk = sock.recv(4096)
                        assert chunk, f"the server closed the stream before its first token: {received!r}"
                        received += chunk
                    assert received.startswith(b"HTTP/1.1 200")
                else:  # leave once the generation has begun
                    wait_until(lambda: post(url, b"", "/health", "GET")[1]["running"] == 1,
                               what="the generation to begin")
            wait_until(lambda: post(url, b"", "/health", "GET")[1]["cancelled"] == left,
                       what="the answer its client left to be cancelled")
        holding.clear()
        status, got = post(url, {"prompt": "the weather"})
        assert status == 200
        assert got["choices"][0]["token_ids"] == run_inference(run_dir, INFER, prompts=["the weather"],
                                                               offload="ring")["tokens"][0]
        health = post(url, b"", "/health", "GET")[1]
    assert health["status"] == "ok" and health["failed"] == 0
    assert (health["cancelled"], health["completed"]) == (2, 1)  # both left answers were stopped, not finished


def test_a_dead_worker_is_a_503_and_health_says_so(run_dir, monkeypatch):
    server = _server(run_dir)
    with server as url:
        worker = server.service.worker

        def broken():
            raise RuntimeError("the loop broke")

        monkeypatch.setattr(worker, "_admit", broken)
        status, got = post(url, {"prompt": "hi"})
        assert status == 503 and "generation worker has died (RuntimeError: the loop broke)" in got["error"]["message"]
        status, got = post(url, {"prompt": "hi", "stream": True})
        assert status == 503 and "has died" in got["error"]["message"]  # refused before the stream begins
        status, health = post(url, b"", "/health", "GET")
        assert status == 503 and health["status"] == "dead" and health["error"] == "RuntimeError: the loop broke"


@pytest.mark.parametrize("streamed", [False, True])
def test_a_hung_generation_times_out_with_504_and_health_says_stuck_until_it_ends(run_dir, monkeypatch, streamed):
    server = _server(run_dir, request_timeout_s=1)
    release, returned = threading.Event(), threading.Event()
    model = server.service.loaded.model
    forward = model.forward

    def hung_forward(*args, **kwargs):  # a forward that does not come back until released
        assert release.wait(60)
        returned.set()
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", hung_forward)
    with server as url:
        try:
            if streamed:  # the stream has begun (200): the timeout is its last event
                chunks, done = stream(url, {"prompt": "hi", "max_tokens": 2})
                message = chunks[-1]["error"]["message"]
                assert done and len(chunks) == 1
            else:
                status, got = post(url, {"prompt": "hi", "max_tokens": 2})
                message = got["error"]["message"]
                assert status == 504
            assert "no answer within serve.request_timeout_s=1 s" in message
            assert not returned.is_set()  # answered while the forward still hangs
            wait_until(lambda: post(url, b"", "/health", "GET")[1]["status"] == "stuck", what="health to say stuck")
            status, health = post(url, b"", "/health", "GET")
            assert status == 503 and health["running"] == 1
            status, got = post(url, {"prompt": "hi", "stream": True})
            assert status == 503 and "more than serve.request_timeout_s=1 s" in got["error"]["message"]
        finally:
            release.set()
        wait_until(lambda: post(url, b"", "/health", "GET")[1]["status"] == "ok", what="health to say ok again")
        status, got = post(url, {"prompt": "hi", "max_tokens": 2})
        assert status == 200 and len(got["choices"][0]["token_ids"]) == 2
        health = post(url, b"", "/health", "GET")[1]
    assert (health["cancelled"], health["completed"], health["failed"]) == (1, 1, 0)


def test_prompt_arrays_echo_and_the_tokenizer_routes(run_dir, caplog):
    """lm-eval's requests: several prompts (texts, or token id lists) in one body, one choice per prompt and n,
    ordered by index; echo with logprobs scores each prompt; /tokenizer_info, /tokenize and /detokenize in vLLM's
    shapes; every refusal is logged with its reason."""
    texts = ["the weather", "a machine"]
    with caplog.at_level("INFO", "moesys.serve.requests"), _server(run_dir, max_batch_size=4) as url:
        status, got = post(url, {"prompt": texts, "n": 2, "temperature": 0.8, "seed": 3})
        assert status == 200 and [c["index"] for c in got["choices"]] == [0, 1, 2, 3]
        for c in got["choices"]:
            p, i = divmod(c["index"], 2)
            alone = run_inference(run_dir, {**INFER, "temperature": 0.8, "seed": 3 + i}, prompts=[texts[p]],
                                  offload="auto")
            assert c["token_ids"] == alone["tokens"][0] and c["text"] == alone["text"][0]
        assert got["usage"]["prompt_tokens"] == sum(len(t) for t in texts)

        ids = [list(t.encode()) for t in texts]
        status, got = post(url, {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0})
        assert status == 200
        for c, prompt, text in zip(got["choices"], ids, texts):
            lp = c["logprobs"]
            assert c["text"] == text + bytes(c["token_ids"]).decode(errors="replace")
            assert lp["tokens"] == [chr(t) for t in prompt] + [bytes(c["token_ids"]).decode(errors="replace")]
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])
            assert len(lp["top_logprobs"]) == len(prompt) + 1
            assert lp["text_offset"] == list(range(len(prompt) + 1))
        status, scored = post(url, {"prompt": "x" * 48, "echo": True, "logprobs": 0, "max_tokens": 0})
        assert status == 200 and scored["choices"][0]["token_ids"] == [] and scored["usage"]["completion_tokens"] == 0
        assert len(scored["choices"][0]["logprobs"]["token_logprobs"]) == 48

        status, info = post(url, b"", "/tokenizer_info", "GET")
        assert status == 200 and "eos_token" in info and info["model_max_length"] == 48
        assert post(url, {"prompt": "hi", "add_special_tokens": False}, "/tokenize") == (200, {
            "count": 2, "max_model_len": 48, "tokens": [104, 105], "token_strs": None})
        status, chat = post(url, {"messages": [{"role": "user", "content": "hi"}]}, "/tokenize")
        assert status == 200 and bytes(chat["tokens"]).decode() == "user: hi\nassistant:"
        assert post(url, {"tokens": [104, 105]}, "/detokenize") == (200, {"prompt": "hi"})
        status, bad = post(url, {"tokens": [104, 999]}, "/detokenize")
        assert status == 400 and bad["error"]["message"] == "token id 999 is outside the vocabulary 0..255"
        assert post(url, {"prompt": "hi", "tokens": [1]}, "/tokenize")[0] == 400
        assert post(url, {"prompt": "hi"}, "/nowhere")[0] == 404
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request id=")]
    assert any("route=/detokenize status=400" in line and
               'error="token id 999 is outside the vocabulary 0..255"' in line for line in lines)
    assert any("route=unrouted status=404" in line and 'error="POST /nowhere: Not Found"' in line for line in lines)


def test_every_sampling_field_seeded_gives_moesys_infers_tokens_and_a_stream_can_end_with_its_usage(run_dir):
    settings = {"temperature": 0.9, "top_k": 50, "top_p": 0.85, "presence_penalty": 0.6, "frequency_penalty": 1.1,
                "seed": 11}
    with _server(run_dir) as url:
        for body, infer in (({**settings, "logit_bias": {"101": 4.0, "32": -100}},
                             {**settings, "logit_bias": {101: 4.0, 32: -100.0}}),
                            ({"temperature": 0, "logit_bias": {"120": 100}, "frequency_penalty": 2.0},
                             {"temperature": 0.0, "logit_bias": {"120": 100}, "frequency_penalty": 2.0})):
            expected = run_inference(run_dir, {**INFER, **infer}, prompts=["the weather"], offload="none")
            status, got = post(url, {"prompt": "the weather", "user": "eval-7", **body})
            assert status == 200 and got["choices"][0]["token_ids"] == expected["tokens"][0]
        assert expected["tokens"][0] == [120] * 6  # a bias of 100 outweighs 5 x 2.0 of frequency penalty
        chunks, done = stream(url, {"prompt": "hi", "max_tokens": 3, "stream_options": {"include_usage": True}})
        assert done and chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
            "prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
        assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
