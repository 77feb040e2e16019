"""Run by tests/recipe/test_recipes.py: tiny twins of shipped recipes (``lightning_plugins.recipe.tiny``), one after another
in one launched world, so the world starts once for many recipes.

    python tests/scripts/smoke_recipes.py lightning TWIN.yaml ...     (the first Trainer starts the other ranks)
    accelerate launch --config_file CONFIG tests/scripts/smoke_recipes.py accelerate TWIN.yaml ...

Each twin trains as its recipe says and writes ``<train.output_dir>/<door>/metrics.csv``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning_plugins.testing.exit_report  # noqa: F401  (before any door: reports the process-group threads alive at exit)

from lightning_plugins.recipe.schema import load_recipe


def main(door: str, recipes: list[str]) -> None:
    for path in recipes:
        recipe = load_recipe(path)
        out = Path(recipe.train.output_dir) / door
        recipe = load_recipe(path, [f"train.output_dir={out}"])
        if door == "lightning":
            from lightning_plugins.strategies.runner import run_finetune

            run_finetune(recipe)
        else:
            from lightning_plugins.accelerate.runner import run_recipe

            run_recipe(recipe)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
