"""The expert store's file I/O at disk speed: one gather write (os.writev) of a safetensors file straight from the
tensors' memory, and one scatter read (os.preadv) straight into fresh tensors (the paper's "2D Prefetch Scheduling": SSD
traffic overlapped with compute needs large requests, not a serialised copy or page faults on a memory map).

Where the filesystem allows it, a live file whose tensors fill one run of memory aligned to IO_BLOCK (an `io_slot`)
moves with direct I/O (O_DIRECT): the disk reads and writes that memory itself, with no copy through the page cache
(what DeepSpeed's NVMe offload does). Through the page cache, a write or read costs the CPU several times a memcpy of
its bytes, on the cores the optimizer and the model need; direct, a small fraction of one
(benchmarks/host-costs_*.md).

The files are the safetensors files of runtime/files/tensorfile.py, so `verify` and any safetensors reader read them.
A durable file carries the data's `moesys.crc32`, is replaced by rename (a reader sees the old or the new file, never
a torn one) and fsynced. Live files are working memory, rebuilt from a checkpoint on resume, and the store's readers
wait for the queued writes of a key (write-behind): a live file is rewritten in place, without a checksum (a CRC of
every write costs about as much CPU as the write itself, for a check nothing would make).
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
import tempfile
import threading
from pathlib import Path

import torch

from runtime.files.tensorfile import DTYPES, ChecksumError, encode, encode_header, raw_bytes, read_header
from runtime.host.io import fsync_dir
from runtime.storage.expert_slots import IO_BLOCK

_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def direct_io_supported(directory: Path) -> bool:
    """Whether files in `directory` open with O_DIRECT (tmpfs and some network filesystems refuse it)."""
    if not _O_DIRECT:
        return False
    probe = Path(directory) / f".direct-probe.{os.getpid()}.{threading.get_ident()}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | _O_DIRECT, 0o600))
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


def write_file(path: Path, tensors: dict[str, torch.Tensor], durable: bool, direct: bool = False) -> int:
    """Write `path` as a file of `tensors` with one gather write; returns its size. Not `durable`, a file of that
    size already there is rewritten in place (its blocks reused: no new file, no rename, no unlink of the old one),
    with direct I/O when `direct` and the tensors fill one aligned run of memory (their data section then starts
    on an IO_BLOCK boundary); else a temp file beside it is renamed over it, with `durable` fsynced first and the
    directory after."""
    layout = _direct_layout(tensors) if direct and not durable else None
    buffers: list[bytes | memoryview] = list(layout) if layout is not None else encode(tensors, checksum=durable)
    size = sum(len(memoryview(b).cast("B")) for b in buffers)
    if not durable and _size_of(path) == size:
        if layout is not None:
            fd = os.open(path, os.O_WRONLY | _O_DIRECT)
            try:
                return _transfer(fd, [_aligned_copy(layout[0]), layout[1]])
            finally:
                os.close(fd)
        fd = os.open(path, os.O_WRONLY)
        try:
            written = _transfer(fd, buffers)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # start writeback now (see below)
        finally:
            os.close(fd)
        return written
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".{threading.get_ident()}.tmp", dir=path.parent)
    try:
        try:
            size = _transfer(fd, buffers)
            if durable:
                os.fsync(fd)
            else:  # start writeback now: dirty pages a memory cgroup cannot reclaim get its processes OOM-killed
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)
    return size


def _size_of(path: Path) -> int | None:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return None


def read_file(path: Path, into: dict[str, torch.Tensor] | None = None, direct: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, filled by one scatter read: into the tensors of `into` (same names,
    shapes and dtypes, contiguous) or fresh memory of their own; the checksum is not verified here
    (tensorfile.verify does). With `direct`, a file laid out as `write_file` lays out `into` for direct I/O is read
    that way, header and data in one request. A malformed or truncated file, or one that does not match `into`,
    raises ChecksumError."""
    layout = _direct_layout(into) if direct and into is not None else None
    if into is not None and layout is not None and _read_expected(path, *layout):
        return dict(into)
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        try:
            header, data_start = read_header(f)
            header.pop("__metadata__", None)
            tensors, end = {}, 0
            for key, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                begin, stop = entry["data_offsets"]
                t = torch.empty(entry["shape"], dtype=DTYPES[entry["dtype"]]) if into is None else into[key]
                if (begin != end or stop - begin != t.numel() * t.element_size() or not t.is_contiguous()
                        or t.dtype != DTYPES[entry["dtype"]]):
                    raise ValueError(f"{key} at bytes {begin}..{stop}")
                tensors[key], end = t, stop
        except (struct.error, ValueError, KeyError, TypeError) as exc:  # KeyError: a name `into` lacks
            raise ChecksumError(f"{path} is not a readable safetensors file ({exc}); it is damaged") from None
        got = _transfer(fd, [raw_bytes(t) for t in tensors.values()], read_at=data_start)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the tensors hold the bytes now; free the page cache
    if got != end:
        raise ChecksumError(f"{path} is damaged: it holds {got} of its {end} tensor bytes")
    return {key: tensors[key] for key in header}


