"""The processes `moesys bench infer` measures in (runtime/bench/infer.py): transformers (default generate, its
static cache, accelerate's offload) and moesys's modes, each decoding greedy tokens with one model and step reused
across timed generations, at a given thread count, reporting as it goes (PARTIAL lines) so that a process killed at
its time limit still tells what it measured.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROMPT = list(range(100, 116))
NEW_TOKENS = 32
REPEATS = 3
PAIRED_ROUNDS = 5

_WORKER = False
"""Set in a worker process `_subprocess` started: its PARTIAL lines go to the parent."""


def _partial(result: dict) -> None:
    """In a worker process, print what it has measured so far as a PARTIAL line: a worker killed at its time limit
    still gives it (`_subprocess` reads the last one)."""
    if _WORKER:
        print("PARTIAL " + json.dumps(result), flush=True)


def _decode_rate(generate, new_tokens: int, repeats: int, measured: dict | None = None,
                 report: Callable[[dict], None] = _partial) -> tuple[list[int], float]:
    """(tokens, decode tokens/s): generate(n) makes n greedy tokens; decode = (t(n) - t(1)) over n - 1 tokens. The
    warm-up's time and each rate are added to `measured` and reported (as PARTIAL lines) as they come."""
    measured = {} if measured is None else measured
    start = time.perf_counter()
    generate(2)  # warm-up (compiles a compiled step)
    measured["warm_up_s"] = time.perf_counter() - start
    report(measured)
    rates, tokens = measured.setdefault("decode_rates", []), []
    for _ in range(repeats):
        start = time.perf_counter()
        generate(1)
        first = time.perf_counter() - start
        start = time.perf_counter()
        tokens = generate(new_tokens)
        rates.append((new_tokens - 1) / max(1e-9, time.perf_counter() - start - first))
        measured["decode_tokens_per_s"] = statistics.median(rates)
        report(measured)
    return tokens, statistics.median(rates)


def _threads(threads: int | None) -> int:
    """Set this process's intra-op threads (all usable CPUs when None, as `moesys infer` runs); the count."""
    import torch

    from runtime.host.topology import set_cpu_threads

    if threads is None:
        return set_cpu_threads(1)
    torch.set_num_threads(threads)
    return threads


def _hf_worker(checkpoint: str, slots: int, offload_dir: str | None, new_tokens: int, repeats: int,
               threads: int | None = None, static: bool = False) -> dict:
    """transformers (+ accelerate's offload when offload_dir is given), in this process. With a GPU, the model is
    on it and accelerate keeps the dense weights and layers 0..K-1's experts there, the other experts in host
    memory (its CPU offload); without one, everything is in memory and the other experts go to disk.

    static: transformers' own fastest decode, a static cache (generate compiles the forward on a GPU itself); on a
    CPU, where generate does not compile, the static cache eager and then with the forward compiled (the recipe of
    transformers' docs), the faster of the two reported (`compiled` says which)."""
    import torch
    import transformers

    from runtime.bench.decode_bound import kv_cache_bytes

    measured: dict[str, Any] = {"threads": _threads(threads)}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    start = time.perf_counter()
    kwargs: dict[str, Any] = {"dtype": torch.bfloat16}
    if offload_dir is not None:
        config = transformers.AutoConfig.from_pretrained(checkpoint)
        place = 0 if device == "cuda" else "cpu"
        device_map = {"model.embed_tokens": place, "model.norm": place, "model.rotary_emb": place, "lm_head": place}
        for i in range(config.num_hidden_layers):
            for part in ("self_attn", "input_layernorm", "post_attention_layernorm", "mlp.gate"):
                device_map[f"model.layers.{i}.{part}"] = place
            device_map[f"model.layers.{i}.mlp.experts"] = place if i < slots else (
                "cpu" if device == "cuda" else "disk")
        kwargs.update(device_map=device_map, offload_folder=offload_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, **kwargs).eval()
    if offload_dir is None:
        model.to(device)
    ids = torch.tensor([PROMPT], device=device)
    measured["load_s"] = time.perf_counter() - start
    _partial(measured)
    cfg = model.config
    capacity = -(-(len(PROMPT) + new_tokens) // 64) * 64
    cache = transformers.StaticCache(config=cfg, max_cache_len=capacity) if static else None

    def generate(n: int) -> list[int]:
        if cache is not None:
            cache.reset()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                                 **({"past_key_values": cache} if cache is not None else {}))
        return out[0, len(PROMPT):].tolist()

    tokens, rate = _decode_rate(generate, new_tokens, repeats, measured)
    measured.pop("decode_rates", None)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    positions = capacity if static else len(PROMPT) + new_tokens / 2  # a dynamic cache grows with the token
    measured.update(offload_folder_bytes=sum(f.stat().st_size for f in Path(offload_dir).rglob("*") if f.is_file())
                    if offload_dir else 0, kv_cache_bytes_per_token=kv_cache_bytes(
                        cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, int(positions), 2))
    compiled = static and device == "cuda"
    if static and device == "cpu":  # compiled where that pays: measured beside the eager static cache
        eager = {**measured, "tokens": tokens, "decode_tokens_per_s": rate, "compiled": False}
        _partial({**eager, "complete": True})  # stands if compiling runs past the time limit
        measured["eager_tokens_per_s"] = rate
        model.forward = torch.compile(model.forward, dynamic=False)
        compiled_run: dict[str, Any] = {}
        measured["compiled_run"] = compiled_run
        compiled_tokens, compiled_rate = _decode_rate(
            generate, new_tokens, repeats, compiled_run,
            report=lambda run: _partial({**eager, "complete": True, "compiled_run": run}))
        compiled_run.pop("decode_rates", None)
        measured["compiled_tokens_per_s"] = compiled_rate
        if compiled_rate > rate:
            tokens, rate, compiled = compiled_tokens, compiled_rate, True
    read_before = _read_bytes()
    generate(new_tokens)
    return {**measured, "tokens": tokens, "decode_tokens_per_s": rate, "compiled": compiled,
            "disk_read_bytes_per_token": (_read_bytes() - read_before) / new_tokens}


