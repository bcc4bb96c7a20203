"""Offloaded inference against the peer a user would pick (the paper's "Ring Memory Offloading"), with its targets.

One random bf16 Hugging Face Mixtral checkpoint, written as shards with an index (8 layers of 8 experts, experts
89% of the parameters at the default shape), decoded greedily by, each in a fresh process (runtime/bench/
infer_workers.py):
- transformers with every weight in memory: its default generate (`transformers`) and its fastest decode, a
  static cache, compiled where that pays (`transformers_static`),
- transformers + accelerate with the same expert budget: `device_map` keeps layers 0..K-1's experts in memory
  and sends the other layers' experts to an offload folder on disk (everything else stays in memory). accelerate
  1.15 with transformers 5.x writes that folder as safetensors and maps each offloaded module per forward without
  a copy, so only the routed experts' pages are read, from the page cache when the machine has room for it,
- `moesys infer --offload none`, `--offload auto` and `--offload ring` with infer.ring_slots=K, each with its decode
  step eager or compiled as infer.compile says, and its host synchronisations and operators per layer per decode
  token counted with torch.profiler (runtime/inference/step_counts.py).
Decode tokens/s is the median of `repeats` generations in each process (decode = the tokens after the first,
timed apart from the prompt). Every system decodes on all usable CPUs; moesys none and transformers' two rows also
on one thread (`by_threads`). Each system is put beside its bandwidth bound (runtime/bench/infer_bounds.py): the
bytes its token reads (dense weights, routed experts, KV cache, what it streams from the host tier) over read
bandwidths measured here at its thread count (`bound_table`).
Then `moesys infer --offload auto` (its library call, in a fresh process) runs inside a memory cgroup of half the
checkpoint's size (with the budget that fits there, CAPPED_SLOTS), from a cold page cache (the checkpoint's files
evicted from it, runtime/host/page_cache.py) and from a warm one, and must give the tokens of uncapped
`--offload none`;
accelerate runs in the same cap with the same budget, where its page cache counts against the budget as auto's
does. A system that fails or runs past its time limit gets an {"error": ...} row instead of results. Greedy tokens
of transformers are compared too; in bf16 its op order differs, so on a random model they can part after a few
tokens (`matching_prefix` counts how many agree).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from runtime.bench.infer_workers import NEW_TOKENS, PROMPT, REPEATS, _hf_worker, _moesys_worker  # noqa: F401
from runtime.host import memcap
from runtime.host.page_cache import evict_dir

SIZES = {
    "small": {"hidden": 1024, "ffn": 3584, "layers": 8, "experts": 8, "vocab": 32000, "heads": 8, "kv_heads": 8},
    "large": {"hidden": 2048, "ffn": 7168, "layers": 16, "experts": 8, "vocab": 32000, "heads": 16, "kv_heads": 4},
}
"""`--size`: small (1.6 GB, runs on the 2-core development machine) and large (a 16-layer Mixtral, 11.9 GB,
for a GPU machine)."""
MOESYS_MODES = ("none", "auto", "ring")
CAPPED_SLOTS = 1
"""The budget inside the cap: half of the default checkpoint is 0.80 GB, which holds the dense weights (0.20 GB),
the process's runtime (the plan's PROCESS_RUNTIME_BYTES) and one layer's experts (0.18 GB), not three."""


def _subprocess(call: str, args: dict, isolate: bool = True, timeout: float = 900,
                cap: memcap.MemoryCap | None = None) -> dict:
    """Run `call(**args)` of this module in a fresh Python process (in this one when not isolate), inside `cap`
    when given; its result, or {"error": ...} when it fails or runs past `timeout` seconds."""
    if not isolate:
        return json.loads(json.dumps(globals()[call](**args)))
    code = ("import json, sys; from runtime.bench import infer as b, infer_workers as w; w._WORKER = True; "
            f"print(json.dumps(b.{call}(**json.loads(sys.argv[1]))))")
    try:
        done = subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True,
                              timeout=timeout, preexec_fn=cap.preexec if cap else None)
    except subprocess.TimeoutExpired as exc:
        return {"error": f"{call} ran past its {timeout:g} s limit and was killed", **_last_partial(exc.stdout)}
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return {"error": last, "returncode": done.returncode, **_last_partial(done.stdout)}
    return json.loads(done.stdout.strip().splitlines()[-1])


CAPPED_FIELDS = ("tokens", "decode_tokens_per_s", "store_bytes_per_token", "disk_read_bytes_per_token",
                 "page_cache_bytes_per_token", "peak_rss_anon_bytes", "placement")
"""What the capped runs keep of `moesys infer --json`."""


def _auto_worker(checkpoint: str, slots: int, new_tokens: int) -> dict:
    """`moesys infer --offload auto` through the library call it wraps (run_inference), as a user's command runs it:
    the checkpoint streamed, experts placed within `slots` layers; the CAPPED_FIELDS of its --json."""
    from runtime.inference.generate import run_inference

    result = run_inference(checkpoint, {"max_new_tokens": new_tokens, "ring_slots": slots}, prompt_ids=[PROMPT],
                           offload="auto")
    return {k: result[k] for k in CAPPED_FIELDS}


