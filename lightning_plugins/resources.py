"""Where the shipped files are: the recipes, the tiny model and data, the real models' configs, the Slurm batch files
and the Accelerate configs, the same in a clone and in an installed wheel.

In the repository they live at the top (``recipes/``, ``accelerate_configs/``); the wheel carries them as package data
(``pyproject.toml`` maps them into ``lightning_plugins/recipes`` and ``lightning_plugins/accelerate_configs``), found
here through :mod:`importlib.resources`. This is the one module that knows either place: everything else asks it.

A shipped recipe has an id, ``<model>/<name>`` (``llama-3.1-8b/lora_1gpu``, ``tiny/lora_tp2``): the commands take an
id or a path (:func:`find_recipe`), and ``lightning-plugins recipes`` lists the ids (:func:`recipe_ids`).
"""

from __future__ import annotations

import difflib
from importlib.resources import files
from pathlib import Path

from lightning_plugins.errors import RecipeError

__all__ = [
    "accelerate_configs_dir",
    "find_recipe",
    "model_configs_dir",
    "recipe_ids",
    "recipes_dir",
    "slurm_dir",
    "tiny_dir",
]


def _shipped(name: str) -> Path:
    """``name`` as package data (an installed wheel), else at the top of the clone this package runs from."""
    installed = files("lightning_plugins") / name
    if isinstance(installed, Path) and installed.is_dir():
        return installed
    return Path(__file__).resolve().parents[1] / name


def recipes_dir() -> Path:
    """The shipped recipes: ``<model>/<name>.yaml``, with ``configs/``, ``slurm/`` and ``tiny/``."""
    return _shipped("recipes")


def tiny_dir() -> Path:
    """The tiny default: its model, data and recipes."""
    return recipes_dir() / "tiny"


def model_configs_dir() -> Path:
    """The real models' ``config.json`` files, one directory per model (``Llama-3.1-8B/config.json``)."""
    return recipes_dir() / "configs"


def slurm_dir() -> Path:
    """The Slurm batch files (``lightning.sbatch``, ``accelerate.sbatch``)."""
    return recipes_dir() / "slurm"


def accelerate_configs_dir() -> Path:
    """The ``accelerate launch --config_file`` configs (CPU worlds, 1-32 nodes of 8 GPUs, DeepSpeed, FSDP2 offload)."""
    return _shipped("accelerate_configs")


def recipe_ids() -> list[str]:
    """Every shipped recipe's id, ``<model>/<name>``, sorted (the tiny ones included: ``tiny/lora_tp2``)."""
    root = recipes_dir()
    return sorted(f"{p.parent.name}/{p.stem}" for p in root.glob("*/*.yaml"))


def find_recipe(name: str | Path) -> Path:
    """The recipe file ``name`` names: a path to a file, else a shipped recipe's id (``llama-3.1-8b/lora_1gpu``,
    ``.yaml`` optional, a leading ``recipes/`` too).

    Raises:
        RecipeError: Neither: naming the nearest shipped ids and ``lightning-plugins recipes``.
    """
    path = Path(name).expanduser()
    if path.is_file():
        return path
    text = str(name).strip()
    key = text.removeprefix("recipes/").removesuffix(".yaml").removesuffix(".yml")
    ids = recipe_ids()
    if key in ids:
        return recipes_dir() / f"{key}.yaml"
    if path.is_dir():
        raise RecipeError(f"{name}: a directory, not a recipe file. Give a recipe's YAML file or a shipped recipe's id.")
    near = difflib.get_close_matches(key, ids, n=3, cutoff=0.5)
    if not near:  # the model's own recipes, when the model is right and the name is not
        near = [i for i in ids if i.split("/")[0] == key.split("/")[0]][:5]
    hint = f" Did you mean {', '.join(near)}?" if near else ""
    raise RecipeError(
        f"{name}: no such recipe file, and no shipped recipe has that id.{hint}"
        " `lightning-plugins recipes` lists the shipped ids."
    )
