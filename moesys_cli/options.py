"""Options shared by several verbs, declared once."""

import difflib
from typing import Annotated, Any

import typer
import yaml

from moesys_cli.resolve import available_recipes
from runtime.config.keys import keys_meant
from runtime.errors import UserError

Overrides = Annotated[
    list[str] | None,
    typer.Argument(help="recipe=NAME and Hydra key=value overrides, e.g. recipe=gpt-moe-13b model.num_experts=16",
                   show_default=False),
]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]


def epilog(recipes: bool = True) -> str:
    """The end of a verb's --help: where every key is listed and, for verbs that take recipe=, which recipes exist."""
    text = "Every key with its type, default and meaning: moesys config --keys."
    if not recipes:
        return text
    try:
        names = ", ".join(available_recipes())
    except UserError as exc:
        names = str(exc)
    return f"{text}  Recipes: {names} (or recipe=FILE.yaml)."


def split_args(args: list[str], usage: str, plain: tuple[str, ...], sections: tuple[str, ...],
               aliases: dict[str, str] | None = None) -> tuple[dict[str, list[str]], dict[str, dict[str, Any]]]:
    """A verb's key=value arguments: the values of each `plain` key as given, in order (`aliases` renames a key
    first: infer.prompt is prompt), and SECTION.KEY=VALUE of each of `sections` as overrides[SECTION][KEY], the
    value a YAML scalar ('' is None; what is not YAML stays text). Anything else is a one-line UserError."""
    values: dict[str, list[str]] = {key: [] for key in plain}
    overrides: dict[str, dict[str, Any]] = {section: {} for section in sections}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep:
            raise UserError(f"argument {arg!r} is not key=value; {usage}")
        key = (aliases or {}).get(key, key)
        section, _, name = key.partition(".")
        if key in values:
            values[key].append(value)
        elif section in overrides and name and "." not in name:
            try:
                overrides[section][name] = yaml.safe_load(value) if value else None
            except yaml.YAMLError:
                overrides[section][name] = value
        else:
            meant = difflib.get_close_matches(key, plain, n=2) + ([] if "." in key else keys_meant(key, sections))
            meant = list(dict.fromkeys((aliases or {}).get(k, k) for k in meant))  # infer.prompt is prompt
            hint = f"did you mean {', '.join(meant)}? " if meant else ""
            raise UserError(f"unknown argument {key!r}; {hint}{usage}")
    return values, overrides


def train_keys(overrides: dict[str, Any], allowed: set[str], usage: str):
    """The `train.*` keys a verb takes (`overrides["train"]` from split_args), typed and checked by the config
    schema: the train section; a one-line UserError for any other train.* key."""
    from runtime.config import config_from_dict

    extra = sorted(set(overrides) - allowed)
    if extra:
        raise UserError(f"unknown argument 'train.{extra[0]}'; {usage}")
    return config_from_dict({"train": overrides}).train


def required(values: dict[str, list[str]], key: str, usage: str) -> str:
    """The last value given for `key` (as a later override wins); a one-line UserError when none (or '') was."""
    if not values.get(key) or not values[key][-1]:
        raise UserError(f"no {key} given; {usage}")
    return values[key][-1]
