"""Which checkpoint a launch starts from (train.resume_from=latest|none|step_N), as Megatron-LM and Lightning let a
user pick one: the CLI makes the chosen checkpoint the run's newest before the workers start, so they, and torchrun's
restarts of them, resume from it as from any newest checkpoint. Later checkpoints are moved aside, never deleted.
"""

from __future__ import annotations

import time
from pathlib import Path

from runtime.config import MoesysConfig, resume_step
from runtime.errors import UserError
from runtime.files.checkpoint_format import latest_checkpoint
from runtime.files.paths import CHECKPOINTS, LATEST, META, STEP_PREFIX, SUPERSEDED, run_dir_of, step_of
from runtime.host.io import atomic_write_text, fsync_dir


def checkpoint_steps(run_dir: Path) -> dict[int, Path]:
    """The run's complete checkpoints by step, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    found = {}
    for path in sorted(root.glob(f"{STEP_PREFIX}*")) if root.is_dir() else []:
        step = step_of(path.name)
        if step is not None and (path / META).is_file():
            found[step] = path
    return found


def _listing(steps: dict[int, Path]) -> str:
    names = [f"step_{s}" for s in steps]
    return ", ".join(names[-6:]) if names else "none"


def chosen_checkpoint(cfg: MoesysConfig) -> Path | None:
    """The checkpoint this launch starts from, None for a fresh start. A step_N the run has no complete checkpoint of
    is a UserError of one line that lists the ones it has."""
    run_dir = run_dir_of(cfg)
    choice = cfg.train.resume_from
    if choice == "none":
        return None
    if choice == "latest":
        return latest_checkpoint(run_dir)
    step, steps = resume_step(choice), checkpoint_steps(run_dir)
    if step not in steps:
        raise UserError(f"train.resume_from={choice}: {run_dir / CHECKPOINTS} has no complete checkpoint of step "
                        f"{step} (it has: {_listing(steps)}); choose one of them, latest or none")
    return steps[step]


def skip_hint(checkpoint: Path) -> str:
    """How to start a run without `checkpoint` (a damaged one): the key and the older checkpoints to give it."""
    checkpoint = Path(checkpoint)
    run_dir = checkpoint.parent.parent
    step = step_of(checkpoint.name)
    older = [s for s in checkpoint_steps(run_dir) if step is not None and s < step]
    back = f"train.resume_from=step_{older[-1]} (the newest older checkpoint) or " if older else ""
    return f"to skip it, launch again with {back}train.resume_from=none (from scratch)"


def apply_resume_from(cfg: MoesysConfig) -> str | None:
    """Make the chosen checkpoint the run's newest: the later ones (all of them for none) move to
    CHECKPOINTS/superseded-TIME/ and `latest` names the chosen one (or goes). Returns what moved, as one line."""
    run_dir = run_dir_of(cfg)
    if cfg.train.resume_from == "latest":
        return None
    chosen = chosen_checkpoint(cfg)
    start = -1 if chosen is None else step_of(chosen.name)
    assert start is not None, "a chosen checkpoint is a step_N directory"
    root = run_dir / CHECKPOINTS
    later = [path for step, path in checkpoint_steps(run_dir).items() if step > start]
    if later:
        aside = root / f"{SUPERSEDED}{time.strftime('%Y%m%d-%H%M%S')}"
        aside.mkdir(parents=True, exist_ok=True)
        for path in later:
            path.rename(aside / path.name)
        fsync_dir(root)
    pointer = root / LATEST
    if chosen is None:
        pointer.unlink(missing_ok=True)
    elif root.is_dir():
        atomic_write_text(pointer, chosen.name + "\n")
    if not later:
        return None
    where = "from scratch" if chosen is None else f"from {chosen.name}"
    return (f"train.resume_from={cfg.train.resume_from}: starting {where}; the {len(later)} later checkpoint(s) "
            f"moved to {aside} (delete it when no longer needed)")
