"""Recipe checks of the levers that need more than one section (called by the recipe's validation)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_plugins.errors import OptionsError, RecipeError
from lightning_plugins.parallel.optim.optim_in_backward import check_step_in_backward

__all__ = ["check_levers"]


def check_levers(recipe: Any, path: Path) -> None:
    """Refuse what ``memory.optimizer_in_backward`` and ``parallel.float8`` cannot do with ``recipe`` (a resolved
    :class:`~lightning_plugins.recipe.schema.Recipe`).

    Raises:
        RecipeError: for gradient clipping, accumulation or ``train.on_nonfinite: skip`` with
            ``optimizer_in_backward``; for ``parallel.float8`` with ``lora.quantize: nf4`` (an NF4 base is no float8
            linear).
    """
    if recipe.parallel.float8 and recipe.lora is not None and recipe.lora.quantize == "nf4":
        from lightning_plugins.parallel.quantized import FLOAT8_WITH_NF4

        raise RecipeError(f"{path}: parallel.float8 with lora.quantize: nf4: {FLOAT8_WITH_NF4}")
    if recipe.memory.optimizer_in_backward:
        try:
            check_step_in_backward(recipe.optim.max_grad_norm, recipe.accumulation, recipe.train.on_nonfinite)
        except OptionsError as err:
            raise RecipeError(f"{path}: memory.optimizer_in_backward: {err}") from None
