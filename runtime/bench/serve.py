"""A bounded load test of `moesys serve` on loopback (issue 17's reliability target): the real command serves a
random Hugging Face Mixtral checkpoint it writes itself, CLIENTS concurrent clients send requests for DURATION_S
seconds each with keep-alive connections, then the server gets SIGTERM and must drain and exit 0.

Every answer is checked against `run_inference` (what `moesys infer` runs) for the same prompt and seed: a
request that is not a 200 with exactly those tokens counts as failed, and any failure fails the benchmark. Per
setting: requests/s, completion tokens/s and p50/p99 latency, for --offload none, auto and ring (the last two
with RING_SLOTS of the model's layers on the device), and none with serve.max_batch_size=CLIENTS.
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
from typing import Any, Optional

SHAPE = {"hidden": 256, "ffn": 1024, "layers": 4, "experts": 8, "vocab": 4096, "heads": 4}
CLIENTS = 8
DURATION_S = 8.0
PROMPT_TOKENS = 16
MAX_TOKENS = 16
RING_SLOTS = 1
SETTINGS = {"none": ("none", 1), "auto": ("auto", 1), "ring": ("ring", 1), "none_batched": ("none", CLIENTS)}
"""name: (--offload, serve.max_batch_size)."""


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
    if events[-1] != b"[DONE]":
        raise RuntimeError("stream did not end with [DONE]")
    return [t for e in events[:-1] for t in json.loads(e)["choices"][0]["token_ids"]]


def _start(checkpoint: Path, offload: str, batch: int) -> tuple[subprocess.Popen, str, int]:
    """The real `moesys serve` on a free loopback port: (process, host, port)."""
    proc = subprocess.Popen([sys.executable, "-m", "moesys_cli", "serve", f"checkpoint={checkpoint}", "--port", "0",
                             "--offload", offload, f"infer.ring_slots={RING_SLOTS}", f"serve.max_batch_size={batch}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    found = re.search(r"listening on http://([^:\s]+):(\d+)", line)
    if not found:
        proc.kill()
        raise RuntimeError(f"moesys serve did not start: {line}{proc.stderr.read()[-2000:]}")
    return proc, found.group(1), int(found.group(2))


def _load(host: str, port: int, bodies: list[dict], expected: list[list[int]], clients: int,
          duration_s: float) -> dict[str, Any]:
    """`clients` threads, each asking in turn until the time is up; latency per request, failures with a reason."""
    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()
    stop_at = time.perf_counter() + duration_s

    def client(index: int) -> None:
        conn = http.client.HTTPConnection(host, port, timeout=120)
        turn = index
        while time.perf_counter() < stop_at:
            which = turn % len(bodies)
            turn += 1
            start = time.perf_counter()
            try:
                tokens = _ask(conn, bodies[which])
                problem = None if tokens == expected[which] else f"request {which}: tokens differ from moesys infer"
            except (OSError, RuntimeError, ValueError, http.client.HTTPException) as exc:
                problem = f"request {which}: {type(exc).__name__}: {exc}"
                conn.close()
                conn = http.client.HTTPConnection(host, port, timeout=120)
            with lock:
                if problem:
                    failures.append(problem)
                else:
                    latencies.append(time.perf_counter() - start)
        conn.close()

    began = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - began
    ms = sorted(1e3 * s for s in latencies)
    return {"requests": len(latencies), "failed": len(failures), "failures": failures[:5],
            "requests_per_s": len(latencies) / elapsed, "tokens_per_s": len(latencies) * MAX_TOKENS / elapsed,
            "p50_latency_ms": statistics.median(ms) if ms else None,
            "p99_latency_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))] if ms else None}


def _setting(checkpoint: Path, offload: str, batch: int, bodies: list[dict], expected: list[list[int]],
             clients: int, duration_s: float) -> dict[str, Any]:
    proc, host, port = _start(checkpoint, offload, batch)
    try:
        conn = http.client.HTTPConnection(host, port, timeout=120)
        _ask(conn, bodies[0])  # warm-up: the first forward's one-off costs are not load
        conn.close()
        result = _load(host, port, bodies, expected, clients, duration_s)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    result["exit_code"] = proc.returncode
    if proc.returncode != 0:
        result["failures"].append(f"exit {proc.returncode} after SIGTERM: {err.strip()[-300:]}")
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
        results = {name: _setting(checkpoint, offload, batch, bodies, expected, clients, duration_s)
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
