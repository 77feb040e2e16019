"""Bounded failures: a rank that dies or hangs ends the whole job within the configured bound, and the job's
last words name the rank and the cause (through both doors, 2 CPU processes, a fault injected at a chosen
optimizer step by tests/scripts/inject_fault.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from lightning_plugins.testing.world import free_port, run_command, run_world

from lightning_plugins.run.faults import describe_exit, is_collective_timeout
from lightning_plugins.recipe.schema import load_recipe
from lightning_plugins.errors import RecipeError

ROOT = Path(__file__).parents[2]
RECIPE = ROOT / "recipes" / "tiny" / "full_tp2.yaml"
INJECT = Path(__file__).parents[1] / "scripts" / "inject_fault.py"
TIMEOUT_S = 5  # train.collective_timeout_s of the launched runs
GRACE_S = 2  # SupervisedLauncher's wait for a failed rank's exit status
SLACK_S = 6  # process teardown on a loaded 2-core machine
TORCHRUN_GRACE_S = 3  # torchrun SIGKILLs a worker this long after the SIGTERM it stops it with (see _SHORT_GRACE)
#: ``accelerate launch`` (its console script's ``main``) with torchrun's grace shortened: its process context stops the
#: other workers of a failed one with ``close()`` and that method's default 30 s, not the configurable
#: ``--shutdown-timeout``. The same SIGTERM, then SIGKILL of the worker still running; the hung job spends 3 s of that
#: wait instead of 30.
_SHORT_GRACE = (
    "import sys\n"
    "from torch.distributed.elastic.multiprocessing.api import PContext\n"
    f"PContext.close.__defaults__ = (None, {TORCHRUN_GRACE_S})\n"
    "from accelerate.commands.accelerate_cli import main\n"
    "sys.exit(main())\n"
)


def _run(
    door: str, fault: str, rank: int, tmp_path: Path, steps: int = 6
) -> tuple[subprocess.CompletedProcess, float]:
    """Run the tiny TP=2 recipe through ``door`` with ``fault`` on ``rank`` at step 3; seconds from fault to exit."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    mark = tmp_path / "fault_time"
    args = [fault, str(rank), "3", str(mark), door]
    recipe = [str(RECIPE), f"--train.max_steps={steps}", f"--train.output_dir={tmp_path / 'run'}",
              f"--train.collective_timeout_s={TIMEOUT_S}"]  # fmt: skip
    if door == "lightning":
        command = [sys.executable, str(INJECT), *args, "finetune", *recipe]
    else:
        accelerate = [sys.executable, "-c", _SHORT_GRACE] if fault == "hang" else [
            str(Path(sys.executable).parent / "accelerate")]  # fmt: skip
        launch = [*accelerate, "launch", "--config_file",
                  str(ROOT / "accelerate_configs" / "cpu_2proc.yaml"), "--main_process_port", str(free_port())]  # fmt: skip
        command = [*launch, str(INJECT), *args, *recipe]
    proc = run_command(command, cwd=tmp_path, expected=1)  # and no rank crashed in native code on the way out
    ended = time.time()
    assert mark.is_file(), f"the fault never happened:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
    return proc, ended - float(mark.read_text())


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_lightning_dead_rank_ends_the_job_naming_it(tmp_path: Path) -> None:
    proc, elapsed = _run("lightning", "kill", 1, tmp_path)
    last = proc.stderr.strip().splitlines()[-1]
    assert elapsed < GRACE_S + SLACK_S, elapsed
    assert re.search(r"RankFailure: rank 1 \(pid \d+\) was killed by SIGKILL; rank 0 then stopped", last), last


@pytest.mark.slow
def test_lightning_rank_failing_after_the_run_fails_the_job(tmp_path: Path) -> None:
    """Lightning's launcher reports the launching rank's own status only: a rank that crashed on its way out, after
    training, left a job that looked successful. The launching rank now waits for its ranks when it exits."""
    proc, _ = _run("lightning", "exit_late", 1, tmp_path, steps=3)
    last = proc.stderr.strip().splitlines()[-1]
    assert re.search(r"RankFailure: rank 1 \(pid \d+\) exited with code 3, after the Trainer run of rank 0", last), last
    assert (tmp_path / "run" / "hf" / "config.json").is_file()  # the run itself finished


