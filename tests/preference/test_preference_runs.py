"""A DPO run is a run like any other: checkpoints, resume, export, the non-finite guard, the loggers and the profiler
through ``lightning-plugins finetune`` on the tiny DPO recipe (LoRA, FSDP2 on 2 processes), as for SFT
(tests/run/test_nonfinite.py, test_loggers.py, test_perf.py, tests/recipe/test_finetune.py).

Two launches (slow; ``tests/scripts/nonfinite_run.py`` injects the NaN into rank 1's ``lm_head`` input):

* the run: a NaN in step 2 (skipped under ``train.on_nonfinite=skip``), 6 steps, a checkpoint every 2, the profiler
  on step 3, CSV and TensorBoard loggers, the adapter exported and merged;
* the resumed run: from that run's ``step=4.ckpt`` into another directory, a NaN in step 6 under the default ``stop``.

Checked: TRL's metric names (training and held out) reach both loggers; the profile summary covers step 3 on both
ranks; the skipped step is named and leaves the adapters as they were; the resumed step 5 is the run's step 5; the stop
names the step and the last checkpoint and leaves no export; the adapter loads in plain peft on the base and gives the
merged model's logits (plain transformers), and the last checkpoint exported by ``lightning-plugins export`` gives them
exactly.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import torch

from lightning_plugins.testing.world import run_command

#: Plain peft (PeftModel.from_pretrained, the user's side) reads a transformers attribute deprecated in 5.x.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
ROOT = Path(__file__).parents[2]
TINY = ROOT / "recipes" / "tiny"
RECIPE = TINY / "dpo_lora_fsdp2.yaml"
SCRIPT = ROOT / "tests" / "scripts" / "nonfinite_run.py"
ARGS = ["--train.max_steps=6", "--train.log_every=1", "--train.eval_every=3", "--train.checkpoint_every=2",
        "--train.loggers=[csv, tensorboard]", "--train.profile={start_step: 3, steps: 1}"]  # fmt: skip
#: TRL's DPO metrics, logged under ``train/`` and ``val/``.
TRL = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
       "logps/rejected", "logits/chosen", "logits/rejected")  # fmt: skip


def _finetune(out: Path, extra: list[str], nan: str, expected: int | None = 0) -> str:
    command = [sys.executable, str(SCRIPT), "finetune", str(RECIPE), f"--train.output_dir={out}", *ARGS, *extra]
    proc = run_command(command, cwd=out.parent, timeout=300, expected=expected, LIGHTNING_PLUGINS_TEST_NAN=nan)
    assert "warning" not in proc.stderr.lower(), proc.stderr[-4000:]
    if expected is None:
        assert proc.returncode != 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout + proc.stderr


def _rows(out: Path) -> dict[int, dict[str, float]]:
    """``step -> {metric: value}`` from the CSV logger's file (one step's training and held-out rows merged)."""
    rows: dict[int, dict[str, float]] = {}
    with open(out / "logs" / "version_0" / "metrics.csv", newline="") as handle:
        for row in csv.DictReader(handle):
            rows.setdefault(int(row["step"]), {}).update({k: float(v) for k, v in row.items() if v and k != "step"})
    return rows


def _tensorboard_tags(out: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return {value.tag for path in (out / "tensorboard").rglob("events.out.tfevents.*")
            for event in EventFileLoader(str(path)).Load() for value in event.summary.value}  # fmt: skip


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([[1, 5, 6, 7, 8, 9]])).logits


@pytest.mark.slow
def test_a_dpo_run_logs_profiles_skips_resumes_stops_and_exports(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lightning_plugins.cli import main as cli

    run, resumed = tmp_path / "run", tmp_path / "resumed"
    said = _finetune(run, ["--train.on_nonfinite=skip", "--train.merge_lora=true"], "1:2")
    assert "optimizer step 2: a non-finite loss on rank(s) [" in said, said[-4000:]
    assert "step skipped (train.on_nonfinite=skip; 1 consecutive of at most 10)" in said, said[-4000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step=2.ckpt", "step=4.ckpt", "step=6.ckpt"]

    # The loggers: TRL's names, training and held out, in the CSV logger's file and TensorBoard's events.
    rows = _rows(run)
    names = {f"{split}/{name}" for split in ("train", "val") for name in TRL}
    assert names <= set().union(*rows.values()) and names <= _tensorboard_tags(run), sorted(set().union(*rows.values()))
    assert sorted(step for step, row in rows.items() if "train/loss" in row) == [0, 1, 2, 3, 4, 5]
    assert rows[0]["train/rewards/margins"] == 0 != rows[2]["train/rewards/margins"], rows  # the adapters moved
    losses = [rows[step]["train/loss"] for step in range(6)]
    assert [value != value for value in losses] == [False, True, False, False, False, False], losses  # step 2 NaN

    # The profiler: step 3 on both ranks, its window partitioned.
    summary = json.loads((run / "profile" / "summary.json").read_text())
    assert summary["steps"] == [3, 3] and [rank["rank"] for rank in summary["ranks"]] == [0, 1], summary
    for rank in summary["ranks"]:
        assert sum(rank["shares"].values()) == pytest.approx(1.0, abs=1e-9) and rank["compute_s"] > 0, rank
    assert "profile of optimizer steps 3..3" in said and (run / "profile" / "rank1.json").stat().st_size > 1000

    # Resumed from step 4: step 5 as the run took it; a NaN in step 6 stops it, naming the last checkpoint.
    # (nonfinite_run.py counts this process's optimizer step() calls: loading AdamW's state makes the first, torch's
    # DCP building the state to load into with a step of zero gradients; step 6 is the third.)
    said = _finetune(resumed, [f"--resume={run / 'checkpoints' / 'step=4.ckpt'}"], "1:3", expected=None)
    assert "error: optimizer step 6: a non-finite loss on rank(s) [" in said, said[-4000:]
    assert "or set train.on_nonfinite=skip to skip such steps" in said, said[-4000:]
    assert "the last checkpoint, " in said and "holds finite weights" in said, said[-4000:]
    assert not (resumed / "adapter").exists() and not (resumed / "checkpoints" / "step=6.ckpt").exists()
    again = _rows(resumed)
    assert sorted(step for step, row in again.items() if "train/loss" in row) == [4], again
    compared = [key for key in rows[4] if key.startswith(("train/loss", "train/rewards", "train/logps", "train/grad"))]
    assert len(compared) == 8 and max(abs(again[4][key] - rows[4][key]) for key in compared) <= 1e-6, (again, rows)

    # The export: the adapter in plain peft on the base gives the merged model's logits (plain transformers); the
    # last checkpoint exported by `lightning-plugins export` is that adapter.
    base = AutoModelForCausalLM.from_pretrained(TINY / "model")
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(TINY / "model"), run / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(run / "merged")
    torch.testing.assert_close(_logits(tuned), _logits(merged), rtol=1e-5, atol=1e-5)
    assert (_logits(merged) - _logits(base)).abs().max() > 1e-3  # DPO moved the model
    cli(["export", str(run / "checkpoints" / "step=6.ckpt"), str(tmp_path / "exported")])
    streamed = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(TINY / "model"), tmp_path / "exported")
    torch.testing.assert_close(_logits(streamed), _logits(tuned), rtol=0, atol=0)
