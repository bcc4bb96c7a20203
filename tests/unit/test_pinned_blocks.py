"""runtime/host/pinned.py: large pinned blocks are allocated at their size, beside the user's own allocator settings,
and a user's own pinned settings win. Each case runs in a fresh process: the settings are the process's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = "from runtime.host.pinned import exact_large_pinned_blocks as e; print(e())"


def settings_after(env: dict[str, str]) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.parametrize("variable", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
def test_the_pinned_keys_join_the_users_settings(variable):
    assert settings_after({variable: "expandable_segments:True"}) == (
        "expandable_segments:True,pinned_max_round_threshold_mb:1024,pinned_max_cached_size_mb:1024")


def test_without_settings_only_the_pinned_keys():
    assert settings_after({}) == "pinned_max_round_threshold_mb:1024,pinned_max_cached_size_mb:1024"


def test_a_users_own_pinned_setting_is_left_alone():
    assert settings_after({"PYTORCH_ALLOC_CONF": "pinned_max_cached_size_mb:64"}) == "pinned_max_cached_size_mb:64"


def test_settings_torch_refuses_leave_the_allocator_as_it_was(monkeypatch):
    import torch

    from runtime.host.pinned import exact_large_pinned_blocks

    def refuse(settings: str) -> None:
        raise RuntimeError("backend can only be chosen at start")

    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "backend:cudaMallocAsync")
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", refuse)
    assert exact_large_pinned_blocks() == "backend:cudaMallocAsync"
