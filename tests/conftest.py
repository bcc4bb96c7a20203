"""Tests marked `gpu` need CUDA and are skipped, with the reason, where there is none."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is present")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not item.keywords: a folder named gpu is one
            item.add_marker(skip)
