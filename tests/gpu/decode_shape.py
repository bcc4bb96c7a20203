"""The decode step's GPU measurements in one call that fits a short device lease: `moesys bench infer`'s systems at
its large shape (a 16-layer random bf16 Mixtral, 11.9 GB), each in a fresh process with its share of a time limit,
beside its bandwidth bound, and a CUDA profile of the compiled static step (kernels, launches and GPU-busy share
per token). Usage: python tests/gpu/decode_shape.py LIMIT_S SYSTEMS [SLOTS [SIZE]], SYSTEMS a comma list of none,
none_gather (the static step with gathered experts: `DecodeStep`'s experts_form), auto, ring, transformers,
transformers_static, accelerate, profile, profile_gather and profile_auto (the compiled step under the CUDA
profiler), run in that order; SIZE one of bench infer's (default large)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from runtime.bench import infer as bench
from runtime.bench.infer_bounds import apply_bounds, measure_bandwidths

WORKERS = {"transformers": ("_hf_worker", {"offload_dir": None}),
           "transformers_static": ("_hf_worker", {"offload_dir": None, "static": True}),
           "accelerate": ("_hf_worker", {"offload_dir": "offload"}),
           "none": ("_moesys_worker", {"mode": "none", "counts": False}),
           "none_gather": ("_moesys_worker", {"mode": "none", "counts": False, "experts_form": "gather"}),
           "auto": ("_moesys_worker", {"mode": "auto", "counts": False}),
           "ring": ("_moesys_worker", {"mode": "ring", "counts": False})}
REPEATS = 2
"""Generations timed per system: on a GPU each takes a second or less; loading and compiling take the time."""
SHARES = {"none": 1.4, "none_gather": 1.6, "auto": 1.4, "transformers_static": 1.2, "ring": 1.0, "accelerate": 0.8,
          "transformers": 0.6, "profile": 0.8, "profile_gather": 1.0, "profile_auto": 0.8}
"""Each system's weight in the time left when it starts: compiled steps (none, auto, transformers' static cache)
spend most of theirs compiling (gathered experts longer: inductor tunes each reduction); the time a system leaves
unused goes to the ones after it."""
PROFILE_TOKENS = 8
TOP_KERNELS = 10
"""Kernels (and CPU operators) named in the profile: the ones with the most time per token (GPU time; self CPU
time)."""


def profile_compiled_token(checkpoint: str, mode: str = "none", slots: int = 4, experts_form: str = "auto") -> dict:
    """One compiled static decode token on CUDA under torch.profiler: CUDA kernels and runtime launches per token,
    the GPU's kernel time against the token's wall time (busy share), and the kernels and CPU operators that take
    the most of it (per token: calls and seconds, by name; an offloaded mode's CPU work shows in the latter), from the
    difference of two generation lengths so the prefill cancels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from runtime.inference.decode import DecodeStep
    from runtime.inference.generate import generate
    from runtime.inference.load import open_checkpoint
    from runtime.inference.offloaders import make_offloader

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    loaded = open_checkpoint(checkpoint, device=device)
    offloader = make_offloader(loaded.model, mode, device, slots, source=loaded.experts)
    step = DecodeStep(loaded.model, compile=cuda, experts_form=experts_form)
    run = lambda n: generate(loaded.model, [bench.PROMPT], n, offloader=offloader, step=step)  # noqa: E731
    run(4)
    run(2 + PROFILE_TOKENS)

    def measure(n: int) -> dict:
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        sync()
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            start = time.perf_counter()
            run(n)
            sync()
            wall = time.perf_counter() - start
        events = prof.events()
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        cpu_ops = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
        launches = [e for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch",
                                                    "cuLaunchKernelEx", "cudaLaunchKernelExC")]
        graphs = [e for e in events if e.name == "cudaGraphLaunch"]
        return {"wall_s": wall, "kernels": len(kernels), "launches": len(launches), "graph_launches": len(graphs),
                "kernel_s": sum(e.device_time_total for e in kernels) / 1e6,
                "kernels_by_name": _by_name(kernels, lambda e: e.device_time_total),
                "cpu_ops_by_name": _by_name(cpu_ops, lambda e: e.self_cpu_time_total)}

    short, long = measure(2), measure(2 + PROFILE_TOKENS)
    per = {k: (long[k] - short[k]) / PROFILE_TOKENS for k in short if not k.endswith("_by_name")}
    offloader.close()
    return {"mode": mode, "experts_form": experts_form, "per_token": per,
            "gpu_busy_share": per["kernel_s"] / per["wall_s"] if per["wall_s"] else None,
            "tokens_per_s_under_profiler": 1 / per["wall_s"] if per["wall_s"] else None,
            "top_kernels": _top_per_token(short["kernels_by_name"], long["kernels_by_name"]),
            "top_cpu_ops": _top_per_token(short["cpu_ops_by_name"], long["cpu_ops_by_name"])}


