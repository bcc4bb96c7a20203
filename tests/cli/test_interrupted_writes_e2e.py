"""Ctrl-C and SIGKILL during the verbs that write one file or directory (tokenize, export), through the real command:
SIGINT exits 130 saying "interrupted: nothing written" and leaves nothing; after SIGKILL the hidden temporary the
killed process left stays until the next successful run of the same output removes it, never a live writer's."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

from runtime.config import ModelConfig
from runtime.data.text import CORPUS_DIR
from tests.cli.conftest import moesys_bin, run_moesys
from tests.trained_run import train_run_dir

MEDIUM_MOE = ModelConfig(hidden_size=256, num_layers=4, num_heads=4, vocab_size=256, ffn_hidden_size=512,
                         num_experts=16, max_seq_len=48)
"""About 70 MB of export: long enough to write that a signal lands while the temporary directory exists."""


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([moesys_bin(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _when(found: Callable[[], list[Path]], proc: subprocess.Popen) -> list[Path]:
    """Wait for the running command to create its temporary (an event, polled); fails if it ended first."""
    deadline = time.monotonic() + 600
    while not (paths := found()):
        assert proc.poll() is None, f"it ended before writing anything: {proc.communicate()}"
        assert time.monotonic() < deadline, "no temporary appeared"
        time.sleep(0.01)
    return paths


def _interrupted(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, (out[-2000:], err[-2000:])
    assert err.strip().splitlines()[-1] == "interrupted: nothing written", err


def _killed(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.communicate(timeout=60)


def test_tokenize_interrupted_writes_nothing_and_a_killed_ones_temporary_goes_next_time(tmp_path):
    tok = tmp_path / "tok.json"
    assert run_moesys("tokenizer", "train", f"data={CORPUS_DIR}", "vocab_size=400", f"out={tok}").returncode == 0
    big = tmp_path / "big.txt"
    corpus = "\n\n".join(p.read_text() for p in sorted(CORPUS_DIR.glob("*.txt")))
    big.write_text(corpus * max(1, (40 << 20) // len(corpus)))  # ~40 MB: seconds of BPE encoding
    out = tmp_path / "tokens.bin"
    args = ("tokenize", f"data={big}", f"out={out}", f"train.tokenizer={tok}", "--json")
    temps = lambda: sorted(tmp_path.glob(".tokens.bin.*.tmp"))  # noqa: E731

    proc = _start(*args)
    _when(temps, proc)
    _interrupted(proc)
    assert not out.exists() and not temps()

    proc = _start(*args)
    left = _when(temps, proc)
    _killed(proc)
    assert temps() == left  # SIGKILL leaves the temporary behind
    live = tmp_path / f".tokens.bin.{os.getpid()}@{left[0].name.split('@')[1]}"  # the same name from a live pid: ours
    live.write_bytes(b"")
    done = run_moesys("tokenize", f"data={CORPUS_DIR / 'weather.txt'}", f"out={out}", f"train.tokenizer={tok}")
    assert done.returncode == 0, done.stderr
    assert out.exists() and temps() == [live]


def test_export_interrupted_writes_nothing_and_a_killed_ones_temporary_goes_next_time(tmp_path):
    run = train_run_dir(tmp_path / "run", MEDIUM_MOE)
    out = tmp_path / "model"
    temps = lambda: sorted(tmp_path.glob(".model.*.tmp"))  # noqa: E731

    proc = _start("export", f"checkpoint={run}", f"out={out}")
    _when(temps, proc)
    _interrupted(proc)
    assert not out.exists() and not temps()

    proc = _start("export", f"checkpoint={run}", f"out={out}")
    left = _when(temps, proc)
    _killed(proc)
    assert temps() == left and left[0].is_dir()
    done = run_moesys("export", f"checkpoint={run}", f"out={out}")
    assert done.returncode == 0, done.stderr
    assert (out / "meta.json").exists() and not temps()
