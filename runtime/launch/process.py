"""The processes of a torchrun job: tied to the process that launched them, stopped by SIGINT/SIGTERM forwarded
once, and followed through torchrun's log tree (LOG_DIR/<run id>/attempt_<n>/<local rank>/): restarts and the
rank that failed first."""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from runtime.files.checkpoint_format import latest_checkpoint, read_meta

PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STOP_GRACE_S = 35.0
"""How long a job stopped by its follower gets after SIGTERM before SIGKILL: torchrun gives its workers 30 s
(its shutdown timeout) to exit before it kills them."""


def _prctl() -> Callable[..., int] | None:
    """libc's prctl on Linux, else None (loaded here, never in a forked child that is about to exec)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent(sig: int, parent: int) -> None:
    """Have Linux send `sig` to this process when its parent exits (PR_SET_PDEATHSIG); if the parent is no longer
    `parent` (it exited before the request, and this process was adopted), send it now. No-op without prctl."""
    prctl = _prctl()
    if prctl is None:
        return
    prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


def _tie_to(parent: int, sig: int, then: Callable[[], None] | None = None) -> Callable[[], None] | None:
    """A preexec_fn: the child gets `sig` when `parent` exits, and never starts if it already has; then it runs
    `then` (a memory cap's group to join)."""
    prctl = _prctl()
    if prctl is None:
        return then

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(128 + int(sig))
        if then is not None:
            then()

    return preexec


class LauncherJob:
    """A command (torchrun) run while this process follows it, as a context manager.

    It runs in its own session, so a terminal's Ctrl-C reaches it only through this process, and Linux sends it
    SIGTERM when this process dies, even by SIGKILL (torchrun then stops its workers as for any SIGTERM). The first
    SIGINT or SIGTERM this process receives is forwarded (torchrun passes it on; the workers checkpoint at the end
    of the step and exit); a second one kills the command, and its workers die with it.
    """

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None,
                 stop_grace_s: float = STOP_GRACE_S, preexec: Callable[[], None] | None = None):
        self.argv, self.log_path = argv, Path(log_path)
        self.preexec = preexec
        """Run in the child before it starts the command, once it is tied to this process (a cgroup to join)."""
        self.stop_grace_s = stop_grace_s
        """Leaving the with-block while the command runs stops it: SIGTERM, then SIGKILL after this long."""
        self.env = {**os.environ, **env} if env else None
        self.stop_signal: int | None = None
        """The first stop signal received (signal.SIGINT or signal.SIGTERM), or None."""
        self.proc: subprocess.Popen | None = None
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}

    def __enter__(self) -> LauncherJob:
        if threading.current_thread() is threading.main_thread():  # only the main thread receives signals
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env=self.env,
                                         preexec_fn=_tie_to(os.getpid(), signal.SIGTERM, self.preexec))
        if self.stop_signal is not None:  # arrived while starting
            self.proc.send_signal(self.stop_signal)
        return self

    def _on_signal(self, signum: int, frame) -> None:
        first = self.stop_signal is None
        if first:
            self.stop_signal = signum
        if self.proc is not None:
            self.proc.send_signal(signum) if first else self.proc.kill()

    @property
    def started(self) -> subprocess.Popen:
        """The command's process, once the with-block started it."""
        if self.proc is None:
            raise RuntimeError("the command has not started: use the job as a context manager")
        return self.proc

    def wait(self, timeout: float) -> int | None:
        """The command's exit status, or None while it runs after `timeout` seconds."""
        try:
            return self.started.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self, grace_s: float = 5.0) -> None:
        """Stop the command now: SIGTERM, then SIGKILL after grace_s (a torchrun blocked in a network call does
        not get to its SIGTERM handler)."""
        proc = self.started
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __exit__(self, *exc) -> None:
        try:
            if self.proc is not None and self.proc.poll() is None:  # the follower failed: stop the job, gently
                self.kill(self.stop_grace_s)  # but bounded: a torchrun blocked on the network ignores SIGTERM
        finally:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)


