"""Resuming with a changed recipe: each difference from the checkpoint's recipe is applied on purpose or refused.

Both doors record the resolved recipe in every checkpoint (:data:`RECIPE_FILE`, written by rank 0 with the other
metadata, so ``checksums.json`` covers it). Before a resume loads anything, :func:`check_resume` compares that record
with the recipe of this run, key by key, and :data:`RULES` (the one table) says what each difference is:

* ``applied``: the run goes on with the new value, one line each on rank 0 (``resuming step=4 with train.max_steps
  6 -> 10``): length, cadence, layout and world (the checkpoint reshards), memory levers, timeouts, outputs.
* ``refused``: another model, other samples, other adapters or another arithmetic would continue weights that were
  trained on something else: a :class:`ResumeMismatch` names each key, its old and new value and how to start fresh.
* ``optimizer``: the ``optim`` settings the checkpoint's AdamW state and schedule were built from. Refused unless the
  run asks for ``train.resume_reset_optimizer`` (the doors' ``--resume-reset-optimizer``): then the weights, the step
  and the data position are loaded and AdamW's state and the schedule are rebuilt from the new settings, the schedule
  positioned at the resumed step (:func:`reset_optimizer`).

A checkpoint written before recipes were recorded resumes as it always did, with one line saying so.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml

from lightning_plugins.adapters.vision import VisionOptions
from lightning_plugins.recipe.schema import Recipe
from lightning_plugins.errors import RecipeError
from lightning_plugins.errors import ResumeMismatch

if TYPE_CHECKING:
    import torch

#: The resolved recipe a checkpoint was written under, inside the checkpoint directory.
RECIPE_FILE = "recipe.yaml"
#: The door flag that maps onto ``train.resume_reset_optimizer``.
RESET_FLAG = "--resume-reset-optimizer"

Kind = Literal["applied", "refused", "optimizer", "control"]

#: What a difference at a key means on resume: the most specific entry (a key or a section) wins, with why.
RULES: dict[str, tuple[Kind, str]] = {
    "model": ("refused", "the checkpoint holds the weights of the model it names"),
    "model.dtype": ("refused", "the checkpoint was trained in the arithmetic this setting chose"),
    "model.attn_implementation": ("applied", ""),
    "model.trust_remote_code": ("applied", ""),
    "data": ("refused", "the checkpoint's data position counts the samples this setting chose"),
    "data.eval": ("applied", ""),
    "data.truncation": ("applied", ""),  # a check of the samples, not a choice of them
    "layout": ("applied", ""),
    "parallel": ("applied", ""),
    "memory": ("applied", ""),
    "memory.param_dtype": ("refused", "the checkpoint was trained in the arithmetic this setting chose"),
    "memory.reduce_dtype": ("refused", "the checkpoint was trained in the arithmetic this setting chose"),
    "lora": ("refused", "the checkpoint holds the adapters these settings built"),
    "optim": ("optimizer", "the checkpoint's AdamW state and schedule were built from it"),
    "train": ("applied", ""),
    "train.global_batch_size": ("refused", "the checkpoint's steps and data position count batches of this size"),
    "train.global_batch_tokens": ("refused", "the checkpoint's steps and data position count batches of this size"),
    "train.seed": ("refused", "the checkpoint's data order and initial weights came from this seed"),
    "train.resume_reset_optimizer": ("control", ""),
    "hardware": ("applied", ""),
    "objective": ("refused", "the checkpoint was trained toward this objective"),
    "vision": ("refused", "the checkpoint's weights and optimizer state hold the parts these settings trained"),
    "vision.images_per_sample": ("applied", ""),  # the planner's assumption, not the run's
    "vision.image_size": ("applied", ""),
}


@dataclass(frozen=True)
class Change:
    """One key whose value differs between the checkpoint's recipe and this run's.

    Attributes:
        key: The dotted key path (``optim.lr``).
        old: The checkpoint's value (``None``: absent).
        new: This run's value.
        kind: What :data:`RULES` says of it.
        why: Why a refused (or optimizer) key cannot simply change.
    """

    key: str
    old: Any
    new: Any
    kind: Kind
    why: str

    def describe(self) -> str:
        return f"{self.key} {_show(self.old)} -> {_show(self.new)}"


def rule_for(key: str) -> tuple[Kind, str]:
    """The :data:`RULES` entry of ``key``: its own, else its closest enclosing section's."""
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        rule = RULES.get(".".join(parts[:end]))
        if rule is not None:
            return rule
    return "refused", "this run does not know whether it can change on resume"


