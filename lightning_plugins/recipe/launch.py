"""What both doors' command lines do before training: read the recipe with its overrides, then claim the run.

The Lightning door (``lightning-plugins finetune``, :mod:`lightning_plugins.cli`) and the Accelerate door
(``accelerate launch -m lightning_plugins.accelerate``, :mod:`lightning_plugins.accelerate.__main__`) take the same
arguments (:func:`add_recipe_arguments`), read the recipe the same way (:func:`load_run_recipe`) and claim the
output directory the same way (:func:`claim_run`: the recipe checked against this machine, the run lock, the resume
decision and the recipe-diff check). Only how a door decides the resume (once per job) and how it fails differ.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from lightning_plugins.recipe.schema import Recipe
from lightning_plugins.run.lock import RunLock


def say(line: str) -> None:
    """A door's printer for what a run decides on its own (checkpoints skipped, recipe changes applied): stderr."""
    print(line, file=sys.stderr, flush=True)


def recipe_overrides(extra: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``--section.key=value`` or ``--section.key value`` arguments as ``section.key=value`` strings.

    Args:
        extra: The arguments ``parser`` did not know (``parse_known_args``).
        parser: Reports a malformed override (exit 2, naming it and the form expected).
    """
    overrides, rest = [], list(extra)
    while rest:
        arg = rest.pop(0)
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            parser.error(
                f"unrecognized argument {arg!r}: recipe overrides look like --section.key=value (e.g. --lora.r=32)"
            )
        if "=" in arg:
            overrides.append(arg[2:])
        elif rest:
            overrides.append(f"{arg[2:]}={rest.pop(0)}")
        else:
            parser.error(f"{arg} needs a value (e.g. {arg}=VALUE)")
    return overrides


def add_recipe_arguments(parser: argparse.ArgumentParser, example: str) -> None:
    """The arguments of a door that runs a recipe: the file, ``--print-config``, ``--resume`` and the reset flag.

    Args:
        parser: The door's parser (or sub-command parser).
        example: A recipe the help names (a shipped id, or a path relative to the repository).
    """
    from lightning_plugins.recipe.diff import add_reset_argument

    parser.add_argument("recipe", help=f"the recipe: a YAML file or a shipped recipe's id, e.g. {example}")
    parser.add_argument("--print-config", action="store_true", help="print the resolved recipe and exit")
    parser.add_argument(
        "--resume", default=None, help="a checkpoint to resume from (default: the latest in the output directory)"
    )
    add_reset_argument(parser)


def load_run_recipe(
    args: argparse.Namespace, extra: list[str], parser: argparse.ArgumentParser, forced: Sequence[str] = ()
) -> Recipe:
    """The recipe ``args.recipe`` with the command line's overrides, then ``forced`` (what the launch decides).

    Raises:
        RecipeError: The recipe or an override is invalid.
        CheckpointError: ``--resume`` names no usable checkpoint.
    """
    from lightning_plugins.checkpoint.checks import check_resume_path
    from lightning_plugins.recipe.diff import reset_overrides
    from lightning_plugins.recipe.schema import load_recipe

    recipe = load_recipe(args.recipe, [*recipe_overrides(extra, parser), *reset_overrides(args), *forced])
    if args.resume is not None:
        check_resume_path(args.resume)
    return recipe


def claim_run(
    recipe: Recipe,
    recipe_path: str | Path,
    resume: str | Path | None,
    *,
    take_lock: bool,
    decide: Callable[[], Path | None],
    say: Callable[[str], None] | None,
) -> tuple[Recipe, str | Path | None, RunLock | None]:
    """Check the recipe here, take the run lock, decide the resume and check the recipe against the checkpoint's.

    Args:
        recipe: The run's recipe (:func:`load_run_recipe`).
        recipe_path: Its file (named in the errors).
        resume: ``--resume`` (``None``: ``decide``).
        take_lock: Whether this process takes the output directory's run lock (the job's first process only).
        decide: The door's resume decision when ``--resume`` is not given (once per job, see
            :mod:`lightning_plugins.checkpoint.resume_choice`).
        say: The printer of this process (``None``: a process that says nothing).

    Returns:
        The recipe to run (:func:`~lightning_plugins.recipe.diff.check_resume`), the checkpoint to resume from
        (``None``: a fresh start) and the lock held (release it when the run ends).

    Raises:
        RecipeError: The recipe does not fit here, or differs from the checkpoint's where it must not.
        RunLockError: Another run holds the output directory.
        CheckpointError: The checkpoint cannot be read.
    """
    from lightning_plugins.recipe.diff import check_resume
    from lightning_plugins.recipe.preflight import check_here
    from lightning_plugins.run.lock import take_run_lock

    lock = None
    try:
        check_here(recipe, recipe_path)
        if take_lock:  # one run per output directory
            lock = take_run_lock(recipe.train.output_dir)
        resume = resume or decide()
        recipe = check_resume(recipe, resume, say)
    except BaseException:
        if lock is not None:  # now: the caller may go on (a test, a notebook)
            lock.release()
        raise
    return recipe, resume, lock
