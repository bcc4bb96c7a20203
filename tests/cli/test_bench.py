"""`moesys bench`: an unknown benchmark or an override it would ignore is a one-line error; nested results render
as flat rows."""

import json

import pytest

from moesys_cli.bench import _rows
from tests.cli.conftest import run_moesys


def test_unknown_benchmark_is_a_one_line_error():
    r = run_moesys("bench", "nosuch")
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error: ")
    assert "unknown benchmark 'nosuch'" in r.stderr and "ring" in r.stderr


def test_nested_results_render_as_dotted_rows():
    result = {"ring_vs_none": 0.8123, "by_batch": {"4": {"ring_vs_none_rounds": [0.81, 0.777], "copies": 3}},
              "device": "cpu"}
    assert list(_rows(result)) == [("ring_vs_none", "0.812"), ("by_batch.4.ring_vs_none_rounds", "0.81 0.78"),
                                   ("by_batch.4.copies", "3"), ("device", "cpu")]


@pytest.mark.parametrize("name,override", [("offload", "model.hidden_size=64"), ("moe-layer", "model.num_experts=4"),
                                           ("embedding", "model.vocab_size=512"), ("ring", "train.lr=1")])
def test_an_override_a_benchmark_would_ignore_is_refused(name, override):
    proc = run_moesys("bench", name, override)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert f"moesys bench {name} takes" in proc.stderr and f"drop {override.split('=')[0]}" in proc.stderr


@pytest.mark.parametrize("args,message", [(("bench", "ring", "--size", "large"), "moesys bench ring takes no --size"),
                                          (("bench", "infer", "--size", "huge"), "--size 'huge' is not one of small"),
                                          (("bench", "infer", "infer.compile=maybe"), "infer.compile=maybe")])
def test_a_size_or_compile_value_the_benchmark_cannot_take_is_refused(args, message):
    proc = run_moesys(*args)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr


@pytest.mark.extended
def test_the_serve_bench_under_a_short_load_fails_no_request_batched_or_not(tmp_path):
    """`moesys bench serve`'s own code at a short load: the real `moesys serve` one request at a time and with
    continuous batching on its bf16 checkpoint, every answer checked against `moesys infer` (a wrong token
    raises), each server drained and exited 0. Speed is the benchmark's, not this test's."""
    from runtime.bench.serve import SETTINGS, run_serve_bench

    out = run_serve_bench(clients=4, duration_s=1.5, workdir=tmp_path,
                          settings={name: SETTINGS[name] for name in ("none", "none_batched")})
    assert out["dtype"] == "bfloat16" and set(out["settings"]) == {"none", "none_batched"}
    for result in out["settings"].values():
        assert result["requests"] > 0 and result["failed"] == 0 and result["exit_code"] == 0
    assert out["batched_vs_one_at_a_time_requests_per_s"] > 0


@pytest.mark.parametrize("name,steps", [("train", 1), ("elastic", 1), ("offload-train", 3)])
def test_a_training_bench_takes_train_max_steps_or_refuses_too_few(name, steps):
    proc = run_moesys("bench", name, f"train.max_steps={steps}")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"moesys bench {name} measures at least" in proc.stderr and f"train.max_steps={steps}" in proc.stderr


SMALL_TRAIN = ["recipe=tiny", "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
               "model.num_experts=4", "train.seq_len=32", "train.micro_batch_size=2", "train.lr=0.003"]


@pytest.mark.extended
def test_bench_train_runs_the_steps_asked_in_alternating_rounds_and_reports_the_spread(tmp_path):
    """12 torchrun jobs of 2 steps (about 5 minutes on 2 cores): every job ran train.max_steps steps (the bench
    checks each job's metrics), and each ratio comes with its rounds and their spread."""
    proc = run_moesys("bench", "train", *SMALL_TRAIN, "train.max_steps=2", "--json", cwd=tmp_path, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["steps"] == 2 and out["rounds"] == 3
    for ratio in ("two_vs_one", "hierarchical_vs_flat"):
        rounds, spread = out[f"{ratio}_rounds"], out[f"{ratio}_spread"]
        assert len(rounds) == 3 and all(r > 0 for r in rounds)
        assert spread == {"min": min(rounds), "median": sorted(rounds)[1], "max": max(rounds)}
        assert out[ratio] == spread["median"]
    for key in ("one_process_tokens_per_s", "two_process_tokens_per_s", "flat_tokens_per_s",
                "hierarchical_tokens_per_s", "global_batch_tokens", "peak_flops", "one_process_mfu"):
        assert out[key] > 0
