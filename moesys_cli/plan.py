"""`moesys plan`: parameter counts, Eq. 1 per tier, placement and a per-rank estimate, with a verdict."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from moesys_cli.options import Json, Overrides
from moesys_cli.render import console, human_bytes, human_count, literal, print_json, warn
from moesys_cli.resolve import lr_warning, resolve_config
from runtime.errors import UserError
from runtime.launch.command import launch_ram_problem
from runtime.plan.compare import TOLERANCE, TierComparison, compare_run, comparison_to_dict
from runtime.plan.machine_profile import machine_rates, rates_to_dict
from runtime.plan.modes import OffloadMode
from runtime.plan.planner import keep_layers_hint, plan_placement, plan_to_dict
from runtime.plan.prediction import predict_modes
from runtime.plan.schedule import choose_schedule, scheduled

Measure = Annotated[bool, typer.Option(
    "--measure", help="First measure this machine's rates (copies, host AdamW, disk, GEMM, and the model's resident "
                      "MFU from a short real job in the planned layout) and keep them in its profile for later plans "
                      "here (runtime/plan/machine_profile.py).")]
Compare = Annotated[Path | None, typer.Option(
    "--compare", metavar="RUN_DIR", help="Set the run's recorded plan beside the peak memory each of its ranks "
                                         "measured, per tier, with the ratio (the run's own config is used).")]


TIER_NAMES = {"gpu": {"gpu": "on the GPU", "cpu": "in host RAM", "ssd": "on SSD"},
              "cpu": {"gpu": "in the device pool (RAM)", "cpu": "in the host cache (RAM)", "ssd": "on SSD"}}
"""What each tier of the placement is, by what the device is (placement.device)."""


def plan(overrides: Overrides = None, json_out: Json = False, compare: Compare = None,
         measure: Measure = False) -> None:
    """Check memory budgets (Eq. 1) and say where each kind of state lives; a recipe with purpose=serve is judged
    by its inference budget. Exit 0 fits, 1 does not, 2 bad input. With --compare RUN_DIR: predicted against
    measured memory of a run, exit 0."""
    if compare is not None:
        if overrides:
            raise UserError(f"--compare reads the run's own config; drop the overrides ({' '.join(overrides)})")
        rows = compare_run(compare)
        if json_out:
            print_json(comparison_to_dict(compare.resolve(), rows))
        else:
            _render_compare(compare.resolve(), rows)
        raise typer.Exit(0)
    cfg = resolve_config(overrides or [], schedule=False)
    if measure:
        from runtime.bench.machine import measure_machine  # torch: only when asked
        measured, where = measure_machine(cfg)
        if not json_out:
            console.print(f"measured this machine: {_rates_text(measured)} (kept in {where})", markup=False)
    rates = machine_rates(cfg)
    schedule = choose_schedule(cfg, rates)
    cfg = scheduled(cfg, schedule)
    planned = plan_placement(cfg)
    result = plan_to_dict(planned)
    result["schedule"] = schedule.to_dict()
    result["step_time"] = predict_modes(cfg, rates)
    result["rates"] = rates_to_dict(rates)
    hint = keep_layers_hint(planned) if cfg.purpose == "train" else None
    machine = launch_ram_problem(cfg, planned.process_host_bytes) if cfg.purpose == "train" else None
    if machine:  # what moesys train would refuse here before launching
        result["problems"].append(machine)
        result["feasible"] = False
    result["warnings"] = [w for w in (lr_warning(cfg, overrides or []),) if w]
    for warning in result["warnings"]:
        warn(warning)
    if json_out:
        print_json({"recipe": cfg.recipe, "init_from": cfg.train.init_from, **result})
    else:
        _render(cfg.recipe, result, hint, cfg.train.init_from)
        if cfg.purpose == "train":
            _render_speed(result, schedule.line())
    raise typer.Exit(0 if result["feasible"] else 1)


def _rates_text(rates: dict) -> str:
    names = {"pcie_h2d_gbps": "h2d {:.1f} GB/s", "pcie_d2h_gbps": "d2h {:.1f} GB/s",
             "adamw_gparams_per_core": "host AdamW {:.3f} Gparams/s a core", "disk_read_gbps": "disk read {:.2f} GB/s",
             "disk_write_gbps": "write {:.2f} GB/s", "gemm_tflops": "GEMM {:.3g} TFLOP/s",
             "resident_mfu": "resident MFU {:.2f}"}
    return ", ".join(text.format(rates[key]) for key, text in names.items() if key in rates)


def _render_speed(r: dict, schedule_line: str) -> None:
    """Each storage mode's predicted step beside resident, the rates it assumed, and the schedule's line."""
    parts = []
    for mode, p in r["step_time"].items():
        share = f", {p['vs_none']:.2f}x none" if mode != "none" else ""
        parts.append(f"{mode} {p['step_s']:.3g} s ({p['tokens_per_s']:,.0f} tokens/s{share}, {p['bound_term']} bound"
                     f"{'' if p['fits'] else ', does not fit'})")
    console.print("step time predicted: " + "; ".join(parts), markup=False)
    rates = r["rates"]
    console.print(f"  [dim]rates: {literal(_rates_text(rates))}, {rates['cpu_cores_per_node']} cores a node "
                  f"({literal(rates['from'])})[/]")
    console.print(f"schedule: {schedule_line}", markup=False)


def _render(recipe: str | None, r: dict, hint: str | None = None, init_from: str | None = None) -> None:
    p = r["params"]
    source = f" train.init_from={literal(init_from)}" if init_from else ""
    console.print(f"[bold]moesys plan[/] recipe={literal(recipe)}{source}: {human_count(p['total'])} parameters "
                  f"(dense D {human_count(p['dense'])}, sparse S {human_count(p['sparse'])}, "
                  f"active/token {human_count(p['active'])}, embedding {human_count(p['embedding'])})")
    b = r["budget"]
    kept = r["placement"].get("resident_layers", 0) if r["placement"]["offload"] != "none" else 0
    layers = f"L={b['layers']} offloaded MoE layers, {kept} kept" if kept else f"L={b['layers']} MoE layers"
    eq1 = Table(title=f"Eq. 1  (alpha={b['alpha']}, {layers}, N={b['nodes']} nodes)")
    for col in ("tier", "inequality", "required", "capacity", "holds"):
        eq1.add_column(col)
    for name, t in b["tiers"].items():
        eq1.add_row(name.upper(), t["formula"], human_bytes(t["required_bytes"]), human_bytes(t["capacity_bytes"]),
                    "[green]yes[/]" if t["ok"] else "[red]no[/]")
    console.print(eq1)
    pl, pr = r["placement"], r["per_rank"]
    tiers = TIER_NAMES[pl["device"]]
    device = "GPU" if pl["device"] == "gpu" else "CPU (no GPU)"
    console.print(f"Per rank ({pr['world_size']} ranks) on {device} with storage.offload={pl['offload']}: dense "
                  f"{tiers[pl['dense']]}, experts {tiers[pl['sparse']]}", markup=False)
    rank = Table()
    rank.add_column("state")
    rank.add_column("bytes", justify="right")
    for name, n in pr["device"].items():
        rank.add_row(f"device: {name}", human_bytes(n))
    rank.add_row(f"[bold]device peak[/] (at {pr['device_peak_at']})",
                 f"{human_bytes(pr['device_total'])} / {human_bytes(pr['device_capacity'])}")
    rank.add_row("host (expert cache)", f"{human_bytes(pr['host'])} / {human_bytes(pr['host_capacity'])}")
    rank.add_row("ssd (expert store)", human_bytes(pr["ssd"]))
    if OffloadMode(pl["offload"]) is OffloadMode.SSD:
        rank.add_row("CPU cache", f"{pl['cpu_cache_experts']} of {pl['local_experts']} local experts")
    console.print(rank)
    if hint:
        console.print(hint, markup=False)
    _render_disk(r["disk"], b["tiers"]["ssd"]["capacity_bytes"] / max(1, b["nodes"]))
    inf = r["inference"]
    console.print(f"inference (ring memory): dense {human_bytes(inf['dense_bytes'])} resident, "
                  f"{human_bytes(inf['expert_layer_bytes'])} per MoE layer's experts -> largest infer.ring_slots "
                  f"that fits: {inf['max_ring_slots']}")
    if r["purpose"] == "serve":
        console.print(f"serving with infer.offload={inf['offload']}: {inf['expert_layers_resident']} MoE layers' "
                      f"experts on the device, {human_bytes(inf['required_bytes'])} / "
                      f"{human_bytes(inf['device_bytes'])}", markup=False)
        if not r["training"]["feasible"]:
            console.print(f"judged for serving (purpose=serve); training would not fit: "
                          f"{'; '.join(r['training']['problems'])} (purpose=train judges training)", markup=False)
    for a in r["assumptions"]:
        console.print(f"  [dim]assumes {literal(a)}[/]")
    if r["feasible"]:
        console.print("[bold green]fits[/]")
    else:
        for problem in r["problems"]:
            console.print(f"[red]does not fit:[/] {literal(problem)}")
        for s in r["suggestions"]:
            console.print(f"[yellow]try:[/] {literal(s)}")


def _render_disk(d: dict, per_node: float) -> None:
    parts = [f"expert store {human_bytes(d['expert_store_bytes'])}"] if d["expert_store_bytes"] else []
    n = d["checkpoints_on_disk"]
    if n:
        parts.append(f"{n} checkpoint{'s' if n > 1 else ''} of {human_bytes(d['checkpoint_bytes'])} at once")
    console.print(f"disk written: {' + '.join(parts) or 'nothing'} = {human_bytes(d['total_bytes'])} "
                  f"(topology.ssd_gb: {human_bytes(per_node)} per node)", markup=False)


def _render_compare(run_dir: Path, rows: list[TierComparison]) -> None:
    table = Table(title=f"Plan against measured peaks, {literal(run_dir)}")
    for col in ("rank", "tier", "predicted", "measured", "measured / predicted"):
        table.add_column(col, justify="left" if col == "tier" else "right")
    for row in rows:
        ratio = row.ratio_text
        if row.within is False:
            ratio = f"[red]{ratio}[/]"
        table.add_row(str(row.rank), row.tier, human_bytes(row.predicted_bytes),
                      "-" if row.measured_bytes is None else human_bytes(row.measured_bytes), ratio)
    console.print(table)
    off = [r for r in rows if r.within is False]
    if off:
        console.print(f"[yellow]{len(off)} of {len(rows)} off the plan by more than {TOLERANCE:.0%}[/]")
    else:
        console.print(f"[green]every rank and tier within {TOLERANCE:.0%} of the plan[/]")
