"""Two launchers on this machine act as two nodes (node ranks 0 and 1, rendezvous on localhost), through both doors:
HSDP with ``dp_replicate`` across the nodes and TP=2 within each (4 ranks). Each door's per-step losses over its
attempts are those of the same layout run by one launcher on one node (1e-5), and a two-node job resumes from a
checkpoint another two-node job wrote. A preemption signal delivered to one node's launcher only (Lightning door:
SIGUSR1 to node 1's launching rank; Accelerate door: SIGTERM to node 1's ``accelerate launch``, which forwards it to
its workers) makes every rank of both nodes finish the same optimizer step, write ``step=N.ckpt`` and stop. Lightning
door, then: node 1's launcher is SIGKILLed after the next checkpoint, and every rank of both nodes ends within a bound
with a message naming node 1. Each job is then resumed by the same two-node command.
"""

from __future__ import annotations

import csv
import re
import sys
import time
from pathlib import Path
from signal import SIGTERM, SIGUSR1

import pytest
import torch
from _nodes import Nodes, start_nodes
from lightning_plugins.testing.world import run_command

ROOT = Path(__file__).parents[2]
RECIPE = ROOT / "recipes" / "tiny" / "full_tp2.yaml"
STEPS = 8
ARGS = ["--layout.dp_replicate_size=2", "--train.micro_batch_size=8", f"--train.max_steps={STEPS}",
        "--train.log_every=1", "--train.eval_every=100", "--train.checkpoint_every=2",
        "--optim.warmup_steps=2"]  # fmt: skip
#: How long every rank of both nodes may take to end after one node's launcher is killed.
BOUND_S = 30.0


def _losses(out: Path) -> list[tuple[int, float]]:
    with open(out / "metrics.csv", newline="") as handle:
        return [(int(row["step"]), float(row["train/loss"])) for row in csv.DictReader(handle) if row.get("train/loss")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[int, float]]:
    """The per-step losses of the same layout on one node: one launcher, 4 processes."""
    out = tmp_path_factory.mktemp("one_node")
    command = [sys.executable, "-m", "lightning_plugins", "finetune", str(RECIPE), "--hardware.devices=4", *ARGS,
               f"--train.output_dir={out}"]  # fmt: skip
    run_command(command, cwd=ROOT, timeout=300)
    losses = _losses(out)
    assert [step for step, _ in losses] == list(range(STEPS)), losses
    return losses


