"""`moesys rebalance`: elastic task-to-GPU allocation for a multi-task load, before vs after."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from moesys_cli.options import Json
from moesys_cli.render import console, literal, print_json
from moesys_cli.resolve import recipe_text, resolve_config
from runtime.errors import UserError
from runtime.plan.rebalance import rebalance as compute_rebalance
from runtime.plan.rebalance import rebalance_to_dict, write_rebalanced_recipe

TaskOverrides = Annotated[
    list[str] | None,
    typer.Argument(help="recipe=NAME of a recipe with tasks (e.g. recipe=ufo-multitask) and Hydra key=value "
                        "overrides, e.g. topology.nodes=2 tasks.task1.batch_size=256", show_default=False),
]
FromRun = Annotated[Path | None, typer.Option("--from-run", help="Use each task's measured samples/s from a "
                                                 "finished run's metrics.jsonl.", show_default=False)]
Write = Annotated[Path | None, typer.Option("--write", help="Write a recipe file with this allocation "
                                               "(train with: moesys train recipe=FILE).", show_default=False)]


def rebalance(overrides: TaskOverrides = None, from_run: FromRun = None, write: Write = None,
              json_out: Json = False) -> None:
    """Give heavy tasks more GPUs and pack light ones so the slowest GPU carries as little as possible."""
    cfg = resolve_config(overrides or [])
    result = compute_rebalance(cfg, str(from_run) if from_run else None)
    data = rebalance_to_dict(result)
    if write:
        name, source = f"{cfg.recipe or 'tasks'}-rebalanced", recipe_text(cfg.recipe or "tiny")
        try:
            written = write_rebalanced_recipe(source, cfg, result, write, name)
        except OSError as exc:
            raise UserError(f"cannot write --write {write}: {exc.strerror or exc}; "
                            "give a file path in a directory you can write") from None
        data["written"] = str(written)
    if json_out:
        print_json(data)
        return
    _render(data)


def _render(d: dict) -> None:
    table = Table(title=f"moesys rebalance: {d['gpus']} GPUs, workload from {literal(d['source'])}, "
                        f"up to {d['max_tasks_per_gpu']} task(s) per GPU")
    for col in ("task", "load/step", "GPUs before", "GPUs after", "batch per GPU after"):
        table.add_column(col, justify="right" if col != "task" else "left")
    for task, w in d["workload"].items():
        table.add_row(literal(task), f"{w['batch_size'] * w['cost_per_sample']:g}",
                      str(d["before"]["allocation"][task]), str(d["after"]["allocation"][task]),
                      "/".join(map(str, d["after"]["batch_per_gpu"][task])))
    console.print(table)
    for side in ("before", "after"):
        s = d[side]
        console.print(f"{side:>6}: load per GPU {[round(x, 2) for x in s['load_per_gpu']]}, slowest GPU "
                      f"{s['max_load_per_gpu']:g}, throughput per GPU {s['throughput_per_gpu']:.3f}")
    console.print(f"[bold]speed-up per GPU: {d['speedup_per_gpu']:.2f}x[/]")
    if "written" in d:
        written = literal(d["written"])
        console.print(f"wrote {written}; train with: moesys train recipe={written}")
