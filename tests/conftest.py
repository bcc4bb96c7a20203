"""Tests marked `gpu` need CUDA and are skipped, with the reason, where there is none.

Under pytest-xdist (`-n 2 --dist loadgroup`, the CI's command) every test file is one group, so a module's
fixtures are built once, by one worker; files that take a machine-wide resource (a memory cgroup, network
namespaces) share a named group and run one after another."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is present")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not item.keywords: a folder named gpu is one
            item.add_marker(skip)
