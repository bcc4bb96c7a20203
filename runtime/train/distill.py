"""Distillation into a student with fewer experts (the paper's "Graph Optimization", figure 3): the student trains on
the language-model loss mixed with the teacher's soft targets at a temperature (Hinton et al., 2015), the teacher frozen
in every worker. Held-out text, kept out of the student's training, measures both models.

Legend: N windows, S sequence length, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from runtime.config import MoesysConfig
from runtime.data.dataset import TokenDataset
from runtime.data.pretokenize import read_tokens, run_cache_dir
from runtime.data.text import check_token_count, source_name
from runtime.data.tokenizer import run_tokenizer
from runtime.errors import UserError
from runtime.model.transformer import ModelOutput
from runtime.parallel.groups import ParallelGroups
from runtime.train.objective import LanguageModel

# ---- held-out text ----

@dataclass(frozen=True)
class DistillText:
    """The student's training tokens and the held-out tokens, with where the held-out ones come from."""

    train: np.ndarray
    heldout: np.ndarray
    source: str


def split_heldout(cfg: MoesysConfig) -> DistillText:
    """distill.heldout_data when given (the student then trains on all of train.data), else the last
    distill.heldout_fraction of train.data's tokens, which the student's training never sees. Both in the run's
    tokenizer (the teacher's)."""
    tokenizer, d, tr = run_tokenizer(cfg), cfg.distill, cfg.train
    data_name = source_name(tr.data, "train.data")
    tokens = read_tokens(tr.data, tokenizer, "train.data", tr.data_text_key, run_cache_dir(cfg), tr.data_errors)
    if d.heldout_data:
        heldout = read_tokens(d.heldout_data, tokenizer, "distill.heldout_data", tr.data_text_key, run_cache_dir(cfg),
                              tr.data_errors)
        text = DistillText(tokens, heldout, f"distill.heldout_data={d.heldout_data}")
    else:
        cut = int(tokens.size * (1 - d.heldout_fraction))
        text = DistillText(tokens[:cut], tokens[cut:], f"the last {d.heldout_fraction * 100:g}% of the {data_name}")
    check_token_count(text.train.size, tr.seq_len, f"{data_name} without its held-out part")
    check_token_count(text.heldout.size, tr.seq_len, f"held-out text ({text.source})")
    return text


