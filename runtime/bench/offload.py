"""Training steps/s with expert states resident (offload=none), on SSD behind a 25% LFU CPU cache fetching only
active experts (seed 004 section 3.2, Algorithm 2; seed 002 section 4.2), and fetch-everything (every expert
fetched, stepped and written back each step, as ZeRO-3 offload does), side by side in one run; the store's bytes/s
against the disk's own sequential bandwidth, measured in the same directory, at 8 tokens per step and at a
realistic load where most experts are active every step.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from runtime.bench.disk import DiskBandwidth, measure_disk
from runtime.config import ModelConfig, MoesysConfig, TrainConfig
from runtime.model.params import count_parameters
from runtime.parallel.groups import build_groups
from runtime.train.build import build_components
from runtime.train.data import TokenDataset
from runtime.train.loop import forward_backward, optimizer_step

CPU = torch.device("cpu")


class _Trainer:
    """One process's training, stepped with the trainer's own forward_backward and optimizer_step."""

    def __init__(self, cfg: MoesysConfig, mode: str, store_dir: Path | None, cache_experts: int, skew: float,
                 data: str):
        """Built by build_components, as a training worker builds itself; fetch_all is ssd with nothing cached and
        every expert fetched (the ZeRO-3 offload baseline)."""
        storage = dataclasses.replace(cfg.storage, offload="none" if mode == "none" else "ssd",
                                      ssd_path=str(store_dir), cpu_cache_experts=cache_experts)
        train = dataclasses.replace(cfg.train, run_dir=str(store_dir))
        self.cfg, self.groups = dataclasses.replace(cfg, storage=storage, train=train), build_groups(1, 0, 1, 1)
        self.c = build_components(self.cfg, self.groups, CPU)
        with torch.no_grad():  # Zipf-like router: expert e's logits scaled by skew / (e + 1)
            for layer in self.c.model.moe_layers():
                w = layer.router.gate.weight
                w.mul_(torch.tensor([skew / (e + 1) for e in range(w.shape[0])])[:, None])
        self.c.objective.data = bench_data(data, cfg)
        self.mgr = self.c.offload
        if mode == "fetch_all":
            self.mgr.fetch_everything()

    def step(self, step: int) -> dict:
        forward_backward(self.c, self.cfg, self.groups, step, CPU)
        optimizer_step(self.c, self.cfg, self.groups, step)
        return self.mgr.step_metrics() if self.mgr else {}

    def drain(self) -> None:
        """Wait for this trainer's background work: the CPU optimizer step, the prefetches in flight, the
        write-behind queue and the kernel's write-back of the files written (else another mode pays for them)."""
        if self.mgr:
            self.mgr.drain()
            os.sync()

    def finish(self) -> None:
        if self.mgr:
            self.mgr.close()


def bench_data(data: str, cfg: MoesysConfig) -> TokenDataset:
    """corpus: the shipped text; random: uniform random token ids (no structure: the most experts active)."""
    if data == "corpus":
        return TokenDataset.from_path(None, cfg.train.seq_len, cfg.train.seed)
    generator = torch.Generator().manual_seed(cfg.train.seed)
    tokens = torch.randint(0, cfg.model.vocab_size, (1 << 16,), generator=generator)
    return TokenDataset(tokens, cfg.train.seq_len, cfg.train.seed, name="random tokens")


def bench_config(hidden: int, ffn: int, experts: int, layers: int, tokens: int) -> MoesysConfig:
    model = ModelConfig(hidden_size=hidden, ffn_hidden_size=ffn, num_layers=layers, num_heads=4,
                        num_experts=experts, top_k=1, max_seq_len=max(tokens, 8), aux_loss_weight=0.0)
    return MoesysConfig(model=model, train=TrainConfig(seq_len=tokens, micro_batch_size=1, warmup_steps=1))


