"""Training steps/s with expert states resident (offload=none), in host memory (cpu), on SSD behind a 25% LFU CPU
cache fetching only active experts (ssd; the paper's section 3.2 and Algorithm 2), and fetch-everything (every
expert fetched, stepped and written back each step, as ZeRO-3 offload does), side by side in one run; the store's
bytes/s against the disk's own sequential bandwidth, at 8 tokens per step and at a realistic load where most experts
are active every step.

For cpu and ssd it also prices the host side of the offloaded step, what decides its speed on a GPU: the host work
(staging, copies, the CPU optimizer, the store's reads and writes by their threads' CPU time, bookkeeping, and waits
with nothing else running) in ns per active expert parameter, taken on steps whose optimizer runs inline and whose
background I/O is settled before the next step (on two cores, work overlapped with the model's compute is slowed by
it, which a GPU's host would not be), against the floor measured in the same process (torch's fused AdamW over as
many parameters, plus a memcpy of the bytes the step moved between host and device and to and from the store, each
from memory rather than cache, as the step finds them);
beside it the disk's own floor for the store's bytes (ssd waits for its disk: that time is no CPU's); and, from the
timed steps, the share of that work hidden behind the forward and backward passes. Each mode's step is set beside
its bound (runtime/plan/step_time.py: the resident step plus the host AdamW at the fused rate over the experts it
activated, and the store's bytes over the disk): `bound` per mode, and bound_s, bound_term, bound_terms_s and
vs_bound (bound / measured) in `cpu` and `ssd`.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

import torch

from runtime.bench.disk import DiskBandwidth, measure_disk
from runtime.bench.machine import measured_rates
from runtime.bench.offload_fine_grained import VARIANTS, run_fine_grained
from runtime.config import ModelConfig, MoesysConfig, TrainConfig
from runtime.data.dataset import TokenDataset
from runtime.host.topology import last_level_cache_bytes, usable_cpus
from runtime.parallel.groups import build_groups
from runtime.plan.params import count_parameters
from runtime.plan.step_time import Rates, StepWork, step_bound
from runtime.storage.optim import AdamWHyper, fused_adamw
from runtime.storage.ssd_home import SSDHome
from runtime.train.build import build_components
from runtime.train.loop import forward_backward, optimizer_step
from runtime.train.objective import LanguageModel

CPU = torch.device("cpu")
PRICED_STEPS = 5
"""Steps after the timed ones whose host work is priced without overlap (background jobs run inline), each beside
its floor."""
START_S = 120.0
"""Seconds a fresh process may take to start and build its trainer before its result is waited for in vain."""


OFFLOADED = ("cpu", "ssd")


class _Trainer:
    """One process's training, stepped with the trainer's own forward_backward and optimizer_step."""

    def __init__(self, cfg: MoesysConfig, mode: str, store_dir: Path | None, cache_experts: int, skew: float,
                 data: str):
        """Built by build_components, as a training worker builds itself; fetch_all is ssd with nothing cached and
        every expert fetched (the ZeRO-3 offload baseline)."""
        offload = {"none": "none", "cpu": "cpu"}.get(mode, "ssd")
        storage = dataclasses.replace(cfg.storage, offload=offload, ssd_path=str(store_dir),
                                      cpu_cache_experts=cache_experts)
        train = dataclasses.replace(cfg.train, run_dir=str(store_dir))
        self.cfg, self.groups = dataclasses.replace(cfg, storage=storage, train=train), build_groups(1, 0, 1, 1)
        self.c = build_components(self.cfg, self.groups, CPU)
        with torch.no_grad():  # Zipf-like router: expert e's logits scaled by skew / (e + 1)
            for layer in self.c.model.moe_layers():
                w = layer.router.gate.weight
                w.mul_(torch.tensor([skew / (e + 1) for e in range(w.shape[0])])[:, None])
        objective = self.c.objective
        assert isinstance(objective, LanguageModel), "the bench trains a language model"
        objective.data = bench_data(data, cfg)
        self.mgr = self.c.offload
        if mode == "fetch_all":
            home = self.mgr.home if self.mgr is not None else None
            assert isinstance(home, SSDHome), "fetch_all offloads to SSD"
            home.fetch_everything()
        self.last_step: list[dict] = []

    def step(self, step: int, settle: bool = False) -> dict:
        """One step and its offload metrics; `settle`: its writes home are waited for first, so that all of them
        land in this step's timeline (the next step's reads ahead, started by this one, land in that step's)."""
        began = time.perf_counter()
        forward_backward(self.c, self.cfg, self.groups, step, CPU)
        middle = time.perf_counter()
        optimizer_step(self.c, self.cfg, self.groups, step)
        ended = time.perf_counter()
        writes = getattr(self.mgr.home, "writes", None) if settle and self.mgr else None
        if writes is not None:
            writes.drain()
        metrics = self.mgr.step_metrics() if self.mgr else {}
        if self.mgr:  # the step's timeline, in ms from its start: the trainer's own phases, then the host work
            own = [("forward_backward", True, began, middle, "train", None),
                   ("optimizer_step", True, middle, ended, "train", None)]
            self.last_step = [{"kind": k, "critical": c, "thread": t, "start_ms": round((a - began) * 1e3, 3),
                               "end_ms": round((b - began) * 1e3, 3),
                               **({} if cpu is None else {"cpu_ms": round(cpu * 1e3, 3)})}
                              for k, c, a, b, t, cpu in own + [(s.kind, s.critical, s.start, s.end, s.thread, s.cpu)
                                                               for s in self.mgr.last_spans]]
        return metrics

    def drain(self) -> None:
        """Wait for this trainer's background work: the CPU optimizer step, the prefetches in flight, the
        write-behind queue and the kernel's write-back of the files written (else another mode pays for them)."""
        if self.mgr:
            self.mgr.drain()
            os.sync()

    def forget_waits(self) -> None:
        """Drop the timeline of a drain between steps: its waits belong to no step."""
        if self.mgr:
            self.mgr.timeline.take()

    def finish(self) -> None:
        if self.mgr:
            self.mgr.close()