def _last_partial(stdout: str | bytes | None) -> dict:
    """{"partial": what a worker had measured} from its last PARTIAL line, {} without one."""
    text = stdout.decode(errors="replace") if isinstance(stdout, bytes) else (stdout or "")
    lines = [line for line in text.splitlines() if line.startswith("PARTIAL ")]
    return {"partial": json.loads(lines[-1][len("PARTIAL "):])} if lines else {}


def _infer_cli(checkpoint: Path, slots: int, new_tokens: int, cap: memcap.MemoryCap | None = None,
               timeout: float = 900) -> dict:
    """`moesys infer --offload auto` (_auto_worker) in a fresh process of this interpreter, in the cap when given:
    no `moesys` command needs to be on PATH (a virtual environment not activated); its result, or {"error": ...}."""
    return _subprocess("_auto_worker", {"checkpoint": str(checkpoint), "slots": slots, "new_tokens": new_tokens},
                       timeout=timeout, cap=cap)


def drop_page_cache(directory: Path) -> str | None:
    """Evict `directory`'s files from the page cache (no root needed); None when done, else why not."""
    if not evict_dir(directory):
        return f"cannot evict the files of {directory} from the page cache"
    return None


def _matching_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _ratio(a: dict, b: dict) -> float | None:
    if "decode_tokens_per_s" not in a or "decode_tokens_per_s" not in b:
        return None
    return a["decode_tokens_per_s"] / b["decode_tokens_per_s"]


def _complete(result: dict) -> dict:
    """A worker's row: the row it had reported complete (transformers' eager static cache) when it was killed
    later (compiling on a CPU), with why it stopped (`compile_error`)."""
    partial = result.get("partial", {})
    if "error" not in result or not partial.pop("complete", False):
        return result
    return {**partial, "compile_error": result["error"]}


def _best_transformers(systems: dict[str, dict]) -> dict:
    """The faster of transformers' two rows (default generate, static cache) that measured a rate."""
    rows = [systems.get(k, {}) for k in ("transformers", "transformers_static")]
    rows = [r for r in rows if "decode_tokens_per_s" in r]
    return max(rows, key=lambda r: r["decode_tokens_per_s"]) if rows else {}


def _sweep_threads(threads: list[int] | None) -> list[int]:
    """The thread counts systems decode with: 1 and every usable CPU on a CPU (the largest is the main count the
    rows of `systems` run at); only the main one on a GPU, where the CPU's threads do not bound resident decode."""
    import torch

    from runtime.host.topology import usable_cpus

    if threads:
        return sorted(set(threads))
    return [usable_cpus()] if torch.cuda.is_available() else sorted({1, usable_cpus()})


def _largest_file(directory: Path) -> Path | None:
    files = sorted(directory.glob("*.safetensors"), key=lambda f: f.stat().st_size)
    return files[-1] if files else None


