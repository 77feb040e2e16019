"""Run a recipe through either door with one rank made slow on purpose (tests only).

    python tests/scripts/slow_run.py finetune RECIPE [--a.b=v ...]          (Lightning re-runs it once per rank)
    accelerate launch [...] tests/scripts/slow_run.py accelerate RECIPE [--a.b=v ...]

``LIGHTNING_PLUGINS_TEST_SLOW`` lists what is slowed, comma-separated (installed here by patching; the library
holds none):

    forward:RANK:SECONDS    RANK sleeps before every training forward (a straggler: its peers wait in collectives)
    data:RANK:SECONDS       RANK's training collator sleeps for every batch (a data stall)
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from _door import run_door, runner_of  # tests/scripts is on sys.path (the script's own folder)

ENV = "LIGHTNING_PLUGINS_TEST_SLOW"


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def _slow_forward(runner: Any, seconds: float) -> None:
    build = runner.build_model

    def build_model(*args: Any, **kwargs: Any) -> Any:
        model, tokenizer = build(*args, **kwargs)

        def pre_hook(module: Any, args: Any) -> None:
            if module.training:
                time.sleep(seconds)

        model.register_forward_pre_hook(pre_hook)
        return model, tokenizer

    runner.build_model = build_model


def _slow_data(seconds: float) -> None:
    import lightning_plugins.data as data

    make = data.make_collator

    def make_collator(*args: Any, **kwargs: Any) -> Any:
        collate = make(*args, **kwargs)

        def slow(rows: Any) -> Any:
            time.sleep(seconds)
            return collate(rows)

        return slow

    data.make_collator = make_collator


def main() -> None:
    door, *argv = sys.argv[1:]
    runner = runner_of(door)
    for spec in filter(None, os.environ.get(ENV, "").split(",")):
        kind, rank, seconds = spec.split(":")
        if int(rank) != _rank():
            continue
        if kind == "forward":
            _slow_forward(runner, float(seconds))
        elif kind == "data":
            _slow_data(float(seconds))
        else:
            raise ValueError(f"{ENV}={spec!r}: expected forward:RANK:SECONDS or data:RANK:SECONDS")
    run_door(door, argv)


if __name__ == "__main__":
    main()
