"""Options shared by several verbs, declared once."""

from typing import Annotated, List, Optional

import typer

Overrides = Annotated[
    Optional[List[str]],
    typer.Argument(help="recipe=NAME and Hydra key=value overrides, e.g. recipe=gpt-moe-13b model.num_experts=16",
                   show_default=False),
]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]
