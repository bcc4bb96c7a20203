"""Helpers for end-to-end tests that run the installed `moesys` command."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

FAST_TINY = ["recipe=tiny", "train.seq_len=64", "train.micro_batch_size=4", "train.warmup_steps=2"]


def moesys_bin() -> str:
    found = shutil.which("moesys")
    if not found:
        pytest.skip("the moesys command is not installed (pip install .)")
    return found


def run_moesys(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="200")
    return subprocess.run([moesys_bin(), *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def refused(*args: str) -> str:
    """The one error line of a `moesys ARGS` that must exit 2 without a traceback."""
    done = run_moesys(*args)
    line = done.stderr.strip()
    assert done.returncode == 2, (args, done.stdout[-1000:], line)
    assert len(line.splitlines()) == 1 and line.startswith("error: ") and "Traceback" not in line, line
    return line


def losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if line.strip()]


@contextmanager
def tmpfs(path: Path, size: str, *options: str) -> Iterator[Path]:
    """A real small (or read-only, options "ro") filesystem mounted at `path` for the block; skips the test where
    mounting needs a privilege this process lacks."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join([f"size={size}", *options]), "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"a full or read-only filesystem needs a tmpfs mount, which failed here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(path: Path) -> None:
    """Write a file into `path` until its filesystem has no space left."""
    with open(path / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
        except OSError:
            pass


@contextmanager
def serving(args: list[str], log: Path, timeout_s: float = 120) -> Iterator[tuple[subprocess.Popen, str]]:
    """A real `moesys serve ARGS --port 0`, its output in the file `log`: yields (process, the URL it listens on).
    On leaving it gets SIGTERM if it still runs and is waited for (killed past 60 s): no server outlives a test."""
    from runtime.bench.serve import listening_url

    with open(log, "w") as out:
        proc = subprocess.Popen([moesys_bin(), "serve", *args, "--port", "0"], stdout=out,
                                stderr=subprocess.STDOUT, text=True)
    try:
        yield proc, listening_url(proc, log, timeout_s=timeout_s)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