def _process_io() -> dict[str, int]:
    """This process's bytes read from and written to block devices (page-cache hits not counted), or {}."""
    try:
        lines = Path("/proc/self/io").read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v) for k, v in (line.split(": ") for line in lines) if k in ("read_bytes", "write_bytes")}


def _measure(cfg: MoesysConfig, mode: str, store_dir: str, cache_experts: int, skew: float, data: str,
             warmup: int, steps: int) -> dict:
    """One mode in its own process: steps/s after warm-up (background work drained inside the timing), the
    offload metrics of the timed steps, the bytes the store moved in that time (write-behind included) and the
    bytes that really came from the disk (the rest of the store's reads hit the page cache)."""
    trainer = _Trainer(cfg, mode, Path(store_dir), cache_experts, skew, data)
    for step in range(warmup):
        trainer.step(step)
    trainer.drain()
    store = trainer.mgr.store if trainer.mgr else None
    read0, written0 = (store.bytes_read, store.bytes_written) if store else (0, 0)
    io0 = _process_io()
    began = time.perf_counter()
    metrics = [trainer.step(step) for step in range(warmup, warmup + steps)]
    trainer.drain()
    elapsed = time.perf_counter() - began
    io1 = _process_io()
    moved = {"store_read_bytes": store.bytes_read - read0, "store_write_bytes": store.bytes_written - written0,
             "disk_read_bytes": io1.get("read_bytes", 0) - io0.get("read_bytes", 0)} if store else {}
    peaks = trainer.mgr.tiers.step_metrics() if trainer.mgr else {}
    trainer.finish()
    return {"steps_per_s": steps / elapsed, "elapsed_s": elapsed, "steps": steps, "metrics": metrics,
            "peaks": peaks, **moved}


def _traffic(mode: str, runs: list[dict], disk: DiskBandwidth) -> dict:
    """Seconds per step and the store's read and write bytes/s of one mode (median over rounds), and those
    bytes/s as fractions of the disk's own sequential bandwidth."""
    per_s = lambda key: statistics.median(r[key] / r["elapsed_s"] for r in runs)  # noqa: E731
    read, write = per_s("store_read_bytes"), per_s("store_write_bytes")
    return {f"{mode}_s_per_step": statistics.median(r["elapsed_s"] / r["steps"] for r in runs),
            f"{mode}_read_bytes_per_s": read, f"{mode}_write_bytes_per_s": write,
            f"{mode}_read_vs_disk": read / disk.read_bytes_per_s,
            f"{mode}_write_vs_disk": write / disk.write_bytes_per_s,
            f"{mode}_disk_read_bytes_per_step": statistics.median(r["disk_read_bytes"] / r["steps"] for r in runs)}


