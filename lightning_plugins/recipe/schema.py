"""The recipe: one YAML file that says what to fine-tune, on what data, with which layout and settings.

Parsed by pydantic into typed sections. The ``layout``, ``parallel``, ``memory``, ``data``, ``lora`` and
``objective`` sections *are* the engine's own objects (:class:`~lightning_plugins.ParallelLayout`,
:class:`~lightning_plugins.ParallelOptions`, :class:`~lightning_plugins.MemoryOptions`,
:class:`~lightning_plugins.data.DataConfig`, :class:`~lightning_plugins.adapters.lora.LoraOptions`), so a setting
is defined once and reaches every door. Nothing here is Lightning- or Accelerate-specific.

Every problem is reported before any process starts, as one :class:`RecipeError` naming the file, the
key path and a fix: unknown keys (with the closest valid key), wrong types, missing files, a layout that does
not divide the world or the model, tensor parallelism on a family without a TP plan, a micro-batch that does not
divide the global batch. What depends on the machine the run starts on is checked by
:mod:`lightning_plugins.recipe.preflight`.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError

from lightning_plugins.adapters.lora import LoraOptions
from lightning_plugins.adapters.vision import VisionOptions
from lightning_plugins.data import DataConfig
from lightning_plugins.errors import RecipeError
from lightning_plugins.parallel.layout import ParallelLayout
from lightning_plugins.parallel.options import MemoryOptions, ParallelOptions
from lightning_plugins.preference.options import PreferenceOptions
from lightning_plugins.recipe.checks import check_recipe, resolve_paths
from lightning_plugins.recipe.sections import HardwareSection, ModelSection, OptimSection, Section
from lightning_plugins.recipe.train import TrainSection
from lightning_plugins.resources import find_recipe


class Recipe(Section):
    """A whole recipe. Build it with :func:`load_recipe`, which resolves paths and checks everything."""

    model: ModelSection
    data: DataConfig
    layout: ParallelLayout = ParallelLayout()
    parallel: ParallelOptions = Field(default_factory=ParallelOptions)
    memory: MemoryOptions = Field(default_factory=MemoryOptions)
    lora: LoraOptions | None = None
    vision: VisionOptions = Field(default_factory=VisionOptions)
    optim: OptimSection = Field(default_factory=OptimSection)
    train: TrainSection
    objective: PreferenceOptions = Field(default_factory=PreferenceOptions)
    hardware: HardwareSection = Field(default_factory=HardwareSection)

    @property
    def samples_per_step(self) -> int:
        """Rows per optimizer step over all data ranks."""
        if self.train.global_batch_size is not None:
            return self.train.global_batch_size
        return max(1, self.train.global_batch_tokens // self.data.max_seq_len)

    @property
    def accumulation(self) -> int:
        """Micro-batches each data rank accumulates per optimizer step."""
        return self.samples_per_step // (self.train.micro_batch_size * self.layout.dp_size)

    def to_yaml(self) -> str:
        """The resolved recipe as YAML (what ``--print-config`` shows)."""
        return yaml.safe_dump(json.loads(self.model_dump_json()), sort_keys=False)


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read, override, validate and resolve a recipe; check it against the model config and the world.

    Args:
        path: The YAML file, or a shipped recipe's id (``llama-3.1-8b/lora_1gpu``; ``lightning-plugins recipes``).
        overrides: Dotted ``key=value`` settings applied before validation (``lora.r=32``,
            ``train.max_steps=200``); values are parsed as YAML (``true``, ``1e-4``, ``[q_proj, v_proj]``).

    Raises:
        RecipeError: naming the file, the key path and a fix; nothing has started yet.
    """
    path = find_recipe(path)  # a file, or a shipped recipe's id
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise RecipeError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise RecipeError(
            f"{path}: a recipe is a mapping of sections (model, data, layout, ...), got {type(raw).__name__}."
        )
    for override in overrides:
        apply_override(raw, override, path)
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as err:
        raise RecipeError(_describe(err, path)) from None
    return check_recipe(resolve_paths(recipe, path), path)


def apply_override(raw: dict, override: str, path: Path) -> None:
    key, sep, value = override.partition("=")
    if not sep or not key:
        raise RecipeError(f"{path}: override {override!r} is not `section.key=value` (e.g. --lora.r=32).")
    *parents, leaf = key.strip().lstrip("-").split(".")
    node = raw
    for part in parents:
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise RecipeError(f"{path}: override {override!r}: `{part}` is not a section.")
        node = child
    try:
        node[leaf] = yaml.safe_load(value)
    except yaml.YAMLError as err:
        raise RecipeError(f"{path}: override {override!r}: the value is not valid YAML ({err}).") from None


def _describe(err: ValidationError, path: Path) -> str:
    lines = [f"{path}: {err.error_count()} problem(s) in the recipe:"]
    for problem in err.errors():
        key = ".".join(str(part) for part in problem["loc"]) or "(top level)"
        message = problem["msg"].removeprefix("Value error, ")
        if problem["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            message = f"unknown key; {_closest(problem['loc'])}"
        elif problem["type"] == "missing":
            message = "required key is missing"
        shown = problem.get("input")
        got = "" if problem["type"] == "missing" or isinstance(shown, dict) else f" (got {shown!r})"
        lines.append(f"  {key}: {message}{got}")
    return "\n".join(lines)


def _unwrap(annotation: Any) -> Any:
    """``LoraOptions | None`` -> ``LoraOptions``."""
    args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    return args[0] if len(args) == 1 else annotation


def _keys_of(section: Any) -> dict[str, Any]:
    """The keys a section (a pydantic model or a dataclass of the engine) takes, with their types."""
    if isinstance(section, type) and issubclass(section, BaseModel):
        return {name: _unwrap(field.annotation) for name, field in section.model_fields.items()}
    if dataclasses.is_dataclass(section):
        types = {field.name: _unwrap(field.type) for field in dataclasses.fields(section)}
        return {name: types.get(name) for name in inspect.signature(section).parameters if not name.startswith("_")}
    return {}


def _closest(loc: tuple[str | int, ...]) -> str:
    """How to fix an unknown key: the closest valid key of its section (difflib), else the section's keys."""
    section: Any = Recipe
    for part in loc[:-1]:
        section = _keys_of(section).get(str(part))
    valid = list(_keys_of(section))
    close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.6)
    if close:
        return f"did you mean `{close[0]}`?"
    where = ".".join(str(part) for part in loc[:-1]) or "the recipe"
    return f"remove it, or use one of the keys of {where}: {', '.join(valid)}"
