"""A recipe's learning rate is tuned at the recipe's width; with Adam the stable peak lr falls roughly as 1/width
(muP's rule for hidden weights), so a recipe's lr on a much wider model tends to diverge. This says so."""

from __future__ import annotations

WIDER = 4
"""How many times the recipe's model.hidden_size a model must be before its unchanged lr is flagged."""


def lr_width_warning(lr: float, hidden: int, recipe: str, recipe_lr: float, recipe_hidden: int) -> str | None:
    """One line when `lr` is the recipe's own and the model is WIDER or more times the recipe's width; else None."""
    if lr != recipe_lr or recipe_hidden <= 0 or hidden < WIDER * recipe_hidden:
        return None
    scaled = lr * recipe_hidden / hidden
    return (f"train.lr={lr:g} is recipe {recipe}'s, tuned at model.hidden_size={recipe_hidden}; at {hidden} "
            f"({hidden / recipe_hidden:g}x wider) it is likely to diverge: set train.lr, e.g. train.lr={scaled:.2g} "
            f"(the recipe's lr x {recipe_hidden}/{hidden}: with Adam the stable lr falls as the model widens)")
