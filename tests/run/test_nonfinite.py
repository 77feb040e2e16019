"""The non-finite guard under TP, PP and FSDP2 (LoRA), through both doors: a NaN loss on one rank is seen by every rank
in the same step; ``train.on_nonfinite=skip`` trains on as a run that simply did not take that step, and stops after
``train.max_skipped_steps`` consecutive skips; ``stop`` ends the run with the step, the quantity, the ranks and the
last checkpoint named; neither leaves a checkpoint of the bad step or an export, and the exit status is non-zero.

Two launched runs per layout, one per door, each checking several cases (``tests/scripts/nonfinite_run.py`` injects the
NaN: rank 1's ``lm_head`` input, which under PP only the last stage has):

* skip run: NaN in steps 2, 6 and 7; step 2 is skipped, step 6 too, step 7 is the second consecutive skip: it stops.
* stop run (the reference): step 2 runs its forward and backward but does not update (no NaN: the hook does not step
  the optimizer), then NaN in step 6, which stops the run under the default ``stop``.

The doors agree to 1e-5 (test_accelerate_launch), so each run's door alternates between layouts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from lightning_plugins.testing.world import free_port, run_command, run_world

from lightning_plugins.errors import LayoutError
from lightning_plugins.run.nonfinite import NonFiniteGuard, check_finite_weights, training_state
from lightning_plugins.errors import NonFiniteError
from lightning_plugins.recipe.plots import merge_metrics

ROOT = Path(__file__).parents[2]
TINY = ROOT / "recipes" / "tiny"
SCRIPT = ROOT / "tests" / "scripts" / "nonfinite_run.py"
CONFIG = ROOT / "accelerate_configs" / "cpu_2proc.yaml"
SHORT = ["--train.max_steps=8", "--train.log_every=1", "--train.eval_every=100", "--train.checkpoint_every=2",
         "--optim.warmup_steps=2"]  # fmt: skip
LAYOUTS = {
    "tp": ("full_tp2.yaml", ["--train.micro_batch_size=8"]),
    "pp": ("full_pp2.yaml", ["--train.micro_batch_size=8", "--parallel.pp_microbatches=2"]),
    "lora_fsdp2": ("lora_fsdp2_chat.yaml", ["--train.micro_batch_size=2"]),
}
#: (layout, the door that skips, the door that stops): the default suite runs TP; the others are slow.
CASES = [
    ("tp", "accelerate", "finetune"),
    pytest.param("pp", "finetune", "accelerate", marks=pytest.mark.slow),
    pytest.param("lora_fsdp2", "accelerate", "finetune", marks=pytest.mark.slow),
]
#: Metric rows (0-based steps) both runs took alike: before the skipped step 2, and after it up to step 5.
COMPARED = [0, 2, 3, 4]


def _run(door: str, layout: str, out: Path, extra: list[str], **env: str) -> str:
    recipe, options = LAYOUTS[layout]
    args = [str(TINY / recipe), f"--train.output_dir={out}", *SHORT, *options, *extra]
    if door == "finetune":
        command = [sys.executable, str(SCRIPT), "finetune", *args]
    else:
        command = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(CONFIG),
                   "--main_process_port", str(free_port()), str(SCRIPT), "accelerate", *args]  # fmt: skip
    proc = run_command(command, cwd=ROOT, timeout=300, expected=None, **env)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-4000:]
    assert "warning" not in proc.stderr.lower(), proc.stderr[-4000:]
    return output


def _losses(out: Path, tmp: Path) -> dict[int, float]:
    import csv

    with open(merge_metrics(out / "logs", tmp / f"{out.name}.csv"), newline="") as handle:
        return {int(row["step"]): float(row["train/loss"]) for row in csv.DictReader(handle) if row.get("train/loss")}


def _written(out: Path) -> list[str]:
    """The checkpoints and exports a run left."""
    exports = [d for d in ("hf", "adapter") if (out / d).exists()]
    return sorted(p.name for p in (out / "checkpoints").iterdir()) + exports


@pytest.mark.parametrize(("layout", "skip_door", "stop_door"), CASES, ids=[getattr(c, "values", c)[0] for c in CASES])
def test_nonfinite_steps_are_skipped_or_stop_the_run(
    tmp_path: Path, layout: str, skip_door: str, stop_door: str
) -> None:
    skip, stop = tmp_path / "skip", tmp_path / "stop"
    said = _run(skip_door, layout, skip, ["--train.on_nonfinite=skip", "--train.max_skipped_steps=2"],
                LIGHTNING_PLUGINS_TEST_NAN="1:2,6,7")  # fmt: skip
    assert "optimizer step 2: a non-finite loss on rank(s) [" in said, said[-4000:]
    assert "step skipped (train.on_nonfinite=skip; 1 consecutive of at most 2)" in said, said[-4000:]
    assert "error: optimizer step 7: a non-finite loss on rank(s) [" in said, said[-4000:]
    assert "2 consecutive steps skipped (train.max_skipped_steps=2)" in said, said[-4000:]
    assert f"the last checkpoint, {skip / 'checkpoints' / 'step=6.ckpt'}, holds finite weights" in said, said[-4000:]
    assert _written(skip) == ["step=2.ckpt", "step=4.ckpt", "step=6.ckpt"], _written(skip)

    said = _run(stop_door, layout, stop, [], LIGHTNING_PLUGINS_TEST_NAN="1:6", LIGHTNING_PLUGINS_TEST_NO_STEP="2")
    assert "error: optimizer step 6: a non-finite loss on rank(s) [" in said, said[-4000:]
    assert "a non-finite gradient norm (nan; the global norm" in said, said[-4000:]
    assert f"the last checkpoint, {stop / 'checkpoints' / 'step=4.ckpt'}, holds finite weights" in said, said[-4000:]
    assert "or set train.on_nonfinite=skip to skip such steps" in said, said[-4000:]
    assert _written(stop) == ["step=2.ckpt", "step=4.ckpt"], _written(stop)

    got, want = _losses(skip, tmp_path), _losses(stop, tmp_path)
    assert all(step in got and step in want for step in COMPARED), (got, want)
    torch.testing.assert_close(
        torch.tensor([got[s] for s in COMPARED]), torch.tensor([want[s] for s in COMPARED]), rtol=1e-5, atol=1e-5
    )


def _guard_cases(rank: int, world_size: int) -> None:
    """One world, the guard's decisions: every rank takes the one that a single rank's bad value calls for."""
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight], lr=0.1)
    nan, one = torch.tensor(float("nan")), torch.tensor(1.0)

    def backward() -> None:
        weight.grad = torch.full((3,), 0.5)

    guard = NonFiniteGuard("skip", 2, lambda: Path("out/checkpoints/step=4.ckpt"))
    backward()
    guard.observe_loss(nan if rank == 1 else one)  # one micro-batch bad on rank 1 only
    guard.observe_loss(one)
    assert guard.check(5, one, optimizer) is False and weight.grad is None
    optimizer.step()  # updates nothing, counts nothing
    assert torch.equal(weight.detach(), torch.ones(3)) and not optimizer.state
    backward()
    guard.observe_loss(one)
    assert guard.check(6, one, optimizer) is True and weight.grad is not None  # a good step resets the count
    optimizer.step()
    assert guard.consecutive == 0 and optimizer.state
    backward()
    assert guard.check(7, torch.tensor(float("inf")), optimizer) is False and guard.consecutive == 1
    backward()
    with pytest.raises(NonFiniteError) as raised:
        guard.check(8, nan, optimizer)
    said = str(raised.value)
    assert said.startswith(
        "optimizer step 8: a non-finite gradient norm (nan; the global norm, seen by rank(s) [0, 1])"
    ), said
    assert "2 consecutive steps skipped (train.max_skipped_steps=2)" in said, said
    assert "the last checkpoint, out/checkpoints/step=4.ckpt, holds finite weights" in said, said

    stop = NonFiniteGuard("stop", 10)
    stop.observe_loss(torch.tensor(float("-inf")) if rank == 1 else one)
    with pytest.raises(NonFiniteError, match=r"^optimizer step 3: a non-finite loss on rank\(s\) \[1\]\. .*no check"):
        stop.check(3, one, optimizer)

    # Where the optimizer steps inside backward (Accelerate's DeepSpeed, no norm given): stop only, said so.
    with pytest.raises(LayoutError, match=r"train\.on_nonfinite=skip: the optimizer steps inside backward"):
        NonFiniteGuard("skip", 10, stepped_in_backward=True)
    late = NonFiniteGuard("stop", 10, stepped_in_backward=True)
    late.observe_loss(nan if rank == 0 else one)
    with pytest.raises(NonFiniteError, match=r"loss on rank\(s\) \[0\]\. Training stopped after the optimizer had"):
        late.check(4, None, optimizer)

    check_finite_weights(training_state([weight], [optimizer]), "checkpoint step=6.ckpt", 6)
    if rank == 1:
        next(iter(optimizer.state.values()))["exp_avg_sq"][0] = float("inf")
    with pytest.raises(NonFiniteError, match=r"checkpoint step=6.ckpt after optimizer step 6: .* on rank\(s\) \[1\]"):
        check_finite_weights(training_state([weight], [optimizer]), "checkpoint step=6.ckpt", 6)


def test_every_rank_takes_the_decision_of_one_rank() -> None:
    run_world(_guard_cases, 2)
