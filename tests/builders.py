"""What the tests build that production builds in one go: a rank's resident model alone, without the optimizer,
the objective and the parts `build_components` adds (runtime/train/build.py)."""

from __future__ import annotations

import torch

from runtime.config import MoesysConfig
from runtime.model.transformer import Transformer
from runtime.parallel.groups import ParallelGroups
from runtime.train.build import materialize, model_skeleton


def build_model(cfg: MoesysConfig, groups: ParallelGroups, device: torch.device) -> Transformer:
    """This rank's resident model: its dense part and its block of experts, initialized from train.seed."""
    return materialize(model_skeleton(cfg, groups), cfg, groups, device)