def _compare(cfg: MoesysConfig, pool: ProcessPoolExecutor, tmp: Path, data: str, cache_experts: int, skew: float,
             warmup: int, steps: int, rounds: int, disk: DiskBandwidth) -> dict:
    """The three modes on one input, alternating over `rounds` (median kept). fetch_all steps take seconds each,
    so it times a third of the steps after one warm-up step."""
    runs: dict[str, list[dict]] = {"none": [], "ssd": [], "fetch_all": []}
    for round_ in range(rounds):
        for mode in runs:
            store = str(tmp / f"{data}-{cfg.train.seq_len}-{mode}-{round_}")
            w, n = (1, max(2, steps // 3)) if mode == "fetch_all" else (warmup, steps)
            runs[mode].append(pool.submit(_measure, cfg, mode, store, cache_experts, skew, data, w, n).result())
    rate = {mode: statistics.median(r["steps_per_s"] for r in rs) for mode, rs in runs.items()}
    ssd = [m for r in runs["ssd"] for m in r["metrics"]]
    peaks = runs["ssd"][-1]["peaks"]
    mean = lambda key: sum(m[f"offload/{key}"] for m in ssd) / len(ssd)  # noqa: E731
    return {
        "none_steps_per_s": rate["none"], "ssd_steps_per_s": rate["ssd"], "fetch_all_steps_per_s": rate["fetch_all"],
        "ssd_vs_none": rate["ssd"] / rate["none"], "ssd_vs_fetch_all": rate["ssd"] / rate["fetch_all"],
        "mean_active_experts": mean("experts_active"), "ssd_cache_hit_rate": mean("cache_hit_rate"),
        "ssd_stall_s_per_step": mean("fetch_stall_s"),
        "ssd_bytes_per_step": mean("ssd_read_bytes") + mean("ssd_write_bytes"),
        "ssd_host_peak_bytes": peaks["host_peak_bytes"], "ssd_device_peak_bytes": peaks["device_peak_bytes"],
        "none_s_per_step": 1 / rate["none"], **_traffic("ssd", runs["ssd"], disk),
        **_traffic("fetch_all", runs["fetch_all"], disk),
    }


def run_offload_bench(hidden: int = 128, ffn: int = 1024, experts: int = 16, layers: int = 4, tokens: int = 8,
                      steps: int = 12, warmup: int = 3, rounds: int = 2, cache_fraction: float = 0.25,
                      skew: float = 4.0, ssd_path: str | None = None, inputs: tuple[str, ...] = ("corpus", "random"),
                      load_tokens: int | None = 512, load_input: str = "random", load_steps: int = 6,
                      disk_probe_bytes: int = 1 << 30) -> dict:
    """Steps/s of none, ssd (cache = cache_fraction of all experts) and fetch_all; JSON-ready dict with ratios.

    The top-level numbers are for the first input (the shipped corpus); `by_input` has every input, random tokens
    being the hard case (no structure, so the most experts active and the lowest cache hit rate).
    `realistic_load` runs the three modes again at `load_tokens` tokens per step of `load_input` (most experts
    active every step; `load_steps` timed steps, a third of them warm-up) unless load_tokens is None. `disk` is the
    disk's own sequential bandwidth in the store's directory, the denominator of every *_vs_disk ratio.
    Each mode runs in a fresh process: one mode's host states, threads and garbage must not slow another down
    (measured: fetch-everything left the resident run 3x slower)."""
    cfg = bench_config(hidden, ffn, experts, layers, tokens)
    params = count_parameters(cfg.model)
    total_experts = experts * cfg.model.num_moe_layers
    cache_experts = max(1, round(cache_fraction * total_experts))
    spawn = multiprocessing.get_context("spawn")
    fresh = ProcessPoolExecutor(1, mp_context=spawn, max_tasks_per_child=1)  # a new process for every run
    with tempfile.TemporaryDirectory(dir=ssd_path) as tmp, fresh as pool:
        disk = measure_disk(tmp, disk_probe_bytes)
        by_input = {data: _compare(cfg, pool, Path(tmp), data, cache_experts, skew, warmup, steps, rounds, disk)
                    for data in inputs}
        load = None
        if load_tokens is not None:
            load_cfg = bench_config(hidden, ffn, experts, layers, load_tokens)
            load = _compare(load_cfg, pool, Path(tmp), load_input, cache_experts, skew, max(1, load_steps // 3),
                            load_steps, rounds, disk)
            load.update(input=load_input, tokens_per_step=load_tokens,
                        active_expert_fraction=load["mean_active_experts"] / total_experts)
    return {
        **by_input[inputs[0]], "input": inputs[0], "by_input": by_input,
        **({"realistic_load": load} if load is not None else {}),
        "disk": disk.as_dict(),
        "expert_param_fraction": params.sparse / params.total, "total_experts": total_experts,
        "cache_experts": cache_experts,
        "config": {"hidden": hidden, "ffn": ffn, "experts": experts, "layers": layers, "top_k": 1,
                   "tokens_per_step": tokens, "steps": steps, "warmup": warmup, "rounds": rounds,
                   "router_skew": skew, "isolation": "one process per mode and round"},
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run_offload_bench(), indent=2))