def host_floor(params: int, copied_bytes: int, repeats: int = 3) -> float:
    """Seconds of the least host work an offloaded step over `params` active expert parameters could do: torch's
    fused AdamW over that many fp32 parameters, plus a memcpy of the bytes it copied (median of `repeats`), each
    timed with its tensors out of the CPU's caches, where a step finds its experts' states (they were last touched
    a step ago, and the model's work since has passed through the caches many times): a floor small enough to stay
    in the last-level cache would otherwise run from it, and the work of few active experts be priced against a
    faster floor than that of many."""
    p, g, m, v = (torch.randn(max(params, 1)) for _ in range(4))
    v.abs_()
    step = torch.zeros(())
    buf = torch.empty(max(copied_bytes, 1), dtype=torch.uint8)
    dst = torch.empty_like(buf)
    evict = torch.ones(2 * last_level_cache_bytes(), dtype=torch.uint8)  # written once: its own pages

    def best(fn) -> float:
        fn()  # pages touched, kernels chosen
        times = []
        for _ in range(repeats):
            evict.max()  # read through: the caches hold its clean lines, nothing the timed call has to write back
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
        return statistics.median(times)

    adamw = best(lambda: fused_adamw([p], [g], [m], [v], [step], 1e-4, AdamWHyper()))
    copy = best(lambda: dst.copy_(buf)) if copied_bytes else 0.0
    return adamw + copy


def moved_bytes(metrics: dict) -> int:
    """Bytes a step moved: copies between host and device, and the store's reads and writes (at best a memcpy
    each, from and to the page cache)."""
    return int(sum(metrics.get(f"offload/{key}", 0) for key in ("copied_bytes", "ssd_read_bytes", "ssd_write_bytes")))


def bench_data(data: str, cfg: MoesysConfig) -> TokenDataset:
    """corpus: the shipped text; random: uniform random token ids (no structure: the most experts active)."""
    if data == "corpus":
        return TokenDataset.from_path(None, cfg.train.seq_len, cfg.train.seed)
    generator = torch.Generator().manual_seed(cfg.train.seed)
    tokens = torch.randint(0, cfg.model.vocab_size, (1 << 16,), generator=generator)
    return TokenDataset(tokens, cfg.train.seq_len, cfg.train.seed, name="random tokens")