def heldout_windows(tokens: np.ndarray, seq_len: int, limit: int) -> torch.Tensor:
    """The first `limit` (at most) non-overlapping windows of seq_len + 1 tokens, as [N, S + 1] int64."""
    count = min(limit, (tokens.size - 1) // seq_len)
    rows = [tokens[i * seq_len:i * seq_len + seq_len + 1] for i in range(count)]
    return torch.from_numpy(np.stack(rows).astype(np.int64))


@torch.no_grad()
def heldout_loss(model: nn.Module, windows_NS: torch.Tensor, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy of `model` (in eval mode) over every target token of the windows."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for chunk in windows_NS.split(batch_size):
        chunk = chunk.to(device)
        logits = model(chunk[:, :-1]).logits.float()
        total += float(F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum"))
        count += chunk[:, 1:].numel()
    return total / count


def parameter_size(model: nn.Module) -> tuple[int, int]:
    """(parameters, bytes) of a model, a tied table counted once."""
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)


def compare_on_heldout(cfg: MoesysConfig, student_checkpoint: str | Path) -> dict:
    """The teacher's and the student's held-out loss (the same windows) and sizes, one model in memory at a time."""
    text = split_heldout(cfg)
    windows = heldout_windows(text.heldout, cfg.train.seq_len, cfg.distill.heldout_windows)
    report: dict = {"heldout": {"source": text.source, "windows": int(windows.shape[0]),
                                "tokens": int(windows[:, 1:].numel())}}
    for who, checkpoint in (("teacher", teacher_checkpoint(cfg)), ("student", student_checkpoint)):
        model = load_frozen(checkpoint, torch.device("cpu"))
        report[f"{who}_heldout_loss"] = heldout_loss(model, windows)
        report[f"{who}_params"], report[f"{who}_bytes"] = parameter_size(model)
        del model
    report["size_reduction"] = 1 - report["student_params"] / report["teacher_params"]
    return report


# ---- the loss ----

def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 KL(softmax(teacher / T) || softmax(student / T)), the mean over tokens of [..., V] logits. The teacher's
    side is detached: the gradient reaches the student only. T^2 keeps the soft targets' gradient on the scale of the
    hard targets' as T changes (Hinton et al., 2015, section 2)."""
    s_log = F.log_softmax(student_logits.float().flatten(0, -2) / temperature, dim=-1)
    t_log = F.log_softmax(teacher_logits.detach().float().flatten(0, -2) / temperature, dim=-1)
    return F.kl_div(s_log, t_log, log_target=True, reduction="batchmean") * temperature ** 2


def teacher_checkpoint(cfg: MoesysConfig) -> str:
    """distill.teacher, which distillation needs."""
    if not cfg.distill.teacher:
        raise UserError("distillation needs a teacher: set distill.teacher to its checkpoint")
    return cfg.distill.teacher


def load_frozen(checkpoint: str | Path, device: torch.device) -> nn.Module:
    """A checkpoint's model with every expert on `device`, frozen and in eval mode (the teacher in each worker)."""
    from runtime.inference.load import load_model  # the inference reader: any expert-parallel size, checksums

    model = load_model(checkpoint).model.to(device).eval()
    return model.requires_grad_(False)


class Distillation(LanguageModel):
    """(1 - kd_weight) x language-model loss + kd_weight x kd_loss + the router losses, per micro-batch; the teacher
    sees the same micro-batch without gradients. The step metrics gain kd_loss (the mean over ranks)."""

    def __init__(self, data: TokenDataset, teacher: nn.Module, groups: ParallelGroups, micro_batch_size: int,
                 seq_len: int, temperature: float, kd_weight: float):
        super().__init__(data, groups, micro_batch_size, seq_len)
        self.teacher, self.temperature, self.kd_weight = teacher, temperature, kd_weight
        self.last_kd = torch.zeros(())

    @classmethod
    def from_config(cls, cfg: MoesysConfig, groups: ParallelGroups, device: torch.device) -> Distillation:
        tr = cfg.train
        data = TokenDataset(split_heldout(cfg).train, tr.seq_len, tr.seed, "student's training text",
                            cfg.model.vocab_size)
        return cls(data, load_frozen(teacher_checkpoint(cfg), device), groups, tr.micro_batch_size, tr.seq_len,
                   cfg.distill.temperature, cfg.distill.kd_weight)

    def forward_backward(self, model: nn.Module, step: int, device: torch.device, autocast,
                         scaler=None, micro: int = 0) -> tuple[torch.Tensor, ModelOutput]:
        """One micro-batch a step (`micro` is always 0): the config refuses accumulation with distillation."""
        inputs, targets = self.data.rank_batch(step, self.groups.rank, self.groups.world_size, self.micro_batch_size)
        inputs, targets = inputs.to(device), targets.to(device)
        with autocast:
            with torch.no_grad():
                teacher_logits = self.teacher(inputs).logits
            out = model(inputs)
        lm_loss = F.cross_entropy(out.logits.float().flatten(0, 1), targets.flatten())
        kd = kd_loss(out.logits, teacher_logits, self.temperature)
        loss = (1 - self.kd_weight) * lm_loss + self.kd_weight * kd + out.aux_loss.float()
        (scaler.scale(loss) if scaler else loss).backward()
        self.last_kd = kd.detach()
        return lm_loss.detach(), out

    def records(self, step: int) -> tuple[dict, list[dict]]:
        """kd_loss of the step, averaged over ranks (collective)."""
        kd = self.last_kd.float().reshape(1).clone()  # on the device: NCCL reduces CUDA tensors only
        if self.groups.world_size > 1:
            dist.all_reduce(kd)
        return {"kd_loss": float(kd) / self.groups.world_size}, []
