"""Options shared by several verbs, declared once."""

from typing import Annotated, List, Optional

import typer

from moesys_cli.resolve import available_recipes
from runtime.errors import UserError

Overrides = Annotated[
    Optional[List[str]],
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
