"""DPO through the Accelerate recipe door under tensor, context and expert parallelism (slow).

``accelerate launch ... -m lightning_plugins.accelerate recipes/tiny/dpo_lora_fsdp2.yaml`` with the layout overridden:
TP=2 (sequence and loss parallel), CP=2 (ring: every rank holds a shard of every row of its pairs) and, on a tiny
Qwen3-MoE with its router loss on, EP=2 (the experts split over the data ranks). Each ends with the same held-out
metrics as the Lightning door's run of the same recipe under FSDP2=2 (TRL's metrics, and ``aux_loss`` for the mixture
of experts), to 1e-5 after 6 steps and 2 evaluations. The FSDP2 runs of the dense model take 2 pairs a rank, so each
global micro-batch holds the 4 pairs the single data rank of TP and CP holds (the epoch means of per-batch means depend
on the grouping).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _launch import accelerate_launch, clean_stdout
from test_preference_recipe import RECIPE, _moe_dpo_recipe, _validation

from lightning_plugins.testing.world import run_command

SHORT = ["--train.max_steps=6", "--train.eval_every=3"]
LAYOUTS = {
    "tp2": ["--layout.dp_shard_size=1", "--layout.tp_size=2"],
    "cp2": ["--layout.dp_shard_size=1", "--layout.cp_size=2", "--parallel.cp_backend=ring"],
    "ep2": ["--layout.ep_size=2"],
}


def _lightning_fsdp2(recipe: Path, out: Path, *extra: str) -> list[dict[str, float]]:
    command = [sys.executable, "-m", "lightning_plugins", "finetune", str(recipe), f"--train.output_dir={out}",
               *SHORT, *extra]  # fmt: skip
    result = run_command(command, cwd=out.parent)
    assert "Warning" not in result.stdout + result.stderr
    return _validation(out)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dpo_through_accelerate_launch_evaluates_as_the_lightning_door_under_fsdp2(tmp_path: Path, name: str) -> None:
    moe = name == "ep2"
    recipe = _moe_dpo_recipe(tmp_path) if moe else RECIPE
    want = _lightning_fsdp2(recipe, tmp_path / "fsdp2", *([] if moe else ["--train.micro_batch_size=2"]))
    out = tmp_path / name
    clean_stdout(accelerate_launch(recipe, out, *SHORT, *LAYOUTS[name]))
    got = _validation(out)
    assert len(want) == len(got) == 2 and all(row.keys() == want[0].keys() for row in want + got)
    assert ("val/aux_loss" in want[0]) == moe and "val/rewards/margins" in want[0], want[0]
    assert max(abs(row[key] - other[key]) for row, other in zip(got, want) for key in row) <= 1e-5, (got, want)
