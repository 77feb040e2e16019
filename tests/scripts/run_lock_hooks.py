"""Run a recipe through either door with the hooks that ``tests/run/test_run_lock.py`` needs (tests only).

    python tests/scripts/run_lock_hooks.py finetune RECIPE [--a.b=v ...]          (Lightning re-runs it once per rank)
    accelerate launch [...] tests/scripts/run_lock_hooks.py accelerate RECIPE [--a.b=v ...]

Installed by patching before the normal runner starts (the library holds none), chosen by environment variables:

    LIGHTNING_PLUGINS_TEST_APPEARS=CKPT    a complete checkpoint appears while the job starts: right after rank 0 looked
                                           for one to resume, CKPT is copied into output_dir/checkpoints; a rank that
                                           looks itself waits until it is there.
    LIGHTNING_PLUGINS_TEST_SECOND=JSON     while rank 0 holds the output directory (when it builds the model), run the
                                           command JSON (a list) to its end and write how it ended to output_dir/../
                                           second.json (returncode, stderr, seconds).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _door import run_door, runner_of  # tests/scripts is on sys.path (the script's own folder)

APPEARS, SECOND = "LIGHTNING_PLUGINS_TEST_APPEARS", "LIGHTNING_PLUGINS_TEST_SECOND"
#: What a world's launcher tells its processes: the second run starts its own world.
_LAUNCH_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                     "MASTER_PORT", "LIGHTNING_PLUGINS_RESUME_FROM")  # fmt: skip


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def _checkpoint_appears(source: Path) -> None:
    """Wrap ``latest_checkpoint`` (where both doors look it up, :mod:`lightning_plugins.checkpoint.resume_choice`):
    after rank 0 looked, ``source`` is copied in; any other rank that looks does so once it is there."""
    from lightning_plugins.checkpoint import resume_choice

    look = resume_choice.latest_checkpoint

    def latest_checkpoint(output_dir: str | Path, *args: Any, **kwargs: Any) -> Any:
        marker = Path(output_dir) / "appeared"
        if _rank() != 0:
            deadline = time.monotonic() + 120
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            return look(output_dir, *args, **kwargs)
        found = look(output_dir, *args, **kwargs)
        if not marker.exists():
            shutil.copytree(source, Path(output_dir) / "checkpoints" / source.name)
            marker.touch()
        return found

    resume_choice.latest_checkpoint = latest_checkpoint


def _second_run(runner: Any, command: list[str]) -> None:
    """Wrap ``runner.build_model``: rank 0 runs ``command`` to its end first (it holds the output directory now)."""
    build = runner.build_model

    def build_model(recipe: Any, *args: Any, **kwargs: Any) -> Any:
        if _rank() == 0:
            env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES}
            start = time.monotonic()
            proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
            report = {"returncode": proc.returncode, "stderr": proc.stderr, "seconds": time.monotonic() - start}
            (Path(recipe.train.output_dir).parent / "second.json").write_text(json.dumps(report))
        return build(recipe, *args, **kwargs)

    runner.build_model = build_model


def main() -> None:
    door, *argv = sys.argv[1:]
    runner = runner_of(door)
    if os.environ.get(APPEARS):
        _checkpoint_appears(Path(os.environ[APPEARS]))
    if os.environ.get(SECOND):
        _second_run(runner, json.loads(os.environ[SECOND]))
    run_door(door, argv)


if __name__ == "__main__":
    main()
