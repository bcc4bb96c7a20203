"""A bounded load test of `moesys serve` on loopback (its target: no valid request fails): the server the command runs
(its library call, in a fresh process) serves a random Hugging Face Mixtral checkpoint the bench writes itself,
CLIENTS concurrent clients send requests for DURATION_S seconds each with keep-alive connections, then the server
gets SIGTERM and must drain and exit 0.

The requests mix prompt lengths, max_tokens, greedy and sampled settings. Every answer is checked against
`run_inference` (what `moesys infer` runs) for the same prompt and seed: a request that is not a 200 with exactly
those tokens counts as failed, and any failure fails the benchmark; on a GPU a batched server decodes with a
compiled batch step whose bf16 products over several rows are not batch-invariant, so there its answers that part
from the lone run's are counted (`differing_from_lone_run`, greedy ones apart) instead of failed. Per setting:
requests/s, completion tokens/s, p50/p99 latency and time to first token (streamed requests), for one request at a
time with --offload none, auto and ring (the last two with RING_SLOTS of the model's layers on the device), and
continuous batching with --offload none and serve.max_batch_size=CLIENTS; `batched_vs_one_at_a_time_requests_per_s`
compares the last with the first, measured side by side in the same run.
"""

from __future__ import annotations

import http.client
import json
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

SHAPE = {"hidden": 256, "ffn": 1024, "layers": 4, "experts": 8, "vocab": 4096, "heads": 4}
DTYPE = "bfloat16"
"""The checkpoint's dtype: what Mixtral checkpoints ship in and servers serve."""
CLIENTS = 16
DURATION_S = 10.0
PROMPT_LENGTHS = (4, 12, 24, 40)
MAX_TOKENS_CHOICES = (8, 16, 24, 32)
PROMPT_TOKENS = max(PROMPT_LENGTHS)
MAX_TOKENS = max(MAX_TOKENS_CHOICES)
"""The longest prompt and answer of the mix (the requests' lengths and max_tokens vary below these)."""
RING_SLOTS = 1
SETTINGS = {"none": ("none", 1), "auto": ("auto", 1), "ring": ("ring", 1), "none_batched": ("none", CLIENTS)}
"""name: (--offload, serve.max_batch_size). max_batch_size 1 is one request at a time; none_batched is continuous
batching of up to CLIENTS sequences."""
START_TIMEOUT_S = 300.0
"""How long the server may take to load and listen."""
REQUEST_TIMEOUT_S = 120.0
"""A client's socket timeout; the load's threads are given DURATION_S plus two of these to end."""
STOP_TIMEOUT_S = 120.0
"""How long the server may take to drain and exit after SIGTERM."""


