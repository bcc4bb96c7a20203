"""The cache of layer stores: the on-disk copy of a checkpoint's experts that `--offload ring|ondemand` reads (one
safetensors file per MoE layer, runtime/inference/offload.py LayerStore), one directory per checkpoint under
infer.cache_dir, reused while the checkpoint is unchanged, bounded by infer.cache_gb, and checked for free space
before it is written.

ROOT/<digest>/        a checkpoint's copy (digest of its path, weight files' sizes and times)
ROOT/<digest>.lock    held shared (flock) by every process using the copy; its mtime is the copy's last use

Making room evicts the least recently used copies first, each only under an exclusive lock taken without waiting, so
a copy a running `moesys infer` or `moesys serve` holds is never removed.
"""

from __future__ import annotations

import fcntl
import hashlib
import math
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Protocol

from runtime.config import InferConfig
from runtime.errors import UserError

GB = 1e9
LOCK_SUFFIX = ".lock"
CACHE_GB = InferConfig.cache_gb
"""The bound a caller gets without a config (infer.cache_gb's default)."""


class StoreHold(Protocol):
    """What an offloader lets go of when it closes: a cached store's lock, or a private store."""

    directory: Path

    def close(self) -> None: ...


class CacheError(UserError):
    """The experts' copy cannot be made: larger than infer.cache_gb, or no room on infer.cache_dir's filesystem."""


def default_cache_root() -> Path:
    """$XDG_CACHE_HOME/moesys/experts, or ~/.cache/moesys/experts: a user's cache, not the shared temp directory."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "moesys" / "experts"


def cache_key(fingerprint: str) -> str:
    return hashlib.sha1(fingerprint.encode()).hexdigest()[:16]


def _size(directory: Path) -> int:
    """Bytes of the files in a copy (0 when it does not exist)."""
    try:
        return sum(e.stat(follow_symlinks=False).st_size for e in os.scandir(directory) if e.is_file())
    except FileNotFoundError:
        return 0


def _locked(path: Path, how: int) -> IO | None:
    """The lock file at `path` (created if absent) locked with `how` (flock flags), or None when another process
    holds it the other way (LOCK_NB). Retried when an evicter unlinked the file between our open and our lock."""
    while True:
        f = open(path, "a+")
        try:
            fcntl.flock(f, how)
        except BlockingIOError:
            f.close()
            return None
        try:
            same = os.fstat(f.fileno()).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return f
        f.close()


class CachedStore:
    """A checkpoint's layer store in the cache, held (shared lock) until close(): no other process evicts it
    meanwhile."""

    def __init__(self, directory: Path, lock: IO):
        self.directory = directory
        self._lock: IO | None = lock

    def close(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None


class ScratchStore:
    """A layer store of this process's own (a model given without a checkpoint), removed by close()."""

    def __init__(self):
        self.directory = Path(tempfile.mkdtemp(prefix="moesys-experts-"))

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def _copies(root: Path, keep: str) -> Iterable[tuple[float, str]]:
    """(last use, key) of every copy under `root` but `keep`, least recently used first."""
    found = []
    for entry in os.scandir(root):
        if entry.is_dir(follow_symlinks=False) and entry.name != keep:
            lock = root / (entry.name + LOCK_SUFFIX)
            used = lock.stat().st_mtime if lock.exists() else entry.stat(follow_symlinks=False).st_mtime
            found.append((used, entry.name))
    return sorted(found)


def _evict(root: Path, keep: str, room: int) -> None:
    """Remove the least recently used copies other than `keep` until the others fit in `room` bytes; a copy some
    process holds is skipped (it is in use)."""
    copies = list(_copies(root, keep))
    total = sum(_size(root / key) for _, key in copies)
    for _, key in copies:
        if total <= room:
            return
        lock_path = root / (key + LOCK_SUFFIX)
        lock = _locked(lock_path, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if lock is None:
            continue
        try:
            size = _size(root / key)
            shutil.rmtree(root / key, ignore_errors=True)
            lock_path.unlink(missing_ok=True)
            total -= size
        finally:
            lock.close()


def checkout(root: Path, fingerprint: str, need_bytes: int, cap_gb: float) -> CachedStore:
    """Hold the copy of the checkpoint `fingerprint` names under `root`, making room for its `need_bytes` first:
    copies least recently used go until the cache fits in `cap_gb`, and the filesystem must have the bytes still to
    write. The copy's files are written (or found reusable) by the caller while it holds the copy."""
    root = Path(root).expanduser()
    cap = int(cap_gb * GB)
    if need_bytes > cap:
        raise CacheError(f"the checkpoint's experts need {need_bytes:,} bytes on disk for --offload ring|ondemand, "
                         f"more than infer.cache_gb={cap_gb:g}: raise infer.cache_gb, or use --offload auto (it "
                         "reads the experts where they lie)")
    key, lock = cache_key(fingerprint), None
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = _locked(root / (key + LOCK_SUFFIX), fcntl.LOCK_SH)
        os.utime(root / (key + LOCK_SUFFIX))  # its last use: now
        _evict(root, key, cap - need_bytes)
        free = shutil.disk_usage(root).free
    except OSError as exc:
        if lock is not None:
            lock.close()
        raise CacheError(f"cannot use infer.cache_dir={root} ({exc.strerror or exc}); set infer.cache_dir to a "
                         "directory you can write") from None
    assert lock is not None, "a blocking (LOCK_SH) lock is granted, never refused"
    missing = max(0, need_bytes - _size(root / key))
    if missing > free:
        lock.close()
        raise CacheError(f"infer.cache_dir={root}: the copy of the checkpoint's experts needs {missing:,} bytes more "
                         f"and its filesystem has {free:,} free; set infer.cache_dir to a filesystem with room, or use "
                         "--offload auto (it reads the experts where they lie)")
    return CachedStore(root / key, lock)


def store_bytes(specs: Iterable[dict]) -> int:
    """Bytes of the tensors of `specs` ({name: (dtype, shape)} per layer): what the copy holds."""
    return sum(math.prod(shape) * dtype.itemsize for layer in specs for dtype, shape in layer.values())
