"""One run per output directory and one resume decision per job (issue 23).

The lock (:mod:`lightning_plugins.run.lock`): a held directory is refused naming the holder; the lock of a run that is
gone (pid gone, pid reused, another host's lock untouched too long) is taken over with a notice; the lock is released
however its run ends. Through the doors: a second run on a directory a Lightning run holds is refused at once by the
Accelerate door, and the first run finishes; a complete checkpoint that appears while a job starts (after rank 0
looked, before the other ranks would) is ignored by every rank in both doors, on the trajectory of a fresh run.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from _launch import collected, shared_run
from lightning_plugins.testing.world import free_port, run_command

from lightning_plugins.checkpoint.resume_choice import RESUME_ENV, check_same_decision
from lightning_plugins.run.lock import LOCK_NAME, take_run_lock
from lightning_plugins.errors import RunLockError

ROOT = Path(__file__).parents[2]
RECIPE = ROOT / "recipes" / "tiny" / "full_tp2.yaml"
CONFIG = ROOT / "accelerate_configs" / "cpu_2proc.yaml"
HOOKS = ROOT / "tests" / "scripts" / "run_lock_hooks.py"
STEPS = 6
ARGS = [f"--train.max_steps={STEPS}", "--train.log_every=1", "--train.eval_every=100", "--train.checkpoint_every=2",
        "--optim.warmup_steps=2", "--train.micro_batch_size=8"]  # fmt: skip


def _write_lock(out: Path, **holder: object) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_NAME
    path.write_text(json.dumps({"since": time.time(), "command": "train.py", "token": "x", **holder}))
    return path


def test_a_held_directory_is_refused_naming_the_holder(tmp_path: Path) -> None:
    lock = take_run_lock(tmp_path)
    holder = json.loads((tmp_path / LOCK_NAME).read_text())
    assert (holder["host"], holder["pid"]) == (socket.gethostname(), os.getpid())
    with pytest.raises(RunLockError) as refused:
        take_run_lock(tmp_path)
    message = str(refused.value)
    assert f"host {socket.gethostname()}, pid {os.getpid()}" in message and sys.executable in message
    assert "another train.output_dir" in message
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()
    take_run_lock(tmp_path).release()  # free again


def test_the_lock_of_a_run_that_is_gone_is_taken_over(tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    here = socket.gethostname()
    said: list[str] = []
    cases = {
        "dead pid": ({"host": here, "pid": int(gone.stdout)}, 0.0, f"pid {int(gone.stdout)} is gone"),
        "reused pid": ({"host": here, "pid": os.getpid(), "pid_start": "1"}, 0.0, "now belongs to another process"),
        "silent host": ({"host": "node-7", "pid": 12}, 400.0, "last touched"),
    }
    for name, (holder, age, reason) in cases.items():
        path = _write_lock(tmp_path / name, **holder)
        os.utime(path, (time.time() - age, time.time() - age))
        lock = take_run_lock(path.parent, said.append)
        assert said[-1].startswith(f"Taking over {path}") and reason in said[-1], (name, said)
        assert f"host {holder['host']}, pid {holder['pid']}" in said[-1]
        assert json.loads(path.read_text())["pid"] == os.getpid()
        lock.release()
    # Another host's lock touched recently: that run may be alive.
    _write_lock(tmp_path / "busy host", host="node-7", pid=12)
    with pytest.raises(RunLockError, match="host node-7, pid 12"):
        take_run_lock(tmp_path / "busy host")
    assert len(said) == 3


def test_the_lock_is_released_however_the_run_ends(tmp_path: Path) -> None:
    endings = {"exception": 1, "exit": 3, "sigterm": 128 + signal.SIGTERM}
    procs = {}
    for ending in endings:
        # The module alone (framework-free), not the package, whose __init__ imports torch (seconds per process): the
        # package is registered bare (its path only), so lock.py's `from lightning_plugins.errors import ...` loads
        # errors.py alone.
        module = ROOT / "lightning_plugins" / "run" / "lock.py"
        script = textwrap.dedent(f"""
            import importlib.util, sys, time, types
            package = types.ModuleType("lightning_plugins")
            package.__path__ = [{str(module.parents[1])!r}]
            sys.modules["lightning_plugins"] = package
            spec = importlib.util.spec_from_file_location("run_lock", {str(module)!r})
            run_lock = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(run_lock)
            run_lock.take_run_lock({str(tmp_path / ending)!r})
            assert "torch" not in sys.modules, "the lock module alone imported torch"
            print("held", flush=True)
            sys.stdin.readline()  # until the test has seen the lock
            if {ending!r} == "exception":
                raise RuntimeError("boom")
            if {ending!r} == "exit":
                sys.exit(3)
            time.sleep(60)
        """)
        procs[ending] = subprocess.Popen(
            [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
    for ending, proc in procs.items():
        assert proc.stdin is not None and proc.stdout is not None
        assert proc.stdout.readline() == "held\n", proc.communicate()
        assert (tmp_path / ending / LOCK_NAME).exists()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        if ending == "sigterm":
            proc.send_signal(signal.SIGTERM)
    for ending, proc in procs.items():
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == endings[ending], (ending, err)
        assert not (tmp_path / ending / LOCK_NAME).exists(), ending


def test_ranks_that_took_different_resume_decisions_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another node's launcher decides for its own ranks: the strategy checks, once the ranks can talk, that all agree
    (the gather is given here: rank 1's node found a checkpoint that rank 0's did not)."""
    check_same_decision(lambda mine: [mine, mine])  # nothing handed down (a Trainer the script builds itself)
    monkeypatch.setenv(RESUME_ENV, "")
    check_same_decision(lambda mine: [mine, mine])
    with pytest.raises(RuntimeError, match=r"rank 0: no checkpoint; rank 1: out/checkpoints/step=4.ckpt\).*--resume"):
        check_same_decision(lambda mine: [mine, "out/checkpoints/step=4.ckpt"])


