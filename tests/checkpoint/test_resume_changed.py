"""Resuming with a changed recipe through both doors (lightning_plugins.recipe.diff).

One process per run, the tiny Llama. A raised ``train.max_steps`` is applied: the resumed run continues on the
trajectory of an uninterrupted longer run (the Accelerate door's, which the Lightning door matches to 1e-5:
test_accelerate_launch). Another model or other data are refused before anything is loaded; changed ``optim`` settings
are refused without ``--resume-reset-optimizer`` and, with it, train with the new learning rate and schedule,
positioned at the resumed step.
"""

from __future__ import annotations

import csv
import json
import shutil
import sys
from pathlib import Path

import pytest
from _launch import shared_run
from lightning_plugins.testing.world import run_command

from lightning_plugins.recipe.diff import RECIPE_FILE, RESET_FLAG
from lightning_plugins.recipe.build import lr_lambda

ROOT = Path(__file__).parents[2]
RECIPE = ROOT / "recipes" / "tiny" / "full_tp2.yaml"
# One process, a constant schedule (the schedule of a 4-step run is then that of a 6-step run), checkpoints at 2 and 4.
ONE = ["--layout.tp_size=1", "--hardware.devices=1", "--parallel.sequence_parallel=false",
       "--parallel.loss_parallel=false", "--train.micro_batch_size=8", "--train.checkpoint_every=2",
       "--train.log_every=1", "--train.eval_every=100", "--optim.scheduler=constant", "--optim.warmup_steps=2"]  # fmt: skip
# The optim settings of the resumed run with --resume-reset-optimizer: another lr, a decaying schedule.
NEW_OPTIM = ["--optim.lr=1e-3", "--optim.scheduler=linear"]


def _door(door: str, out: Path, *extra: str, expected: int = 0) -> str:
    module = "lightning_plugins" if door == "finetune" else "lightning_plugins.accelerate"
    args = ["finetune"] if door == "finetune" else []
    command = [sys.executable, "-m", module, *args, str(RECIPE), *ONE, f"--train.output_dir={out}", *extra]
    proc = run_command(command, cwd=ROOT, timeout=300, expected=expected)
    return proc.stdout + proc.stderr


def _rows(out: Path) -> dict[int, dict[str, float]]:
    with open(out / "metrics.csv", newline="") as handle:
        return {int(r["step"]): {k: float(v) for k, v in r.items() if v} for r in csv.DictReader(handle) if r["train/loss"]}


def _checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 4-step Lightning run and an uninterrupted 6-step Accelerate run, both with checkpoints every 2 steps (both
    shared with test_untrusted: _launch.shared_run)."""
    command = [sys.executable, "-m", "lightning_plugins", "finetune", str(RECIPE), *ONE, "--train.max_steps=4"]
    lightning4 = shared_run(tmp_path_factory, command)
    command = [sys.executable, "-m", "lightning_plugins.accelerate", str(RECIPE), *ONE, "--train.max_steps=6"]
    return {"lightning4": lightning4, "accelerate6": shared_run(tmp_path_factory, command)}


@pytest.mark.slow
def test_raised_max_steps_continues_the_longer_run(runs: dict[str, Path], tmp_path: Path) -> None:
    """The checkpoint records its recipe (covered by its checksums); a raised max_steps is said once and applied."""
    checkpoint = runs["lightning4"] / "checkpoints" / "step=4.ckpt"
    assert "max_steps: 4" in (checkpoint / RECIPE_FILE).read_text()
    assert RECIPE_FILE in json.loads((checkpoint / "checksums.json").read_text())["files"]
    out = tmp_path / "raised"
    shutil.copytree(runs["lightning4"], out)
    said = _door("finetune", out, "--train.max_steps=6")
    assert said.count("resuming step=4 with train.max_steps 4 -> 6") == 1
    assert "Warning" not in said, said
    resumed, reference = _rows(out), _rows(runs["accelerate6"])
    assert sorted(resumed) == sorted(reference) == list(range(6))
    for step in range(6):
        assert resumed[step]["train/loss"] == pytest.approx(reference[step]["train/loss"], abs=1e-5), step


@pytest.mark.parametrize("door", [pytest.param("finetune", marks=pytest.mark.slow), "accelerate"])
def test_refused_resumes_stop_before_anything_runs(
    runs: dict[str, Path], tmp_path: Path, door: str, capsys: pytest.CaptureFixture
) -> None:
    """Another model.path or data.train, or a changed optim.lr without the flag: refused by the door's preflight,
    naming the key, the old and new values and the way out; nothing is written (one recipe file serves both doors,
    so either door compares it with the Lightning door's checkpoint)."""
    from lightning_plugins.accelerate.__main__ import main as accelerate_main
    from lightning_plugins.cli import main as cli_main

    out = runs["lightning4"]
    before = _checkpoints(out)
    model, data = tmp_path / "model", tmp_path / "train.jsonl"
    shutil.copytree(RECIPE.parent / "model", model)
    shutil.copy(RECIPE.parent / "data" / "train.jsonl", data)
    old_model, old_data = (RECIPE.parent / "model").resolve(), (RECIPE.parent / "data" / "train.jsonl").resolve()
    cases = [
        ([f"--model.path={model}"], f'model.path "{old_model}" -> "{model}"', "another train.output_dir"),
        ([f"--data.train={data}"], f'data.train "{old_data}" -> "{data}"', "another train.output_dir"),
        (["--optim.lr=1e-3"], "optim.lr 0.003 -> 0.001", f"pass {RESET_FLAG}"),
    ]
    for extra, change, fix in cases:
        argv = [str(RECIPE), *ONE, f"--train.output_dir={out}", "--train.max_steps=6", *extra]
        with pytest.raises(SystemExit) as stopped:
            cli_main(["finetune", *argv]) if door == "finetune" else accelerate_main(argv)
        message = str(stopped.value.code) if door == "finetune" else capsys.readouterr().err
        assert stopped.value.code not in (0, None)
        assert f"cannot resume {out / 'checkpoints' / 'step=4.ckpt'}" in message, message
        assert change in message and fix in message, message
        assert "train.max_steps" not in message  # applied, not refused
    assert _checkpoints(out) == before


@pytest.mark.parametrize("door", ["finetune", "accelerate"])
def test_reset_optimizer_trains_with_the_new_lr(runs: dict[str, Path], tmp_path: Path, door: str) -> None:
    """With --resume-reset-optimizer the weights, step and data position are the checkpoint's (step 5's loss is the
    uninterrupted run's) and the logged learning rate is the new schedule's, positioned at step 4."""
    source = runs["lightning4"] if door == "finetune" else runs["accelerate6"]
    out = tmp_path / "reset"
    checkpoint = source / "checkpoints" / "step=4.ckpt"
    said = _door(door, out, f"--resume={checkpoint}", "--train.max_steps=6", *NEW_OPTIM, RESET_FLAG)
    assert "resuming step=4 with optim.lr 0.003 -> 0.001" in said
    assert f"resuming step=4 with a new AdamW state and schedule ({RESET_FLAG}), positioned at step=4" in said
    rows, reference = _rows(out), _rows(runs["accelerate6"])
    assert sorted(rows) == [4, 5]
    assert rows[4]["train/loss"] == pytest.approx(reference[4]["train/loss"], abs=1e-5)  # the weights before it
    for step in (4, 5):  # both doors log, in the row of step N (from 0), the rate the schedule holds after it: N + 1's
        expected = 1e-3 * lr_lambda(step + 1, 6, 2, "linear", 0.0)
        assert rows[step]["train/lr"] == pytest.approx(expected, rel=1e-6), (step, rows[step]["train/lr"])