def _by_name(events, time_us) -> dict[str, list[float]]:
    """{name (first 100 characters): [calls, seconds]} of profiler events, each event's time by `time_us`."""
    out: dict[str, list[float]] = {}
    for e in events:
        calls_s = out.setdefault(e.name[:100], [0, 0.0])
        calls_s[0] += 1
        calls_s[1] += time_us(e) / 1e6
    return out


def _top_per_token(short: dict[str, list[float]], long: dict[str, list[float]]) -> list[dict]:
    """The TOP_KERNELS names with the most time per token: the two generations' difference over PROFILE_TOKENS."""
    per = {name: [(calls - short.get(name, [0, 0.0])[0]) / PROFILE_TOKENS,
                  (seconds - short.get(name, [0, 0.0])[1]) / PROFILE_TOKENS]
           for name, (calls, seconds) in long.items()}
    top = sorted(per.items(), key=lambda kv: -kv[1][1])[:TOP_KERNELS]
    return [{"name": name, "calls": calls, "seconds": seconds} for name, (calls, seconds) in top]


PROFILES = {"profile": ("none", "auto"), "profile_gather": ("none", "gather"), "profile_auto": ("auto", "auto")}
"""Profile systems: the offload mode and experts_form each profiles."""


def _profile(checkpoint: Path, slots: int, timeout: float, mode: str = "none", experts_form: str = "auto") -> dict:
    """profile_compiled_token in a fresh process, or {"error": ...}."""
    code = ("import json, sys; from tests.gpu.decode_shape import profile_compiled_token as p; "
            "print(json.dumps(p(sys.argv[1], mode=sys.argv[4], slots=int(sys.argv[2]), experts_form=sys.argv[3])))")
    try:
        done = subprocess.run([sys.executable, "-c", code, str(checkpoint), str(slots), experts_form, mode],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"ran past {timeout:.0f} s"}
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(limit_s: float, systems: list[str], slots: int, size: str = "large") -> dict:
    from runtime.inference.random_checkpoint import write_random_mixtral

    deadline = time.monotonic() + limit_s
    shape = bench.SIZES[size]
    root = Path(tempfile.mkdtemp(prefix="moesys-decode-shape-"))
    out: dict = {"shape": shape, "ring_slots": slots, "systems": {}}
    try:
        checkpoint = root / "mixtral"
        start = time.monotonic()
        out["checkpoint_bytes"] = write_random_mixtral(checkpoint, shape["hidden"], shape["ffn"], shape["layers"],
                                                       shape["experts"], shape["vocab"], heads=shape["heads"],
                                                       kv_heads=shape["kv_heads"])
        out["write_s"] = time.monotonic() - start
        print("checkpoint", json.dumps({k: out[k] for k in ("checkpoint_bytes", "write_s")}), flush=True)
        out["bandwidth"] = measure_bandwidths(bench._sweep_threads(None), bench._largest_file(checkpoint))
        print("bandwidth", json.dumps(out["bandwidth"]), flush=True)
        common = {"checkpoint": str(checkpoint), "slots": slots, "new_tokens": bench.NEW_TOKENS,
                  "repeats": REPEATS}
        for i, name in enumerate(systems):
            weight = SHARES.get(name, 1.0) / sum(SHARES.get(n, 1.0) for n in systems[i:])
            budget = max(30.0, (deadline - time.monotonic() - 10) * weight)
            start = time.monotonic()
            if name in PROFILES:
                out[name] = _profile(checkpoint, slots, budget, *PROFILES[name])
                print(name, json.dumps(out[name]), flush=True)
                continue
            call, extra = WORKERS[name]
            extra = {k: (str(root / v) if k == "offload_dir" and v else v) for k, v in extra.items()}
            key = name if name.startswith("transformers") else {"accelerate": "accelerate_disk"}.get(
                name, f"moesys_{name}")
            out["systems"][key] = bench._subprocess(call, {**common, **extra}, timeout=budget)
            out["systems"][key]["wall_s"] = time.monotonic() - start
            print(key, json.dumps({k: v for k, v in out["systems"][key].items() if k != "tokens"}), flush=True)
        out["bound_table"] = apply_bounds(out["systems"], out["bandwidth"])
        reference = out["systems"].get("moesys_none", {}).get("tokens")
        for result in out["systems"].values():
            result["matching_prefix"] = bench._matching_prefix(result.get("tokens") or [], reference or [])
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    result = main(float(sys.argv[1]), sys.argv[2].split(","), int(sys.argv[3]) if len(sys.argv) > 3 else 4,
                  sys.argv[4] if len(sys.argv) > 4 else "large")
    print(json.dumps(result, indent=1))