def diff_recipes(old: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    """The keys whose values differ between two recipes (as :meth:`Recipe.to_yaml` writes them), classified."""
    changes = []
    objective = new.get("objective")
    if "objective" not in old and isinstance(objective, dict) and objective.get("method", "sft") == "sft":
        old = {**old, "objective": objective}  # a recipe from before the section trained SFT
    if "vision" not in old and new.get("vision") == asdict(VisionOptions()):
        old = {**old, "vision": new["vision"]}  # a recipe from before the section trained as its defaults say
    for key, before, after in _differences(old, new):
        kind, why = rule_for(key)
        if kind != "control":
            changes.append(Change(key, before, after, kind, why))
    return changes


def add_reset_argument(parser: argparse.ArgumentParser) -> None:
    """A door's :data:`RESET_FLAG` (read back by :func:`reset_overrides`)."""
    parser.add_argument(
        RESET_FLAG,
        action="store_true",
        help="resume with changed optim settings: load the weights, step and data position, rebuild AdamW's state and"
        " the schedule from the new settings (train.resume_reset_optimizer=true)",
    )


def reset_overrides(args: argparse.Namespace) -> list[str]:
    """The recipe override :data:`RESET_FLAG` stands for (none when it is not given)."""
    return ["train.resume_reset_optimizer=true"] if args.resume_reset_optimizer else []


def record_recipe(directory: str | Path, recipe: str) -> None:
    """Write the resolved recipe (``Recipe.to_yaml()``) into a checkpoint being written (one rank calls it)."""
    (Path(directory) / RECIPE_FILE).write_text(recipe)


def recorded_recipe(checkpoint: str | Path) -> dict[str, Any] | None:
    """The recipe recorded in ``checkpoint``, or ``None`` when it was written before recipes were recorded."""
    path = Path(checkpoint) / RECIPE_FILE
    return yaml.safe_load(path.read_text()) if path.is_file() else None


def check_resume(
    recipe: Recipe, checkpoint: str | Path | None, say: Callable[[str], None] | None = None
) -> Recipe:
    """Compare the recipe recorded in the checkpoint this run resumes from with ``recipe`` (a door's preflight).

    Args:
        recipe: This run's recipe.
        checkpoint: The checkpoint the run resumes from (``--resume``, or the latest in ``train.output_dir``);
            ``None``: a fresh start.
        say: Rank 0's printer for the differences applied (``None``: say nothing).

    Returns:
        The recipe to run: ``train.resume_reset_optimizer`` stays on only when this resume has ``optim`` changes to
        apply (a requeued job that keeps the flag then resumes its own later checkpoints exactly).

    Raises:
        ResumeMismatch: naming each refused key, its old and new value, and how to start fresh; ``optim`` changes
            without ``train.resume_reset_optimizer``, naming the keys and :data:`RESET_FLAG`.
    """
    reset = recipe.train.resume_reset_optimizer
    if checkpoint is None:
        return _with_reset(recipe, False)
    checkpoint = Path(checkpoint)
    name = checkpoint.name.removesuffix(".ckpt")
    old = recorded_recipe(checkpoint)
    if old is None:
        if say is not None:
            say(f"resuming {name}: {checkpoint} records no recipe (written by an older version), so nothing can be"
                " compared with this run's.")  # fmt: skip
        return _with_reset(recipe, False)
    changes = diff_recipes(old, yaml.safe_load(recipe.to_yaml()))
    refused = [c for c in changes if c.kind == "refused"]
    optimizer = [c for c in changes if c.kind == "optimizer"]
    if refused or (optimizer and not reset):
        explicit = checkpoint.parent.resolve() != (Path(recipe.train.output_dir) / "checkpoints").resolve()
        raise ResumeMismatch(_refusal(checkpoint, explicit, refused, optimizer, reset))
    if say is not None:
        for change in changes:
            say(f"resuming {name} with {change.describe()}")
        if optimizer:
            say(f"resuming {name} with a new AdamW state and schedule ({RESET_FLAG}), positioned at {name}")
        elif reset:
            say(f"resuming {name}: {RESET_FLAG} has nothing to reset (optim is the checkpoint's); AdamW's state is kept")
    return _with_reset(recipe, bool(optimizer))


def reset_optimizer(
    optimizer: torch.optim.Optimizer, schedule: Any, model: torch.nn.Module, recipe: Recipe, total: int, step: int
) -> dict[str, Any]:
    """Give a resumed ``optimizer`` and ``schedule`` the state a fresh AdamW and schedule of ``recipe`` would have, the
    schedule positioned at ``step`` (what ``train.resume_reset_optimizer`` does after the weights are loaded).

    Args:
        optimizer: The door's optimizer, its checkpoint state loaded (replaced here).
        schedule: The door's schedule of ``optimizer``.
        model: The model ``optimizer`` trains (only the number of its trainable parameters matters).
        recipe: This run's recipe, whose ``optim`` settings are used.
        total: The optimizer steps of the whole run.
        step: The optimizer steps already taken (the resumed checkpoint's).

    Returns:
        The schedule's new state (what a door that restores the schedule later must restore instead).
    """
    from lightning_plugins.recipe.build import make_optimizer

    # Only the groups of a fresh one are read: a plain AdamW has the same (an offloaded one would copy the weights).
    memory = replace(recipe.memory, optimizer_offload=False)
    fresh, fresh_schedule = make_optimizer(model, recipe.model_copy(update={"memory": memory}), total)
    fresh_schedule.last_epoch = step
    rates = [base * rate(step) for base, rate in zip(fresh_schedule.base_lrs, fresh_schedule.lr_lambdas)]
    for group, rate in zip(fresh.param_groups, rates):
        group["lr"] = rate
    fresh_schedule._last_lr = rates
    optimizer.load_state_dict(fresh.state_dict())  # no per-parameter state: AdamW starts over
    state = fresh_schedule.state_dict()
    schedule.load_state_dict(state)
    return state


def _with_reset(recipe: Recipe, reset: bool) -> Recipe:
    if recipe.train.resume_reset_optimizer == reset:
        return recipe
    return recipe.model_copy(update={"train": recipe.train.model_copy(update={"resume_reset_optimizer": reset})})


def _refusal(
    checkpoint: Path, explicit: bool, refused: list[Change], optimizer: list[Change], reset: bool
) -> str:
    lines = [f"cannot resume {checkpoint}: this run's recipe differs from the one it was written under"
             f" ({checkpoint / RECIPE_FILE}):"]  # fmt: skip
    lines += [f"  {c.describe()}: {c.why}" for c in refused]
    if optimizer and not reset:
        lines += [f"  {c.describe()}: {c.why}" for c in optimizer]
    if refused:
        fresh = (
            "drop --resume (with a train.output_dir that holds no checkpoints)"
            if explicit
            else f"give another train.output_dir (or move {checkpoint.parent} away)"
        )
        lines.append(
            f"To start fresh with the new settings, {fresh}; to continue this checkpoint's run, put the recorded values"
            " back."
        )
    if optimizer and not reset:
        keys = ", ".join(c.key for c in optimizer)
        lines.append(
            f"To resume with the new {keys}, pass {RESET_FLAG}: the weights, step and data position are loaded and"
            " AdamW's state and the schedule are rebuilt from the new settings; or put the recorded values back."
        )
    return "\n".join(lines)


def _differences(old: Any, new: Any, prefix: str = "") -> Iterator[tuple[str, Any, Any]]:
    """``(dotted key, old, new)`` of every leaf that differs; a section present on one side only (``lora: null``) is
    one difference of its own."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(old.keys() | new.keys()):
            yield from _differences(old.get(key), new.get(key), f"{prefix}.{key}" if prefix else str(key))
    elif old != new:
        yield prefix, old, new


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (str, dict, list)) else str(value)
