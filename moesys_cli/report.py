"""`moesys report SOURCE [out=FILE.html]`: one self-contained HTML page of a training run directory or of a
`moesys infer --json` file (runtime/report/)."""

from __future__ import annotations

from typing import Annotated

import typer

from moesys_cli.options import Json
from moesys_cli.render import console, literal, print_json
from runtime.errors import UserError

ReportArgs = Annotated[
    list[str] | None,
    typer.Argument(help="RUN_DIR (a train.run_dir) or FILE.json (moesys infer --json), and optionally out=FILE.html "
                        "(default: RUN_DIR/report.html, or FILE.html beside FILE.json)", show_default=False),
]
USAGE = "moesys report takes RUN_DIR or FILE.json, and optionally out=FILE.html"


def parse_report_args(args: list[str]) -> tuple[str, str | None]:
    """(source, out or None)."""
    sources, out = [], None
    for arg in args:
        key, sep, value = arg.partition("=")
        if sep and key == "out":
            if not value:
                raise UserError(f"out= needs a file name; {USAGE}")
            out = value
        elif sep and "/" not in key:
            raise UserError(f"unknown argument {key!r}; {USAGE}")
        else:
            sources.append(arg)
    if len(sources) != 1:
        raise UserError(f"{'no source' if not sources else 'more than one source'} given; {USAGE}")
    return sources[0], out


def report(args: ReportArgs = None, json_out: Json = False) -> None:
    """Write one HTML page with the charts of a run (loss, speed, expert load, offloading, memory against the plan,
    tasks) or of an inference result (per-layer policy, bytes per token, a token's copy/compute timeline)."""
    source, out = parse_report_args(args or [])
    from runtime.report.write import write_report  # matplotlib: loaded only by this verb

    result = write_report(source, out)
    if json_out:
        print_json(result)
        return
    what = f"{result['status']}, " if result["kind"] == "training" else ""
    console.print(f"[bold]moesys report[/] {literal(result['out'])} ({result['kind']}: {literal(what)}"
                  f"{len(result['figures'])} charts)", highlight=False)
