"""The training report's sections on metrics files written here (the real run is tests/cli/test_report_e2e.py):
an offloaded run and a multi-task run draw their sections, a torn last line and a running job still render, and
resumes, restarts and capacity drops are shown."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from runtime.config import config_from_dict
from runtime.errors import UserError
from runtime.report.task_section import allocations
from runtime.report.training import write_training_report
from runtime.report.write import write_report
from runtime.files.run_dir import RunLock, save_config

LAYERS, EXPERTS = 2, 4


def _step(step: int, max_steps: int = 6, routed: float = 1.0, **extra) -> dict:
    """A step line with the fields the training loop writes (runtime/train/loop.py, metrics.py)."""
    load = [[(e + step + layer) % EXPERTS / 6 * routed for e in range(EXPERTS)] for layer in range(LAYERS)]
    return {"step": step, "max_steps": max_steps, "loss": 5.0 - 0.3 * step, "aux_loss": 0.04, "importance_loss": 0.01,
            "load_balancing_loss": 1.05, "sparsity_loss": 2.7, "z_loss": 4.4, "expert_fraction": load,
            "expert_load": load, "gate_entropy": [1.3] * LAYERS, "gate_routed": [routed] * LAYERS,
            "expert_load_max_over_mean": 1.5, "memory_bytes_per_rank": [4e8, 4.1e8],
            "memory/peak_rss_anon": [3.0e8 + step, 3.1e8 + step], "memory/cuda_max_allocated": [0, 0],
            "memory/ssd_bytes": [0, 0], "grad_norm": 2.0, "lr": 1e-3, "tokens_per_s": 9000.0 + step,
            "step_time_s": 0.2, **extra}


def _run(tmp_path: Path, lines: list[dict], tail: str = "", **config) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    save_config(config_from_dict(config), run_dir / "config.yaml")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + tail)
    return run_dir


def _figures(page: Path) -> list[str]:
    return re.findall(r'<figure id="([^"]+)"><img src="data:image/png;base64,', page.read_text())


def test_an_offloaded_run_draws_bytes_per_tier_hit_rate_stall_and_memory_against_the_plan(tmp_path):
    def offload(step: int) -> dict:  # the offload/* fields of OffloadEngine.step_metrics
        return {"offload/experts_active": 6, "offload/cache_hit_rate": 0.5 + step / 20,
                "offload/fetch_stall_s": 0.002, "offload/ssd_read_bytes": 1 << 20, "offload/ssd_write_bytes": 1 << 19,
                "offload/device_in_bytes": 7 << 20, "offload/host_in_bytes": 3 << 20, "offload/ssd_in_bytes": 0,
                "offload/device_used_bytes": 0, "offload/host_used_bytes": 12 << 20,
                "offload/ssd_used_bytes": 12 << 20}

    run_dir = _run(tmp_path, [_step(s, **offload(s)) for s in range(1, 7)], storage={"offload": "ssd"})
    result = write_training_report(run_dir)
    assert result["sections"] == ["summary", "loss", "speed", "experts", "offload", "memory", "config"]
    assert _figures(run_dir / "report.html") == result["figures"]
    for fig in ("fig-offload-bytes", "fig-offload-held", "fig-cache-hit-rate", "fig-fetch-stall", "fig-memory-ram",
                "fig-memory-plan"):
        assert fig in result["figures"]
    text = (run_dir / "report.html").read_text()
    assert 'id="memory-table"' in text and "offload: ssd" in text  # the comparison and the config as text


def test_a_multitask_run_draws_loss_and_samples_per_task_and_each_allocation_in_force(tmp_path):
    lines = []
    for step in range(1, 7):
        if step <= 3:  # two tasks on ranks 0 and 1, then a rebalanced restart puts task a on both ranks
            alloc = [(0, "a", 8), (1, "b", 4)]
        else:
            alloc = [(0, "a", 4), (1, "a", 4), (1, "b", 4)]
        lines += [{"step": step, "rank": r, "task": t, "samples": n, "compute_s": 0.5, "samples_per_s": 2 * n}
                  for r, t, n in alloc]
        lines.append(_step(step, task_loss={"a": 5.0 - 0.1 * step, "b": 5.2 - 0.1 * step},
                           **({"restart": 1, "resumed_from": 3} if step == 4 else {})))
    run_dir = _run(tmp_path, lines)
    result = write_training_report(run_dir)
    assert "tasks" in result["sections"]
    assert {"fig-task-loss", "fig-task-samples"} <= set(result["figures"])
    text = (run_dir / "report.html").read_text()
    rows = re.findall(r"<tr><td>(\d+-\d+)</td><td>(\w+)</td><td>([\d, ]+)</td>", text)
    assert rows == [("1-3", "a", "0"), ("1-3", "b", "1"), ("4-6", "a", "0, 1"), ("4-6", "b", "1")]
    assert result["starts"] == [{"step": 4, "resumed_from": 3, "restart": 1}]
    assert "restart 1, resumed from step 3" in text
    rank_lines = [line for line in lines if "task" in line]
    assert [(a, b) for a, b, _ in allocations(rank_lines)] == [(1, 3), (4, 6)]
    assert allocations(rank_lines)[1][2] == {"a": [(0, 4), (1, 4)], "b": [(1, 4)]}


def test_a_torn_last_line_and_a_running_job_still_render(tmp_path):
    run_dir = _run(tmp_path, [_step(s, max_steps=10) for s in range(1, 4)], tail='{"step": 4, "max_steps": 10, "lo')
    assert write_training_report(run_dir)["status"] == "stopped at step 3 of 10"
    lock = RunLock(run_dir)  # what moesys train holds while its job runs
    try:
        result = write_training_report(run_dir, tmp_path / "live.html")
    finally:
        lock.release()
    assert result["status"] == "running: step 3 of 10" and result["last_step"] == 3
    assert "fig-loss" in _figures(tmp_path / "live.html")


def test_capacity_drops_are_drawn_below_each_layers_expert_load(tmp_path):
    run_dir = _run(tmp_path, [_step(s, routed=0.9) for s in range(1, 4)], model={"capacity_factor": 1.0})
    write_training_report(run_dir)
    text = (run_dir / "report.html").read_text()
    assert text.count("the share capacity dropped (mean 10.0%)") == LAYERS


def test_a_run_without_steps_yet_renders_and_bad_sources_are_one_line_errors(tmp_path):
    run_dir = _run(tmp_path, [])
    result = write_report(run_dir)
    assert result["status"] == "no step recorded" and result["figures"] == []
    with pytest.raises(UserError, match="does not exist"):
        write_report(tmp_path / "missing")
    (tmp_path / "other.json").write_text('{"steps": 3}')
    with pytest.raises(UserError, match="not a moesys infer --json result"):
        write_report(tmp_path / "other.json")
    with pytest.raises(UserError, match="not a run directory"):
        write_report(tmp_path)
    export = tmp_path / "export"  # what moesys export writes: a config beside a model, no run
    export.mkdir()
    for name in ("config.yaml", "meta.json", "model.safetensors"):
        (export / name).write_text("{}")
    with pytest.raises(UserError, match="not a run directory .it holds a model: meta.json, model.safetensors"):
        write_report(export)
    (export / "meta.json").unlink()
    (export / "model.safetensors").unlink()
    with pytest.raises(UserError, match="not a run directory .no config.yaml with logs/"):
        write_report(export)
    assert sorted(p.name for p in export.iterdir()) == ["config.yaml"]  # no report.html was written


def test_a_directory_as_out_an_unreadable_run_file_and_mistyped_fields_are_one_line_errors(tmp_path):
    run_dir = _run(tmp_path, [_step(1)])
    with pytest.raises(UserError, match="is a directory; pass a file name"):
        write_report(run_dir, out=tmp_path)
    (run_dir / "metrics.jsonl").unlink()
    (run_dir / "metrics.jsonl").mkdir()  # read fails with the file's name: not blamed on out=
    with pytest.raises(UserError, match=r"cannot read .*metrics\.jsonl"):
        write_report(run_dir)
    result = {"placement": ["resident"], "decode_tokens_per_s": 3.0, "store_bytes_per_token": 0,
              "timeline": {"compute": [[0.0, 0.1]]}}
    for field, value, want in (("decode_tokens_per_s", None, "a number"), ("copy_s", "1 ms", "a number"),
                               ("placement", "resident", "a list"),
                               ("timeline", {"copy": [[0.0]]}, r"lists of \[start, end\] spans"),
                               ("peak_bytes", {"device": {"total": "big"}}, "byte counts")):
        (tmp_path / "r.json").write_text(json.dumps({**result, field: value}))
        with pytest.raises(UserError, match=f"field '{field}' .* not {want}"):
            write_report(tmp_path / "r.json")
    (tmp_path / "r.json").write_text(json.dumps(result))
    assert write_report(tmp_path / "r.json")["kind"] == "inference"
