"""`moesys export`: a training checkpoint or a Hugging Face model directory as one servable model (moesys layout, or the
model's own Hugging Face family)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from moesys_cli.options import Json, required, split_args
from moesys_cli.render import console, human_bytes, interrupted_writes_nothing, literal, print_json
from runtime.config import config_from_dict

ExportArgs = Annotated[
    list[str] | None,
    typer.Argument(help="checkpoint=RUN_DIR (a step directory, or a Hugging Face model directory), out=DIR and "
                        "export.* overrides, e.g. export.format=hf export.dtype=bf16", show_default=False),
]
USAGE = "moesys export takes checkpoint=RUN_DIR, out=DIR and export.KEY=VALUE"


def parse_export_args(args: list[str]) -> tuple[str, str, dict[str, Any]]:
    """(checkpoint, out, export.* overrides as YAML scalars)."""
    values, overrides = split_args(args, USAGE, ("checkpoint", "out"), ("export",))
    return required(values, "checkpoint", USAGE), required(values, "out", USAGE), overrides["export"]


@interrupted_writes_nothing()
def export(args: ExportArgs = None, json_out: Json = False) -> None:
    """Write one model without optimizer state, merged across expert-parallel ranks, streamed tensor by tensor."""
    checkpoint, out, overrides = parse_export_args(args or [])
    ex = config_from_dict({"export": overrides}).export  # types, choices and unknown keys checked in one place
    from runtime.inference.export import export_checkpoint  # torch: loaded only by verbs that compute

    result = export_checkpoint(checkpoint, out, ex.format, ex.dtype, ex.max_shard_gb)
    if json_out:
        print_json(result)
        return
    source = "the checkpoint was {} with optimizer state" if result["optimizer_state"] else "the source was {}"
    console.print(f"[bold]moesys export[/] {literal(result['checkpoint'])} -> {literal(result['out'])} "
                  f"({result['format']}): {result['tensors']} tensors, {human_bytes(result['bytes'])} in "
                  f"{len(result['files'])} file(s); {source.format(human_bytes(result['checkpoint_bytes']))}",
                  highlight=False)
    if result["tokenizer"] is not None and result["eos_token"] is None:
        console.print("its tokenizer has no eos token <|endoftext|> (as runs made before moesys's special tokens): the "
                      "export names none, and generation runs to its length", highlight=False)
