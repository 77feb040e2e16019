"""Recipe checks of the optimizer levers that need more than one section (called by the recipe's validation)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_plugins.errors import OptionsError, RecipeError
from lightning_plugins.parallel.optim_in_backward import check_step_in_backward

__all__ = ["check_optim_levers"]


def check_optim_levers(recipe: Any, path: Path) -> None:
    """Refuse what ``memory.optimizer_in_backward`` cannot do with ``recipe`` (a resolved
    :class:`~lightning_plugins.recipe.schema.Recipe`).

    Raises:
        RecipeError: for gradient clipping, accumulation or ``train.on_nonfinite: skip`` with it.
    """
    if recipe.memory.optimizer_in_backward:
        try:
            check_step_in_backward(recipe.optim.max_grad_norm, recipe.accumulation, recipe.train.on_nonfinite)
        except OptionsError as err:
            raise RecipeError(f"{path}: memory.optimizer_in_backward: {err}") from None
