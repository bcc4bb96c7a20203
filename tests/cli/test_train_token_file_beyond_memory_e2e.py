"""A pre-tokenized corpus larger than the memory the run has: `moesys train` on a 1 GiB token file inside a memory
cgroup of 0.75 GiB (page cache included, as the kernel counts it) completes with no OOM kill, because the workers map
the file and read only the windows of their steps. The file is out of the page cache when the run starts, so every
page the run reads is charged to its cap. (docs/data.md gives the same run with two processes, by hand.)"""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest

from runtime.host import memcap
from runtime.host.page_cache import evict
from tests.cli.conftest import losses, moesys_bin

pytestmark = pytest.mark.skipif(memcap.available() is not None, reason=f"no memory cap: {memcap.available()}")

FILE_BYTES = 1 << 30
CAP = int(0.75 * (1 << 30))
CHUNK = 1 << 25  # ids written at a time


@pytest.mark.extended
def test_a_token_file_larger_than_the_memory_cap_trains_inside_it(tmp_path):
    path = tmp_path / "corpus.bin"
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:  # what a user's pre-tokenized corpus is: raw uint16 ids
        for _ in range(FILE_BYTES // (2 * CHUNK)):
            f.write(rng.integers(0, 256, CHUNK, dtype=np.uint16).tobytes())
    assert evict(path)
    args = ["recipe=tiny", "topology.nproc_per_node=1", "topology.expert_parallel=1", "train.seq_len=64",
            "train.micro_batch_size=4", "train.warmup_steps=1", "train.max_steps=3", "train.final_checkpoint=false",
            f"train.data={path}", f"train.run_dir={tmp_path / 'run'}"]
    with memcap.MemoryCap(CAP, "moesys-test-tokens") as cap:
        done = subprocess.run([moesys_bin(), "train", *args], capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, COLUMNS="200"), preexec_fn=cap.preexec)
        oom_kills, peak = cap.oom_kills(), cap.max_usage()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert oom_kills == 0 and "Traceback" not in done.stderr
    assert path.stat().st_size > CAP >= peak, (path.stat().st_size, CAP, peak)
    assert len(losses(tmp_path / "run")) == 3