def run_infer_bench(ring_slots: int, shape: dict | None = None, new_tokens: int = NEW_TOKENS,
                    repeats: int = REPEATS, capped: bool = True, workdir: Path | None = None,
                    isolate: bool = True, size: str = "small", compile: bool | None = None,
                    threads: list[int] | None = None) -> dict:
    """Every system on one checkpoint with an expert budget of `ring_slots` layers (`moesys bench infer` passes
    infer.ring_slots and infer.compile, and --size picks the shape from SIZES; `shape` overrides its keys); the
    ratios against their targets, each system's bandwidth bound and the capped cold/warm runs. Every system runs with
    the main thread count (all usable CPUs); moesys none and transformers' two rows also at each other count of
    `threads` (default 1 and all on a CPU), `by_threads`. isolate=False runs the systems in this process (tests: the
    same code without a fresh interpreter for each)."""
    from runtime.bench.infer_bounds import apply_bounds, measure_bandwidths
    from runtime.inference.random_checkpoint import write_random_mixtral

    if size not in SIZES:
        raise ValueError(f"--size {size!r} is not one of {', '.join(SIZES)}")
    shape = dict(SIZES[size], **(shape or {}))
    sweep = _sweep_threads(threads)
    main = sweep[-1]
    root = Path(tempfile.mkdtemp(prefix="moesys-bench-infer-", dir=workdir))
    try:
        checkpoint = root / "mixtral"
        size_bytes = write_random_mixtral(checkpoint, shape["hidden"], shape["ffn"], shape["layers"],
                                          shape["experts"], shape["vocab"], heads=shape["heads"],
                                          kv_heads=shape.get("kv_heads"))
        expert_bytes = 3 * shape["hidden"] * shape["ffn"] * 2 * shape["experts"] * shape["layers"]
        common = {"checkpoint": str(checkpoint), "slots": ring_slots, "new_tokens": new_tokens, "repeats": repeats}

        def decode_at(t: int) -> dict[str, dict]:  # the rows compared at each thread count
            at = {**common, "threads": t}
            return {"transformers": _subprocess("_hf_worker", {**at, "offload_dir": None}, isolate),
                    "transformers_static": _complete(_subprocess("_hf_worker", {**at, "offload_dir": None,
                                                                                "static": True}, isolate)),
                    "moesys_none": _subprocess("_moesys_worker", {**at, "mode": "none", "compile": compile,
                                                                  "against_forward": t == main}, isolate)}

        systems = decode_at(main)
        systems["accelerate_disk"] = _subprocess("_hf_worker", {**common, "threads": main,
                                                                "offload_dir": str(root / "offload")}, isolate)
        for mode in MOESYS_MODES[1:]:
            systems[f"moesys_{mode}"] = _subprocess("_moesys_worker", {**common, "threads": main, "mode": mode,
                                                                     "compile": compile}, isolate)
        systems["moesys_none_forward"] = _subprocess("_moesys_worker", {**common, "threads": main, "mode": "none",
                                                                         "forward_step": True}, isolate)
        by_threads: dict[str, dict[str, Any]] = {str(t): decode_at(t) for t in sweep if t != main}
        reference = systems["moesys_none"].get("tokens")
        for result in [*systems.values(), *(r for rows in by_threads.values() for r in rows.values())]:
            result["same_tokens_as_none"] = result.get("tokens") == reference
            result["matching_prefix"] = _matching_prefix(result.get("tokens") or [], reference or [])
        bandwidth = measure_bandwidths(sweep, _largest_file(checkpoint))
        table = apply_bounds(systems, bandwidth)
        for rows in by_threads.values():
            table.update(apply_bounds(rows, bandwidth))
        by_threads[str(main)] = {k: systems[k] for k in ("transformers", "transformers_static", "moesys_none")}
        for rows in by_threads.values():
            rows["none_vs_transformers"] = _ratio(rows["moesys_none"], _best_transformers(rows))
        out: dict[str, Any] = {
            "shape": shape, "checkpoint_bytes": size_bytes, "expert_share": expert_bytes / size_bytes,
            "ring_slots": ring_slots, "prompt_tokens": len(PROMPT), "new_tokens": new_tokens, "threads": main,
            "bandwidth": bandwidth, "systems": systems, "bound_table": table,
            "by_threads": {t: {"none_vs_transformers": rows["none_vs_transformers"],
                               **{k: v for k, v in rows.items() if k != "none_vs_transformers"}}
                           for t, rows in sorted(by_threads.items(), key=lambda kv: int(kv[0]))},
            "auto_vs_none": _ratio(systems["moesys_auto"], systems["moesys_none"]),
            "auto_vs_accelerate": _ratio(systems["moesys_auto"], systems["accelerate_disk"]),
            "ring_vs_none": _ratio(systems["moesys_ring"], systems["moesys_none"]),
            "none_vs_transformers": _ratio(systems["moesys_none"], _best_transformers(systems)),
            "none_vs_none_forward": systems["moesys_none"].get("same_process_vs_forward"),
            "none_share_of_bound": {t: rows["moesys_none"].get("share_of_bound") for t, rows in by_threads.items()},
            "targets": {"auto_vs_none": 0.95, "auto_vs_accelerate": 1.6, "capped_auto_vs_accelerate": 3.0,
                        "none_vs_none_forward": 1.0, "none_share_of_bound": 0.6, "none_vs_transformers": 1.1},
        }
        if capped:
            out["capped"] = _capped_runs(checkpoint, size_bytes, new_tokens, reference,
                                         systems["accelerate_disk"].get("tokens"))
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _capped_runs(checkpoint: Path, size: int, new_tokens: int, reference, accelerate_reference,
                 slots: int = CAPPED_SLOTS) -> dict:
    """auto inside a memory cgroup of half the checkpoint: cold page cache, then warm; then accelerate's disk
    offload in the same cap with the same budget (its page cache is charged to the cgroup, as auto's is: outside a
    cap both read the offloaded experts from a page cache as large as the machine)."""
    why = memcap.available()
    if why:
        return {"skipped": why}
    out: dict[str, Any] = {"cap_bytes": size // 2, "ring_slots": slots}
    for run in ("cold", "warm"):
        if run == "cold":
            dropped = drop_page_cache(checkpoint)
            if dropped:
                out["cold_note"] = dropped
        with memcap.MemoryCap(size // 2, "moesys-bench-infer") as cap:
            result = _infer_cli(checkpoint, slots, new_tokens, cap)
            result.update(oom_kills=cap.oom_kills(), cgroup_peak_bytes=cap.max_usage())
        result["same_tokens_as_none"] = (result.get("tokens") or [None])[0] == reference  # one prompt
        out[run] = result
    with memcap.MemoryCap(size // 2, "moesys-bench-infer-accelerate") as cap:
        result = _subprocess("_hf_worker", {"checkpoint": str(checkpoint), "slots": slots, "new_tokens": new_tokens,
                                            "repeats": 1, "offload_dir": str(checkpoint.parent / "offload-capped")},
                             cap=cap)
        result.update(oom_kills=cap.oom_kills(), cgroup_peak_bytes=cap.max_usage())
    result["same_tokens_as_uncapped"] = result.get("tokens") == accelerate_reference
    out["accelerate_disk"] = result
    out["auto_vs_accelerate"] = _ratio(out["warm"], result)
    return out
