"""Evict files from the kernel's page cache without root: fsync each file (dirty pages cannot be dropped), then
posix_fadvise(DONTNEED). Used for cold-start measurements and after checksumming a checkpoint, so reading a file
once does not leave it cached. Pages another process keeps mapped and locked stay; elsewhere this is a no-op.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def evict(path: str | Path, ranges: Iterable[tuple[int, int]] | None = None) -> bool:
    """Drop `path`'s pages from the page cache, or only those of `ranges` ((offset, length) in bytes); False where
    the system cannot (no posix_fadvise, unreadable)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        try:
            os.fsync(fd)
        except OSError:  # a file system that refuses fsync on a read-only descriptor: clean pages still go
            pass
        for offset, length in [(0, 0)] if ranges is None else ranges:  # length 0: to the end of the file
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def evict_dir(directory: str | Path, pattern: str = "*") -> int:
    """Drop the pages of every file under `directory` (recursively) whose name matches `pattern`; how many."""
    return sum(evict(f) for f in sorted(Path(directory).rglob(pattern)) if f.is_file())
