"""`moesys config`: the resolved configuration as YAML (or JSON), or with --keys every key with its type, default,
resolved value and docstring."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import typer

from moesys_cli.options import Json, Overrides
from moesys_cli.render import print_json
from moesys_cli.resolve import config_yaml, resolve_config
from runtime.config_keys import config_keys

Keys = Annotated[bool, typer.Option("--keys", help="List every key (dotted) with its type, schema default, value "
                                                   "with this recipe and overrides, and what it does.")]
MISSING = object()


def config(overrides: Overrides = None, keys: Keys = False, json_out: Json = False) -> None:
    """Print the configuration every verb resolves from conf/, the recipe and the overrides."""
    cfg = resolve_config(overrides or [])
    values = dataclasses.asdict(cfg)
    if not keys:
        if json_out:
            print_json(values)
        else:
            typer.echo(config_yaml(cfg), nl=False)
        return
    rows = [{"key": k.key, "type": k.type, "default": k.default, "value": _lookup(values, k.key), "doc": k.doc}
            for k in config_keys()]
    if json_out:
        print_json([{**r, "value": None if r["value"] is MISSING else r["value"]} for r in rows])
        return
    table = [("KEY", "TYPE", "DEFAULT", "VALUE", "WHAT IT DOES")]
    table += [(r["key"], r["type"], _text(r["default"]), "" if r["value"] is MISSING else _text(r["value"]), r["doc"])
              for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    for row in table:
        typer.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4])


def _lookup(values: dict, dotted: str) -> Any:
    """The resolved value of a dotted key; MISSING for the tasks.NAME.* pattern."""
    node: Any = values
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return MISSING
        node = node[part]
    return node


def _text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if value == "":
        return "''"
    return str(value)