def worker_pids(agent_pid: int) -> frozenset[int]:
    """The workers torchrun (`agent_pid`) runs now: its live children that run the worker module. Empty when
    torchrun has ended, or between two attempts."""
    import psutil

    from runtime.launch.command import WORKER_MODULE

    found = set()
    try:
        children = psutil.Process(agent_pid).children()
    except psutil.Error:
        return frozenset()
    for child in children:
        try:
            if child.status() != psutil.STATUS_ZOMBIE and WORKER_MODULE in child.cmdline():
                found.add(child.pid)
        except psutil.Error:
            continue
    return frozenset(found)


@dataclass(frozen=True)
class RankError:
    local_rank: int
    message: str
    """The exception line, e.g. `RuntimeError: ...`."""


_RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]: ?")


def exception_line(text: str) -> str | None:
    """The exception line of the last Python traceback in `text` (torch's `[rankN]:` prefixes removed)."""
    lines = [_RANK_PREFIX.sub("", line) for line in text.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if not starts:
        return None
    for line in lines[starts[-1] + 1:]:
        if line.strip() and not line[0].isspace():
            return line.strip()
    return None


def _error_json_message(path: Path) -> str | None:
    try:
        message = json.loads(path.read_text()).get("message")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(message, dict):
        message = message.get("message")
    return message.strip().splitlines()[-1] if isinstance(message, str) and message.strip() else None


_ECHO = re.compile(r"Connection (closed|reset) by peer|Broken pipe")
"""An error that only echoes a peer's failure: the connection to it ended."""


def first_failure(attempt_dir: Path) -> RankError | None:
    """The error of the rank that failed first in one attempt of torchrun's log tree, or None.

    A rank failed when it has an error.json or its stderr.log ends a traceback; the one whose file was written
    first failed first. The others usually fail because of it (a peer's closed connection), later; such an echo
    is quoted only when no rank has another error (a rank's file may be written last after it failed first: a
    rank that timed out keeps logging while it shuts down, and its peer on the same node sees the close first)."""
    found = []
    for rank_dir in Path(attempt_dir).iterdir():
        if not rank_dir.name.isdigit():
            continue
        error_file, stderr = rank_dir / "error.json", rank_dir / "stderr.log"
        message = _error_json_message(error_file) if error_file.exists() else None
        source = error_file
        if message is None and stderr.exists():
            message, source = exception_line(stderr.read_text(errors="replace")), stderr
        if message:
            found.append((bool(_ECHO.search(message)), source.stat().st_mtime_ns, int(rank_dir.name), message))
    if not found:
        return None
    _, _, rank, message = min(found)
    return RankError(rank, message)


def resume_point(run_dir: Path) -> tuple[Path, int] | None:
    """The checkpoint workers started in `run_dir` now resume from, and its step; None when there is none."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return None
    try:
        return ckpt, int(read_meta(ckpt)["step"])
    except (OSError, ValueError, KeyError):
        return None


class TorchrunLogs:
    """torchrun's log tree under LOG_DIR, for the launch that starts after this object is made (earlier
    launches into the same run directory left their own run-id directories there)."""

    def __init__(self, log_dir: Path):
        self.log_dir = Path(log_dir)
        self._earlier = set(self._run_dirs())

    def _run_dirs(self) -> list[Path]:
        return [p for p in self.log_dir.iterdir() if p.is_dir()] if self.log_dir.is_dir() else []

    def attempts(self) -> list[Path]:
        """This launch's attempt directories, oldest first (attempt_1 and later are restarts of the workers)."""
        found = [a for d in self._run_dirs() if d not in self._earlier for a in d.glob("attempt_*")
                 if a.name.removeprefix("attempt_").isdigit()]
        return sorted(found, key=lambda a: int(a.name.removeprefix("attempt_")))

    def restarts(self) -> int:
        """How many times torchrun has restarted this launch's workers."""
        attempts = self.attempts()
        return int(attempts[-1].name.removeprefix("attempt_")) if attempts else 0

    def failure(self) -> RankError | None:
        """The first failing rank's error in the newest attempt."""
        attempts = self.attempts()
        return first_failure(attempts[-1]) if attempts else None
