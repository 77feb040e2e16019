"""DPO learns: on the shipped reversal pairs, the held-out reward accuracy of a tiny DPO run rises above chance.

The base is the tiny model after the shipped SFT recipe (``full_tp2.yaml``, one process): DPO on a randomly initialised
model moves the rewards of the 48 training pairs but nothing held out. The DPO run is the shipped recipe
(``dpo_lora_fsdp2.yaml``, one process) with a learning rate for LoRA on a trained model (the recipe's 1e-2 suits the
random one). Its 16 held-out pairs are evaluated every 10 steps.
"""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import pytest

from lightning_plugins.testing.world import run_command

TINY = Path(__file__).parents[2] / "recipes" / "tiny"
ONE = ["--hardware.devices=1"]
SFT = [str(TINY / "full_tp2.yaml"), *ONE, "--layout.tp_size=1", "--parallel.sequence_parallel=false",
       "--parallel.loss_parallel=false", "--train.max_steps=150"]  # fmt: skip
DPO = [str(TINY / "dpo_lora_fsdp2.yaml"), *ONE, "--layout.dp_shard_size=1", "--optim.lr=3e-4", "--train.max_steps=40",
       "--train.eval_every=10"]  # fmt: skip


def _finetune(args: list[str], out: Path, cwd: Path) -> None:
    run_command([sys.executable, "-m", "lightning_plugins", "finetune", *args, f"--train.output_dir={out}"], cwd=cwd)


@pytest.mark.slow
def test_held_out_reward_accuracy_rises_above_chance(tmp_path: Path) -> None:
    _finetune(SFT, tmp_path / "sft", tmp_path)
    _finetune([*DPO, f"--model.path={tmp_path / 'sft' / 'hf'}"], tmp_path / "dpo", tmp_path)
    rows = [row for row in csv.DictReader((tmp_path / "dpo" / "metrics.csv").open()) if row.get("val/loss")]
    assert len(rows) == 4, rows
    accuracy = [float(row["val/rewards/accuracies"]) for row in rows]
    margins = [float(row["val/rewards/margins"]) for row in rows]
    losses = [float(row["val/loss"]) for row in rows]
    assert accuracy[-1] > 0.5, accuracy  # above chance: the reward ranks most held-out pairs right
    assert margins[-1] > margins[0] > 0, margins
    assert losses[-1] < losses[0] < math.log(2), losses  # below the loss of a policy equal to its reference
