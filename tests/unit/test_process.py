"""runtime/process.py: a job dies with its launcher, stop signals are forwarded once, and torchrun's log tree
gives the restarts and the rank that failed first."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from runtime.process import LauncherJob, TorchrunLogs, exception_line, first_failure
from tests.waiting import wait_until

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

CLOSED = ("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"loop.py\", line 9, in step\n"
          "[rank0]:     work.wait()\n[rank0]: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1\n")
HEADER = ("[rank1]: Traceback (most recent call last):\n[rank1]:   File \"checkpoint.py\", line 204, in load\n"
          "[rank1]:     with safe_open(str(rng_file), framework=\"pt\") as f:\n"
          "[rank1]:          ^^^^^^^^^^^^^^^^^^^^^^^^\n"
          "[rank1]: safetensors_rust.SafetensorError: Error while deserializing header: header too large\n")


def write(path: Path, text: str, mtime_ns: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def attempt(root: Path, run_id: str = "5f1c_ab12", n: int = 0) -> Path:
    """One attempt of torchrun's --log_dir layout: LOG_DIR/<run id>_<suffix>/attempt_<n>/<local rank>/."""
    for rank in (0, 1):
        for name in ("stdout.log", "stderr.log"):
            write(root / run_id / f"attempt_{n}" / str(rank) / name, "", 1_000)
    return root / run_id / f"attempt_{n}"


def test_the_rank_whose_traceback_came_first_is_quoted_not_its_peer(tmp_path):
    a = attempt(tmp_path)
    write(a / "1" / "stderr.log", "W1123 a warning\n" + HEADER, 2_000_000_000)
    write(a / "0" / "stderr.log", CLOSED, 2_000_500_000)  # half a millisecond later: it failed because rank 1 did
    failure = first_failure(a)
    assert failure.local_rank == 1
    assert failure.message == "safetensors_rust.SafetensorError: Error while deserializing header: header too large"


def test_a_peer_that_only_saw_the_connection_close_is_not_quoted_even_when_it_wrote_first(tmp_path):
    a = attempt(tmp_path)
    write(a / "0" / "stderr.log", CLOSED, 2_000_000_000)
    write(a / "1" / "stderr.log", HEADER + "W1124 shutting down\n", 2_000_500_000)  # failed first, wrote last
    assert first_failure(a).local_rank == 1
    write(a / "1" / "stderr.log", "W1123 a warning\n", 2_000_500_000)  # no other error: the echo is all there is
    assert first_failure(a).local_rank == 0


def test_error_json_counts_as_a_failure_and_ranks_without_a_traceback_do_not(tmp_path):
    a = attempt(tmp_path)
    write(a / "0" / "stderr.log", "W1123 a warning written at start\n", 1_000_000)  # rank 0 never failed
    error = {"message": {"message": "ValueError: bad batch\n", "extraInfo": {"py_callstack": "...", "timestamp": "1"}}}
    write(a / "1" / "error.json", json.dumps(error), 3_000_000)
    write(a / "1" / "stderr.log", "[rank1]: Traceback (most recent call last):\n[rank1]: ValueError: bad batch\n",
          3_000_001)
    assert first_failure(a).local_rank == 1 and first_failure(a).message == "ValueError: bad batch"
    write(a / "1" / "error.json", json.dumps({"message": "OSError: disk full"}), 3_000_000)
    assert first_failure(a).message == "OSError: disk full"
    assert first_failure(attempt(tmp_path / "clean")) is None


def test_exception_line_is_the_last_tracebacks(tmp_path):
    chained = ("Traceback (most recent call last):\n  File \"a.py\", line 1\nKeyError: 'x'\n\n"
               "During handling of the above exception, another exception occurred:\n\n"
               "Traceback (most recent call last):\n  File \"a.py\", line 3\n    raise X\nCheckpointError: no tensor\n")
    assert exception_line(chained) == "CheckpointError: no tensor"
    assert exception_line("W1123 nothing failed\n") is None


def test_logs_of_earlier_launches_are_not_this_ones(tmp_path):
    attempt(tmp_path, "old_run", 0)
    attempt(tmp_path, "old_run", 1)
    write(tmp_path / "old_run" / "attempt_1" / "0" / "stderr.log", CLOSED, 5_000)
    (tmp_path / "launcher.log").write_text("")
    logs = TorchrunLogs(tmp_path)
    assert logs.restarts() == 0 and logs.failure() is None
    attempt(tmp_path, "new_run", 0)
    assert logs.restarts() == 0
    write(attempt(tmp_path, "new_run", 1) / "1" / "stderr.log", HEADER, 6_000)
    assert logs.restarts() == 1 and logs.failure().local_rank == 1


