"""`moesys bench`: an unknown benchmark or an override it would ignore is a one-line error; nested results render
as flat rows."""

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
