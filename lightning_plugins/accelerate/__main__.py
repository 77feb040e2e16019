"""The Accelerate door's recipe runner.

``accelerate launch [--config_file accelerate_configs/X.yaml] -m lightning_plugins.accelerate RECIPE [--a.b=v ...]``

Also runs as ``python -m lightning_plugins.accelerate RECIPE`` (one process). The launch decides the world
(``hardware.devices`` / ``hardware.nodes`` of the recipe are replaced by it); the recipe decides the rest.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from datetime import timedelta

from torch.distributed.elastic.multiprocessing.errors import record


@record  # under torchrun (`accelerate launch`): the launcher's failure summary quotes this rank's exception
def main(argv: Sequence[str] | None = None) -> None:
    from lightning_plugins.recipe.launch import add_recipe_arguments

    parser = argparse.ArgumentParser(prog="python -m lightning_plugins.accelerate", description=__doc__)
    add_recipe_arguments(parser, "recipes/tiny/full_tp2.yaml")
    args, extra = parser.parse_known_args(argv)

    from lightning_plugins.accelerate.settings import describe_launch, launched_world
    from lightning_plugins.checkpoint import resume_choice
    from lightning_plugins.data import DataError
    from lightning_plugins.errors import (
        CheckpointError, LayoutError, NonFiniteError, OptionsError, RankFailure, RecipeError, RunLockError,
    )  # fmt: skip
    from lightning_plugins.recipe.launch import claim_run, load_run_recipe, say
    from lightning_plugins.run.faults import explain_timeout, is_collective_timeout, is_peer_gone

    local, nodes = launched_world()
    try:
        recipe = load_run_recipe(args, extra, parser, [f"hardware.devices={local}", f"hardware.nodes={nodes}"])
    except RecipeError as err:
        _fail(f"{err}\n(under accelerate launch the world is the one started by {describe_launch()}; it replaces the"
              " recipe's hardware.devices x hardware.nodes)")  # fmt: skip
    except CheckpointError as err:
        _fail(str(err))
    if args.print_config:
        print(recipe.to_yaml(), end="")
        return
    first = _rank() == 0
    said = say if first else None
    try:
        # One run per output directory (torchrun stops the others). Every rank checks the recipe against what it
        # finds; the run follows rank 0's choice and reading (run_recipe).
        recipe, resume, lock = claim_run(
            recipe, args.recipe, args.resume, take_lock=first, say=said,
            decide=lambda: resume_choice.latest_checkpoint(recipe.train.output_dir, said),
        )  # fmt: skip
    except (RecipeError, CheckpointError, RunLockError) as err:
        _fail(str(err))
    from lightning_plugins.accelerate.runner import run_recipe  # (after the checks: it imports the training stack)

    try:
        result = run_recipe(recipe, resume=resume)
    except (LayoutError, OptionsError, DataError) as err:  # every rank reads the same data: all stop here
        _fail(f"{args.recipe}: {err}")
    except NonFiniteError as err:  # every rank stops alike
        _fail(str(err))
    except Exception as err:
        if is_peer_gone(err):  # another rank ended first: torchrun (watching every 0.1 s) must name it, not this one
            time.sleep(_HEAD_START_S)
            raise
        if not is_collective_timeout(err):
            raise
        timeout = timedelta(seconds=recipe.train.collective_timeout_s)
        raise RankFailure(explain_timeout(_rank(), err, timeout)) from err
    finally:
        if lock is not None:
            lock.release()
    if result:
        print("\n".join(f"{key}: {value}" for key, value in result.items()))


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _fail(message: str) -> None:
    """Exit with ``message`` said once (every rank fails the same way, before any collective).

    The other ranks give rank 0 a head start: torchrun ends every worker as soon as one fails, and would otherwise
    often end rank 0 before it said why."""
    if _rank() == 0:
        print(f"error: {message}", file=sys.stderr)
    else:
        time.sleep(_HEAD_START_S)
    sys.exit(1)


#: How long a rank that need not be the one to explain a failure waits before it exits (torchrun ends it first): the
#: other ranks in :func:`_fail`, a rank whose peer ended first.
_HEAD_START_S = 5.0


if __name__ == "__main__":
    main()
