"""A bounded load test of `moesys serve` on loopback (its target: no valid request fails): the real command serves a
random Hugging Face Mixtral checkpoint it writes itself, CLIENTS concurrent clients send requests for DURATION_S
seconds each with keep-alive connections, then the server gets SIGTERM and must drain and exit 0.

Every answer is checked against `run_inference` (what `moesys infer` runs) for the same prompt and seed: a
request that is not a 200 with exactly those tokens counts as failed (except that a batched greedy answer may
leave that path where float rounding flipped a near-tie: every token's logit within NEAR_TIE of the best one), and
any failure fails the benchmark. Per setting: requests/s, completion tokens/s and p50/p99 latency, for --offload
none, auto and ring (the last two with RING_SLOTS of the model's layers on the device), and none with
serve.max_batch_size=CLIENTS.
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
from pathlib import Path
from typing import Any, Callable, Optional
from urllib.parse import urlsplit

SHAPE = {"hidden": 256, "ffn": 1024, "layers": 4, "experts": 8, "vocab": 4096, "heads": 4}
CLIENTS = 8
DURATION_S = 8.0
PROMPT_TOKENS = 16
MAX_TOKENS = 16
RING_SLOTS = 1
SETTINGS = {"none": ("none", 1), "auto": ("auto", 1), "ring": ("ring", 1), "none_batched": ("none", CLIENTS)}
"""name: (--offload, serve.max_batch_size)."""
NEAR_TIE = 1e-4
"""How far below the best logit a batched greedy answer's token may be: batching moves this model's logits by about
1e-6 (fp32 rounding), while its top two logits are about 0.06 apart (median) and other tokens far more."""
START_TIMEOUT_S = 300.0
"""How long the server may take to load and listen."""
REQUEST_TIMEOUT_S = 120.0
"""A client's socket timeout; the load's threads are given DURATION_S plus two of these to end."""
STOP_TIMEOUT_S = 120.0
"""How long the server may take to drain and exit after SIGTERM."""


def _bodies(vocab: int) -> list[dict[str, Any]]:
    """Eight distinct requests of one prompt length: greedy and sampled, half of them streamed."""
    bodies = []
    for i in range(8):
        prompt = [(97 + 31 * i + 7 * j) % vocab for j in range(PROMPT_TOKENS)]
        sampled = {"temperature": 0.8, "top_k": 50} if i % 2 else {}
        bodies.append({"prompt": prompt, "max_tokens": MAX_TOKENS, "seed": i, **sampled, "stream": i % 4 < 2})
    return bodies


def _expected(checkpoint: Path, bodies: list[dict]) -> list[list[int]]:
    from runtime.inference.generate import run_inference

    out = []
    for body in bodies:
        infer = {"max_new_tokens": body["max_tokens"], "seed": body["seed"],
                 "temperature": body.get("temperature", 0.0), "top_k": body.get("top_k", 0)}
        out.append(run_inference(checkpoint, infer, prompt_ids=[body["prompt"]], offload="none")["tokens"][0])
    return out


def _checker(checkpoint: Path, bodies: list[dict], expected: list[list[int]],
             batched: bool) -> Callable[[int, list[int]], Optional[str]]:
    """check(body index, tokens): None when the answer is right, else why not. Unbatched: exactly `moesys infer`'s
    tokens. Batched greedy: those, or tokens each within NEAR_TIE of the best logit given the ones before it."""
    model: list = []
    seen: dict[tuple, Optional[str]] = {}

    def follows_greedy(prompt: list[int], tokens: list[int]) -> bool:
        from runtime.inference.generate import generate
        from runtime.inference.load import load_model

        if not model:
            model.append(load_model(checkpoint).model.eval())
        for i, token in enumerate(tokens):
            logits_V = generate(model[0], [prompt + tokens[:i]], 1, keep_logits=True).logits[0][0]
            if logits_V[token] < logits_V.max() - NEAR_TIE:
                return False
        return True

    def check(which: int, tokens: list[int]) -> Optional[str]:
        key = (which, tuple(tokens))
        if key not in seen:
            body = bodies[which]
            right = tokens == expected[which] or (
                batched and not body.get("temperature") and len(tokens) == len(expected[which])
                and follows_greedy(body["prompt"], tokens))
            seen[key] = None if right else f"request {which}: tokens differ from moesys infer"
        return seen[key]

    return check


def _ask(conn: http.client.HTTPConnection, body: dict) -> list[int]:
    """One request's new token ids (streamed or not); raises on anything but a 200."""
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {data[:200]!r}")
    if not body["stream"]:
        return json.loads(data)["choices"][0]["token_ids"]
    events = [line[6:] for line in data.split(b"\n") if line.startswith(b"data: ")]
    if not events or events[-1] != b"[DONE]":
        raise RuntimeError("stream did not end with [DONE]")
    return [t for e in events[:-1] for t in json.loads(e)["choices"][0]["token_ids"]]


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


