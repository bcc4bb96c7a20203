"""`moesys plan --compare RUN_DIR` on a finished tiny run (2 CPU processes, as the user gets it): every rank's
measured peak RAM within 20% of the plan's estimate (how close the plan is meant to be)."""

from __future__ import annotations

import json

import pytest

from tests.cli.conftest import run_moesys

pytestmark = pytest.mark.slow


def test_a_tiny_run_measures_within_20_percent_of_its_plan(tmp_path):
    run_dir = tmp_path / "run"
    done = run_moesys("train", "recipe=tiny", "train.max_steps=40", f"train.run_dir={run_dir}", "--json")
    assert done.returncode == 0, done.stderr
    out = run_moesys("plan", "--compare", str(run_dir), "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    for rank in result["ranks"]:
        ram, ssd = rank["tiers"]["ram"], rank["tiers"]["ssd"]
        assert 0.8 <= ram["ratio"] <= 1.2, (rank["rank"], ram)
        assert ram["within_tolerance"] and ssd == {"predicted_bytes": 0, "measured_bytes": 0, "ratio": None,
                                                   "within_tolerance": True}
    assert result["within_tolerance"]
    table = run_moesys("plan", "--compare", str(run_dir))
    assert table.returncode == 0 and "every rank and tier within 20% of the plan" in table.stdout
    refused = run_moesys("plan", "recipe=tiny", "--compare", str(run_dir))
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
