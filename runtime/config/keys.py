"""Every config key of the schema (runtime/config/schema.py) as a dotted name with its type, default and docstring,
and the config reference page (docs/config.md) drawn from them.

The docstrings are the attribute docstrings under each dataclass field, read from the source with ast.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import itertools
import textwrap
import types
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any

from runtime.config import MoesysConfig, choices


@dataclass(frozen=True)
class ConfigKey:
    key: str
    """Dotted name, as given on the command line (tasks.NAME.* for each task of a multi-task recipe)."""
    type: str
    """int, float, str, bool, list[int], `| null` when it may be null, a|b|c for a fixed set of values."""
    default: Any
    """The schema's default (conf/ and recipes may set another value: `moesys config recipe=NAME`)."""
    doc: str
    """The field's docstring, on one line."""


@cache
def attribute_docs(cls: type) -> dict[str, str]:
    """{field: docstring} from the string literal under each annotated field of a class; {} without source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, after in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def type_name(tp: Any) -> str:
    """int, str | null, list[int] | null, a|b|c for a field typed with a Literal ..."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        allowed = choices(tp)
        return "|".join(allowed) if allowed else type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        inner = [type_name(a) for a in args if a is not type(None)]
        return " | ".join(inner + (["null"] if type(None) in args else []))
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_name(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp))


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def config_keys(cls: type = MoesysConfig, prefix: str = "") -> list[ConfigKey]:
    """The leaf keys of a schema dataclass, in declaration order; a dict of dataclasses (tasks) as NAME."""
    hints = typing.get_type_hints(cls, include_extras=True)
    docs = {k: v for base in reversed(cls.__mro__) for k, v in attribute_docs(base).items()}  # a section's bases too
    keys: list[ConfigKey] = []
    for f in dataclasses.fields(cls):
        tp, dotted = hints[f.name], f"{prefix}{f.name}"
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            keys += config_keys(tp, f"{dotted}.")
        elif typing.get_origin(tp) is dict and dataclasses.is_dataclass(typing.get_args(tp)[1]):
            keys += config_keys(typing.get_args(tp)[1], f"{dotted}.NAME.")
        else:
            keys.append(ConfigKey(dotted, type_name(tp), _default(f), docs.get(f.name, "")))
    return keys


def value_text(value: Any) -> str:
    """A config value as it is written on the command line: null, true/false, '' for the empty string."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if value == "":
        return "''"
    return str(value)


REFERENCE_HEAD = """# Configuration reference

Every key of the configuration schema, by section: its type, the schema's default and what it does. The recipes and
conf/ set other values for some keys; `moesys config recipe=NAME [key=value ...]` prints the values a verb would run
with, and `moesys config --keys` adds them beside these defaults. Set any key on the command line as `key=value`.

This page is generated from the schema by `moesys config --keys --markdown > docs/config.md`; a test fails when it
is not current.
"""


def _cell(text: str) -> str:
    """Text in a Markdown table cell: a pipe escaped (it would end the cell), an asterisk escaped (emphasis)."""
    return text.replace("|", "\\|").replace("*", "\\*")


def _section_doc(cls: type, name: str) -> str:
    """The first paragraph of the docstring of the schema section `name`, on one line."""
    hints = typing.get_type_hints(cls, include_extras=True)
    tp = hints.get(name)
    if typing.get_origin(tp) is dict:
        tp = typing.get_args(tp)[1]
    doc = inspect.getdoc(tp) if dataclasses.is_dataclass(tp) else None
    return " ".join((doc or "").split("\n\n")[0].split())


def keys_markdown(cls: type = MoesysConfig) -> str:
    """The config reference as Markdown: one table per section (key, type, default, what it does), in schema
    order, the top-level keys last. Schema defaults only, so the page depends on nothing but the schema."""
    sections: dict[str, list[ConfigKey]] = {}
    for key in config_keys(cls):
        head, dot, _ = key.key.partition(".")
        sections.setdefault(head if dot else "", []).append(key)
    top = sections.pop("", [])
    parts = [REFERENCE_HEAD]
    for name, keys in [*sections.items(), *([("", top)] if top else [])]:
        title = f"`{name}`" if name else "Top level"
        doc = _section_doc(cls, name) if name else "Keys outside any section."
        rows = [f"| `{k.key}` | {_cell(k.type)} | `{_cell(value_text(k.default))}` | {_cell(k.doc)} |" for k in keys]
        parts.append("\n".join([f"## {title}", "", doc, "", "| key | type | default | what it does |",
                                 "| --- | --- | --- | --- |", *rows, ""]))
    return "\n".join(parts)


def keys_meant(name: str, sections: tuple[str, ...] | None = None) -> list[str]:
    """The dotted keys a key given without its section most likely meant (`max_steps`: train.max_steps), among the
    keys of `sections` (all when None): those whose last part is `name`, else those whose last part is closest in
    spelling; at most three."""
    keys = [k.key for k in config_keys() if sections is None or k.key.split(".")[0] in sections]
    exact = [k for k in keys if k.rpartition(".")[2] == name]
    if exact:
        return exact[:3]
    close = difflib.get_close_matches(name, sorted({k.rpartition(".")[2] for k in keys}), n=3)
    return [k for c in close for k in keys if k.rpartition(".")[2] == c][:3]
