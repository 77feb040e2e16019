"""``accelerate launch`` of the tiny recipes, shared by the tests that start the Accelerate door for real."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from lightning_plugins.testing.world import free_port, run_command

ROOT = Path(__file__).parents[1]
TINY = ROOT / "recipes" / "tiny"
CONFIG = ROOT / "accelerate_configs" / "cpu_2proc.yaml"


def accelerate_launch(
    recipe: Path, out: Path, *extra: str, config: Path = CONFIG, launch: tuple[str, ...] = (), expected: int | None = 0
) -> subprocess.CompletedProcess:
    """``accelerate launch --config_file CONFIG [options] -m lightning_plugins.accelerate RECIPE [overrides]``, ended with
    status ``expected`` (``None``: any) and no rank crashed (:func:`lightning_plugins.testing.world.run_command`)."""
    launcher = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(config), *launch]
    command = [*launcher, "--main_process_port", str(free_port()), "-m", "lightning_plugins.accelerate", str(recipe),
               f"--train.output_dir={out}", *extra]  # fmt: skip
    return run_command(command, cwd=ROOT, expected=expected)


def clean_stdout(proc: subprocess.CompletedProcess) -> str:
    """The run's standard output, after checking its console is clean (how it ended is checked by run_command)."""
    assert "warning" not in proc.stderr.lower(), proc.stderr[-3000:]
    return proc.stdout
