"""Run a recipe through either door, SIGKILLed at a point that ``LIGHTNING_PLUGINS_TEST_KILL`` names (tests only).

    python tests/scripts/kill_run.py finetune RECIPE [--a.b=v ...]          (Lightning re-runs it once per rank)
    accelerate launch [...] tests/scripts/kill_run.py accelerate RECIPE [--a.b=v ...]

The hooks are installed here, by patching, before the normal runner starts; the library holds none. Kill points
(counted in this attempt):

    batch:K[:RANK]          before the K-th training forward (0-based micro-batch; only RANK, or every rank)
    save:N:mid_dcp          in the save of step N: every rank's data written, before DCP's ``.metadata`` (rank 0
                            dies; its peers fail in the next collective)
    save:N:before_rename    in the save of step N: everything written under ``.partial``, before the rename
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

ENV = "LIGHTNING_PLUGINS_TEST_KILL"


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def _die(where: str) -> None:
    thread = threading.current_thread().name  # an asynchronous save dies in DCP's background writer
    print(f"kill_run: SIGKILL rank {_rank()} at {where} (thread {thread})", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_at_batch(runner: Any, index: int, rank: int | None) -> None:
    """Wrap ``runner.build_model`` so the model kills this process before its ``index``-th training forward."""
    build = runner.build_model

    def build_model(*args: Any, **kwargs: Any) -> Any:
        model, tokenizer = build(*args, **kwargs)
        count = [0]

        def pre_hook(module: Any, args: Any, kwargs: Any) -> None:
            if not module.training:
                return
            if count[0] == index and (rank is None or rank == _rank()):
                _die(f"training forward {index}")
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
    if door == "finetune":
        import lightning_plugins.finetune as runner
    else:
        import lightning_plugins.accelerate.runner as runner  # type: ignore[no-redef]
    spec = os.environ.get(ENV, "")
    kind, *fields = spec.split(":") if spec else [""]
    if kind == "batch":
        _kill_at_batch(runner, int(fields[0]), int(fields[1]) if len(fields) > 1 else None)
    elif kind == "save":
        _kill_in_save(int(fields[0]), fields[1])
    elif kind:
        raise ValueError(f"{ENV}={spec!r}: expected batch:K[:RANK] or save:N:PHASE")
    if door == "finetune":
        from lightning_plugins.cli import main as cli

        cli(["finetune", *argv])
    else:
        from lightning_plugins.accelerate.__main__ import main as accelerate_main

        accelerate_main(argv)


if __name__ == "__main__":
    main()
