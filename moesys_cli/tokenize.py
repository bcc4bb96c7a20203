"""`moesys tokenize`: a text source written as a pre-tokenized token file (.bin or .npy) that `train.data` and
`train.eval_data` read through a memory map."""

from __future__ import annotations

from typing import Annotated

import typer

from moesys_cli.options import Json, required, split_args, train_keys
from moesys_cli.render import ByteProgress, console, interrupted_writes_nothing, literal, print_json

TokenizeArgs = Annotated[
    list[str] | None,
    typer.Argument(help="data=PATH (a text file, a directory of *.txt, a .jsonl), out=FILE.bin (or .npy), "
                        "train.tokenizer=bytes|PATH (the run's), train.data_text_key=KEY and "
                        "train.data_errors=strict|replace", show_default=False),
]
USAGE = ("moesys tokenize takes data=PATH, out=FILE.bin, train.tokenizer=bytes|PATH, train.data_text_key=KEY and "
         "train.data_errors=strict|replace")


def parse_tokenize_args(args: list[str]) -> tuple[str, str, str, str, str]:
    """(data, out, tokenizer, the .jsonl text key, what bad bytes do)."""
    values, overrides = split_args(args, USAGE, ("data", "out"), ("train",))
    tr = train_keys(overrides["train"], {"tokenizer", "data_text_key", "data_errors"}, USAGE)
    return (required(values, "data", USAGE), required(values, "out", USAGE), tr.tokenizer, tr.data_text_key,
            tr.data_errors)


@interrupted_writes_nothing()
def tokenize(args: TokenizeArgs = None, json_out: Json = False) -> None:
    """Tokenize text once into a memory-mapped token file for train.data or train.eval_data."""
    data, out, spec, text_key, errors = parse_tokenize_args(args or [])
    from runtime.data.pretokenize import tokenize_to_file
    from runtime.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(spec)
    with ByteProgress(json_out) as progress:
        result = tokenize_to_file(data, out, tokenizer, "data", text_key,
                                  lambda done, total: progress("data", done, total), errors)
    if json_out:
        print_json(result)
        return
    console.print(f"[bold]moesys tokenize[/] {literal(result['out'])}: {result['tokens']:,} tokens ({result['dtype']}, "
                  f"tokenizer {literal(result['tokenizer'])}) from {result['text_bytes']:,} bytes in "
                  f"{result['seconds']:.1f} s; train with train.data={literal(result['out'])}", highlight=False)
