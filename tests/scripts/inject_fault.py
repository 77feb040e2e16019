"""Run a door's command with a fault on one rank at one optimizer step (the library holds no test hooks).

    python inject_fault.py FAULT RANK STEP MARK lightning finetune RECIPE [--a.b=v ...]
    accelerate launch ... inject_fault.py FAULT RANK STEP MARK accelerate RECIPE [--a.b=v ...]

``FAULT`` happens on global rank ``RANK`` just before its ``STEP``-th optimizer step (1-based; a global
optimizer-step pre-hook counts them, so no sleep picks the moment): ``kill`` (SIGKILL itself), ``raise``
(a ``RuntimeError``), ``hang`` (block forever outside any collective, so its peers wait in theirs) or ``exit_late``
(train on, and exit with status 3 once the run is over, as a rank that crashes on its way out).
Just before, the time is written to ``MARK``: the test measures how long the job takes to end from there.
Lightning re-runs this script for its other ranks, with the same arguments.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook


def main() -> None:
    fault, rank, step, mark, door, *argv = sys.argv[1:]
    taken = 0

    def before_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        nonlocal taken
        taken += 1
        if taken != int(step) or dist.get_rank() != int(rank):
            return
        Path(mark).write_text(repr(time.time()))
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault == "raise":
            raise RuntimeError(f"injected fault on rank {rank} at step {step}")
        elif fault == "hang":
            threading.Event().wait()
        elif fault == "exit_late":
            atexit.register(os._exit, 3)
        else:
            raise ValueError(f"unknown fault {fault!r}")

    register_optimizer_step_pre_hook(before_step)
    if door == "lightning":
        from lightning_plugins.cli import main as lightning_main

        lightning_main(argv)
    else:
        from lightning_plugins.accelerate.__main__ import main as accelerate_main

        accelerate_main(argv)


if __name__ == "__main__":
    main()
