"""`moesys eval`: the held-out loss, perplexity and tokens of a run's newest checkpoint, a step directory or an export,
on the data given, in the checkpoint's own tokenizer."""

from __future__ import annotations

from typing import Annotated

import typer

from moesys_cli.options import Json, required, split_args
from moesys_cli.render import console, literal, print_json
from runtime.config import config_from_dict
from runtime.errors import UserError

EvalArgs = Annotated[
    list[str] | None,
    typer.Argument(help="checkpoint=RUN_DIR (a step directory or an export), data=PATH (text, a directory of *.txt, "
                        ".jsonl, a .bin/.npy token file), and train.seq_len, train.eval_windows (0: all), "
                        "train.data_text_key, train.data_errors=strict|replace, train.micro_batch_size",
                   show_default=False),
]
USAGE = ("moesys eval takes checkpoint=DIR, data=PATH, train.seq_len=N, train.eval_windows=N, "
         "train.data_text_key=KEY, train.data_errors=strict|replace and train.micro_batch_size=N")


def evaluate(args: EvalArgs = None, json_out: Json = False) -> None:
    """Print the held-out loss, perplexity and tokens evaluated of a run or an export on your data."""
    values, overrides = split_args(args or [], USAGE, ("checkpoint", "data"), ("train",))
    checkpoint, data = required(values, "checkpoint", USAGE), required(values, "data", USAGE)
    from runtime.train.evaluate import EVAL_KEYS

    extra = sorted(set(overrides["train"]) - set(EVAL_KEYS))
    if extra:
        raise UserError(f"unknown argument 'train.{extra[0]}'; {USAGE}")
    config_from_dict({"train": overrides["train"]})  # types and ranges checked before the model loads
    from runtime.train.evaluate import evaluate_checkpoint

    result = evaluate_checkpoint(checkpoint, data, overrides["train"])
    if json_out:
        print_json(result)
        return
    console.print(f"[bold]moesys eval[/] {literal(result['checkpoint'])} on {literal(result['data'])}: loss "
                  f"{result['loss']:.4f}, perplexity {result['perplexity']:.2f}, {result['tokens']:,} tokens "
                  f"({result['windows']} windows of {result['seq_len']})", highlight=False)