def _wait_for(path: Path, nodes: Nodes, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"no {path} after {timeout:g} s\n{nodes.output()[-6000:]}"
        time.sleep(0.05)


def _wait_for_row(out: Path, step: int, nodes: Nodes, timeout: float) -> None:
    """Until some attempt's ``logs/version_*/metrics.csv`` holds the training loss of ``step``."""
    deadline = time.monotonic() + timeout
    while True:
        for path in (out / "logs").glob("version_*/metrics.csv"):
            with open(path, newline="") as handle:
                if any(row["step"] == str(step) and row.get("train/loss") for row in csv.DictReader(handle)):
                    return
        assert time.monotonic() < deadline, f"no metrics row of step {step} after {timeout:g} s\n{nodes.output()[-6000:]}"
        time.sleep(0.05)


@pytest.mark.slow
def test_lightning_door_preempted_on_one_node_then_node_lost_then_resumed(
    tmp_path: Path, reference: list[tuple[int, float]]
) -> None:
    """SIGUSR1 to node 1's launching rank only: every rank stops at one step with its checkpoint. The same command
    resumes; node 1's launcher (rank 2, which started rank 3) is then SIGKILLed after the next checkpoint: every rank of
    both nodes ends within the bound and node 0 says a rank of node 1 ended; the same command resumes to the end."""
    out = tmp_path / "run"
    checkpoints = out / "checkpoints"
    preempted = _preempt_one_node("finetune", out, SIGUSR1, "SIGUSR1 to rank(s) [2]", {"node 0": 75, "node 1": 75})
    following = (preempted // 2 + 1) * 2  # the next periodic checkpoint (train.checkpoint_every=2)
    assert following < STEPS, f"preempted at step {preempted}: too late to lose a node before the run ends"
    with start_nodes("finetune", RECIPE, *ARGS, f"--train.output_dir={out}") as nodes:
        _wait_for(checkpoints / f"step={following}.ckpt", nodes, 240)
        # Lightning writes a step's metrics row after its checkpoint (ModelCheckpoint runs in on_train_batch_end, the
        # loggers after it): a node lost in between would lose that row, which the resume never trains again.
        _wait_for_row(out, following - 1, nodes, 60)
        nodes.signal(1)  # SIGKILL node 1's launcher only
        took = nodes.wait_gone(BOUND_S)
        print(f"every rank of both nodes ended {took:.1f} s after node 1's launcher was killed")
        codes = nodes.wait(0)
        assert codes == {"node 0": 1, "node 1": -9}, (codes, nodes.output()[-6000:])
        said = nodes.err(0)
    assert not (checkpoints / f"step={STEPS}.ckpt").exists(), "the kill came after the run ended"
    assert "RankFailure: rank 0 (node 0 of 2) lost its connection to a rank on node 1" in said, said[-4000:]
    complete = sorted(int(p.name[5:-5]) for p in checkpoints.glob("step=*.ckpt"))
    assert complete[-1] >= following, complete
    _resume_on_two_nodes("finetune", out, complete[-1], reference)


@pytest.mark.slow
def test_accelerate_door_preempted_on_one_node_then_resumed(tmp_path: Path, reference: list[tuple[int, float]]) -> None:
    """SIGTERM to node 1's ``accelerate launch`` only: every rank of both nodes stops at one step with its checkpoint;
    the same two-node command resumes from it on the one-node trajectory."""
    out = tmp_path / "run"
    step = _preempt_one_node("accelerate", out, SIGTERM, "SIGTERM to rank(s) [2, 3]", None)
    _resume_on_two_nodes("accelerate", out, step, reference)


def _preempt_one_node(door: str, out: Path, sig: int, reason: str, expected: dict[str, int] | None) -> int:
    """Start a two-node job, send ``sig`` to node 1's launcher once ``step=2.ckpt`` is written; every process of both
    nodes ends within the bound, non-zero, with the checkpoint of the step rank 0 names (saying ``reason``) and none
    later. Returns that step."""
    checkpoints = out / "checkpoints"
    with start_nodes(door, RECIPE, *ARGS, f"--train.output_dir={out}") as nodes:
        _wait_for(checkpoints / "step=2.ckpt", nodes, 240)
        nodes.signal(1, sig)
        took = nodes.wait_gone(BOUND_S)
        print(f"{door}: every rank of both nodes stopped {took:.1f} s after node 1's launcher got signal {sig}")
        codes, said = nodes.wait(0), nodes.output()
    assert all(code != 0 for code in codes.values()) and (expected is None or codes == expected), (codes, said[-6000:])
    found = re.search(rf"preempted \({re.escape(reason)}\) at step (\d+): checkpoint saved to (\S+);", said)
    assert found, said[-6000:]
    step = int(found.group(1))
    assert 2 <= step < STEPS and found.group(2) == str(checkpoints / f"step={step}.ckpt"), (found.group(0), said[-6000:])
    assert (checkpoints / f"step={step}.ckpt" / ".metadata").is_file()
    assert max(int(p.name[5:-5]) for p in checkpoints.glob("step=*.ckpt")) == step
    return step


def _resume_on_two_nodes(door: str, out: Path, step: int, reference: list[tuple[int, float]]) -> None:
    """The same two-node command resumes from ``step=step.ckpt`` and ends on the reference trajectory."""
    checkpoints = out / "checkpoints"
    with start_nodes(door, RECIPE, *ARGS, f"--train.output_dir={out}") as nodes:
        nodes.check(300)
        assert f"resumed_from: {checkpoints / f'step={step}.ckpt'}" in nodes.out(0), nodes.output()[-6000:]
        assert "warning" not in nodes.output().lower(), nodes.output()[-6000:]
    assert (checkpoints / f"step={STEPS}.ckpt" / ".metadata").is_file()
    _same_losses(out, reference)


def _same_losses(out: Path, reference: list[tuple[int, float]]) -> None:
    got = _losses(out)
    assert [s for s, _ in got] == [s for s, _ in reference], (got, reference)
    torch.testing.assert_close(
        torch.tensor([v for _, v in got]), torch.tensor([v for _, v in reference]), rtol=1e-5, atol=1e-5, msg=str(got)
    )