def _accelerate(script: list[str]) -> list[str]:
    launch = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(CONFIG),
              "--main_process_port", str(free_port())]  # fmt: skip
    return [*launch, *script]


def _losses(out: Path) -> list[tuple[int, float]]:
    with open(out / "metrics.csv", newline="") as handle:
        return [(int(row["step"]), float(row["train/loss"])) for row in csv.DictReader(handle) if row.get("train/loss")]


@pytest.fixture(scope="module")
def first_run(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> tuple[Path, subprocess.CompletedProcess | None]:
    """A Lightning run (TP=2, checkpoints at steps 2, 4 and 6) and how it ended. An Accelerate run is started on its
    directory meanwhile when this session runs the test that reads how that ended (slow: the default suite checks the
    refusal in one process, test_a_held_directory_is_refused_naming_the_holder, and launches no world only to be
    refused); otherwise it is test_integrity's reference run (``_launch.shared_run``: once per session), ``None``."""
    if not collected(request, "test_a_second_run_on_a_held_directory_is_refused_at_once"):
        command = [sys.executable, "-m", "lightning_plugins", "finetune", str(RECIPE), *ARGS]
        return shared_run(tmp_path_factory, command), None
    out = tmp_path_factory.mktemp("first") / "out"
    command = [sys.executable, str(HOOKS), "finetune", str(RECIPE), f"--train.output_dir={out}", *ARGS]
    second = _accelerate(["-m", "lightning_plugins.accelerate", str(RECIPE), f"--train.output_dir={out}", *ARGS])
    proc = run_command(command, cwd=ROOT, timeout=300, LIGHTNING_PLUGINS_TEST_SECOND=json.dumps(second))
    return out, proc


@pytest.mark.slow
def test_a_second_run_on_a_held_directory_is_refused_at_once(
    first_run: tuple[Path, subprocess.CompletedProcess | None],
) -> None:
    out, proc = first_run
    second = json.loads((out.parent / "second.json").read_text())
    assert second["returncode"] != 0
    holder = f"is in use by another run (host {socket.gethostname()}, pid "
    assert f"error: {out} {holder}" in second["stderr"] and str(HOOKS) in second["stderr"], second["stderr"][-3000:]
    print(f"second run refused in {second['seconds']:.1f} s")
    # The first run was not disturbed: it finished, released the directory, and its results are complete.
    assert "resumed_from: None" in proc.stdout
    assert [step for step, _ in _losses(out)] == list(range(STEPS))
    assert not (out / LOCK_NAME).exists()
    take_run_lock(out).release()


@pytest.mark.parametrize("door", ["finetune", pytest.param("accelerate", marks=pytest.mark.slow)])
def test_a_checkpoint_appearing_while_a_job_starts_is_ignored_by_every_rank(
    first_run: tuple[Path, subprocess.CompletedProcess | None], tmp_path: Path, door: str
) -> None:
    """Rank 0 finds no checkpoint; one appears before the other ranks would look: every rank starts fresh, and the
    run is the first run's (a rank that resumed alone would hang the job until the collective timeout)."""
    reference, _ = first_run
    out = tmp_path / "out"
    args = [str(RECIPE), f"--train.output_dir={out}", *ARGS, "--train.collective_timeout_s=60"]
    command = [sys.executable, str(HOOKS), door, *args]
    proc = run_command(
        command if door == "finetune" else _accelerate(command[1:]), cwd=ROOT, timeout=300,
        LIGHTNING_PLUGINS_TEST_APPEARS=str(reference / "checkpoints" / "step=4.ckpt"),
    )  # fmt: skip
    assert (out / "appeared").exists()  # the checkpoint did appear, after rank 0 looked
    assert "resumed_from: None" in proc.stdout, proc.stdout[-3000:]
    steps, losses = zip(*_losses(out), strict=True)
    reference_steps, reference_losses = zip(*_losses(reference), strict=True)
    assert steps == reference_steps == tuple(range(STEPS))
    assert losses == pytest.approx(reference_losses, abs=1e-5)
