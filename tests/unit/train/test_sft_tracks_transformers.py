"""Chat fine-tuning of every released family against transformers' own: a tiny random model that transformers saved
is imported with train.init_from and trained 20 steps on chat data by moesys's own loop (one process, one sample a
row, fp32, AdamW with weight decay 0, a constant lr, no clipping, no router loss, dropless); transformers' model of the
same directory trains on the very rows moesys's ChatDataset gave each step, with torch.optim.AdamW over one group and
the same betas and eps. The losses agree step for step and fall; the fine-tune's `moesys export export.format=hf`
loads in transformers with moesys's logits."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from moesys_cli.resolve import resolve_config
from runtime.config import MoesysConfig
from runtime.data.chat_data import IGNORE
from runtime.data.chat_source import open_chat_dataset, prepare_chat_data
from runtime.data.tokenizer import run_tokenizer
from runtime.files.run_dir import read_metrics
from runtime.inference.export import export_checkpoint
from runtime.inference.load import load_model
from runtime.parallel.groups import build_groups
from runtime.storage.optim import ADAMW_BETAS, ADAMW_EPS
from runtime.train.init_from import record_source_facts
from runtime.train.loop import train
from runtime.train.run_setup import prepare_run_dir
from tests.cli.conftest import run_moesys
from tests.hf_families import FAMILIES, TOKENS, load_transformers, max_diff, save_sharded, tiny_model, write_chats

pytest.importorskip("transformers", reason="transformers is not installed")
STEPS = 20
SFT = ["recipe=tiny", "topology.nproc_per_node=1", "topology.expert_parallel=1", "storage.offload=none",
       "train.seq_len=128", "train.micro_batch_size=2", f"train.max_steps={STEPS}", "train.lr=1e-3",
       "train.lr_schedule=constant", "train.warmup_steps=0", "train.weight_decay=0", "train.grad_clip=0",
       "train.pack=false", "train.precision=fp32", "train.log_every=1", "train.checkpoint_every=0",
       "model.aux_loss_weight=0"]
"""One process, one sample a row (padded), fp32, a constant lr from step 0, no weight decay, clipping or router loss:
the plain torch.optim.AdamW step the reference takes."""


@dataclasses.dataclass
class FineTune:
    family: str
    source: Path
    run_dir: Path
    cfg: MoesysConfig
    losses: list[float]


@pytest.fixture(scope="module", params=list(FAMILIES))
def fine_tune(request, tmp_path_factory) -> FineTune:
    """What `moesys train` does before and in its worker, in this process: the run directory, the source's chat
    template, the chat data encoded with it, then the training loop."""
    family, root = request.param, tmp_path_factory.mktemp(request.param)
    source = save_sharded(tiny_model(family), root / "source")
    data = write_chats(root / "chat.jsonl")
    cfg = resolve_config([*SFT, f"train.init_from={source}", f"train.data={data}", f"train.run_dir={root / 'run'}"])
    assert (cfg.model.family, cfg.model.capacity_factor, cfg.model.aux_loss_weight) == (family, 0.0, 0.0)
    run_dir = prepare_run_dir(cfg)
    record_source_facts(cfg)
    prepare_chat_data(cfg, run_tokenizer(cfg))
    train(cfg, run_dir, build_groups(1, 0, 1, 1), torch.device("cpu"))
    losses = [m["loss"] for m in read_metrics(run_dir) if "loss" in m]
    return FineTune(family, source, run_dir, cfg, losses)


def transformers_losses(ft: FineTune) -> list[float]:
    """transformers' model of the source trained on the rows moesys's ChatDataset gives each step. moesys's targets
    are already shifted (position t's target is token t + 1, IGNORE where the loss does not count); transformers
    shifts `labels` itself (position t predicts labels[t + 1]), so labels are the targets one place to the right."""
    reference = load_transformers(ft.source).train()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=ft.cfg.train.lr, betas=ADAMW_BETAS, eps=ADAMW_EPS,
                                  weight_decay=0.0)
    data = open_chat_dataset(ft.cfg, run_tokenizer(ft.cfg), "train.data", ft.cfg.train.data)
    losses = []
    for step in range(STEPS):
        rows = data.rank_batch(step, 0, 1, ft.cfg.train.micro_batch_size)
        assert rows.positions is None and bool((rows.targets[:, -1] == IGNORE).all())  # no target past the labels
        labels = torch.cat([torch.full_like(rows.targets[:, :1], IGNORE), rows.targets[:, :-1]], dim=1)
        loss = reference(input_ids=rows.inputs, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_chat_sft_losses_track_transformers_step_for_step(fine_tune):
    """20 steps: every loss within 1e-4 (absolute, on losses near ln 256) of transformers', and the last steps'
    well below the first's (each conversation comes back every 3 steps: the model learns them)."""
    theirs = transformers_losses(fine_tune)
    ours = fine_tune.losses
    diffs = [abs(a - b) for a, b in zip(ours, theirs)]
    print(f"{fine_tune.family}: SFT losses {ours[0]:.4f} -> {ours[-1]:.4f}, max abs diff from transformers' "
          f"{max(diffs):.2e} (step {diffs.index(max(diffs)) + 1})")
    assert len(ours) == len(theirs) == STEPS
    assert max(diffs) <= 1e-4, list(zip(ours, theirs))
    assert max(ours[-3:]) < min(ours[:3]) - 0.5


@pytest.mark.slow
def test_the_fine_tune_exports_to_its_family_with_moesys_logits(fine_tune, tmp_path):
    """`moesys export export.format=hf` of the fine-tuned run: transformers loads the family's own format, and its
    logits on a batch equal those of moesys's model of the run's checkpoint (fp32, 1e-5), which the training moved
    away from the source's."""
    out = tmp_path / "hf"
    if fine_tune.family == "qwen3_moe":  # the command a user types, once; the library call it wraps for the rest
        done = run_moesys("export", f"checkpoint={fine_tune.run_dir}", f"out={out}", "export.format=hf")
        assert done.returncode == 0, done.stderr[-2000:]
    else:
        export_checkpoint(fine_tune.run_dir, out, "hf")
    exported = load_transformers(out)
    assert exported.config.model_type == fine_tune.family
    with torch.no_grad():
        theirs = exported(input_ids=TOKENS).logits
        diff = max_diff(theirs, load_model(fine_tune.run_dir).model(TOKENS).logits)
        moved = max_diff(theirs, load_transformers(fine_tune.source)(input_ids=TOKENS).logits)
    print(f"{fine_tune.family}: export after training, logits max abs diff {diff:.2e} (moved {moved:.2e})")
    assert diff <= 1e-5
    assert moved > 1e-2
