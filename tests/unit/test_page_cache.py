"""Evicting files from the page cache without root: the pages a read brought in are gone afterwards (checked with
mincore where the file system keeps a page cache of its own), and a directory is evicted file by file."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

import pytest

from runtime.host.page_cache import evict, evict_dir

pytestmark = pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise on this system")


def resident_pages(path) -> int:
    """How many of the file's pages are in the page cache (mincore on a private map of it, which reads nothing)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        first = ctypes.c_char.from_buffer(mm)
        vec = (ctypes.c_ubyte * (-(-size // mmap.PAGESIZE)))()
        failed = libc.mincore(ctypes.c_void_p(ctypes.addressof(first)), ctypes.c_size_t(size), vec)
        del first  # the map cannot close while ctypes holds a pointer into it
        if failed:
            pytest.skip(f"mincore failed (errno {ctypes.get_errno()})")
        return sum(b & 1 for b in vec)
    finally:
        mm.close()


def test_evict_drops_a_read_files_pages(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(64 * mmap.PAGESIZE))
    path.read_bytes()
    if resident_pages(path) == 0:
        pytest.skip("this file system keeps no page cache of its own")
    assert evict(path)
    if resident_pages(path) == 64:
        pytest.skip("this file system ignores POSIX_FADV_DONTNEED (tmpfs keeps its files in the page cache)")
    assert resident_pages(path) < 64


def test_evict_dir_evicts_every_matching_file_below_it(tmp_path):
    (tmp_path / "sub").mkdir()
    for name in ("a.safetensors", "sub/b.safetensors", "c.json"):
        (tmp_path / name).write_bytes(b"x" * 100)
    assert evict_dir(tmp_path, "*.safetensors") == 2
    assert evict_dir(tmp_path) == 3
    assert evict_dir(tmp_path / "missing") == 0


def test_evict_of_a_missing_file_says_so_instead_of_raising(tmp_path):
    assert evict(tmp_path / "missing") is False
