"""Serving a checkpoint larger than memory, as a user runs it: `moesys infer` (default --offload auto) inside a
memory cgroup of half the checkpoint's size generates the greedy tokens of `--offload none` run without a cap,
from a cold page cache, and its anonymous memory stays within the dense weights, the budget and a bounded overhead.

The checkpoint: a random bf16 Hugging Face Mixtral, 16 layers of 12 experts (1.2 GB, 97% experts), written as
shards with an index. infer.ring_slots=1 keeps one layer's experts resident; the other 15 are computed in place
from the memory-mapped shards, so only the routed experts' pages are ever read.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from runtime.host import memcap
from runtime.inference.random_checkpoint import write_random_mixtral
from runtime.host.page_cache import evict_dir
from tests.cli.conftest import moesys_bin

pytestmark = pytest.mark.skipif(memcap.available() is not None, reason=f"no memory cap: {memcap.available()}")

PROMPT = "prompt_ids=[5,17,300,42,9,1000,77,8]"


def infer(checkpoint: Path, args: list[str], cap: memcap.MemoryCap | None = None) -> dict:
    done = subprocess.run([moesys_bin(), "infer", f"checkpoint={checkpoint}", PROMPT, "infer.max_new_tokens=12",
                           *args, "--json"], capture_output=True, text=True, timeout=300,
                          preexec_fn=cap.preexec if cap else None)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.extended
def test_a_checkpoint_twice_the_memory_cap_generates_the_uncapped_tokens(tmp_path):
    checkpoint = tmp_path / "mixtral"
    size = write_random_mixtral(checkpoint, hidden=512, ffn=2048, layers=16, experts=12, vocab=2048)
    reference = infer(checkpoint, ["--offload", "none"])

    cap_bytes = size // 2
    evict_dir(checkpoint, "*.safetensors")  # the capped run reads the checkpoint from the disk: a cold start
    with memcap.MemoryCap(cap_bytes, "moesys-infer-test") as cap:
        got = infer(checkpoint, ["infer.ring_slots=1"], cap)
        oom_kills = cap.oom_kills()
    assert oom_kills == 0
    assert got["tokens"] == reference["tokens"]
    assert got["offload"] == "auto" and got["placement"] == ["resident"] + ["inplace"] * 15
    dense, experts = got["peak_bytes"]["device"]["dense"], got["peak_bytes"]["device"]["experts"]
    assert experts * 16 < size  # the budget: one layer of sixteen
    # dense weights + budget + the process's own runtime (torch, the CLI: about 0.3 GB), not the model
    assert got["peak_rss_anon_bytes"] < dense + experts + 400 * 2**20 < cap_bytes
    assert reference["peak_rss_anon_bytes"] > size  # resident: the whole model, more than the cap
    assert got["disk_read_bytes_per_token"] > 0  # cold: the routed experts came from the disk
    assert 0 < got["store_bytes_per_token"] < size / 4  # only routed experts are read, not every layer's eight
