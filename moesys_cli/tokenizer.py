"""`moesys tokenizer train`: a byte-level BPE learned from the user's text, written as the tokenizer.json that
`moesys train train.tokenizer=FILE` takes."""

from __future__ import annotations

from typing import Annotated

import typer

from moesys_cli.options import Json, required, split_args, train_keys
from moesys_cli.render import ByteProgress, console, interrupted_writes_nothing, literal, print_json
from runtime.config import BYTE_VOCAB
from runtime.data.tokenizer_train import MAX_VOCAB
from runtime.errors import UserError

app = typer.Typer(name="tokenizer", no_args_is_help=True, add_completion=False, pretty_exceptions_show_locals=False,
                  help="Tokenizers: moesys tokenizer train data=... vocab_size=N out=FILE.")

TrainArgs = Annotated[
    list[str] | None,
    typer.Argument(help="data=PATH (a text file, a directory of *.txt, a .jsonl), vocab_size=N (from "
                        f"{BYTE_VOCAB} to {MAX_VOCAB:,}), out=FILE, train.data_text_key=KEY for a .jsonl whose text "
                        "is not under 'text', and train.data_errors=strict|replace", show_default=False),
]
USAGE = ("moesys tokenizer train takes data=PATH, vocab_size=N, out=FILE, train.data_text_key=KEY and "
         "train.data_errors=strict|replace")


def parse_train_args(args: list[str]) -> tuple[str, int, str, str, str]:
    """(data, vocab size, out, the .jsonl text key, what bad bytes do)."""
    values, overrides = split_args(args, USAGE, ("data", "vocab_size", "out"), ("train",))
    tr = train_keys(overrides["train"], {"data_text_key", "data_errors"}, USAGE)
    size = required(values, "vocab_size", USAGE)
    try:
        vocab_size = int(size)
    except ValueError:
        raise UserError(f"vocab_size={size!r} is not an integer; {USAGE}") from None
    return (required(values, "data", USAGE), vocab_size, required(values, "out", USAGE), tr.data_text_key,
            tr.data_errors)


@app.command("train", context_settings={"allow_extra_args": False})
@interrupted_writes_nothing()
def train(args: TrainArgs = None, json_out: Json = False) -> None:
    """Train a byte-level BPE tokenizer on your text and write it as a Hugging Face tokenizer.json."""
    data, vocab_size, out, text_key, errors = parse_train_args(args or [])
    from runtime.data.tokenizer_train import train_bpe

    with ByteProgress(json_out) as progress:
        result = train_bpe(data, vocab_size, out, "data", text_key, lambda done, total: progress("data", done, total),
                           errors)
    if json_out:
        print_json(result)
        return
    console.print(f"[bold]moesys tokenizer train[/] {literal(result['out'])}: byte-level BPE of "
                  f"{result['vocab_size']} tokens (asked {result['requested_vocab_size']}; ids 0-2 are "
                  f"{result['eos_token']} (eos), <|im_start|>, <|im_end|>) from "
                  f"{result['text_bytes']:,} bytes of {literal(result['data'])} in {result['seconds']:.1f} s; train "
                  f"with train.tokenizer={literal(result['out'])} model.vocab_size>={result['vocab_size']}",
                  highlight=False)
