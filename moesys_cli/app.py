"""The `moesys` command: one Typer app, one small module per verb. Bad input exits 2 with a one-line error."""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Optional

import typer

from moesys_cli import bench as bench_cmd
from moesys_cli import config as config_cmd
from moesys_cli import distill as distill_cmd
from moesys_cli import export as export_cmd
from moesys_cli import infer as infer_cmd
from moesys_cli import plan as plan_cmd
from moesys_cli import rebalance as rebalance_cmd
from moesys_cli import report as report_cmd
from moesys_cli import serve as serve_cmd
from moesys_cli import train as train_cmd
from moesys_cli.options import epilog
from moesys_cli.render import error
from runtime.errors import UserError, os_reason, unwritable

app = typer.Typer(
    name="moesys",
    help="Train and serve Mixture-of-Experts models whose experts outgrow GPU memory.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
)
CONTEXT = {"allow_extra_args": False}

EPILOG = epilog()
app.command("plan", context_settings=CONTEXT, epilog=EPILOG)(plan_cmd.plan)
app.command("train", context_settings=CONTEXT, epilog=EPILOG)(train_cmd.train)
app.command("infer", context_settings=CONTEXT, epilog=epilog(recipes=False))(infer_cmd.infer)
app.command("export", context_settings=CONTEXT, epilog=epilog(recipes=False))(export_cmd.export)
app.command("distill", context_settings=CONTEXT, epilog=epilog(recipes=False))(distill_cmd.distill)
app.command("serve", context_settings=CONTEXT, epilog=epilog(recipes=False))(serve_cmd.serve)
app.command("rebalance", context_settings=CONTEXT, epilog=EPILOG)(rebalance_cmd.rebalance)
app.command("bench", context_settings=CONTEXT, epilog=EPILOG)(bench_cmd.bench)
app.command("report", context_settings=CONTEXT)(report_cmd.report)
app.command("config", context_settings=CONTEXT, epilog=EPILOG)(config_cmd.config)


def _version(value: bool) -> None:
    if value:
        try:
            typer.echo(f"moesys {version('moesys')}")
        except PackageNotFoundError:
            typer.echo("moesys (not installed)")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True,
                                                         help="Print the version and exit.")] = None,
) -> None:
    """moesys: plan, train, infer, rebalance and benchmark MoE models (SE-MoE / MoESys on PyTorch); moesys config
    shows the configuration every verb resolves."""


def main() -> None:
    """Console entry point: library errors, and a full, read-only or forbidden filesystem met anywhere, become one
    line on stderr and exit code 2."""
    try:
        app(standalone_mode=True)
    except UserError as exc:
        error(str(exc))
        sys.exit(2)
    except Exception as exc:
        found = unwritable(exc)
        if found is None:
            raise
        error(os_reason(found))
        sys.exit(2)
