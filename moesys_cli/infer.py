"""`moesys infer`: generate from a moesys run directory or a Hugging Face model directory (Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE, ERNIE-4.5-MoE), streaming the checkpoint and placing experts per layer within a device budget
(auto), or with ring-memory offloading (the paper's "Ring Memory Offloading")."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.table import Table

from moesys_cli.options import Json, required, split_args
from moesys_cli.render import console, human_bytes, literal, print_json
from runtime.errors import UserError, os_reason

InferArgs = Annotated[
    list[str] | None,
    typer.Argument(help='checkpoint=DIR, prompt="text" (repeat for a batch), prompt_ids=[1,2,3] and infer.* '
                        "overrides, e.g. infer.max_new_tokens=16 infer.ring_slots=2", show_default=False),
]
Offload = Annotated[str | None, typer.Option(
    "--offload", help="auto (default: per-layer placement within infer.ring_slots layers), ring, ondemand or none "
                      "(overrides infer.offload).", show_default=False)]
Report = Annotated[Path | None, typer.Option(
    "--report", metavar="FILE.html", help="Also write the result as one HTML page (moesys report): per-layer "
                                          "policy, bytes per token, a token's copy/compute timeline.")]
USAGE = "moesys infer takes checkpoint=DIR, prompt=TEXT, prompt_ids=[..] and infer.KEY=VALUE"


@dataclass
class InferRequest:
    checkpoint: str
    overrides: dict[str, Any] = field(default_factory=dict)
    prompts: list[str] = field(default_factory=list)
    prompt_ids: list[list[int]] = field(default_factory=list)


def _ids(value: str) -> list[int]:
    try:
        ids = yaml.safe_load(value)
    except yaml.YAMLError:
        ids = None
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise UserError(f"prompt_ids={value!r} is not a list of token ids like [1,2,3]")
    return ids


def parse_infer_args(args: list[str]) -> InferRequest:
    """Split `checkpoint=`, `prompt=`, `prompt_ids=` and `infer.*` arguments; values of infer.* are YAML scalars,
    a prompt stays text (even "123")."""
    values, overrides = split_args(args, USAGE, ("checkpoint", "prompt", "prompt_ids"), ("infer",),
                                   aliases={"infer.prompt": "prompt", "infer.prompt_ids": "prompt_ids"})
    return InferRequest(required(values, "checkpoint", USAGE), overrides["infer"], values["prompt"],
                        [_ids(value) for value in values["prompt_ids"]])


def infer(args: InferArgs = None, offload: Offload = None, json_out: Json = False, report: Report = None) -> None:
    """Generate tokens; prints prefill/decode tokens/s, where each layer's experts were, bytes read per token and
    peak memory."""
    request = parse_infer_args(args or [])
    if report is not None:  # refused before the model loads
        folder = report.resolve().parent
        if not folder.is_dir():
            raise UserError(f"--report {report}: the directory {folder} does not exist")
        if not os.access(folder, os.W_OK):
            raise UserError(f"--report {report}: the directory {folder} cannot be written; choose another file")
    from runtime.inference.generate import run_inference  # torch: loaded only by verbs that compute

    result = run_inference(request.checkpoint, request.overrides, request.prompts, request.prompt_ids, offload)
    if json_out:
        print_json(result)
    else:
        _render(result)
    if report is not None:  # after the result is shown: a report that cannot be written loses nothing else
        from runtime.report.inference import write_inference_report  # matplotlib: only when asked

        try:
            write_inference_report(result, report)
        except OSError as exc:
            raise UserError(f"--report {report}: cannot write it ({os_reason(exc)}); the result is above") from None
        if not json_out:
            console.print(f"report: {literal(report.resolve())}", highlight=False)


def _placement(layers: list[str]) -> str:
    """'resident x3, inplace x5' in layer order."""
    runs: list[list] = []
    for policy in layers:
        if runs and runs[-1][0] == policy:
            runs[-1][1] += 1
        else:
            runs.append([policy, 1])
    return ", ".join(f"{p} x{n}" for p, n in runs)


def _render(r: dict) -> None:
    budget = f" K={r['ring_slots']} of N={r['moe_layers']}" if r["ring_slots"] else f" (N={r['moe_layers']} MoE layers)"
    console.print(f"[bold]moesys infer[/] {r['kind']} checkpoint {literal(r['checkpoint'])} on {r['device']}, "
                  f"--offload {r['offload']}{budget}")
    for i, tokens in enumerate(r["tokens"]):
        shown = repr(r["text"][i]) if r["text"] is not None else str(tokens)
        ended = f" [dim](ended at stop token {tokens[-1]})[/]" if tokens and tokens[-1] in r["stop_token_ids"] else ""
        console.print(f"[dim]{i}:[/] {literal(shown)}{ended}", highlight=False)
    table = Table(show_header=False)
    dev, host = r["peak_bytes"]["device"], r["peak_bytes"]["host"]
    hidden = r["copy_hidden_share"]
    rows = [
        ("prefill", f"{r['prefill_tokens_per_s']:.1f} tokens/s ({r['prefill_tokens']} tokens)"),
        ("decode", f"{r['decode_tokens_per_s']:.1f} tokens/s ({r['decode_tokens']} tokens)"),
        ("experts by layer", _placement(r["placement"])),
        ("device peak", f"{human_bytes(dev['total'])} (dense {human_bytes(dev['dense'])}, experts "
                        f"{human_bytes(dev['experts'])}, KV cache {human_bytes(dev['kv_cache'])})"),
        ("host experts", human_bytes(host["experts"])),
        ("process memory peak", f"{human_bytes(r['peak_rss_anon_bytes'])} anonymous"),
        ("store read per token", f"{human_bytes(r['store_bytes_per_token'])} (from disk "
                                 f"{human_bytes(r['disk_read_bytes_per_token'])}, page cache "
                                 f"{human_bytes(r['page_cache_bytes_per_token'])})"),
        ("copied per token", human_bytes(r["copied_bytes_per_token"])),
        ("copy time hidden", "no copies" if hidden is None else f"{100 * hidden:.0f}% of {r['copy_s'] * 1e3:.1f} ms"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