def bench_config(hidden: int, ffn: int, experts: int, layers: int, tokens: int, top_k: int = 1,
                 expert_type: str = "gelu", bias: bool = True) -> MoesysConfig:
    model = ModelConfig(hidden_size=hidden, ffn_hidden_size=ffn, num_layers=layers, num_heads=4,
                        num_experts=experts, top_k=top_k, max_seq_len=max(tokens, 8), aux_loss_weight=0.0,
                        expert_type=expert_type, bias=bias)
    return MoesysConfig(model=model, train=TrainConfig(seq_len=tokens, micro_batch_size=1, warmup_steps=1))


def _process_io() -> dict[str, int]:
    """This process's bytes read from and written to block devices (page-cache hits not counted), or {}."""
    try:
        lines = Path("/proc/self/io").read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v) for k, v in (line.split(": ") for line in lines) if k in ("read_bytes", "write_bytes")}


def _measure(cfg: MoesysConfig, mode: str, store_dir: str, cache_experts: int, skew: float, data: str,
             warmup: int, steps: int, budget_s: float) -> dict:
    """One mode in its own process: steps/s after warm-up (background work drained inside the timing), the
    offload metrics of the timed steps, the bytes the store moved in that time (write-behind included) and the
    bytes that really came from the disk (the rest of the store's reads hit the page cache). Timed steps stop early
    once `budget_s` has passed (at least one is timed)."""
    trainer = _Trainer(cfg, mode, Path(store_dir), cache_experts, skew, data)
    for step in range(warmup):
        trainer.step(step)
    trainer.drain()
    trainer.forget_waits()
    store = getattr(trainer.mgr.home, "store", None) if trainer.mgr else None
    read0, written0 = (store.bytes_read, store.bytes_written) if store else (0, 0)
    io0 = _process_io()
    began = time.perf_counter()
    metrics = []
    for step in range(warmup, warmup + steps):
        metrics.append(trainer.step(step))
        if time.perf_counter() - began > budget_s:
            break
    trainer.drain()
    elapsed = time.perf_counter() - began
    io1 = _process_io()
    moved = {"store_read_bytes": store.bytes_read - read0, "store_write_bytes": store.bytes_written - written0,
             "disk_read_bytes": io1.get("read_bytes", 0) - io0.get("read_bytes", 0)} if store else {}
    peaks = trainer.mgr.tiers.step_metrics() if trainer.mgr else {}
    host = {}
    if mode in OFFLOADED:  # the host work priced on steps whose background jobs run inline, without overlap
        assert trainer.mgr is not None, "an offloaded mode has its engine"
        trainer.mgr.drain()
        trainer.forget_waits()
        trainer.mgr.optimizer.inline = True
        per_expert = count_parameters(trainer.cfg.model).per_expert
        priced, floors = [], []
        for step in range(warmup + steps, warmup + steps + PRICED_STEPS):
            priced.append(trainer.step(step, settle=True))  # and its floor at once, under the same load
            floors.append(host_floor(int(priced[-1]["offload/experts_active"] * per_expert), moved_bytes(priced[-1])))
        host = _host_side(trainer, priced, floors, overlapped=metrics)
    trainer.finish()
    return {"steps_per_s": len(metrics) / elapsed, "elapsed_s": elapsed, "steps": len(metrics), "metrics": metrics,
            "peaks": peaks, **moved, **host}


