"""`moesys config`: the resolved configuration as YAML (or JSON), or with --keys every key with its type, default,
resolved value and docstring; --keys --markdown writes the config reference page (docs/config.md)."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import typer

from moesys_cli.options import Json, Overrides
from moesys_cli.render import print_json
from moesys_cli.resolve import config_yaml, resolve_config
from runtime.config import ConfigError
from runtime.config.keys import config_keys, keys_markdown, value_text

Keys = Annotated[bool, typer.Option("--keys", help="List every key (dotted) with its type, schema default, value "
                                                   "with this recipe and overrides, and what it does.")]
Markdown = Annotated[bool, typer.Option("--markdown", help="With --keys: the schema's keys as the Markdown config "
                                                           "reference (docs/config.md), schema defaults only.")]
MISSING = object()


def config(overrides: Overrides = None, keys: Keys = False, json_out: Json = False,
           markdown: Markdown = False) -> None:
    """Print the configuration every verb resolves from conf/, the recipe and the overrides."""
    if markdown:
        _check_markdown(keys, json_out, overrides or [])
        typer.echo(keys_markdown(), nl=False)
        return
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
    table += [(r["key"], r["type"], value_text(r["default"]),
               "" if r["value"] is MISSING else value_text(r["value"]), r["doc"]) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    for row in table:
        typer.echo("  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths, strict=True)) + "  " + row[4])


def _lookup(values: dict, dotted: str) -> Any:
    """The resolved value of a dotted key; MISSING for the tasks.NAME.* pattern."""
    node: Any = values
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return MISSING
        node = node[part]
    return node


def _check_markdown(keys: bool, json_out: bool, overrides: list[str]) -> None:
    """--markdown is the schema's reference: it goes with --keys, and takes neither --json nor a recipe or override
    (the page shows schema defaults, so they would be ignored)."""
    if not keys:
        raise ConfigError("--markdown goes with --keys: moesys config --keys --markdown")
    if json_out:
        raise ConfigError("--markdown and --json are two formats of --keys; pick one")
    if overrides:
        raise ConfigError(f"--markdown prints the schema's defaults and takes no recipe= or key=value; "
                          f"drop {overrides[0]}")
