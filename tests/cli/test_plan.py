"""`moesys plan` through the real command: tables, --json contract, exit codes 0 / 1 / 2, one-line errors."""

from __future__ import annotations

import json

from tests.cli.conftest import run_moesys


def test_plan_13b_table_and_json(tmp_path):
    table = run_moesys("plan", "recipe=gpt-moe-13b", cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    assert "13.9B parameters" in table.stdout and "16D + 4aS/L <= M_GPU*N" in table.stdout
    out = run_moesys("plan", "recipe=gpt-moe-13b", "--json", cwd=tmp_path)
    data = json.loads(out.stdout)
    for key in ("total", "dense", "sparse", "active", "embedding"):
        assert isinstance(data["params"][key], int)
    assert {"alpha", "layers", "nodes"} <= set(data["budget"])
    for tier in ("gpu", "cpu", "ssd"):
        assert {"required_bytes", "capacity_bytes", "ok"} <= set(data["budget"]["tiers"][tier])
    assert data["feasible"] is True and "placement" in data and "per_rank" in data


def test_plan_that_does_not_fit_exits_1_and_says_why(tmp_path):
    out = run_moesys("plan", "recipe=gpt-moe-207b", "topology.nodes=1", "topology.expert_parallel=8",
                     "storage.offload=auto", "topology.cpu_memory_gb=256", "--json", cwd=tmp_path)
    assert out.returncode == 1
    data = json.loads(out.stdout)
    assert data["feasible"] is False and data["problems"] and data["suggestions"]


def test_bad_input_exits_2_with_one_line_and_no_traceback(tmp_path):
    for args in (["recipe=nope"], ["model.num_expert=3"], ["model.top_k=99"], ["model.hidden_size=abc"]):
        out = run_moesys("plan", *args, cwd=tmp_path)
        assert out.returncode == 2, args
        assert out.stdout == "" and "Traceback" not in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert out.stderr.startswith("error: ")


def test_version_and_module_entry(tmp_path):
    import subprocess
    import sys
    assert run_moesys("--version").stdout.startswith("moesys ")
    out = subprocess.run([sys.executable, "-m", "moesys_cli", "plan", "--json"], capture_output=True, text=True,
                         cwd=tmp_path)
    assert out.returncode == 0 and json.loads(out.stdout)["recipe"] == "tiny"
