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
