"""The run directory a training launch writes before any worker starts: made, with the resolved config the workers
read, after the checkpoint train.resume_from starts from is checked against the config's model."""

from __future__ import annotations

from pathlib import Path

from runtime.config import MoesysConfig
from runtime.errors import UserError
from runtime.files.paths import default_run_dir
from runtime.files.resume import chosen_checkpoint
from runtime.files.run_dir import check_run_dir, create_run_dir


def prepare_run_dir(cfg: MoesysConfig) -> Path:
    """Create the run directory (absolute) and write the resolved config the workers will read. A directory that
    holds a model or config of something other than a run is refused (check_run_dir); one that holds a checkpoint
    is left untouched unless `cfg`'s model fits the checkpoint train.resume_from starts from (a resume). A directory
    that cannot be made or written is a UserError naming train.run_dir."""
    run_dir = Path(cfg.train.run_dir or default_run_dir(cfg)).resolve()
    cfg.train.run_dir = str(run_dir)
    check_run_dir(run_dir)
    ckpt = chosen_checkpoint(cfg)  # the one train.resume_from starts from
    if ckpt is not None:
        from runtime.train.checkpoint import check_fits  # torch: only a resume loads it, not the CLI's start

        try:
            check_fits(ckpt, cfg)
        except UserError as exc:
            raise UserError(f"cannot resume {run_dir}: {exc}; resume with the model settings it was trained with "
                            "or choose a new train.run_dir") from None
    create_run_dir(cfg, run_dir)
    return run_dir
