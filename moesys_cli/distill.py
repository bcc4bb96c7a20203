"""`moesys distill`: train a student with fewer experts from a teacher run (the paper's "Graph Optimization"): the
teacher's most used experts seed it, it learns from soft targets plus the language-model loss in `moesys train`'s job
(torchrun, checkpoints, resume), and both models are measured on the same held-out text."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated

import typer
import yaml

from moesys_cli.options import Json
from moesys_cli.render import console, human_bytes, human_count, print_json
from moesys_cli.resolve import resolve_config
from moesys_cli.train import TrainProgress, resume_command, run_job
from runtime.config import MoesysConfig
from runtime.errors import UserError
from runtime.files.run_dir import last_step_metrics
from runtime.launch.job import Job
from runtime.train.student_config import (
    Teacher,
    check_student,
    default_student_dir,
    find_teacher,
    recorded_teacher,
    student_recipe,
)

DistillArgs = Annotated[
    list[str] | None,
    typer.Argument(help="checkpoint=RUN_DIR (the teacher), student.num_experts=K and key=value overrides of the "
                        "teacher's config, e.g. train.max_steps=200 distill.temperature=2 distill.kd_weight=0.5",
                   show_default=False),
]
USAGE = "moesys distill takes checkpoint=RUN_DIR, student.num_experts=K and key=value overrides"


def parse_distill_args(args: list[str]) -> tuple[str, int, list[str]]:
    """(teacher checkpoint, student experts, Hydra overrides applied to the teacher's config)."""
    checkpoint, experts, overrides = None, None, []
    for arg in args:
        key, sep, value = arg.partition("=")
        bare = key.lstrip("+~")
        if not sep:
            raise UserError(f"argument {arg!r} is not key=value; {USAGE}")
        if bare == "checkpoint":
            checkpoint = value
            continue
        if bare == "recipe":
            raise UserError("moesys distill starts from the teacher's config: recipe= does not apply; override keys")
        if bare == "model.num_experts":
            raise UserError("set the student's experts with student.num_experts=K, not model.num_experts")
        if bare == "student.num_experts":
            try:
                experts = int(value)
            except ValueError:
                raise UserError(f"student.num_experts={value!r} is not an integer") from None
        overrides.append(arg)
    if not checkpoint:
        raise UserError(f"no checkpoint given; {USAGE}")
    if experts is None:
        raise UserError(f"no student.num_experts given; {USAGE}")
    return checkpoint, experts, overrides


def student_config(teacher: Teacher, experts: int, overrides: list[str]) -> MoesysConfig:
    """The teacher's config with `experts` experts per MoE layer, then the user's overrides, resolved and validated
    as `moesys train` resolves a recipe file."""
    with tempfile.TemporaryDirectory(prefix="moesys-distill-") as tmp:
        recipe = Path(tmp) / "student.yaml"
        recipe.write_text("# @package _global_\n" + yaml.safe_dump(student_recipe(teacher, experts), sort_keys=False))
        return resolve_config([f"recipe={recipe}", *overrides])


def distill(args: DistillArgs = None, json_out: Json = False) -> None:
    """Train a student with fewer experts per MoE layer from a teacher run; report both held-out losses and sizes."""
    checkpoint, experts, overrides = parse_distill_args(args or [])
    teacher = find_teacher(checkpoint)
    cfg = student_config(teacher, experts, overrides)
    check_student(teacher, cfg)
    run_dir = Path(cfg.train.run_dir or default_student_dir(teacher, experts)).resolve()
    cfg.train.run_dir = str(run_dir)
    say = (lambda line: None) if json_out else (lambda line: console.print(line, markup=False, highlight=False))
    recorded = recorded_teacher(run_dir)
    if recorded and recorded != cfg.distill.teacher:  # a resume keeps the teacher the student started from
        say(f"{run_dir} learns from {recorded}; it continues with that teacher")
        teacher = find_teacher(recorded)  # and the student config that teacher gives, not the new one's
        cfg = student_config(teacher, experts, overrides)
        check_student(teacher, cfg)
        cfg.train.run_dir = str(run_dir)
    job = Job(cfg, TrainProgress(quiet=json_out))
    job.check()
    say(f"distill: teacher {cfg.distill.teacher} ({teacher.num_experts} experts per MoE layer) -> student "
        f"{run_dir} ({experts})")
    from runtime.files.paths import SELECTION
    from runtime.train.distill import compare_on_heldout  # torch: loaded only once the input is known good
    from runtime.train.student_init import start_student

    def prepare(directory: Path) -> None:
        record = start_student(cfg, directory)
        if record is not None:
            held = record["heldout"]
            say(f"student experts: each MoE layer keeps the teacher's {experts} most used of "
                f"{record['teacher_experts']} on {held['windows']} held-out windows ({held['source']}); "
                f"{directory / SELECTION}")

    resume = resume_command(["distill", f"checkpoint={checkpoint}"], overrides, run_dir)
    summary = run_job(job, resume, quiet=json_out, prepare=prepare)
    result = {**summary, "teacher": cfg.distill.teacher, "teacher_experts": teacher.num_experts,
              "student_experts": experts, "kd_loss": (last_step_metrics(run_dir) or {}).get("kd_loss"),
              "selection": str(run_dir / SELECTION), **compare_on_heldout(cfg, run_dir)}
    if json_out:
        print_json(result)
        return
    held = result["heldout"]
    say(f"done: {result['steps']} steps, loss {result['initial_loss']:.3f} -> {result['final_loss']:.3f} "
        f"(kd loss {result['kd_loss']:.3f}); checkpoint {result['checkpoint']}")
    say(f"held-out loss on {held['tokens']} tokens ({held['source']}): teacher {result['teacher_heldout_loss']:.4f}, "
        f"student {result['student_heldout_loss']:.4f}")
    say(f"size: teacher {human_count(result['teacher_params'])} parameters ({human_bytes(result['teacher_bytes'])}), "
        f"student {human_count(result['student_params'])} ({human_bytes(result['student_bytes'])}): "
        f"{result['size_reduction']:.1%} smaller")

