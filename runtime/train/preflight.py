"""What `moesys train` checks before it launches anything: the errors each worker would otherwise meet at start,
after torchrun had retried it (data shorter than a window, an expert store that cannot be written or that another
run owns). Each raises a UserError of one line."""

from __future__ import annotations

import tempfile
from pathlib import Path

from runtime.config import MoesysConfig
from runtime.errors import UserError
from runtime.run_dir import expert_store_root
from runtime.storage.expert_store import OWNER, check_owner
from runtime.train.data import TokenDataset


def check_before_launch(cfg: MoesysConfig) -> None:
    """cfg.train.run_dir must be set (the directory the job will use)."""
    if cfg.purpose != "train":
        raise UserError(f"this config is for serving (purpose={cfg.purpose}: {cfg.recipe or 'the recipe'} is planned "
                        "as an inference budget); serve it with moesys infer, or set purpose=train to train it")
    sources = {"train.data": cfg.train.data} if not cfg.tasks else \
        {f"tasks.{name}.data": task.data for name, task in cfg.tasks.items()}
    for key, path in sources.items():
        TokenDataset.from_path(path, cfg.train.seq_len, key=key)  # DataError: missing, empty or too short
    if cfg.storage.offload in ("ssd", "auto"):
        _check_store(expert_store_root(cfg), str(Path(cfg.train.run_dir).resolve()))


def _check_store(root: Path, run_dir: str) -> None:
    for marker in root.glob(f"*/{OWNER}"):  # one store per expert-parallel rank
        check_owner(marker.parent, run_dir)
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:  # where the store would be made: writable? (nothing is left behind, also for --dry-run)
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as exc:
        raise UserError(f"storage.ssd_path {root} cannot be created or written ({probe}: {exc.strerror or exc}); "
                        "set storage.ssd_path to a directory you can write") from None
