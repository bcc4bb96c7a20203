"""Helpers for end-to-end tests that run the installed `moesys` command."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

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


def losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if line.strip()]
