"""runtime/train/lr_width.py: a recipe's lr on a model many times wider than the recipe's is flagged, with the lr
the 1/width rule gives; the recipe at its own width, or an lr the user chose, is not."""

from __future__ import annotations

import pytest

from runtime.train.lr_width import WIDER, lr_width_warning


def test_the_recipes_lr_on_a_16x_wider_model_is_flagged_with_a_scaled_lr():
    warning = lr_width_warning(3e-3, 2048, "tiny", 3e-3, 128)
    assert warning is not None and "\n" not in warning
    assert warning.startswith("train.lr=0.003 is recipe tiny's, tuned at model.hidden_size=128; at 2048 (16x wider)")
    assert "train.lr=0.00019" in warning


@pytest.mark.parametrize("lr,hidden", [(3e-3, 128), (3e-3, 128 * WIDER - 1), (1e-4, 2048)])
def test_its_own_width_a_little_wider_or_a_chosen_lr_is_not(lr, hidden):
    assert lr_width_warning(lr, hidden, "tiny", 3e-3, 128) is None
