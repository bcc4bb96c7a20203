"""The `moesys` command: one Typer app, one small module per verb. Bad input exits 2 with a one-line error."""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated

import typer

from moesys_cli import bench as bench_cmd
from moesys_cli import config as config_cmd
from moesys_cli import distill as distill_cmd
from moesys_cli import evaluate as eval_cmd
from moesys_cli import export as export_cmd
from moesys_cli import infer as infer_cmd
from moesys_cli import plan as plan_cmd
from moesys_cli import rebalance as rebalance_cmd
from moesys_cli import report as report_cmd
from moesys_cli import serve as serve_cmd
from moesys_cli import tokenize as tokenize_cmd
from moesys_cli import tokenizer as tokenizer_cmd
from moesys_cli import train as train_cmd
from moesys_cli.options import epilog
from moesys_cli.render import error
from runtime.errors import UserError, os_reason, unwritable

try:
    from typer._click import exceptions as click_errors  # the Click that newer Typers carry inside
except ImportError:  # an older Typer: Click itself, the same exceptions (mypy sees one module bound twice)
    from click import exceptions as click_errors  # type: ignore[no-redef]

app = typer.Typer(
    name="moesys",
    help="Train and serve Mixture-of-Experts models whose experts outgrow GPU memory.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
)
CONTEXT = {"allow_extra_args": False}

EPILOG = epilog()
SHORT = {
    "plan": "Memory budgets (Eq. 1), placement and a verdict: exit 0 fits, 1 does not, 2 bad input.",
    "train": "Train with expert + data parallelism in torchrun processes.",
    "infer": "Generate tokens from a checkpoint, experts placed within a device budget.",
    "export": "Write one servable model (no optimizer state) from a training checkpoint.",
    "distill": "Train a student with fewer experts per MoE layer from a teacher run.",
    "serve": "Serve OpenAI-style completions over HTTP until SIGTERM or Ctrl-C.",
    "rebalance": "Allocate GPUs to the tasks of a multi-task load so the slowest GPU carries the least.",
    "bench": "Measure side by side and print the ratios.",
    "report": "Write one HTML page of a run's or an inference result's charts.",
    "config": "Print the configuration every verb resolves, or every key with --keys.",
    "tokenizer": "Train a byte-level BPE tokenizer on your text (moesys tokenizer train).",
    "tokenize": "Write text as a memory-mapped token file for train.data or train.eval_data.",
    "eval": "Print the held-out loss and perplexity of a run or an export on your data.",
}
"""One line per verb for `moesys --help` (the verbs' docstrings are their own --help, reflowed there)."""


def _verb(name: str, fn, epilog: str | None = EPILOG) -> None:
    app.command(name, context_settings=CONTEXT, epilog=epilog, short_help=SHORT[name])(fn)


_verb("plan", plan_cmd.plan)
_verb("train", train_cmd.train)
_verb("infer", infer_cmd.infer, epilog(recipes=False))
_verb("export", export_cmd.export, epilog(recipes=False))
_verb("distill", distill_cmd.distill, epilog(recipes=False))
_verb("serve", serve_cmd.serve, epilog(recipes=False))
_verb("rebalance", rebalance_cmd.rebalance)
_verb("bench", bench_cmd.bench)
_verb("report", report_cmd.report, None)
_verb("config", config_cmd.config)
_verb("tokenize", tokenize_cmd.tokenize, epilog(recipes=False))
_verb("eval", eval_cmd.evaluate, epilog(recipes=False))
app.add_typer(tokenizer_cmd.app, name="tokenizer", short_help=SHORT["tokenizer"])

def _version(value: bool) -> None:
    if value:
        try:
            typer.echo(f"moesys {version('moesys')}")
        except PackageNotFoundError:
            typer.echo("moesys (not installed)")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: Annotated[bool | None, typer.Option("--version", callback=_version, is_eager=True,
                                                         help="Print the version and exit.")] = None,
) -> None:
    """moesys: plan, train, infer, rebalance and benchmark MoE models (SE-MoE / MoESys on PyTorch); moesys config
    shows the configuration every verb resolves."""


def usage_line(exc: click_errors.UsageError) -> str:
    """A usage error (a bad option value, an unknown command or option, a missing argument) as one line that says
    where the command's help is."""
    message = " ".join(exc.format_message().split())
    ctx = exc.ctx
    return f"{message} (see {ctx.command_path} --help)" if ctx is not None else message


def main() -> None:
    """Console entry point: usage errors, library errors, and a full, read-only or forbidden filesystem met
    anywhere, become one line on stderr and exit code 2."""
    try:
        code = app(standalone_mode=False)
    except click_errors.NoArgsIsHelpError:
        sys.exit(2)  # the group printed its help
    except click_errors.UsageError as exc:
        error(usage_line(exc))
        sys.exit(2)
    except click_errors.ClickException as exc:
        error(" ".join(exc.format_message().split()))
        sys.exit(exc.exit_code)
    except typer.Abort:
        error("aborted")
        sys.exit(1)
    except UserError as exc:
        error(str(exc))
        sys.exit(2)
    except Exception as exc:
        found = unwritable(exc)
        if found is None:
            raise
        error(os_reason(found))
        sys.exit(2)
    sys.exit(code if isinstance(code, int) and not isinstance(code, bool) else 0)
