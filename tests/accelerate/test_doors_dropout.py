"""LoRA with dropout, one process, through both doors: the same masks, so every step's loss, learning rate, gradient
norm and held-out loss agree (1e-5), as without dropout (test_accelerate_launch).

Lightning reseeds every rank with ``train.seed`` when its strategy sets up the process group (``reset_seed``), after
the door built the model and its adapters, whose initialisation draws from the same generator; the Accelerate door
seeds again at that point (:func:`lightning_plugins.accelerate.runner.run_recipe`). Without that, its masks were the
draws after the adapters' initialisation: here step 0's gradient norm was 1.745752 against Lightning's 1.758148 and
step 1's loss 3.582225 against 3.570073 (``lora_B`` starts at zero, so step 0's loss is the same either way).
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
import torch
from _launch import ROOT, TINY

from lightning_plugins.testing.world import run_command

#: One process, 2 micro-batches per step (masks drawn between them), held-out evaluation after step 2 (no masks).
ONE = ["--layout.tp_size=1", "--hardware.devices=1", "--lora.dropout=0.1", "--train.micro_batch_size=8",
       "--train.max_steps=3", "--train.log_every=1", "--train.eval_every=2", "--optim.warmup_steps=1"]  # fmt: skip
COLUMNS = ("train/loss", "train/lr", "train/grad_norm", "val/loss")


def _rows(out: Path) -> dict[str, list[tuple[int, float]]]:
    with open(out / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    return {key: [(int(r["step"]), float(r[key])) for r in rows if r.get(key)] for key in COLUMNS}


@pytest.mark.slow
def test_lora_dropout_draws_the_same_masks_in_both_doors(tmp_path: Path) -> None:
    doors = {"lightning": [sys.executable, "-m", "lightning_plugins", "finetune"],
             "accelerate": [sys.executable, "-m", "lightning_plugins.accelerate"]}  # fmt: skip
    recipe = str(TINY / "lora_tp2.yaml")
    outs = {door: tmp_path / door for door in doors}
    for door, command in doors.items():
        run_command([*command, recipe, *ONE, f"--train.output_dir={outs[door]}"], cwd=ROOT, timeout=300)
    got, want = _rows(outs["accelerate"]), _rows(outs["lightning"])
    for key in COLUMNS:
        assert [s for s, _ in got[key]] == [s for s, _ in want[key]] and want[key], (key, got[key], want[key])
        values = torch.tensor([v for _, v in got[key]]), torch.tensor([v for _, v in want[key]])
        torch.testing.assert_close(*values, rtol=1e-5, atol=1e-5, msg=key)
    assert len(want["train/loss"]) == 3 and len(want["val/loss"]) == 1
