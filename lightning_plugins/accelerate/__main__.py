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
    from lightning_plugins.cli import _overrides
    from lightning_plugins.recipe.diff import add_reset_argument, check_resume, reset_overrides

    parser = argparse.ArgumentParser(prog="python -m lightning_plugins.accelerate", description=__doc__)
    parser.add_argument("recipe", help="the recipe file, e.g. recipes/tiny/full_tp2.yaml")
    parser.add_argument("--print-config", action="store_true", help="print the resolved recipe and exit")
    parser.add_argument(
        "--resume", default=None, help="a checkpoint to resume from (default: the latest in the output directory)"
    )
    add_reset_argument(parser)
    args, extra = parser.parse_known_args(argv)

    from lightning_plugins.accelerate.settings import describe_launch, launched_world
    from lightning_plugins.checkpoint.checks import check_resume_path
    from lightning_plugins.errors import CheckpointError
    from lightning_plugins.data import DataError
    from lightning_plugins.run.faults import explain_timeout, is_collective_timeout, is_peer_gone
    from lightning_plugins.errors import RankFailure
    from lightning_plugins.errors import LayoutError, OptionsError
    from lightning_plugins.errors import NonFiniteError
    from lightning_plugins.recipe.preflight import check_here
    from lightning_plugins.recipe.schema import load_recipe
    from lightning_plugins.errors import RecipeError
    from lightning_plugins.run.lock import take_run_lock
    from lightning_plugins.errors import RunLockError
    from lightning_plugins.recipe.build import latest_checkpoint

    local, nodes = launched_world()
    try:
        world = [f"hardware.devices={local}", f"hardware.nodes={nodes}"]
        recipe = load_recipe(args.recipe, [*_overrides(extra, parser), *reset_overrides(args), *world])
    except RecipeError as err:
        _fail(f"{err}\n(under accelerate launch the world is the one started by {describe_launch()}; it replaces the"
              " recipe's hardware.devices x hardware.nodes)")  # fmt: skip
    if args.print_config:
        print(recipe.to_yaml(), end="")
        return
    first = _rank() == 0
    lock = None
    try:
        check_here(recipe, args.recipe)
        if args.resume is not None:
            check_resume_path(args.resume)
        if first:  # one run per output directory (torchrun stops the others)
            lock = take_run_lock(recipe.train.output_dir)
        say = _say if first else None
        # Every rank checks the recipe against what it finds; the run follows rank 0's choice and reading (run_recipe).
        resume = args.resume or latest_checkpoint(recipe.train.output_dir, say)
        recipe = check_resume(recipe, resume, say)
    except (RecipeError, CheckpointError, RunLockError) as err:
        if lock is not None:  # now: the caller may go on (a test, a notebook)
            lock.release()
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


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


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
