"""Atomic files: write to a temporary name beside the target, fsync, rename, fsync the directory.

A process killed at any point leaves either the old file or the new one, never a torn one. The temporary name
(`.NAME.PID@HOST.XXXX.tmp`) says which process wrote it, so the next writer of NAME can remove what a killed one left
(remove_stale_temps) and never the file of a writer still running.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO


def umask() -> int:
    """This process's umask, read without changing it (os.umask can only set it, racing other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def new_file_mode() -> int:
    """The mode open() gives a new file (mkstemp's is 0600): exported models, reports and run files are readable by
    whoever may read their directory, as files the user wrote by hand are."""
    return 0o666 & ~umask()


def new_dir_mode() -> int:
    """The mode mkdir gives a new directory (mkdtemp's is 0700)."""
    return 0o777 & ~umask()


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"


def temp_prefix(path: Path) -> str:
    """The start of a temporary name for writing `path`: hidden, and naming this process and host."""
    return f".{Path(path).name}.{os.getpid()}@{_host()}."


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temps(path: str | Path) -> list[Path]:
    """Remove the temporary files and directories that writers of `path` killed mid-write (SIGKILL, a power cut)
    left beside it: only names of temp_prefix's pattern, only of this host, only of a process that is gone.
    Returns what was removed."""
    path = Path(path)
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(\d+)@{re.escape(_host())}\.[^/]*\.tmp")
    removed: list[Path] = []
    try:
        found = list(path.parent.iterdir())
    except OSError:
        return removed
    for stale in found:
        match = pattern.fullmatch(stale.name)
        if match is None or _alive(int(match.group(1))):
            continue
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
        removed.append(stale)
    return removed


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: str | Path) -> Iterator[BinaryIO]:
    """A binary file to write (and seek in) that becomes `path` only when the block ends without an exception;
    streaming writers use it to write a large file piece by piece with the same guarantee. A failed write leaves
    no temporary file, and an OSError that names no file (a write on a full disk) is raised naming `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path), suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, new_file_mode())
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        if exc.filename is None and exc.errno is not None:
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_file(path) as f:
        f.write(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def fsync_file(path: str | Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())