def _start(checkpoint: Path, offload: str, batch: int, log: Path) -> tuple[subprocess.Popen, str, int]:
    """The real `moesys serve` on a free loopback port, its output going to `log` (a pipe nobody reads during the
    load could fill and block the server): (process, host, port)."""
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "moesys_cli", "serve", f"checkpoint={checkpoint}", "--port",
                                 "0", "--offload", offload, f"infer.ring_slots={RING_SLOTS}",
                                 f"serve.max_batch_size={batch}"], stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        url = urlsplit(listening_url(proc, log, START_TIMEOUT_S))
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
    return proc, url.hostname, url.port


def _load(host: str, port: int, bodies: list[dict], check: Callable[[int, list[int]], Optional[str]],
          clients: int, duration_s: float) -> dict[str, Any]:
    """`clients` threads, each asking in turn until the time is up; then each answer is checked (on this thread:
    the reference model is not shared between threads). Latency per request, failures with a reason."""
    answers: list[tuple[int, list[int], float]] = []
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
                tokens = _ask(conn, bodies[which])
                with lock:
                    answers.append((which, tokens, time.perf_counter() - start))
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
    latencies = []
    for which, tokens, seconds in answers:
        problem = check(which, tokens)
        if problem:
            failures.append(problem)
        else:
            latencies.append(seconds)
    ms = sorted(1e3 * s for s in latencies)
    return {"requests": len(latencies), "failed": len(failures), "failures": failures[:5],
            "requests_per_s": len(latencies) / elapsed, "tokens_per_s": len(latencies) * MAX_TOKENS / elapsed,
            "p50_latency_ms": statistics.median(ms) if ms else None,
            "p99_latency_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))] if ms else None}


def _setting(checkpoint: Path, offload: str, batch: int, bodies: list[dict], expected: list[list[int]],
             clients: int, duration_s: float, log: Path) -> dict[str, Any]:
    check = _checker(checkpoint, bodies, expected, batched=batch > 1)
    proc, host, port = _start(checkpoint, offload, batch, log)
    try:
        conn = http.client.HTTPConnection(host, port, timeout=REQUEST_TIMEOUT_S)
        _ask(conn, bodies[0])  # warm-up: the first forward's one-off costs are not load
        conn.close()
        result = _load(host, port, bodies, check, clients, duration_s)
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


def run_serve_bench(clients: int = CLIENTS, duration_s: float = DURATION_S, settings: Optional[dict] = None,
                    workdir: Optional[Path] = None) -> dict[str, Any]:
    """Each setting under the same load; raises when any valid request failed or the server did not exit 0."""
    from runtime.inference.random_checkpoint import write_random_mixtral
    import torch

    root = Path(tempfile.mkdtemp(prefix="moesys-bench-serve-", dir=workdir))
    try:
        checkpoint = root / "mixtral"
        size = write_random_mixtral(checkpoint, SHAPE["hidden"], SHAPE["ffn"], SHAPE["layers"], SHAPE["experts"],
                                    SHAPE["vocab"], heads=SHAPE["heads"], dtype=torch.float32, max_seq_len=256)
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
    out: dict[str, Any] = {"shape": SHAPE, "checkpoint_bytes": size, "ring_slots": RING_SLOTS, "clients": clients,
                           "duration_s": duration_s, "prompt_tokens": PROMPT_TOKENS, "max_tokens": MAX_TOKENS,
                           "settings": results}
    base = results.get("none", {}).get("requests_per_s")
    for name, r in results.items():
        if name != "none" and base:
            out[f"{name}_vs_none_requests_per_s"] = r["requests_per_s"] / base
    return out