def _read_expected(path: Path, header: bytes, region: memoryview) -> bool:
    """Read a file of the layout the store writes (`header`, then `region`'s bytes) with one direct read, and tell
    whether it was that (else the caller reads it the general way: a file of another layout, or a damaged one)."""
    fd = os.open(path, os.O_RDONLY | _O_DIRECT)
    try:
        head = _aligned_buffer(len(header))
        return _transfer(fd, [head, region], read_at=0) == len(header) + len(region) and head == header
    finally:
        os.close(fd)


def _direct_layout(tensors: dict[str, torch.Tensor]) -> tuple[bytes, memoryview] | None:
    """(header, data) of the file of `tensors` moved with direct I/O: a header padded to whole IO_BLOCKs and the
    one aligned run of memory the tensors fill; None when they do not fill one."""
    region = _aligned_run(list(tensors.values()))
    if region is None:
        return None
    return _block_header(tuple((name, t.dtype, tuple(t.shape)) for name, t in tensors.items())), region


@functools.lru_cache(maxsize=64)
def _block_header(specs: tuple) -> bytes:
    return encode_header({name: (dtype, shape) for name, dtype, shape in specs}, align=IO_BLOCK)


def _aligned_run(tensors: list[torch.Tensor]) -> memoryview | None:
    """The bytes of `tensors` as one writable view when they follow each other in one run of CPU memory that starts
    and ends on an IO_BLOCK boundary (what direct I/O moves); None otherwise."""
    if not tensors:
        return None
    storage = tensors[0].untyped_storage()
    start = end = tensors[0].data_ptr()
    for t in tensors:
        if t.data_ptr() != end or t.device.type != "cpu" or not t.is_contiguous():
            return None
        end += t.nbytes
    if start % IO_BLOCK or (end - start) % IO_BLOCK or end > storage.data_ptr() + storage.nbytes():
        return None  # (the last test: adjacent memory of another allocation is not the first tensor's to hand out)
    # torch's stubs list set_ with a stride or with the storage alone; the stride is optional (contiguous)
    run = torch.empty(0, dtype=torch.uint8).set_(  # type: ignore[call-overload]
        storage, start - storage.data_ptr(), (end - start,))
    return memoryview(run.numpy())


_bounce = threading.local()


def _aligned_buffer(size: int) -> memoryview:
    """`size` bytes of this thread's page-aligned memory (what direct I/O reads into and writes from), valid until
    its next call."""
    buf = getattr(_bounce, "buf", None)
    if buf is None or len(buf) < size:
        buf = _bounce.buf = mmap.mmap(-1, size)
    return memoryview(buf)[:size]


def _aligned_copy(data: bytes) -> memoryview:
    """`data` (a header: whole IO_BLOCKs) in this thread's aligned memory."""
    view = _aligned_buffer(len(data))
    view[:] = data
    return view


def _transfer(fd: int, buffers: list, read_at: int | None = None) -> int:
    """Write every buffer at the file position (writev), or fill them from file offset `read_at` (preadv), in as
    few system calls as the kernel allows; returns the bytes moved (fewer only at the end of a file)."""
    views = [view for view in (memoryview(b).cast("B") for b in buffers) if len(view)]
    done = i = 0
    while i < len(views):
        batch = views[i:i + _IOV_MAX]
        n = os.writev(fd, batch) if read_at is None else os.preadv(fd, batch, read_at + done)
        if n == 0:
            break
        done += n
        while i < len(views) and n >= len(views[i]):
            n -= len(views[i])
            i += 1
        if n:
            views[i] = views[i][n:]
    return done
