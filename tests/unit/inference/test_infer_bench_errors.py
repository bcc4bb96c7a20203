"""`moesys bench infer` keeps going when one system hangs: a subprocess that runs past its limit becomes an
{"error": ...} row for that system instead of a traceback that loses every other result."""

from __future__ import annotations

import subprocess

from runtime.bench import infer as bench


def hang(*args, **kwargs):
    raise subprocess.TimeoutExpired(args[0], kwargs.get("timeout"))


def test_a_worker_past_its_time_limit_is_an_error_row(monkeypatch):
    monkeypatch.setattr(bench.subprocess, "run", hang)
    result = bench._subprocess("_moesys_worker", {"checkpoint": "x"}, timeout=5)
    assert result == {"error": "_moesys_worker ran past its 5 s limit and was killed"}


def test_the_capped_cli_past_its_time_limit_is_an_error_row(monkeypatch, tmp_path):
    monkeypatch.setattr(bench.subprocess, "run", hang)
    result = bench._infer_cli(tmp_path, slots=1, new_tokens=4, timeout=7)
    assert result == {"error": "moesys infer ran past its 7 s limit and was killed"}


def test_cold_runs_evict_the_checkpoint_without_root(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 4096)
    assert bench.drop_page_cache(tmp_path) is None


def test_a_worker_killed_at_its_limit_keeps_what_it_had_measured(monkeypatch):
    """The worker's PARTIAL lines (load, warm-up with compilation, rates so far) come back with the error row."""
    def killed(*args, **kwargs):
        raise subprocess.TimeoutExpired(args[0], kwargs.get("timeout"), output=b'PARTIAL {"load_s": 3.0}\n'
                                        b'PARTIAL {"load_s": 3.0, "warm_up_s": 40.0}\n')

    monkeypatch.setattr(bench.subprocess, "run", killed)
    result = bench._subprocess("_moesys_worker", {"checkpoint": "x"}, timeout=5)
    assert result == {"error": "_moesys_worker ran past its 5 s limit and was killed",
                      "partial": {"load_s": 3.0, "warm_up_s": 40.0}}


def test_a_worker_prints_partial_lines_only_in_its_own_process(capsys):
    from runtime.bench import infer_workers

    infer_workers._partial({"load_s": 1.0})
    assert capsys.readouterr().out == ""
    infer_workers._WORKER = True
    try:
        infer_workers._partial({"load_s": 1.0})
    finally:
        infer_workers._WORKER = False
    assert capsys.readouterr().out == 'PARTIAL {"load_s": 1.0}\n'


def test_transformers_static_killed_while_compiling_keeps_its_eager_row():
    row = {"tokens": [1, 2], "decode_tokens_per_s": 9.0, "compiled": False}
    killed = {"error": "_hf_worker ran past its 5 s limit and was killed",
              "partial": {**row, "complete": True, "compiled_run": {"warm_up_s": 4.0}}}
    assert bench._complete(killed) == {**row, "compiled_run": {"warm_up_s": 4.0}, "compile_error": killed["error"]}
    early = {"error": "killed", "partial": {"load_s": 3.0}}  # nothing measured yet: stays an error row
    assert bench._complete(early) == early
