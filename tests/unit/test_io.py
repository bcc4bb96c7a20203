"""Atomic files: the target appears whole or not at all, with the mode a plain open() gives it."""

from __future__ import annotations

import errno
import os
import stat
import subprocess

import pytest

from runtime.io import atomic_file, atomic_write_text, remove_stale_temps, temp_prefix


def test_the_file_appears_with_the_umask_mode_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "report.html"
    atomic_write_text(target, "<html></html>")
    plain = tmp_path / "plain"
    plain.write_text("x")
    assert target.read_text() == "<html></html>"
    assert stat.S_IMODE(target.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain", "report.html"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "config.yaml"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_file(target) as f:
            f.write(b"half")
            raise RuntimeError("killed mid-write")
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["config.yaml"]


def test_a_write_error_without_a_file_name_is_raised_naming_the_target(tmp_path):
    target = tmp_path / "dense.safetensors"
    with pytest.raises(OSError) as exc:
        with atomic_file(target):
            raise OSError(errno.ENOSPC, "No space left on device")  # what f.write raises on a full disk
    assert exc.value.errno == errno.ENOSPC and exc.value.filename == str(target)
    assert os.listdir(tmp_path) == []


def test_stale_temporaries_of_dead_writers_go_and_nothing_else_does(tmp_path):
    target = tmp_path / "out.bin"
    dead = subprocess.Popen(["true"])
    dead.wait()
    mine = temp_prefix(target)  # .out.bin.PID@HOST.
    stale_file = tmp_path / f"{mine.replace(str(os.getpid()), str(dead.pid))}abc.tmp"
    stale_dir = tmp_path / f"{mine.replace(str(os.getpid()), str(dead.pid))}dir.tmp"
    stale_file.write_bytes(b"x")
    stale_dir.mkdir()
    (stale_dir / "shard").write_bytes(b"x")
    kept = [tmp_path / f"{mine}live.tmp", tmp_path / ".out.bin.abc.tmp", tmp_path / ".other.bin.1.tmp",
            tmp_path / f".out.bin.{dead.pid}@elsewhere.abc.tmp"]
    for path in kept:
        path.write_bytes(b"x")
    assert sorted(remove_stale_temps(target)) == sorted([stale_file, stale_dir])
    assert sorted(tmp_path.iterdir()) == sorted(kept)
