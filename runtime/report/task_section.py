"""The report's multi-task section (the paper's "Elastic MoE Training"): each task's loss and samples/s over steps, and
the allocation of ranks to tasks in force over each stretch of steps (a rebalanced restart changes it)."""

from __future__ import annotations

from runtime.files.run_dir import task_samples_per_s
from runtime.report.charts import Line, VMark, line_chart
from runtime.report.page import Page
from runtime.report.run_data import RunData


def allocations(rank_lines: list[dict]) -> list[tuple[int, int, dict[str, list[tuple[int, int]]]]]:
    """[(first step, last step, {task: [(rank, samples per step), ...]})], one entry per stretch of steps with the
    same allocation, from the per-rank lines of metrics.jsonl."""
    by_step: dict[int, dict[str, list[tuple[int, int]]]] = {}
    for line in rank_lines:
        by_step.setdefault(line["step"], {}).setdefault(line["task"], []).append((line["rank"], line["samples"]))
    stretches: list[tuple[int, int, dict]] = []
    for step in sorted(by_step):
        alloc = {t: sorted(v) for t, v in sorted(by_step[step].items())}
        if stretches and stretches[-1][2] == alloc:
            stretches[-1] = (stretches[-1][0], step, alloc)
        else:
            stretches.append((step, step, alloc))
    return stretches


def add_tasks(page: Page, run: RunData, marks: list[VMark]) -> None:
    if not run.has("task_loss") and not run.rank_lines:
        return
    sec = page.section("tasks", "Tasks")
    tasks = list(dict.fromkeys(t for s in run.steps for t in (s.get("task_loss") or {})))
    lines = [Line(t, [s["step"] for s in run.steps if t in (s.get("task_loss") or {})],
                  [s["task_loss"][t] for s in run.steps if t in (s.get("task_loss") or {})]) for t in tasks]
    if lines:
        sec.figure("fig-task-loss", line_chart("Loss per task", lines, "loss", marks=marks), "loss of each task",
                   "Mean over each task's samples of the step.")
    by_step: dict[int, list[dict]] = {}
    for line in run.rank_lines:
        by_step.setdefault(line["step"], []).append(line)
    speeds = {step: task_samples_per_s(lines) for step, lines in sorted(by_step.items())}
    names = list(dict.fromkeys(t for v in speeds.values() for t in v))
    if names:
        sec.figure("fig-task-samples", line_chart(
            "Samples per second per task",
            [Line(t, [s for s, v in speeds.items() if t in v], [v[t] for v in speeds.values() if t in v])
             for t in names], "samples/s", marks=marks),
            "samples per second of each task",
            "Each task's samples over its ranks' compute time (with expert parallelism that time includes waiting "
            "for slower ranks in the AlltoAll).")
    rows = []
    for first, last, alloc in allocations(run.rank_lines):
        for task, ranks in alloc.items():
            rows.append((f"{first}-{last}", task, ", ".join(str(r) for r, _ in ranks),
                         " + ".join(str(n) for _, n in ranks), sum(n for _, n in ranks)))
    if rows:
        sec.table("allocation", ("steps", "task", "ranks", "samples per rank", "samples per step"), rows)
