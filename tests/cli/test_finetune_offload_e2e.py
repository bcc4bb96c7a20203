"""An offloaded fine-tune trains like a resident one, as a user types it: `moesys train recipe=tiny
train.init_from=DIR` (two torchrun processes, expert parallel 2) of a tiny random Qwen3-MoE that transformers saved,
on chat data, with storage.offload=cpu and storage.offload=ssd gives the losses of storage.offload=none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.conftest import FAST_TINY, losses, run_moesys
from tests.hf_families import save_sharded, tiny_model, write_chats

pytest.importorskip("transformers", reason="transformers is not installed")
pytestmark = pytest.mark.slow
STEPS = 4


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("finetune-offload")
    save_sharded(tiny_model("qwen3_moe"), root / "source")
    write_chats(root / "chat.jsonl")
    return root


def fine_tune(workdir: Path, offload: str) -> Path:
    run_dir = workdir / offload
    done = run_moesys("train", *FAST_TINY, f"train.init_from={workdir / 'source'}",
                      f"train.data={workdir / 'chat.jsonl'}", f"train.max_steps={STEPS}", "train.checkpoint_every=0",
                      "train.final_checkpoint=false", f"storage.offload={offload}", f"train.run_dir={run_dir}",
                      cwd=workdir, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(losses(run_dir)) == STEPS
    return run_dir


def offload_metrics(run_dir: Path) -> set[str]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {key for line in lines for key in line if key.startswith("offload/")}


@pytest.fixture(scope="module")
def resident(workdir) -> list[float]:
    run_dir = fine_tune(workdir, "none")
    assert not offload_metrics(run_dir)
    assert losses(run_dir)[-1] < losses(run_dir)[0]  # the fine-tune learns: equal losses say something
    return losses(run_dir)


@pytest.mark.parametrize("offload", ["cpu", "ssd"])
def test_an_offloaded_fine_tune_gives_the_resident_losses(workdir, resident, offload):
    """Within 1e-5 (relative) at every step; the experts did live off the device (the offload engine reported, the
    SSD store was written)."""
    run_dir = fine_tune(workdir, offload)
    got = losses(run_dir)
    print(f"storage.offload={offload}: max abs loss diff from resident "
          f"{max(abs(a - b) for a, b in zip(got, resident)):.2e}")
    assert offload_metrics(run_dir)
    assert offload != "ssd" or any((run_dir / "expert_store").iterdir())
    assert got == pytest.approx(resident, rel=1e-5)