@pytest.mark.slow
def test_lightning_hung_rank_ends_by_the_collective_timeout(tmp_path: Path) -> None:
    proc, elapsed = _run("lightning", "hang", 1, tmp_path)
    last = proc.stderr.strip().splitlines()[-1]
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + GRACE_S + SLACK_S, elapsed
    assert f"RankFailure: rank 0: a collective got no answer from its peers within {TIMEOUT_S} s" in last, last
    assert "train.collective_timeout_s" in last, last
    stuck = re.search(r"Still running, so stopped: rank 1 \(pid (\d+)\)", last)
    assert stuck and _gone(int(stuck.group(1))), last


def test_accelerate_failed_rank_and_hung_rank(tmp_path: Path) -> None:
    """torchrun (under `accelerate launch`) names the first failure; the entry point's @record quotes its error. The
    two jobs run side by side: the hung one spends its ~8 s waiting (timeouts), not computing."""
    with ThreadPoolExecutor(1) as pool:
        hung = pool.submit(_run, "accelerate", "hang", 1, tmp_path / "hang")
        proc, elapsed = _run("accelerate", "raise", 1, tmp_path / "raise")
        assert elapsed < SLACK_S, elapsed
        root = proc.stderr[proc.stderr.index("Root Cause") :]
        assert re.search(r"rank\s*: 1 \(local_rank: 1\)", root), root
        assert "RuntimeError: injected fault on rank 1" in root, root
        proc, elapsed = hung.result()

    # Rank 0 times out and fails; torchrun then stops rank 1 with SIGTERM, which a rank takes as a preemption request
    # (a healthy rank saves at its step end): the hung one never gets there, and torchrun's SIGKILL ends it.
    assert TIMEOUT_S + TORCHRUN_GRACE_S <= elapsed < TIMEOUT_S + TORCHRUN_GRACE_S + SLACK_S, elapsed
    root = proc.stderr[proc.stderr.index("Root Cause") :]
    assert re.search(r"rank\s*: 0 \(local_rank: 0\)", root), root
    assert f"within {TIMEOUT_S} s" in root and "train.collective_timeout_s" in root, root


def _mesh_groups_wait_as_long_as_the_world(rank: int, world_size: int) -> None:
    from lightning_plugins.run.faults import set_collective_timeout
    from lightning_plugins.parallel.layout import ParallelLayout

    set_collective_timeout(timedelta(seconds=7))
    mesh = ParallelLayout(tp_size=2).resolve(world_size).build_mesh("cpu")
    for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_shard_cp", "dp_cp"):
        backend = mesh[name].get_group()._get_backend(torch.device("cpu"))
        assert backend.options._timeout == timedelta(seconds=7), (name, backend.options._timeout)


def test_mesh_groups_take_the_collective_timeout() -> None:
    # torch gives the groups it creates for a mesh dimension smaller than the world its 30-min default otherwise.
    run_world(_mesh_groups_wait_as_long_as_the_world, 2)


def test_collective_timeout_is_validated(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match=r"train.collective_timeout_s: Input should be greater than 0"):
        load_recipe(RECIPE, ["train.collective_timeout_s=0"])
    assert load_recipe(RECIPE).train.collective_timeout_s == 1800


def test_exit_and_timeout_descriptions() -> None:
    assert describe_exit(-9) == "was killed by SIGKILL" and describe_exit(1) == "exited with code 1"
    try:
        try:
            raise RuntimeError("[gloo/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete")
        except RuntimeError as inner:
            raise ValueError("while saving") from inner
    except ValueError as outer:
        assert is_collective_timeout(outer)
    assert not is_collective_timeout(RuntimeError("Connection closed by peer"))
