"""Run a recipe through either door, SIGKILLed at a point that ``LIGHTNING_PLUGINS_TEST_KILL`` names (tests only).

    python tests/scripts/kill_run.py finetune RECIPE [--a.b=v ...]          (Lightning re-runs it once per rank)
    accelerate launch [...] tests/scripts/kill_run.py accelerate RECIPE [--a.b=v ...]

The hooks are installed here, by patching, before the normal runner starts; the library holds none. Kill points
(counted in this attempt):

    batch:K[:RANK]          before the K-th training forward (0-based micro-batch; only RANK, or every rank)
    save:N:mid_dcp          in the save of step N: every rank's data written, before DCP's ``.metadata`` (rank 0
                            dies; its peers fail in the next collective)
    save:N:before_rename    in the save of step N: everything written under ``.partial``, before the rename
    signal:K:SIG:TARGET     before rank 0's K-th training forward, send SIG (SIGTERM, SIGUSR1, SIGKILL) to TARGET:
                            ``launcher`` (the Lightning door's launching rank, ``accelerate launch``), ``group`` (its
                            process group) or ``step`` (the launcher and every rank, as SLURM's ``--signal`` delivers
                            it; needs ``LIGHTNING_PLUGINS_TEST_PIDS``); rank 0 then waits until its preemption flag is set (by the signal, or by
                            its watchdog once the launcher is gone), so the run stops at the end of that step

With ``LIGHTNING_PLUGINS_TEST_PIDS`` set to a directory, each rank writes its pid there (``rank<RANK>``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from _door import run_door, runner_of  # tests/scripts is on sys.path (the script's own folder)

ENV = "LIGHTNING_PLUGINS_TEST_KILL"


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def _die(where: str) -> None:
    thread = threading.current_thread().name  # an asynchronous save dies in DCP's background writer
    print(f"kill_run: SIGKILL rank {_rank()} at {where} (thread {thread})", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_at_batch(runner: Any, index: int, rank: int | None) -> None:
    """Wrap ``runner.build_model`` so the model kills this process before its ``index``-th training forward."""
    _at_batch(runner, index, rank, lambda: _die(f"training forward {index}"))


def _signal_at_batch(runner: Any, door: str, index: int, name: str, target: str) -> None:
    """Before rank 0's ``index``-th training forward, send signal ``name`` to the launcher or its process group, then
    wait until this rank's preemption flag is set."""
    from lightning_plugins.run.preemption import Preemption

    requested = threading.Event()
    request = Preemption._request

    def noted(self: Any, *args: Any) -> None:
        request(self, *args)
        requested.set()

    Preemption._request = noted  # type: ignore[method-assign]

    def send() -> None:
        launcher = os.getpid() if door == "finetune" else os.getppid()
        print(f"kill_run: {name} to the {target} (pid {launcher}) at training forward {index}", file=sys.stderr,
              flush=True)  # fmt: skip
        if target == "group":
            os.killpg(os.getpgid(launcher), signal.Signals[name])
        elif target == "step":  # as SLURM's --signal: the launcher and every rank (LIGHTNING_PLUGINS_TEST_PIDS)
            ranks = [int(p.read_text()) for p in Path(os.environ["LIGHTNING_PLUGINS_TEST_PIDS"]).iterdir()]
            for pid in [launcher, *ranks]:
                os.kill(pid, signal.Signals[name])
        else:
            os.kill(launcher, signal.Signals[name])
        if not requested.wait(60):
            raise RuntimeError(f"kill_run: {name} to the {target} did not set rank 0's preemption flag within 60 s")

    _at_batch(runner, index, 0, send)


def _at_batch(runner: Any, index: int, rank: int | None, action: Any) -> None:
    """Wrap ``runner.build_model`` so the model calls ``action`` before its ``index``-th training forward."""
    build = runner.build_model

    def build_model(*args: Any, **kwargs: Any) -> Any:
        model, tokenizer = build(*args, **kwargs)
        count = [0]

        def pre_hook(module: Any, args: Any, kwargs: Any) -> None:
            if not module.training:
                return
            if count[0] == index and (rank is None or rank == _rank()):
                action()
            count[0] += 1

        model.register_forward_pre_hook(pre_hook, with_kwargs=True)
        return model, tokenizer

    runner.build_model = build_model


def _kill_in_save(step: int, phase: str) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    partial = f"step={step}.ckpt.partial"
    if phase == "mid_dcp":
        finish = FileSystemWriter.finish

        def finish_then_die(self: Any, *args: Any, **kwargs: Any) -> Any:
            if Path(str(self.path)).name == partial:
                _die(f"save {step}, before .metadata")
            return finish(self, *args, **kwargs)

        FileSystemWriter.finish = finish_then_die  # type: ignore[method-assign]
    elif phase == "before_rename":
        rename = Path.rename

        def rename_or_die(self: Path, target: Any) -> Any:
            if self.name == partial:
                _die(f"save {step}, before the rename")
            return rename(self, target)

        Path.rename = rename_or_die  # type: ignore[method-assign]
    else:
        raise ValueError(f"{ENV}: unknown save phase {phase!r} (mid_dcp, before_rename)")


def main() -> None:
    door, *argv = sys.argv[1:]
    runner = runner_of(door)
    pids = os.environ.get("LIGHTNING_PLUGINS_TEST_PIDS")
    if pids:
        (Path(pids) / f"rank{_rank()}").write_text(str(os.getpid()))
    spec = os.environ.get(ENV, "")
    kind, *fields = spec.split(":") if spec else [""]
    if kind == "batch":
        _kill_at_batch(runner, int(fields[0]), int(fields[1]) if len(fields) > 1 else None)
    elif kind == "save":
        _kill_in_save(int(fields[0]), fields[1])
    elif kind == "signal":
        _signal_at_batch(runner, door, int(fields[0]), fields[1], fields[2])
    elif kind:
        raise ValueError(f"{ENV}={spec!r}: expected batch:K[:RANK], save:N:PHASE or signal:K:SIG:TARGET")
    run_door(door, argv)


if __name__ == "__main__":
    main()
