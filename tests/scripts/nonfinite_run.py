"""Run a recipe through either door with a non-finite loss injected, or with one optimizer step not taken (tests only).

    python tests/scripts/nonfinite_run.py finetune RECIPE [--a.b=v ...]          (Lightning re-runs it once per rank)
    accelerate launch [...] tests/scripts/nonfinite_run.py accelerate RECIPE [--a.b=v ...]

The hooks are installed here, by patching the runner's ``build_model`` and ``make_optimizer`` before it starts; the
library holds none. Steps are optimizer steps, 1-based (the checkpoint after step N is ``step=N.ckpt``):

    LIGHTNING_PLUGINS_TEST_NAN=RANK:STEP[,STEP...]   on global rank RANK, the ``lm_head`` input of every training
                                                     forward of those steps is multiplied by NaN (the loss and the
                                                     gradients turn NaN; under PP only the last stage has a head;
                                                     the input, as the chunked loss computes from it, not logits)
    LIGHTNING_PLUGINS_TEST_NO_STEP=STEP              that optimizer step runs its forward and backward but updates
                                                     nothing: the run that "simply did not take that step"
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from _door import run_door, runner_of  # tests/scripts is on sys.path (the script's own folder)

NAN = "LIGHTNING_PLUGINS_TEST_NAN"
NO_STEP = "LIGHTNING_PLUGINS_TEST_NO_STEP"
#: Optimizer ``step()`` calls completed in this process (a skipped step calls it too).
_done = [0]


def _patch(runner: Any) -> None:
    rank_and_steps = os.environ.get(NAN)
    no_step = int(os.environ.get(NO_STEP, "0"))
    make_optimizer, build_model = runner.make_optimizer, runner.build_model

    def counted_optimizer(*args: Any, **kwargs: Any) -> Any:
        optimizer, schedule = make_optimizer(*args, **kwargs)
        step = optimizer.step  # the schedule's wrapper of it: the schedule sees every call

        def step_or_not(closure: Any = None, **kw: Any) -> Any:
            try:
                if _done[0] + 1 == no_step:
                    return closure() if closure is not None else None
                return step(closure, **kw) if closure is not None else step(**kw)
            finally:
                _done[0] += 1

        optimizer.step = functools.update_wrapper(step_or_not, step)  # keeps the schedule's marks on it
        return optimizer, schedule

    def poisoned_model(*args: Any, **kwargs: Any) -> Any:
        model, tokenizer = build_model(*args, **kwargs)
        rank, steps = rank_and_steps.split(":")
        poisoned = {int(s) for s in steps.split(",")}

        def hook(module: Any, inputs: tuple) -> Any:
            if module.training and dist.get_rank() == int(rank) and _done[0] + 1 in poisoned:
                return (inputs[0] * torch.nan, *inputs[1:])
            return None

        heads = [m for name, m in model.named_modules() if name.split(".")[-1] == "lm_head"]
        assert heads, "no lm_head to poison"
        for head in heads:
            head.register_forward_pre_hook(hook)
        return model, tokenizer

    runner.make_optimizer = counted_optimizer
    if rank_and_steps:
        runner.build_model = poisoned_model


def main() -> None:
    door, *argv = sys.argv[1:]
    runner = runner_of(door)
    _patch(runner)
    run_door(door, argv)


if __name__ == "__main__":
    main()
