"""Each `moesys bench infer` system beside its bandwidth bound (runtime/bench/decode_bound.py): read bandwidths
measured at the thread counts the systems decode with, the bytes a token reads (dense weights, routed experts, KV
cache; streamed experts along the path they take) and the table of both per system.

Streamed paths: on a CPU an `--offload auto` layer computes its routed experts where the checkpoint's mapped pages
lie (the CPU reading host memory), and the ring copies whole layers out of its mapped store; on CUDA auto's decode
rows go to whichever of the CPU (over pinned host memory) and a PCIe copy its cost model finds faster, the ring
copies over PCIe, and accelerate's CPU offload copies every offloaded layer's experts over PCIe.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from runtime.bench.decode_bound import decode_bound, host_to_device_bandwidth, mapped_read_bandwidth, read_bandwidth

READS_LIKE = {"transformers": "moesys_none", "transformers_static": "moesys_none",
              "moesys_none_forward": "moesys_none", "accelerate_disk": "moesys_auto"}
"""Systems whose weights a token reads as another's do: transformers and the forward-per-token baseline read what
none reads (the same weights), accelerate what auto reads (the same budget, routed experts only)."""


def measure_bandwidths(threads: list[int], mapped_file: Path | None = None) -> dict[str, Any]:
    """Read bandwidths at each thread count (the largest is the main one, whose figures are the top-level fields):
    the device tier's (on a CPU: memory placed as weights are, on huge pages), the host's, the checkpoint's mapped
    pages' (the memory auto's streamed layers compute on without a GPU), and pinned copies' to the GPU."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cpu = torch.device("cpu")
    by_threads = {}
    for t in sorted(set(threads)):
        host = read_bandwidth(cpu, threads=t)
        by_threads[str(t)] = {
            "device_read_bytes_per_s": read_bandwidth(device) if device.type == "cuda" else host,
            "host_read_bytes_per_s": host,
            "mapped_read_bytes_per_s": mapped_read_bandwidth(mapped_file, t) if mapped_file else host}
    main = max(threads)
    return {**by_threads[str(main)], "host_to_device_bytes_per_s": host_to_device_bandwidth(device),
            "threads": main, "by_threads": by_threads}


def streamed_path(system: str, bandwidth: dict[str, Any], at: dict[str, float]) -> tuple[str | None, float]:
    """(path, bytes/s) of the bytes `system` streams from the host tier, `at` its thread count's bandwidths; (None,
    0) for a system that streams nothing."""
    pcie = bandwidth["host_to_device_bytes_per_s"]
    if system in ("moesys_auto", "accelerate_disk"):
        if not pcie:
            return "cpu_compute", at["mapped_read_bytes_per_s"]
        if system == "accelerate_disk":
            return "pcie_copy", pcie
        cpu = at["host_read_bytes_per_s"]  # pinned host memory, the CPU's threads
        return ("cpu_compute", cpu) if cpu >= pcie else ("pcie_copy", pcie)
    if system == "moesys_ring":
        return ("pcie_copy", pcie) if pcie else ("copy", at["mapped_read_bytes_per_s"])
    return None, 0.0


def binding_term(device_bytes: float, device_bw: float, host_bytes: float, host_bw: float) -> str:
    """The term of `decode_bound` that takes longer: "device_read" (the device tier's bytes) or "streamed" (the
    bytes the streamed path carries)."""
    streamed_s = host_bytes / host_bw if host_bytes and host_bw else 0.0
    return "streamed" if streamed_s > device_bytes / device_bw else "device_read"


def apply_bounds(systems: dict[str, dict], bandwidth: dict[str, Any]) -> dict[str, dict]:
    """Give every measured system its bound (fields `bandwidth_bound_tokens_per_s`, `share_of_bound` and `bound`:
    bytes per tier, bandwidths, the streamed path) at its own thread count; the bound table, keyed system@threads."""
    table = {}
    for name, row in systems.items():
        source = systems.get(READS_LIKE.get(name, name), {})
        if "device_read_bytes_per_token" not in source:
            continue
        threads = row.get("threads", bandwidth["threads"])
        at = bandwidth["by_threads"].get(str(threads), bandwidth)
        kv = row.get("kv_cache_bytes_per_token", source.get("kv_cache_bytes_per_token", 0))
        device_bytes = source["device_read_bytes_per_token"] + kv
        host_bytes = source["host_read_bytes_per_token"]
        path, path_bw = streamed_path(name, bandwidth, at)
        bound = decode_bound(device_bytes, at["device_read_bytes_per_s"], host_bytes, path_bw)
        row["bandwidth_bound_tokens_per_s"] = bound
        measured = row.get("decode_tokens_per_s")
        if measured is not None:
            row["share_of_bound"] = measured / bound if bound else None
        row["bound"] = {"threads": threads, "device_bytes_per_token": device_bytes,
                        "device_read_bytes_per_s": at["device_read_bytes_per_s"],
                        "streamed_bytes_per_token": host_bytes, "streamed_path": path,
                        "streamed_bytes_per_s": path_bw, "token_bytes": {**source.get("token_bytes", {}),
                                                                          "kv_cache": kv},
                        "binding": binding_term(device_bytes, at["device_read_bytes_per_s"], host_bytes, path_bw)}
        table[f"{name}@{threads}"] = {
            "bytes_per_token": device_bytes + host_bytes, "read_bytes_per_s": at["device_read_bytes_per_s"],
            "streamed_path": path, "streamed_bytes_per_s": path_bw, "binding": row["bound"]["binding"],
            "bound_tokens_per_s": bound,
            "measured_tokens_per_s": measured, "vs_bound": row.get("share_of_bound")}
    return table