def _host_side(trainer: _Trainer, metrics: list[dict], floors: list[float], overlapped: list[dict]) -> dict:
    """The host work of a priced step per active expert parameter beside the floor measured right after it: the
    step whose ratio to its own floor is the median (the two measured back to back, on a machine whose memory
    bandwidth drifts from one second to the next); the hidden share of the timed (overlapped) steps."""
    ratios = [m["offload/host_cost_s"] / f if f > 0 else 0.0 for m, f in zip(metrics, floors, strict=True)]
    middle = sorted(range(len(metrics)), key=ratios.__getitem__)[len(metrics) // 2]
    step, floor = metrics[middle], floors[middle]
    of = lambda key, m=step: m[f"offload/{key}"]  # noqa: E731
    params = float(of("experts_active") * count_parameters(trainer.cfg.model).per_expert)
    overlapped_cost, exposed = _mean(overlapped, "host_cost_s"), _mean(overlapped, "host_exposed_s")
    per_param = lambda seconds: seconds / params * 1e9 if params else 0.0  # noqa: E731
    return {"host": {"cpu_side_ns_per_param": per_param(of("host_cost_s")),
                     "work_ns_per_param": per_param(of("host_work_s")),
                     "idle_wait_ns_per_param": per_param(of("host_idle_wait_s")),
                     "floor_ns_per_param": per_param(floor),
                     "cpu_side_vs_floor": ratios[middle],
                     "priced_ratios": ratios,
                     "hidden_share": (0.0 if overlapped_cost <= 0
                                      else max(0.0, min(1.0, 1 - exposed / overlapped_cost))),
                     "active_params_per_step": params, "copied_bytes_per_step": float(of("copied_bytes")),
                     "store_read_bytes_per_step": float(step.get("offload/ssd_read_bytes", 0)),
                     "store_write_bytes_per_step": float(step.get("offload/ssd_write_bytes", 0)),
                     "host_s_per_step": of("host_cost_s"), "overlapped_host_s_per_step": overlapped_cost,
                     "exposed_s_per_step": exposed,
                     "seconds_by_kind": {k[len("offload/time_"):-2]: v for k, v in step.items()
                                         if k.startswith("offload/time_")},
                     "timeline": trainer.last_step}}


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


def _mean(metrics: list[dict], key: str) -> float:
    """The steps' mean of metric offload/`key` (0 without steps)."""
    return sum(m.get(f"offload/{key}", 0) for m in metrics) / len(metrics) if metrics else 0.0


def _bounds(cfg: MoesysConfig, runs: dict[str, list[dict]], rate: dict[str, float], rates: Rates) -> dict:
    """Each mode's step beside its bound (runtime/plan/step_time.py): the resident step's measured time, the host
    AdamW over the experts it activated and the store's bytes over the disk's bandwidth (one process: every core
    the host optimizer's, and the model's, so they add up)."""
    per_expert = count_parameters(cfg.model).per_expert
    out = {}
    for mode, rs in runs.items():
        metrics = [m for r in rs for m in r["metrics"]]
        work = StepWork(compute_s=1 / rate["none"], optimizer_params=_mean(metrics, "experts_active") * per_expert,
                        host_cores=rates.cores, disk_read_bytes=_mean(metrics, "ssd_read_bytes"),
                        disk_write_bytes=_mean(metrics, "ssd_write_bytes"))
        out[mode] = step_bound(work, rates).to_dict(1 / rate[mode])
    return out


MODES = ("none", "cpu", "ssd", "fetch_all")


def _compare(cfg: MoesysConfig, pool: ProcessPoolExecutor, tmp: Path, data: str, cache_experts: int, skew: float,
             warmup: int, steps: int, rounds: int, disk: DiskBandwidth, deadline: float, rates: Rates,
             modes: tuple[str, ...] = MODES) -> dict:
    """The modes (none, cpu and ssd at least) on one input, alternating over `rounds` (median kept); each run gets
    an equal share of the time left before `deadline` for its timed steps. fetch_all steps take seconds each, so it
    times a third of the steps after one warm-up step."""
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    left = rounds * len(runs)
    for round_ in range(rounds):
        for mode in runs:
            store = str(tmp / f"{data}-{cfg.train.seq_len}-{mode}-{round_}")
            w, n = (1, max(2, steps // 3)) if mode == "fetch_all" else (warmup, steps)
            budget = max(1.0, (deadline - time.monotonic()) / left)
            left -= 1
            runs[mode].append(pool.submit(_measure, cfg, mode, store, cache_experts, skew, data, w, n, budget)
                              .result(timeout=budget + START_S))
    rate = {mode: statistics.median(r["steps_per_s"] for r in rs) for mode, rs in runs.items()}
    ssd = [m for r in runs["ssd"] for m in r["metrics"]]
    peaks = runs["ssd"][-1]["peaks"]
    bounds = _bounds(cfg, runs, rate, rates)
    host = {mode: _median_host([r["host"] for r in runs[mode]]) | {"steps_per_s": rate[mode],
                                                                   "vs_none": rate[mode] / rate["none"]} | bounds[mode]
            for mode in OFFLOADED}
    for h in host.values():  # the disk's time for the store's bytes, per active parameter: what ssd's waits approach
        disk_s = (h["store_read_bytes_per_step"] / disk.read_bytes_per_s
                  + h["store_write_bytes_per_step"] / disk.write_bytes_per_s)
        active = h["active_params_per_step"]
        h["disk_floor_ns_per_param"] = disk_s / active * 1e9 if active else 0.0
    fetch_all = {} if "fetch_all" not in runs else {
        "fetch_all_steps_per_s": rate["fetch_all"], "ssd_vs_fetch_all": rate["ssd"] / rate["fetch_all"],
        **_traffic("fetch_all", runs["fetch_all"], disk)}
    return {
        "none_steps_per_s": rate["none"], "cpu_steps_per_s": rate["cpu"], "ssd_steps_per_s": rate["ssd"],
        "cpu_vs_none": rate["cpu"] / rate["none"], "ssd_vs_none": rate["ssd"] / rate["none"],
        "mean_active_experts": _mean(ssd, "experts_active"), "ssd_cache_hit_rate": _mean(ssd, "cache_hit_rate"),
        "ssd_stall_s_per_step": _mean(ssd, "fetch_stall_s"),
        "ssd_bytes_per_step": _mean(ssd, "ssd_read_bytes") + _mean(ssd, "ssd_write_bytes"),
        "ssd_host_peak_bytes": peaks["host_peak_bytes"], "ssd_device_peak_bytes": peaks["device_peak_bytes"],
        "none_s_per_step": 1 / rate["none"], **_traffic("ssd", runs["ssd"], disk), **fetch_all, **host,
        "bound": bounds,
    }


def _median_host(runs: list[dict]) -> dict:
    """The host-side figures of a mode: medians over rounds of the numbers, every round's priced ratios, the last
    round's timeline."""
    out: dict[str, Any] = {}
    for key, value in runs[-1].items():
        if key == "priced_ratios":
            out[key] = [ratio for r in runs for ratio in r[key]]
        elif isinstance(value, float):
            out[key] = statistics.median(r[key] for r in runs)
        elif key == "seconds_by_kind":
            out[key] = {k: statistics.median(r[key].get(k, 0.0) for r in runs) for k in value}
        else:
            out[key] = value
    return out


def run_offload_bench(hidden: int = 128, ffn: int = 1024, experts: int = 16, layers: int = 4, tokens: int = 8,
                      steps: int = 12, warmup: int = 3, rounds: int = 2, cache_fraction: float = 0.25,
                      skew: float = 4.0, ssd_path: str | None = None, inputs: tuple[str, ...] = ("corpus", "random"),
                      load_tokens: int | None = 512, load_input: str = "random", load_steps: int = 6,
                      disk_probe_bytes: int = 1 << 30, time_limit_s: float = 240.0,
                      fine_grained_s: float | None = 120.0) -> dict:
    """Steps/s of none, ssd (cache = cache_fraction of all experts) and fetch_all; JSON-ready dict with ratios.

    The top-level numbers are for the first input (the shipped corpus); `by_input` has every input, random tokens
    being the hard case (no structure, so the most experts active and the lowest cache hit rate).
    `realistic_load` runs the three modes again at `load_tokens` tokens per step of `load_input` (most experts
    active every step; `load_steps` timed steps, a third of them warm-up) unless load_tokens is None. `disk` is the
    disk's own sequential bandwidth in the store's directory, the denominator of every *_vs_disk ratio.
    Each mode runs in a fresh process: one mode's host states, threads and garbage must not slow another down
    (an earlier run of this bench, benchmarks/offload_*.md). `cpu` and `ssd` (top level: the realistic load's, else
    the first input's) price the host side of the offloaded step (module docstring). Timed steps share
    `time_limit_s`: on a slow machine fewer steps are timed, never more time taken (plus each process's start).
    `fine_grained` (unless fine_grained_s is None): 128 experts a layer, top-8, beside 8, top-2, at the realistic load
    (runtime/bench/offload_fine_grained.py), their timed steps sharing `fine_grained_s` more."""
    cfg = bench_config(hidden, ffn, experts, layers, tokens)
    params = count_parameters(cfg.model)
    total_experts = experts * cfg.model.num_moe_layers
    cache_experts = max(1, round(cache_fraction * total_experts))
    spawn = multiprocessing.get_context("spawn")
    fresh = _process_per_run(spawn)
    deadline = time.monotonic() + time_limit_s
    comparisons = len(inputs) + (load_tokens is not None)
    with tempfile.TemporaryDirectory(dir=ssd_path) as tmp, fresh as pool:
        disk = measure_disk(tmp, disk_probe_bytes)
        rates = dataclasses.replace(measured_rates(cfg, CPU), disk_read_bytes_per_s=disk.read_bytes_per_s,
                                    disk_write_bytes_per_s=disk.write_bytes_per_s, cores=usable_cpus())

        def share() -> float:  # each comparison's end, so that one slow input leaves time for the others
            nonlocal comparisons
            end = time.monotonic() + (deadline - time.monotonic()) / comparisons
            comparisons -= 1
            return end

        by_input = {data: _compare(cfg, pool, Path(tmp), data, cache_experts, skew, warmup, steps, rounds, disk,
                                   share(), rates) for data in inputs}
        load = None
        if load_tokens is not None:
            load_cfg = bench_config(hidden, ffn, experts, layers, load_tokens)
            load = _compare(load_cfg, pool, Path(tmp), load_input, cache_experts, skew, max(1, load_steps // 3),
                            load_steps, rounds, disk, share(), rates)
            load.update(input=load_input, tokens_per_step=load_tokens,
                        active_expert_fraction=load["mean_active_experts"] / total_experts)
        fine = None
        if fine_grained_s is not None:
            fine_end = time.monotonic() + fine_grained_s
            variants = len(VARIANTS)

            def compare(variant_cfg: MoesysConfig, cache: int) -> dict:
                nonlocal variants
                end = time.monotonic() + (fine_end - time.monotonic()) / variants
                variants -= 1
                return _compare(variant_cfg, pool, Path(tmp), load_input, cache, skew, max(1, load_steps // 3),
                                load_steps, rounds, disk, end, rates, modes=("none", "cpu", "ssd"))

            fine = run_fine_grained(bench_config, compare, hidden, ffn, layers, load_tokens or tokens, cache_fraction)
    headline = load if load is not None else by_input[inputs[0]]
    return {
        **by_input[inputs[0]], "input": inputs[0], "by_input": by_input,
        **{mode: headline[mode] for mode in OFFLOADED},
        **({"realistic_load": load} if load is not None else {}),
        **({"fine_grained": fine} if fine is not None else {}),
        "disk": disk.as_dict(),
        "expert_param_fraction": params.sparse / params.total, "total_experts": total_experts,
        "cache_experts": cache_experts,
        "config": {"hidden": hidden, "ffn": ffn, "experts": experts, "layers": layers, "top_k": 1,
                   "tokens_per_step": tokens, "steps": steps, "warmup": warmup, "rounds": rounds,
                   "router_skew": skew, "isolation": "one process per mode and round", "time_limit_s": time_limit_s},
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run_offload_bench(), indent=2))


def _process_per_run(context: BaseContext) -> ProcessPoolExecutor:
    """A pool of one worker that is replaced after every run (max_tasks_per_child: Python 3.11 and later)."""
    if sys.version_info < (3, 11):
        raise RuntimeError("moesys bench offload runs each mode in a fresh process, which needs Python 3.11 or newer")
    return ProcessPoolExecutor(1, mp_context=context, max_tasks_per_child=1)