def _bodies(vocab: int) -> list[dict[str, Any]]:
    """Sixteen distinct requests of mixed prompt lengths and max_tokens, greedy and sampled (with several top_k
    and temperatures), half of them streamed."""
    bodies = []
    for i in range(16):
        length = PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)]
        prompt = [(97 + 31 * i + 7 * j) % vocab for j in range(length)]
        sampled = {"temperature": 0.6 + 0.1 * (i % 4), "top_k": (0, 50)[i % 4 // 2]} if i % 2 else {}
        bodies.append({"prompt": prompt, "max_tokens": MAX_TOKENS_CHOICES[i // 4], "seed": i, **sampled,
                       "stream": i % 4 < 2})
    return bodies


def _expected(checkpoint: Path, bodies: list[dict]) -> list[list[int]]:
    from runtime.inference.generate import run_inference

    out = []
    for body in bodies:
        infer = {"max_new_tokens": body["max_tokens"], "seed": body["seed"],
                 "temperature": body.get("temperature", 0.0), "top_k": body.get("top_k", 0)}
        out.append(run_inference(checkpoint, infer, prompt_ids=[body["prompt"]], offload="none")["tokens"][0])
    return out


def _checker(bodies: list[dict], expected: list[list[int]]) -> Callable[[int, list[int]], str | None]:
    """check(body index, tokens): None when the answer is exactly `moesys infer`'s tokens, else why not (batched or
    not: a row of the decode batch is computed as a lone step)."""
    def check(which: int, tokens: list[int]) -> str | None:
        return None if tokens == expected[which] else f"request {which}: tokens differ from moesys infer"

    return check


def _ask(conn: http.client.HTTPConnection, body: dict) -> tuple[list[int], float | None]:
    """One request's new token ids (streamed or not) and, streamed, the seconds to its first event; raises on
    anything but a 200."""
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
    if not body["stream"]:
        return json.loads(response.read())["choices"][0]["token_ids"], None
    first = response.readline()
    ttft = time.perf_counter() - start
    data = first + response.read()
    events = [line[6:] for line in data.split(b"\n") if line.startswith(b"data: ")]
    if not events or events[-1] != b"[DONE]":
        raise RuntimeError("stream did not end with [DONE]")
    return [t for e in events[:-1] for t in json.loads(e)["choices"][0]["token_ids"]], ttft


def listening_url(proc: subprocess.Popen, log: Path, timeout_s: float) -> str:
    """The address a starting `moesys serve` writes to its output file `log` ("listening on URL "), looked for until
    timeout_s; RuntimeError with the file's end when the process exits first or the time is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = log.read_text(errors="replace") if log.exists() else ""
        found = re.search(r"listening on (http://\S+) ", text)
        if found:
            return found.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"moesys serve exited with {proc.returncode} before listening: {text[-2000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"moesys serve did not listen within {timeout_s:g} s: {text[-2000:]}")
        time.sleep(0.05)


def serve_worker(checkpoint: str, offload: str, batch: int) -> None:
    """What `moesys serve checkpoint=CKPT --port 0 --offload OFFLOAD infer.ring_slots=RING_SLOTS
    serve.max_batch_size=BATCH` runs, through the library: the service opened, the address it listens on printed as
    the command prints it, served until SIGTERM drains it."""
    from runtime.serving.server import serve
    from runtime.serving.service import open_service

    service = open_service(checkpoint, {"ring_slots": RING_SLOTS}, {"port": 0, "max_batch_size": batch}, offload)
    serve(service, on_listen=lambda url: print(f"moesys serve listening on {url} (bench)", flush=True))


def _start(checkpoint: Path, offload: str, batch: int, log: Path) -> tuple[subprocess.Popen, str, int]:
    """The server (serve_worker) in a fresh process of this interpreter on a free loopback port, its output going to
    `log` (a pipe nobody reads during the load could fill and block the server): (process, host, port)."""
    code = "import json, sys; from runtime.bench.serve import serve_worker; serve_worker(*json.loads(sys.argv[1]))"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", code, json.dumps([str(checkpoint), offload, batch])],
                                stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        url = urlsplit(listening_url(proc, log, START_TIMEOUT_S))
        if url.hostname is None or url.port is None:
            raise RuntimeError(f"the server announced {url.geturl()}, which names no host and port")
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
    return proc, url.hostname, url.port


def _load(host: str, port: int, bodies: list[dict], check: Callable[[int, list[int]], str | None],
          clients: int, duration_s: float) -> dict[str, Any]:
    """`clients` threads, each asking in turn until the time is up; then each answer is checked (on this thread:
    the reference model is not shared between threads). Latency per request, failures with a reason."""
    answers: list[tuple[int, list[int], float, float | None]] = []
    failures: list[str] = []
    lock = threading.Lock()
    stop_at = time.perf_counter() + duration_s

    def client(index: int) -> None:
        conn = http.client.HTTPConnection(host, port, timeout=REQUEST_TIMEOUT_S)
        turn = index
        while time.perf_counter() < stop_at:
            which = turn % len(bodies)
            turn += 1
            start = time.perf_counter()
            try:
                tokens, ttft = _ask(conn, bodies[which])
                with lock:
                    answers.append((which, tokens, time.perf_counter() - start, ttft))
            except (OSError, RuntimeError, ValueError, http.client.HTTPException) as exc:
                with lock:
                    failures.append(f"request {which}: {type(exc).__name__}: {exc}")
                conn.close()
                conn = http.client.HTTPConnection(host, port, timeout=REQUEST_TIMEOUT_S)
        conn.close()

    began = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + duration_s + 2 * REQUEST_TIMEOUT_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    elapsed = time.perf_counter() - began
    stuck = sum(t.is_alive() for t in threads)
    with lock:
        answers, failures = list(answers), list(failures)
    if stuck:
        failures.append(f"{stuck} client(s) still waiting {2 * REQUEST_TIMEOUT_S:g} s after the load's end")
    good = []
    for answer in answers:
        problem = check(answer[0], answer[1])
        if problem:
            failures.append(problem)
        else:
            good.append(answer)
    return {**_summary(good, elapsed), "failed": len(failures), "failures": failures[:5]}


def _percentile(sorted_ms: list[float], q: float) -> float | None:
    return sorted_ms[min(len(sorted_ms) - 1, int(q * len(sorted_ms)))] if sorted_ms else None


def _summary(answers: list[tuple[int, list[int], float, float | None]], elapsed: float) -> dict[str, Any]:
    """Requests and tokens per second, latency and (streamed requests) time-to-first-token percentiles."""
    ms = sorted(1e3 * a[2] for a in answers)
    ttft = sorted(1e3 * a[3] for a in answers if a[3] is not None)
    return {"requests": len(answers), "requests_per_s": len(answers) / elapsed,
            "tokens_per_s": sum(len(a[1]) for a in answers) / elapsed,
            "p50_latency_ms": statistics.median(ms) if ms else None, "p99_latency_ms": _percentile(ms, 0.99),
            "p50_ttft_ms": statistics.median(ttft) if ttft else None, "p99_ttft_ms": _percentile(ttft, 0.99)}


def _batch_invariant(batch: int) -> bool:
    """Whether a server with serve.max_batch_size=batch computes each row as its lone step: on a GPU a batch is
    decoded by the compiled batch step, whose bf16 products over several rows need not round as one-row products
    do (runtime/inference/decode.py BatchDecodeStep)."""
    import torch

    return batch == 1 or not torch.cuda.is_available()


def _warm(host: str, port: int, bodies: list[dict], clients: int) -> None:
    """One request per client at once (a batched server compiles and records its batch sizes' steps here, not
    under the load)."""
    def ask(which: int) -> None:
        conn = http.client.HTTPConnection(host, port, timeout=START_TIMEOUT_S)
        try:
            _ask(conn, bodies[which % len(bodies)])
        finally:
            conn.close()

    threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(START_TIMEOUT_S)


def _setting(checkpoint: Path, offload: str, batch: int, bodies: list[dict], expected: list[list[int]],
             clients: int, duration_s: float, log: Path) -> dict[str, Any]:
    check = _checker(bodies, expected)
    exact = _batch_invariant(batch)
    differing: list[int] = []
    if not exact:  # tokens that part from the lone run's at a rounding near-tie are counted, not failures
        def check(which: int, tokens: list[int], _exact=check) -> str | None:
            if _exact(which, tokens) is not None:
                differing.append(which)
            return None if len(tokens) == len(expected[which]) else f"request {which}: {len(tokens)} tokens"
    proc, host, port = _start(checkpoint, offload, batch, log)
    try:
        _warm(host, port, bodies, clients if batch > 1 else 1)  # the first forwards' one-off costs are not load
        result = _load(host, port, bodies, check, clients, duration_s)
        result["batch_invariant"] = exact
        if not exact:
            greedy = [which for which in range(len(bodies)) if not bodies[which].get("temperature")]
            result["differing_from_lone_run"] = len(differing)
            result["greedy_differing_from_lone_run"] = sum(which in greedy for which in differing)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            result["failures"].append(f"still running {STOP_TIMEOUT_S:g} s after SIGTERM")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    result["exit_code"] = proc.returncode
    if proc.returncode != 0:
        output = log.read_text(errors="replace").strip()
        result["failures"].append(f"exit {proc.returncode} after SIGTERM: {output[-300:]}")
    return result


def run_serve_bench(clients: int = CLIENTS, duration_s: float = DURATION_S, settings: dict | None = None,
                    workdir: Path | None = None, dtype: str = DTYPE) -> dict[str, Any]:
    """Each setting under the same load; raises when any valid request failed or the server did not exit 0."""
    import torch

    from runtime.inference.random_checkpoint import write_random_mixtral

    root = Path(tempfile.mkdtemp(prefix="moesys-bench-serve-", dir=workdir))
    try:
        checkpoint = root / "mixtral"
        size = write_random_mixtral(checkpoint, SHAPE["hidden"], SHAPE["ffn"], SHAPE["layers"], SHAPE["experts"],
                                    SHAPE["vocab"], heads=SHAPE["heads"], dtype=getattr(torch, dtype), max_seq_len=256)
        bodies = _bodies(SHAPE["vocab"])
        expected = _expected(checkpoint, bodies)
        results = {name: _setting(checkpoint, offload, batch, bodies, expected, clients, duration_s,
                                  root / f"serve-{name}.log")
                   for name, (offload, batch) in (settings or SETTINGS).items()}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    broken = {name: r["failures"] for name, r in results.items() if r["failures"]}
    if broken:
        raise RuntimeError(f"moesys bench serve: valid requests failed: {json.dumps(broken)}")
    for r in results.values():
        del r["failures"]
    out: dict[str, Any] = {"shape": SHAPE, "dtype": dtype, "checkpoint_bytes": size, "ring_slots": RING_SLOTS,
                           "clients": clients, "duration_s": duration_s, "prompt_tokens": PROMPT_TOKENS,
                           "max_tokens": MAX_TOKENS, "settings": results}
    base = results.get("none", {}).get("requests_per_s")
    for name, r in results.items():
        if name != "none" and base:
            out[f"{name}_vs_none_requests_per_s"] = r["requests_per_s"] / base
    if base and "none_batched" in results:
        out["batched_vs_one_at_a_time_requests_per_s"] = results["none_batched"]["requests_per_s"] / base
    out["prompt_lengths"], out["max_tokens_choices"] = list(PROMPT_LENGTHS), list(MAX_TOKENS_CHOICES)
    return out
