"""Tests marked `gpu` need CUDA and are skipped, with the reason, where there is none. The tests' ring and ondemand
expert copies go to a cache directory of the session's own, removed at its end, never the user's ~/.cache."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

_CACHE: list[str] = []


def pytest_configure(config):
    users = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    os.environ.setdefault("HF_HOME", str(Path(users) / "huggingface"))  # Hugging Face's cache stays where it is
    _CACHE.append(tempfile.mkdtemp(prefix="moesys-test-cache-"))
    os.environ["XDG_CACHE_HOME"] = _CACHE[0]


def pytest_unconfigure(config):
    for path in _CACHE:
        shutil.rmtree(path, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is present")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not item.keywords: a folder named gpu is one
            item.add_marker(skip)
