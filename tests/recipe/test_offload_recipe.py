"""``memory.optimizer_offload: true`` in a tiny recipe, through ``accelerate launch`` (TP=2 on 2 CPU processes): the
loss falls, and a run stopped after a checkpoint resumes on the same trajectory, so the offloaded AdamW state went
through the Accelerate door's checkpoint and came back.

The Accelerate door builds the optimizer before ``prepare`` parallelizes the model and points it at the sharded
parameters; the offloaded optimizer makes its host copies from those on first use.
"""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest
import torch
from _launch import TINY, accelerate_launch, clean_stdout

STEPS = 6
SHORT = [f"--train.max_steps={STEPS}", "--train.log_every=1", "--train.eval_every=3", "--train.checkpoint_every=2",
         "--optim.warmup_steps=2", "--memory.optimizer_offload=true"]  # fmt: skip


def _losses(metrics: Path) -> dict[int, float]:
    with open(metrics, newline="") as handle:
        return {int(row["step"]): float(row["train/loss"]) for row in csv.DictReader(handle) if row.get("train/loss")}


@pytest.mark.slow
def test_optimizer_offload_recipe_trains_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    clean_stdout(accelerate_launch(TINY / "full_tp2.yaml", out, *SHORT))
    first = _losses(out / "metrics.csv")
    assert sorted(first) == list(range(STEPS)) and first[STEPS - 1] < 0.8 * first[0], first
    shutil.copy(out / "metrics.csv", tmp_path / "uninterrupted.csv")
    shutil.rmtree(out / "checkpoints" / f"step={STEPS}.ckpt")  # stopped after the checkpoint of step 4
    stdout = clean_stdout(accelerate_launch(TINY / "full_tp2.yaml", out, *SHORT))
    assert f"resumed_from: {out / 'checkpoints' / 'step=4.ckpt'}" in stdout, stdout
    resumed = _losses(out / "logs" / "version_1" / "metrics.csv")
    assert sorted(resumed) == [4, 5], resumed
    torch.testing.assert_close(
        torch.tensor([resumed[4], resumed[5]]), torch.tensor([first[4], first[5]]), rtol=1e-5, atol=1e-5
    )
