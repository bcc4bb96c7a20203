"""Offloaded inference against the peer a user would pick (the paper's "Ring Memory Offloading"), with its targets.

One random bf16 Hugging Face Mixtral checkpoint, written as shards with an index (8 layers of 8 experts, experts
89% of the parameters at the default shape), decoded greedily by, each in a fresh process:
- transformers with every weight in memory,
- transformers + accelerate with the same expert budget: `device_map` keeps layers 0..K-1's experts in memory
  and sends the other layers' experts to an offload folder on disk (everything else stays in memory). accelerate
  1.15 with transformers 5.x writes that folder as safetensors and maps each offloaded module per forward without
  a copy, so only the routed experts' pages are read, from the page cache when the machine has room for it,
- `moesys infer --offload none`, `--offload auto` and `--offload ring` with infer.ring_slots=K, each with its decode
  step eager or compiled as infer.compile says, and its host synchronisations and operators per layer per decode
  token counted with torch.profiler (runtime/inference/step_counts.py).
Decode tokens/s is the median of `repeats` generations in each process (decode = the tokens after the first,
timed apart from the prompt). Each system is put beside its bandwidth bound: the bytes its token reads (dense
weights, routed experts, what it streams or copies from the host tier) over the read bandwidth measured here.
Then `moesys infer --offload auto` (its library call, in a fresh process) runs inside a memory cgroup of half the
checkpoint's size (with the budget that fits there, CAPPED_SLOTS), from a cold page cache (the checkpoint's files
evicted from it, runtime/page_cache.py) and from a warm one, and must give the tokens of uncapped `--offload none`;
accelerate runs in the same cap with the same budget, where its page cache counts against the budget as auto's
does. A system that fails or runs past its time limit gets an {"error": ...} row instead of results. Greedy tokens
of transformers are compared too; in bf16 its op order differs, so on a random model they can part after a few
tokens (`matching_prefix` counts how many agree).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from runtime import memcap
from runtime.page_cache import evict_dir

SIZES = {
    "small": {"hidden": 1024, "ffn": 3584, "layers": 8, "experts": 8, "vocab": 32000, "heads": 8, "kv_heads": 8},
    "large": {"hidden": 2048, "ffn": 7168, "layers": 16, "experts": 8, "vocab": 32000, "heads": 16, "kv_heads": 4},
}
"""`--size`: small (1.6 GB, runs on the 2-core development machine) and large (a 16-layer Mixtral, 11.9 GB,
for a GPU machine)."""
PROMPT = list(range(100, 116))
NEW_TOKENS = 32
REPEATS = 3
PAIRED_ROUNDS = 5
MOESYS_MODES = ("none", "auto", "ring")
CAPPED_SLOTS = 1
"""The budget inside the cap: half of the default checkpoint is 0.80 GB, which holds the dense weights (0.20 GB),
the process's runtime (about 0.3 GB) and one layer's experts (0.18 GB), not three."""


def _decode_rate(generate, new_tokens: int, repeats: int) -> tuple[list[int], float]:
    """(tokens, decode tokens/s): generate(n) makes n greedy tokens; decode = (t(n) - t(1)) over n - 1 tokens."""
    generate(2)  # warm-up
    rates, tokens = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        generate(1)
        first = time.perf_counter() - start
        start = time.perf_counter()
        tokens = generate(new_tokens)
        rates.append((new_tokens - 1) / max(1e-9, time.perf_counter() - start - first))
    return tokens, statistics.median(rates)


def _hf_worker(checkpoint: str, slots: int, offload_dir: Optional[str], new_tokens: int, repeats: int) -> dict:
    """transformers (+ accelerate's offload when offload_dir is given), in this process. With a GPU, the model is
    on it and accelerate keeps the dense weights and layers 0..K-1's experts there, the other experts in host
    memory (its CPU offload); without one, everything is in memory and the other experts go to disk."""
    import torch
    import transformers

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    device = "cuda" if torch.cuda.is_available() else "cpu"
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

    def generate(n: int) -> list[int]:
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return out[0, len(PROMPT):].tolist()

    tokens, rate = _decode_rate(generate, new_tokens, repeats)
    read_before = _read_bytes()
    generate(new_tokens)
    offloaded = sum(f.stat().st_size for f in Path(offload_dir).rglob("*") if f.is_file()) if offload_dir else 0
    return {"tokens": tokens, "decode_tokens_per_s": rate, "offload_folder_bytes": offloaded,
            "disk_read_bytes_per_token": (_read_bytes() - read_before) / new_tokens}


def _moesys_worker(checkpoint: str, mode: str, slots: int, new_tokens: int, repeats: int,
                   compile: Optional[bool] = None, forward_step: bool = False, against_forward: bool = False) -> dict:
    """moesys in this process: the checkpoint opened and placed once (on the GPU when there is one), one decode
    step (compiled or not, as infer.compile says; the model's forward per token with forward_step, the static
    step's baseline) reused by timed generations, then its counts under the profiler and the bytes its token
    reads. against_forward: also the static step against the forward-per-token step in this process, generations
    alternating (PAIRED_ROUNDS), the ratio `none_vs_none_forward` reports: separate processes differ by more than
    the two steps do on a shared machine."""
    import torch

    from runtime.bench.decode_bound import token_bytes
    from runtime.inference.decode import DecodeStep, ForwardStep, compile_default
    from runtime.inference.generate import generate
    from runtime.inference.load import open_checkpoint
    from runtime.inference.offloaders import make_offloader
    from runtime.inference.step_counts import count_decode
    from runtime.topology import set_cpu_threads

    set_cpu_threads(1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    loaded = open_checkpoint(checkpoint, device=device)
    model = loaded.model
    offloader = make_offloader(model, mode, device, slots, source=loaded.experts)
    if forward_step:
        step = ForwardStep(model)
    else:
        step = DecodeStep(model, compile=compile_default(device) if compile is None else compile)
    run = lambda n: generate(model, [PROMPT], n, offloader=offloader, step=step)  # noqa: E731
    tokens, rate = _decode_rate(lambda n: run(n).tokens[0], new_tokens, repeats)
    beside = {}
    if against_forward:  # the same model and offloader, the two steps' generations alternating
        forward = ForwardStep(model)
        run_forward = lambda n: generate(model, [PROMPT], n, offloader=offloader, step=forward)  # noqa: E731
        _decode_rate(lambda n: run_forward(n).tokens[0], 2, 1)  # warm-up
        pairs = [(_decode_rate(lambda n: run(n).tokens[0], new_tokens, 1)[1],
                  _decode_rate(lambda n: run_forward(n).tokens[0], new_tokens, 1)[1]) for _ in range(PAIRED_ROUNDS)]
        beside = {"same_process_vs_forward": statistics.median(a / b for a, b in pairs),
                  "same_process_tokens_per_s": [round(a, 2) for a, _ in pairs],
                  "same_process_forward_tokens_per_s": [round(b, 2) for _, b in pairs]}
    offloader.reset_stats()
    read_before = _read_bytes()
    run(new_tokens)
    read = _read_bytes() - read_before
    stats = offloader.stats()
    counts = count_decode(run, len(model.layers), cuda=device.type == "cuda")
    offloader.close()
    dense, per_expert = token_bytes(model)
    routed = model.cfg.top_k * per_expert  # batch 1: K distinct experts a MoE layer
    resident = sum(p == "resident" for p in stats["placement"]) if mode == "auto" else len(stats["placement"])
    host = stats["store_bytes"] if mode == "auto" else stats["copied_bytes"]
    return {"tokens": tokens, "decode_tokens_per_s": rate, "compiled": step.compiled,
            "host_syncs_per_token": counts.host_syncs_per_token, "ops_per_layer_token": counts.ops_per_layer_token,
            "kernel_reads_per_token": counts.kernel_reads_per_token, "placement": stats["placement"],
            "device_read_bytes_per_token": dense + resident * routed, "host_read_bytes_per_token": host / new_tokens,
            "store_bytes_per_token": stats["store_bytes"] / new_tokens,
            "copied_bytes_per_token": stats["copied_bytes"] / new_tokens,
            "disk_read_bytes_per_token": read / new_tokens, **beside}


def _read_bytes() -> int:
    from runtime.memory_probe import disk_read_bytes

    return disk_read_bytes()


def _subprocess(call: str, args: dict, isolate: bool = True, timeout: float = 900,
                cap: Optional[memcap.MemoryCap] = None) -> dict:
    """Run `call(**args)` of this module in a fresh Python process (in this one when not isolate), inside `cap`
    when given; its result, or {"error": ...} when it fails or runs past `timeout` seconds."""
    if not isolate:
        return json.loads(json.dumps(globals()[call](**args)))
    code = ("import json, sys; from runtime.bench import infer as b; "
            f"print(json.dumps(b.{call}(**json.loads(sys.argv[1]))))")
    try:
        done = subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True,
                              timeout=timeout, preexec_fn=cap.preexec if cap else None)
    except subprocess.TimeoutExpired:
        return {"error": f"{call} ran past its {timeout:g} s limit and was killed"}
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return {"error": last, "returncode": done.returncode}
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


def _infer_cli(checkpoint: Path, slots: int, new_tokens: int, cap: Optional[memcap.MemoryCap] = None,
               timeout: float = 900) -> dict:
    """`moesys infer --offload auto` (_auto_worker) in a fresh process of this interpreter, in the cap when given:
    no `moesys` command needs to be on PATH (a virtual environment not activated); its result, or {"error": ...}."""
    return _subprocess("_auto_worker", {"checkpoint": str(checkpoint), "slots": slots, "new_tokens": new_tokens},
                       timeout=timeout, cap=cap)


def drop_page_cache(directory: Path) -> Optional[str]:
    """Evict `directory`'s files from the page cache (no root needed); None when done, else why not."""
    if not evict_dir(directory):
        return f"cannot evict the files of {directory} from the page cache"
    return None


def _matching_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _ratio(a: dict, b: dict) -> Optional[float]:
    if "decode_tokens_per_s" not in a or "decode_tokens_per_s" not in b:
        return None
    return a["decode_tokens_per_s"] / b["decode_tokens_per_s"]


def _bandwidths() -> dict[str, float]:
    """Read bandwidth of the device tier and of the host tier (the same RAM without a GPU), and pinned copies'."""
    import torch

    from runtime.bench.decode_bound import host_to_device_bandwidth, read_bandwidth

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    host = read_bandwidth(torch.device("cpu"))
    return {"device_read_bytes_per_s": read_bandwidth(device) if device.type == "cuda" else host,
            "host_read_bytes_per_s": host, "host_to_device_bytes_per_s": host_to_device_bandwidth(device)}


def _bounds(systems: dict[str, dict], bandwidth: dict[str, float]) -> None:
    """Each system's bandwidth bound, from the bytes its token reads: a moesys mode's own; transformers and none's
    forward-per-token baseline read what none reads (the same weights), accelerate what auto reads (the same
    budget, routed experts only)."""
    from runtime.bench.decode_bound import decode_bound

    copy_bw = bandwidth["host_to_device_bytes_per_s"] or bandwidth["host_read_bytes_per_s"]
    host_bw = {"moesys_ring": copy_bw,  # whole layers copied into slots
               "moesys_auto": max(bandwidth["host_to_device_bytes_per_s"], bandwidth["host_read_bytes_per_s"])}
    for name, like in (("moesys_none", None), ("moesys_auto", None), ("moesys_ring", None),
                       ("transformers", "moesys_none"), ("moesys_none_forward", "moesys_none"),
                       ("accelerate_disk", "moesys_auto")):
        source = systems[like or name]
        if "device_read_bytes_per_token" not in source:
            continue
        bound = decode_bound(source["device_read_bytes_per_token"], bandwidth["device_read_bytes_per_s"],
                             source["host_read_bytes_per_token"], host_bw.get(like or name, copy_bw))
        systems[name]["bandwidth_bound_tokens_per_s"] = bound
        if "decode_tokens_per_s" in systems[name]:
            systems[name]["share_of_bound"] = systems[name]["decode_tokens_per_s"] / bound if bound else None


def run_infer_bench(ring_slots: int, shape: Optional[dict] = None, new_tokens: int = NEW_TOKENS,
                    repeats: int = REPEATS, capped: bool = True, workdir: Optional[Path] = None,
                    isolate: bool = True, size: str = "small", compile: Optional[bool] = None) -> dict:
    """Every system on one checkpoint with an expert budget of `ring_slots` layers (`moesys bench infer` passes
    infer.ring_slots and infer.compile, and --size picks the shape from SIZES; `shape` overrides its keys); the
    ratios against their targets, each system's bandwidth bound and the capped cold/warm runs. isolate=False runs the
    systems in this process (tests: the same code without a fresh interpreter for each)."""
    from runtime.inference.random_checkpoint import write_random_mixtral

    if size not in SIZES:
        raise ValueError(f"--size {size!r} is not one of {', '.join(SIZES)}")
    shape = dict(SIZES[size], **(shape or {}))
    root = Path(tempfile.mkdtemp(prefix="moesys-bench-infer-", dir=workdir))
    try:
        checkpoint = root / "mixtral"
        size_bytes = write_random_mixtral(checkpoint, shape["hidden"], shape["ffn"], shape["layers"],
                                          shape["experts"], shape["vocab"], heads=shape["heads"],
                                          kv_heads=shape.get("kv_heads"))
        expert_bytes = 3 * shape["hidden"] * shape["ffn"] * 2 * shape["experts"] * shape["layers"]
        common = {"checkpoint": str(checkpoint), "slots": ring_slots, "new_tokens": new_tokens, "repeats": repeats}
        systems: dict[str, dict] = {
            "transformers": _subprocess("_hf_worker", {**common, "offload_dir": None}, isolate),
            "accelerate_disk": _subprocess("_hf_worker", {**common, "offload_dir": str(root / "offload")}, isolate),
        }
        for mode in MOESYS_MODES:
            systems[f"moesys_{mode}"] = _subprocess("_moesys_worker", {**common, "mode": mode, "compile": compile,
                                                                     "against_forward": mode == "none"}, isolate)
        systems["moesys_none_forward"] = _subprocess("_moesys_worker", {**common, "mode": "none",
                                                                         "forward_step": True}, isolate)
        reference = systems["moesys_none"].get("tokens")
        for result in systems.values():
            result["same_tokens_as_none"] = result.get("tokens") == reference
            result["matching_prefix"] = _matching_prefix(result.get("tokens") or [], reference or [])
        bandwidth = _bandwidths()
        _bounds(systems, bandwidth)
        out: dict[str, Any] = {
            "shape": shape, "checkpoint_bytes": size_bytes, "expert_share": expert_bytes / size_bytes,
            "ring_slots": ring_slots, "prompt_tokens": len(PROMPT), "new_tokens": new_tokens,
            "bandwidth": bandwidth, "systems": systems,
            "auto_vs_none": _ratio(systems["moesys_auto"], systems["moesys_none"]),
            "auto_vs_accelerate": _ratio(systems["moesys_auto"], systems["accelerate_disk"]),
            "ring_vs_none": _ratio(systems["moesys_ring"], systems["moesys_none"]),
            "none_vs_transformers": _ratio(systems["moesys_none"], systems["transformers"]),
            "none_vs_none_forward": systems["moesys_none"].get("same_process_vs_forward"),
            "targets": {"auto_vs_none": 0.9, "auto_vs_accelerate": 1.6, "none_vs_none_forward": 1.0},
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
