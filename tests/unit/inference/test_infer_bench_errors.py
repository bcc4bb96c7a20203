"""`moesys bench infer` keeps going when one system hangs: a subprocess that runs past its limit becomes an
{"error": ...} row for that system instead of a traceback that loses every other result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from runtime.bench import infer as bench
from runtime.inference.random_checkpoint import write_random_mixtral


def hang(*args, **kwargs):
    raise subprocess.TimeoutExpired(args[0], kwargs.get("timeout"))


def test_a_worker_past_its_time_limit_is_an_error_row(monkeypatch):
    monkeypatch.setattr(bench.subprocess, "run", hang)
    result = bench._subprocess("_moesys_worker", {"checkpoint": "x"}, timeout=5)
    assert result == {"error": "_moesys_worker ran past its 5 s limit and was killed"}


def test_the_capped_cli_past_its_time_limit_is_an_error_row(monkeypatch, tmp_path):
    monkeypatch.setattr(bench.subprocess, "run", hang)
    result = bench._infer_cli(tmp_path, slots=1, new_tokens=4, timeout=7)
    assert result == {"error": "_auto_worker ran past its 7 s limit and was killed"}


def test_the_capped_infer_runs_with_no_moesys_command_on_path(tmp_path):
    """A virtual environment's python run by its path, not activated: the bench's `moesys infer --offload auto`
    must not look for a `moesys` command on PATH."""
    write_random_mixtral(tmp_path / "mixtral", 64, 128, 2, 4, 256, heads=4)
    path = [d for d in os.environ["PATH"].split(os.pathsep) if d and not (Path(d) / "moesys").exists()]
    code = ("import json, sys; from runtime.bench import infer as b; "
            "print(json.dumps(b._infer_cli(sys.argv[1], slots=1, new_tokens=3)))")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "mixtral")], capture_output=True, text=True,
                          env=dict(os.environ, PATH=os.pathsep.join(path)), timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "error" not in result, result
    assert len(result["tokens"]) == 1 and len(result["tokens"][0]) == 3 and result["placement"]


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
