"""The report of a training run: loss (and the held-out loss of train.eval_data), router losses and lr with resumes
and restarts marked; tokens/s and step time; each MoE layer's expert load over steps (with the share capacity
dropped); then, when the run has them,
offloading (runtime/report/offload_section.py), memory per rank against the plan, and multi-task sections
(runtime/report/task_section.py); the config and plan as collapsible text.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import yaml

from runtime.host.io import atomic_write_text
from runtime.report.charts import Line, VMark, line_chart, load_heatmap
from runtime.report.memory_section import add_memory
from runtime.report.offload_section import add_offload
from runtime.report.page import Page
from runtime.report.run_data import RunData, read_run
from runtime.report.task_section import add_tasks

ROUTER_LOSSES_NOT = {"loss", "aux_loss"}


def _config(run: RunData) -> dict:
    try:
        data = yaml.safe_load(run.config_text) if run.config_text else {}
    except yaml.YAMLError:
        data = {}
    return data if isinstance(data, dict) else {}


def _marks(run: RunData) -> list[VMark]:
    return [VMark(m.step - 0.5, m.label) for m in run.marks]


def _summary(page: Page, run: RunData, cfg: dict) -> None:
    sec = page.section("summary", "Summary")
    topo, plan = cfg.get("topology") or {}, (run.plan or {}).get("placement") or {}
    _, losses = run.series("loss")
    _, speeds = run.series("tokens_per_s")
    rows = [("run directory", str(run.run_dir.resolve())), ("status", run.status),
            ("recipe", cfg.get("recipe") or "-"),
            ("processes", f"{topo.get('nodes', 1)} node(s) x {topo.get('nproc_per_node', '?')}, expert parallel "
                          f"{topo.get('expert_parallel', '?')}"),
            ("expert states", plan.get("offload") or (cfg.get("storage") or {}).get("offload") or "-")]
    if losses:
        rows.append(("loss", f"{losses[0]:.4f} at step {run.steps[0]['step']} -> {losses[-1]:.4f} at step "
                             f"{run.last_step}"))
    held = [s for s in run.steps if isinstance(s.get("eval_loss"), (int, float))]
    if held:
        last = held[-1]
        rows.append(("held-out loss", f"{last['eval_loss']:.4f} at step {last['step']} (perplexity "
                                      f"{last.get('eval_perplexity', float('nan')):.2f}, "
                                      f"{last.get('eval_tokens', 0):,} tokens of train.eval_data)"))
    if speeds:
        rows.append(("tokens/s (median)", f"{statistics.median(speeds):,.0f}"))
    rows += [(f"start at step {m.step}", m.label) for m in run.marks]
    sec.table("summary-table", (), rows)


def _losses(page: Page, run: RunData, marks: list[VMark]) -> None:
    sec = page.section("loss", "Loss and learning rate")
    steps, loss = run.series("loss")
    lines, caption = [Line("loss", steps, loss)], "Mean over ranks; dashed lines: resumes and restarts."
    held_steps, held = run.series("eval_loss")
    if held_steps:  # train.eval_data: the held-out loss at its steps, on the same axis
        lines.append(Line("held-out (train.eval_data)", held_steps, held, {"marker": "o"}))
        caption += " Dots: the loss on train.eval_data (held-out), every train.eval_every steps."
    sec.figure("fig-loss", line_chart("Language-model loss", lines, "loss", marks=marks),
               "language-model loss over steps", caption)
    names = sorted({k for s in run.steps for k, v in s.items()
                    if k.endswith("_loss") and k not in ROUTER_LOSSES_NOT and isinstance(v, (int, float))})
    router = [Line("aux_loss (weighted sum)", *run.series("aux_loss"), {"linewidth": 2.2})]
    router += [Line(name, *run.series(name)) for name in names]
    router = [line for line in router if line.xs]
    if router:
        sec.figure("fig-router-loss", line_chart("Router losses", router, "loss (log scale)", marks=marks,
                                                 log_y=True),
                   "router losses over steps", "Each router loss unweighted, averaged over MoE layers and ranks.")
    for key, fig_id, title, caption in (
            ("lr", "fig-lr", "Learning rate", "AdamW's scheduled learning rate."),
            ("grad_norm", "fig-grad-norm", "Gradient norm", "Global norm before clipping.")):
        xs, ys = run.series(key)
        if xs:
            sec.figure(fig_id, line_chart(title, [Line(key, xs, ys)], key, marks=marks), f"{title.lower()} over steps",
                       caption)


def _speed(page: Page, run: RunData, marks: list[VMark]) -> None:
    sec = page.section("speed", "Speed")
    for key, fig_id, title, unit in (("tokens_per_s", "fig-tokens-per-s", "Tokens per second", "tokens/s"),
                                     ("step_time_s", "fig-step-time", "Step time", "seconds")):
        xs, ys = run.series(key)
        if xs:
            sec.figure(fig_id, line_chart(title, [Line(key, xs, ys)], unit, marks=marks), f"{title.lower()} over steps",
                       "Whole job; the first steps include warm-up.")


def _drops_apply(run: RunData, cfg: dict) -> bool:
    capacity = float((cfg.get("model") or {}).get("capacity_factor") or 0)
    routed = [v for s in run.steps for v in s.get("gate_routed") or [] if isinstance(v, (int, float))]
    return capacity > 0 or any(v < 1 for v in routed)


def _experts(page: Page, run: RunData, cfg: dict, marks: list[VMark]) -> None:
    sec = page.section("experts", "Expert load")
    layers = max((len(s.get("expert_load") or []) for s in run.steps), default=0)
    if not layers:
        sec.note("No expert load recorded (no MoE layer, or no step yet).")
        return
    drops = _drops_apply(run, cfg)
    for layer in range(layers):
        rows = [(s["step"], s["expert_load"][layer], (s.get("gate_routed") or [None] * layers)[layer])
                for s in run.steps if len(s.get("expert_load") or []) > layer]
        experts = max(len(r[1]) for r in rows)
        rows = [r for r in rows if len(r[1]) == experts]
        matrix = [[r[1][e] for r in rows] for e in range(experts)]
        dropped = None
        caption = "Share of the step's routed assignments each expert received (after capacity)."
        if drops:
            kept = [(r[0], 1 - r[2]) for r in rows if isinstance(r[2], (int, float))]
            dropped = Line("dropped", [k[0] for k in kept], [k[1] for k in kept])
            mean = sum(dropped.ys) / len(dropped.ys) if dropped.ys else 0.0
            caption += f" Below: the share capacity dropped (mean {100 * mean:.1f}%)."
        sec.figure(f"fig-expert-load-layer{layer}",
                   load_heatmap(f"MoE layer {layer}: expert load", matrix, [r[0] for r in rows], marks, dropped),
                   f"expert load of MoE layer {layer}, experts x steps", caption)


def _config_text(page: Page, run: RunData) -> None:
    sec = page.section("config", "Config and plan")
    if run.config_text:
        sec.collapsible("config-yaml", "Resolved config (config.yaml)", run.config_text)
    else:
        sec.note("No config.yaml in the run directory.")
    if run.plan is not None:
        sec.collapsible("plan-json", "Plan (plan.json)", json.dumps(run.plan, indent=2))
    else:
        sec.note("No plan.json in the run directory.")


def training_page(run: RunData) -> Page:
    cfg = _config(run)
    page = Page(f"moesys report: {run.run_dir.resolve().name}", run.status)
    marks = _marks(run)
    _summary(page, run, cfg)
    if run.steps:
        _losses(page, run, marks)
        _speed(page, run, marks)
        _experts(page, run, cfg, marks)
        add_offload(page, run, marks)
    add_memory(page, run, marks)
    if run.steps:
        add_tasks(page, run, marks)
    _config_text(page, run)
    return page


def _last_eval(run: RunData) -> dict | None:
    """The newest held-out evaluation of the run (step, loss, perplexity, tokens), None without train.eval_data."""
    held = [s for s in run.steps if isinstance(s.get("eval_loss"), (int, float))]
    if not held:
        return None
    last = held[-1]
    return {"step": last["step"], "loss": last["eval_loss"], "perplexity": last.get("eval_perplexity"),
            "tokens": last.get("eval_tokens")}


def write_training_report(run_dir: str | Path, out: str | Path | None = None) -> dict:
    """Write the report of a run directory (default RUN_DIR/report.html); the `moesys report --json` summary."""
    run = read_run(run_dir)
    out = Path(out) if out else Path(run_dir) / "report.html"
    page = training_page(run)
    atomic_write_text(out, page.html())
    return {"kind": "training", "source": str(Path(run_dir).resolve()), "out": str(out.resolve()),
            "status": run.status, "steps": len(run.steps), "last_step": run.last_step,
            "eval": _last_eval(run),
            "starts": [{"step": m.step, "resumed_from": m.resumed_from, "restart": m.restart} for m in run.marks],
            "sections": [s.id for s in page.sections], "figures": page.figure_ids}
