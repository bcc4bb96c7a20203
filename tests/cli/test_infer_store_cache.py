"""The experts' copy that `moesys infer --offload ring|ondemand` reads, through the real command: it lives in the user's
cache (infer.cache_dir; $XDG_CACHE_HOME/moesys/experts by default), never the temp directory; an unchanged
checkpoint's copy is reused; infer.cache_gb bounds the cache, evicting the least recently used checkpoint's copy but
never one a running server holds; a filesystem without room is refused in one line before anything is written."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.cli.conftest import moesys_bin, serving, tmpfs
from tests.trained_run import train_run_dir

ONE_COPY = 134_144
"""Bytes of a SMALL_MOE checkpoint's experts copy (2 MoE layers of 4 experts, fp32)."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return [train_run_dir(tmp_path_factory.mktemp(name)) for name in ("a", "b")]


def infer(env: dict[str, str], run: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([moesys_bin(), "infer", f"checkpoint={run}", "prompt_ids=[1,2,3]", "infer.max_new_tokens=3",
                           "--offload", "ring", *args, "--json"], capture_output=True, text=True, env=env,
                          timeout=300)


def copies(root: Path) -> dict[str, list[str]]:
    return {d.name: sorted(f.name for f in d.iterdir()) for d in sorted(root.iterdir()) if d.is_dir()}


def test_the_copy_goes_to_the_users_cache_and_is_reused(tmp_path, runs):
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "xdg"), TMPDIR=str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    first = infer(env, runs[0])
    assert first.returncode == 0, first.stderr
    root = tmp_path / "xdg" / "moesys" / "experts"
    assert list(copies(root).values()) == [["layer0.safetensors", "layer1.safetensors"]]
    assert not list((tmp_path / "tmp").iterdir())  # nothing left in the temp directory
    layers = sorted(root.glob("*/layer*.safetensors"))
    written = [p.stat().st_mtime_ns for p in layers]
    again = infer(env, runs[0], "--offload", "ondemand")
    assert again.returncode == 0, again.stderr
    assert [p.stat().st_mtime_ns for p in layers] == written  # the unchanged checkpoint's copy, reused
    assert json.loads(again.stdout)["tokens"] == json.loads(first.stdout)["tokens"]


@pytest.mark.extended
def test_the_bound_evicts_the_least_recently_used_copy_but_not_a_running_servers(tmp_path, runs):
    env = dict(os.environ)
    root = tmp_path / "cache"
    bound = [f"infer.cache_dir={root}", f"infer.cache_gb={1.5 * ONE_COPY / 1e9}"]  # room for one copy
    for run in runs:
        done = infer(env, run, *bound)
        assert done.returncode == 0, done.stderr
    assert len(copies(root)) == 1  # a's copy went to make room for b's
    b_copy = next(iter(copies(root)))
    with serving([f"checkpoint={runs[1]}", "--offload", "ring", *bound], tmp_path / "serve.log"):
        done = infer(env, runs[0], *bound)  # b's copy is in use: it stays, past the bound while it runs
        assert done.returncode == 0, done.stderr
        assert len(copies(root)) == 2 and b_copy in copies(root)
    done = infer(env, runs[0], *bound)  # the server is gone: b's copy is the least recently used
    assert done.returncode == 0, done.stderr
    assert b_copy not in copies(root) and len(copies(root)) == 1


def test_a_copy_the_filesystem_has_no_room_for_is_refused_in_one_line(tmp_path, runs):
    with tmpfs(tmp_path / "small", "64k") as small:
        done = infer(dict(os.environ), runs[0], f"infer.cache_dir={small}")
        assert done.returncode == 2, done.stderr
        line = done.stderr.strip()
        assert len(line.splitlines()) == 1 and f"infer.cache_dir={small}" in line, line
        assert f"needs {ONE_COPY:,} bytes more" in line and "free" in line
        assert not list(small.rglob("*.safetensors"))
    too_big = infer(dict(os.environ), runs[0], f"infer.cache_dir={tmp_path / 'c'}", "infer.cache_gb=0.0001")
    assert too_big.returncode == 2 and "more than infer.cache_gb=0.0001" in too_big.stderr
