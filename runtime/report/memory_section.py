"""The report's memory section: each rank's measured peak over steps beside the plan's estimate for it, and the
per-rank, per-tier comparison `moesys plan --compare` prints (runtime/plan/compare.py)."""

from __future__ import annotations

import functools

from runtime.errors import UserError
from runtime.plan.compare import TOLERANCE, compare_run, tier_bytes
from runtime.report.charts import Line, VMark, grouped_bars, human_bytes, line_chart
from runtime.report.page import Page
from runtime.report.run_data import RunData

TIER_NAMES = {"ram": "RAM (anonymous RSS)", "host": "host (anonymous RSS and pinned)",
              "device": "device (CUDA max allocated)", "ssd": "SSD (expert store)"}


def add_memory(page: Page, run: RunData, marks: list[VMark]) -> None:
    sec = page.section("memory", "Memory per rank against the plan")
    try:
        rows = compare_run(run.run_dir)
    except (UserError, OSError, ValueError, KeyError) as exc:
        sec.note(f"No comparison with the plan: {exc}")
        return
    planned = {(r.rank, r.tier): r.predicted_bytes for r in rows}
    for tier in dict.fromkeys(r.tier for r in rows if r.tier != "ssd"):
        per_rank = run.ranked_by(functools.partial(tier_bytes, tier))
        if not per_rank:
            continue
        lines = [Line(f"rank {rank}", xs, ys) for rank, (xs, ys) in per_rank.items()]
        lines += [Line(f"_plan rank {rank}" if i else "plan (per rank)", [min(xs), max(xs)],
                       [planned[(rank, tier)]] * 2, {"linestyle": "--", "color": "#444444"})
                  for i, (rank, (xs, _)) in enumerate(per_rank.items()) if (rank, tier) in planned]
        sec.figure(f"fig-memory-{tier}", line_chart(f"Peak memory per rank: {TIER_NAMES[tier]}", lines, "bytes",
                                                     marks=marks, byte_axis=True),
                   f"measured peak {tier} memory per rank over steps against the plan",
                   "Peak since each worker started (a resumed worker starts again from its own start); dashed: the "
                   "plan's estimate per rank.")
    groups = [f"rank {r.rank}\n{r.tier}" for r in rows]
    sec.figure("fig-memory-plan", grouped_bars("Planned and measured peak per rank and tier", groups,
                                               {"plan": [r.predicted_bytes for r in rows],
                                                "measured": [r.measured_bytes or 0 for r in rows]},
                                               "bytes", byte_axis=True),
               "planned and measured peak memory per rank and tier",
               f"Measured within {TOLERANCE:.0%} of the plan counts as on plan (moesys plan --compare).")
    sec.table("memory-table", ("rank", "tier", "planned", "measured", "ratio", "on plan"),
              [(r.rank, r.tier, human_bytes(r.predicted_bytes),
                "-" if r.measured_bytes is None else human_bytes(r.measured_bytes),
                r.ratio_text, {True: "yes", False: "no", None: "-"}[r.within])
               for r in rows])
