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