PARENT_EXITS = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", '''
import os, signal
from runtime.process import die_with_parent
die_with_parent(signal.SIGKILL, os.getppid())
print(os.getpid(), flush=True)
signal.pause()
'''], stdout=subprocess.PIPE, text=True)
print(child.stdout.readline().strip(), flush=True)
"""


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@linux_only
def test_a_process_tied_to_its_parent_dies_when_the_parent_exits():
    out = subprocess.run([sys.executable, "-c", PARENT_EXITS], capture_output=True, text=True, timeout=60)
    child = int(out.stdout.strip())
    try:
        wait_until(lambda: gone(child), what="the child to die with its parent (it would run on until a signal)")
    finally:
        if not gone(child):
            os.kill(child, signal.SIGKILL)


@linux_only
def test_a_process_whose_parent_already_changed_dies_at_once():
    code = "import os, signal; from runtime.process import die_with_parent; die_with_parent(9, os.getppid() + 1)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == -signal.SIGKILL


SIGTERM_EXITS_7 = """
import signal, sys
signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))
{handle}
print("ready", flush=True)
while True:
    signal.pause()
"""
"""A command that runs until a signal ends it: SIGTERM with exit code 7, unless `handle` says otherwise."""

NOTES = "signal.signal(signal.{0}, lambda *a: print('got {0}', flush=True))"
"""A handler that notes the signal in the log and goes on running."""


def start_job(tmp_path: Path, handle: str = "", **kwargs) -> LauncherJob:
    log = tmp_path / f"job-{len(list(tmp_path.iterdir()))}.log"
    job = LauncherJob([sys.executable, "-c", SIGTERM_EXITS_7.format(handle=handle)], log, **kwargs)
    job.__enter__()
    wait_until(lambda: "ready" in log.read_text(), what="the command to start", process=job.proc, log=log)
    return job


def test_a_stop_signal_is_forwarded_once_and_a_second_one_kills(tmp_path):
    job = start_job(tmp_path)
    try:
        assert os.getsid(job.proc.pid) == job.proc.pid  # its own session: a terminal's Ctrl-C reaches it through us
        os.kill(os.getpid(), signal.SIGTERM)
        assert job.wait(timeout=30) == 7 and job.stop_signal == signal.SIGTERM
    finally:
        job.__exit__(None, None, None)
    assert signal.getsignal(signal.SIGTERM) != job._on_signal  # the handlers are restored

    job = start_job(tmp_path, handle=NOTES.format("SIGINT"))
    try:
        os.kill(os.getpid(), signal.SIGINT)
        wait_until(lambda: "got SIGINT" in job.log_path.read_text(), what="the command to get the first SIGINT",
                   process=job.proc, log=job.log_path)
        assert job.proc.poll() is None  # it handled the signal and runs on
        os.kill(os.getpid(), signal.SIGINT)
        assert job.wait(timeout=30) == -signal.SIGKILL and job.stop_signal == signal.SIGINT
    finally:
        job.__exit__(None, None, None)
    assert job.log_path.read_text().count("got SIGINT") == 1  # the second was not forwarded: it killed


def test_leaving_the_block_stops_a_command_that_ignores_sigterm_within_the_grace(tmp_path):
    # As a torchrun blocked in a network call: SIGTERM is never handled, so the stop must not wait for it.
    job = start_job(tmp_path, handle="signal.signal(signal.SIGTERM, signal.SIG_IGN)", stop_grace_s=0.5)
    hung = threading.Event()
    backstop = threading.Timer(60, lambda: (hung.set(), job.proc.kill()))  # ends a stop that would hang forever
    backstop.start()
    try:
        job.__exit__(None, None, None)
    finally:
        backstop.cancel()
    assert not hung.is_set(), "leaving the block waited on a command that ignores SIGTERM"
    assert job.proc.returncode == -signal.SIGKILL

    job = start_job(tmp_path)  # one that handles it exits on its own, gently
    job.__exit__(None, None, None)
    assert job.proc.returncode == 7
