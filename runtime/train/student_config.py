"""What a `moesys distill` student run is configured from: the teacher's checkpoint and its config with fewer experts
per MoE layer. Reads only JSON and YAML (no torch), so bad input is refused before anything heavy loads.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from runtime.config import MoesysConfig
from runtime.data.tokenizer import BYTES, checkpoint_tokenizer_file
from runtime.errors import UserError
from runtime.files.checkpoint_format import latest_checkpoint, read_meta
from runtime.files.paths import CHECKPOINTS, META


@dataclass(frozen=True)
class Teacher:
    """A teacher checkpoint: the step directory the student learns from, the run it belongs to, its config."""

    step_dir: Path
    run_dir: Path
    config: dict
    """The config the checkpoint was written with (its meta.json), as plain data."""

    @property
    def num_experts(self) -> int:
        return int(self.config.get("model", {}).get("num_experts", 0))


def find_teacher(checkpoint: str | Path) -> Teacher:
    """A moesys run directory (its newest checkpoint) or one of its step directories."""
    path = Path(checkpoint).expanduser().resolve()
    if not path.is_dir():
        raise UserError(f"checkpoint={checkpoint}: no such directory (give the teacher's moesys run directory)")
    if (path / META).is_file():
        step, run = path, path.parent.parent if path.parent.name == CHECKPOINTS else path
    else:
        latest, run = latest_checkpoint(path), path
        if latest is None:
            raise UserError(f"checkpoint={checkpoint}: no complete checkpoint under {CHECKPOINTS}/ (a moesys run "
                            "directory whose training wrote one)")
        step = latest
    config = read_meta(step).get("config")
    if not isinstance(config, dict):
        raise UserError(f"{step / META}: no config; is {checkpoint} a moesys training run?")
    return Teacher(step, run, config)


def student_recipe(teacher: Teacher, num_experts: int) -> dict:
    """The student's starting config as a recipe: the teacher's, with `num_experts` experts per MoE layer, learning
    from this teacher with the teacher's tokenizer, in no run directory yet and with an expert store of its own."""
    data = copy.deepcopy(teacher.config)
    data["model"]["num_experts"] = num_experts
    data.setdefault("student", {})["num_experts"] = num_experts
    data.setdefault("distill", {})["teacher"] = str(teacher.step_dir)
    data["train"]["run_dir"] = None
    data.setdefault("storage", {})["ssd_path"] = ""  # a store belongs to one run: never the teacher's
    saved = checkpoint_tokenizer_file(teacher.run_dir, teacher.step_dir)
    if data["train"].get("tokenizer", BYTES) != BYTES and saved is not None:  # the teacher's ids: its own copy
        data["train"]["tokenizer"] = str(saved)
    return data


def default_student_dir(teacher: Teacher, num_experts: int) -> Path:
    """RUN_DIR-student-K beside the teacher's run directory."""
    return teacher.run_dir.parent / f"{teacher.run_dir.name}-student-{num_experts}"


def check_student(teacher: Teacher, student: MoesysConfig) -> None:
    """The student has fewer experts than the teacher and its layers; it trains on one node (the CLI writes its
    first checkpoint and measures it afterwards, on this machine)."""
    experts, k = teacher.num_experts, student.student.num_experts
    if experts <= 0:
        raise UserError("the teacher has no MoE layers (model.num_experts=0): there are no experts to distill")
    if k >= experts:
        raise UserError(f"student.num_experts={k} must be fewer than the teacher's {experts} experts")
    model = teacher.config["model"]
    for key in ("num_layers", "moe_layer_freq"):
        if getattr(student.model, key) != model.get(key):
            raise UserError(f"model.{key}={getattr(student.model, key)} differs from the teacher's {model.get(key)}: "
                            "a student keeps the teacher's layers and has fewer experts in each MoE layer")
    if student.launcher.name != "local":
        raise UserError(f"moesys distill runs with launcher=local (got launcher={student.launcher.name})")


def recorded_teacher(run_dir: str | Path) -> str | None:
    """The teacher a student run directory already learns from (its newest checkpoint's config), or None."""
    ckpt = latest_checkpoint(Path(run_dir))
    if ckpt is None:
        return None
    try:
        return read_meta(ckpt).get("config", {}).get("distill", {}).get("teacher")
    except (UserError, AttributeError):
        return None