def _moesys_worker(checkpoint: str, mode: str, slots: int, new_tokens: int, repeats: int,
                   compile: bool | None = None, forward_step: bool = False, against_forward: bool = False,
                   threads: int | None = None, counts: bool = True, experts_form: str = "auto") -> dict:
    """moesys in this process: the checkpoint opened and placed once (on the GPU when there is one), one decode
    step (compiled or not, as infer.compile says; the model's forward per token with forward_step, the static
    step's baseline) reused by timed generations, then its counts under the profiler (unless not counts) and the
    bytes its token reads. against_forward: also the static step against the forward-per-token step in this
    process, generations alternating (PAIRED_ROUNDS), the ratio `none_vs_none_forward` reports: separate processes
    differ by more than the two steps do on a shared machine. threads: torch's intra-op threads (default: every
    usable CPU, as `moesys infer` decodes); experts_form: the decode step's (runtime/inference/decode.py)."""
    import torch

    from runtime.bench.decode_bound import token_bytes
    from runtime.bench.forward_step import ForwardStep
    from runtime.inference.decode import DecodeStep, compile_default
    from runtime.inference.generate import generate
    from runtime.inference.load import open_checkpoint
    from runtime.inference.offloaders import make_offloader
    from runtime.inference.step_counts import count_decode
    from runtime.model import cpu_gemv

    measured: dict[str, Any] = {"threads": _threads(threads)}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    measured["cpu_gemv"] = device.type == "cpu" and cpu_gemv.kernel() is not None  # built before the clock starts
    start = time.perf_counter()
    loaded = open_checkpoint(checkpoint, device=device)
    model = loaded.model
    offloader = make_offloader(model, mode, device, slots, source=loaded.experts)
    measured["load_s"] = time.perf_counter() - start
    _partial(measured)
    step: DecodeStep
    if forward_step:
        step = ForwardStep(model)
    else:
        step = DecodeStep(model, compile=compile_default(device) if compile is None else compile,
                          experts_form=experts_form)
    measured["compiled"] = step.compiled
    run = lambda n: generate(model, [PROMPT], n, offloader=offloader, step=step)  # noqa: E731
    tokens, rate = _decode_rate(lambda n: run(n).tokens[0], new_tokens, repeats, measured)
    beside = {}
    if against_forward:  # the same model and offloader, the two steps' generations alternating
        forward = ForwardStep(model)
        run_forward = lambda n: generate(model, [PROMPT], n, offloader=offloader, step=forward)  # noqa: E731
        _decode_rate(lambda n: run_forward(n).tokens[0], 2, 1, {})  # warm-up
        pairs = [(_decode_rate(lambda n: run(n).tokens[0], new_tokens, 1, {})[1],
                  _decode_rate(lambda n: run_forward(n).tokens[0], new_tokens, 1, {})[1])
                 for _ in range(PAIRED_ROUNDS)]
        beside = {"same_process_vs_forward": statistics.median(a / b for a, b in pairs),
                  "same_process_tokens_per_s": [round(a, 2) for a, _ in pairs],
                  "same_process_forward_tokens_per_s": [round(b, 2) for _, b in pairs]}
    offloader.reset_stats()
    read_before = _read_bytes()
    gen = run(new_tokens)
    read = _read_bytes() - read_before
    stats = offloader.stats()
    if counts:
        c = count_decode(run, len(model.layers), cuda=device.type == "cuda")
        beside.update(host_syncs_per_token=c.host_syncs_per_token, ops_per_layer_token=c.ops_per_layer_token,
                      kernel_reads_per_token=c.kernel_reads_per_token)
    offloader.close()
    dense, per_expert = token_bytes(model)
    routed = model.cfg.top_k * per_expert  # batch 1: K distinct experts a MoE layer
    layers = len(stats["placement"])
    resident = sum(p == "resident" for p in stats["placement"]) if mode == "auto" else layers
    host = stats["store_bytes"] if mode == "auto" else stats["copied_bytes"]
    measured.pop("decode_rates", None)
    return {**measured, "tokens": tokens, "decode_tokens_per_s": rate, "placement": stats["placement"],
            "device_read_bytes_per_token": dense + resident * routed, "host_read_bytes_per_token": host / new_tokens,
            "kv_cache_bytes_per_token": gen.kv_cache_bytes,
            "token_bytes": {"dense": dense, "routed_experts": layers * routed,
                            "streamed_experts": (layers - resident) * routed if mode == "auto" else 0},
            "store_bytes_per_token": stats["store_bytes"] / new_tokens,
            "copied_bytes_per_token": stats["copied_bytes"] / new_tokens,
            "disk_read_bytes_per_token": read / new_tokens, **beside}


def _read_bytes() -> int:
    from runtime.host.memory_probe import disk_read_bytes

    return disk_read_bytes()
