"""What `moesys train` checks of its plan before it launches anything: that the run fits by the plan, and that the
expert store and the checkpoints it will write fit the free space where they go. Each raises a UserError of one line."""

from __future__ import annotations

from runtime.config import MoesysConfig
from runtime.errors import UserError
from runtime.files.paths import CHECKPOINTS, STEP_PREFIX, expert_store_root, run_dir_of, step_of
from runtime.plan.budget import GB
from runtime.plan.disk import bytes_under, check_free, checkpoints_on_disk, kept_checkpoints
from runtime.plan.modes import OffloadMode
from runtime.plan.planner import Plan, plan_placement


def check_disk(cfg: MoesysConfig, plan: Plan | None = None) -> None:
    """The expert store and the checkpoints the run will write must fit the free space of the filesystems they go to
    (storage.ssd_path or RUN_DIR/expert_store; RUN_DIR/checkpoints): a full disk otherwise stops the run minutes in.
    What a resumed run's directory already holds is counted as written. A SLURM job's nodes keep their stores
    where this machine cannot see them: only its checkpoints are checked. `plan`: the launch's plan of `cfg`."""
    plan = plan or plan_placement(cfg)
    disk = plan.disk
    checkpoints = run_dir_of(cfg).resolve() / CHECKPOINTS
    done = sorted(p.name for p in checkpoints.glob(f"{STEP_PREFIX}*") if p.is_dir()) if checkpoints.is_dir() else []
    first = (step_of(done[-1]) or 0) if done else 0
    new = checkpoints_on_disk(cfg, existing=len(done), first_step=first) - len(done)
    store = expert_store_root(cfg)
    here = cfg.launcher.name != "slurm"
    store_new = max(0, disk.store_bytes - bytes_under(store)) if plan.mode is OffloadMode.SSD and here else 0
    held = f"{new} checkpoint{'s' if new > 1 else ''} of {disk.checkpoint_bytes / GB:.2f} GB at once"
    if new > kept_checkpoints(cfg):
        held += f", {kept_checkpoints(cfg)} kept and the next being written"
    writes = [(store, store_new, f"expert store {store_new / GB:.2f} GB"),
              (checkpoints, new * disk.checkpoint_bytes, held)]
    check_free(writes, "free space there, set train.run_dir or storage.ssd_path to a larger disk, or write fewer "
                       "checkpoints (train.checkpoint_every=0 writes only the final one, train.final_checkpoint=false "
                       "none)")


def check_plan(cfg: MoesysConfig, plan: Plan | None = None) -> None:
    """The run must fit by the plan (`plan`: the launch's plan of `cfg`): otherwise a worker fails on a tier's budget,
    or the OOM killer takes it, after minutes of building and restarts. Checked after the launch check, whose RAM
    message names the process count."""
    plan = plan or plan_placement(cfg)
    if plan.feasible:
        return
    first = plan.suggestions[0] if plan.suggestions else ""
    fix = "" if not first else f"; {first}" if first.startswith("no ") else f"; try: {first}"
    raise UserError(f"the plan says this run does not fit ({'; '.join(plan.problems)}){fix} "
                    "(`moesys plan` with the same overrides shows the budget)")
