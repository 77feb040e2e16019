"""A run SIGKILLed anywhere resumes from its last complete checkpoint on the exact per-step trajectory of an
uninterrupted run: both doors under PP and under LoRA on FSDP2 (with dropout: the random states count), and TP through
the Lightning door.

Preemption (:mod:`lightning_plugins.run.preemption`): SIGTERM or SIGUSR1 to the launcher or to its process group, and the
launcher's own death, end every rank at the end of the step the signal arrived in, with ``step=N.ckpt`` written and a
non-zero exit; a SLURM job requeues itself; no worker outlives its launcher; chained interruptions resume on the
reference trajectory.

Kill points are chosen by ``tests/scripts/kill_run.py`` hooks (``LIGHTNING_PLUGINS_TEST_KILL``), not by sleeping:
one rank mid-step inside an accumulation window, the whole job mid-save (DCP data written, no ``.metadata``; or
everything written, before the rename) and between saves; with asynchronous saves (``train.async_checkpoint``) the
background writer dies while training goes on. The resume is the normal command. One uninterrupted
Lightning run per layout is the reference for both doors (the doors agree to 1e-5: test_accelerate_launch), except
with dropout, where each door has its own reference (the doors draw the same masks since the Accelerate door seeds
again where Lightning does: test_doors_dropout; measured equal on this layout, 4 steps, not relied on here).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning_plugins.testing.world import free_port, run_command, run_world
from _launch import collected, declare_finetune_run, shared_finetune_runs
from kill_run import ENV  # tests/scripts is on the path (_world)

ROOT = Path(__file__).parents[2]
TINY = ROOT / "recipes" / "tiny"
KILL = ROOT / "tests" / "scripts" / "kill_run.py"
CONFIG = ROOT / "accelerate_configs" / "cpu_2proc.yaml"
STEPS = 6
# Checkpoints at steps 2 and 4 (mid-epoch), 2 micro-batches per optimizer step.
SHORT = [f"--train.max_steps={STEPS}", "--train.log_every=1", "--train.eval_every=100", "--train.checkpoint_every=2",
         "--optim.warmup_steps=2"]  # fmt: skip
LAYOUTS = {
    "tp": ("full_tp2.yaml", ["--train.micro_batch_size=8"]),
    "pp": ("full_pp2.yaml", ["--train.micro_batch_size=8", "--parallel.pp_microbatches=2"]),
    "lora_fsdp2": ("lora_fsdp2_chat.yaml", ["--train.micro_batch_size=2", "--lora.dropout=0.1"]),
}
ASYNC = ["--train.async_checkpoint=true"]
SLOW = pytest.mark.slow
# (layout, door, kill point, the checkpoint the resume must start from, the partial save the kill leaves, extra args).
# The default suite kills a Lightning run mid-step and an Accelerate run mid-save (async); the other combinations
# are slow.
CASES = [
    ("tp", "finetune", "batch:7:1", 2, None, []),  # rank 1 dies in step 3's second micro-batch
    pytest.param("pp", "finetune", "save:4:before_rename", 2, 4, [], marks=SLOW),  # both doors publish alike
    pytest.param("pp", "accelerate", "batch:10", 4, None, [], marks=SLOW),  # between saves: step 5's first micro-batch
    pytest.param("lora_fsdp2", "finetune", "save:4:mid_dcp", 2, 4, [], marks=SLOW),
    pytest.param("lora_fsdp2", "accelerate", "batch:5:0", 2, None, [], marks=SLOW),  # rank 0, step 2's 2nd micro-batch
    # Asynchronous saves (killed and resumed runs alike): rank 0's background writer dies before DCP's .metadata
    # while training goes on.
    pytest.param("tp", "finetune", "save:4:mid_dcp", 2, 4, ASYNC, marks=SLOW),
    ("pp", "accelerate", "save:4:mid_dcp", 2, 4, ASYNC),
]


def _command(door: str, recipe: Path, out: Path, extra: list[str], *, kill: bool) -> list[str]:
    args = [str(recipe), f"--train.output_dir={out}", *SHORT, *extra]
    if door == "finetune":
        # In a session of its own: a signal to the launcher's process group reaches no test process.
        return ["setsid", sys.executable, str(KILL), "finetune", *args] if kill else [
            sys.executable, "-m", "lightning_plugins", "finetune", *args]  # fmt: skip
    launch = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(CONFIG),
              "--main_process_port", str(free_port())]  # fmt: skip
    return [*launch, str(KILL), "accelerate", *args] if kill else [*launch, "-m", "lightning_plugins.accelerate", *args]


def _run(command: list[str], expected: int | None = 0, **env: str) -> subprocess.CompletedProcess:
    return run_command(command, cwd=ROOT, timeout=300, expected=expected, **env)


def _losses(out: Path) -> list[tuple[int, float]]:
    with open(out / "metrics.csv", newline="") as handle:
        return [(int(row["step"]), float(row["train/loss"])) for row in csv.DictReader(handle) if row.get("train/loss")]


def _exports_the_door_adapter(checkpoint: Path, adapter: Path, out: Path) -> None:
    """``lightning-plugins export`` of the Accelerate door's last LoRA checkpoint (one process, streaming) is the peft
    adapter the door exported from the trained model in memory: the same config and the same tensors."""
    from safetensors.torch import load_file

    from lightning_plugins.cli import main

    main(["export", str(checkpoint), str(out)])
    configs = [json.loads((d / "adapter_config.json").read_text()) for d in (out, adapter)]
    for config in configs:  # peft keeps them as a set: written in each process's own order
        config["target_modules"] = sorted(config["target_modules"])
    assert configs[0] == configs[1], configs
    got, want = (load_file(d / "adapter_model.safetensors") for d in (out, adapter))
    assert sorted(got) == sorted(want) and any("lora_B" in k for k in want), sorted(got)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)


#: Layouts with dropout (random states in the checkpoints): one reference per door.
PER_DOOR = {"lora_fsdp2"}


def _reads(layout: str) -> Callable[[Any], bool]:
    """Whether a collected test reads the Lightning door's reference of ``layout`` (the preempted test: TP's)."""

    def reads(item: Any) -> bool:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.path != Path(__file__) or "references" not in item.fixturenames or params.get("layout", "tp") != layout:
            return False
        return layout not in PER_DOOR or params.get("door") == "finetune"

    return reads


# The references are made in the session's first chain of 2-rank Lightning runs (_launch.shared_finetune_runs).
for _layout, (_recipe, _extra) in LAYOUTS.items():
    declare_finetune_run([str(TINY / _recipe), *SHORT, *_extra], 2, _reads(_layout))


@pytest.fixture(scope="module")
def references(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Callable[[str, str], list[tuple[int, float]]]:
    """``reference(layout, door)``: the per-step losses of one uninterrupted run (made once, when first asked). The
    Lightning door's references of every layout this session's tests read are made together, in one launched world
    (``_launch.shared_finetune_runs``): the default suite's read TP and PP, not LoRA (its cases are slow). The TP one
    is test_integrity's reference run (the same command), made once for both."""
    found: dict[tuple[str, str], list[tuple[int, float]]] = {}
    root = tmp_path_factory.mktemp("reference")
    read = [(p["layout"], p["door"]) for p in collected(request, "test_killed_run_resumes_on_the_same_trajectory")]
    read += [("tp", p["door"]) for p in collected(request, "test_preempted_run_resumes_on_the_same_trajectory")]
    chained = [name for name in LAYOUTS if any(lay == name and name not in PER_DOOR or (lay, door) == (name, "finetune")
                                               for lay, door in read)]  # fmt: skip

    def reference(layout: str, door: str) -> list[tuple[int, float]]:
        key = (layout, door if layout in PER_DOOR else "finetune")
        if key not in found:
            keys = [(name, "finetune") for name in dict.fromkeys([*chained, layout])] if key[1] == "finetune" else [key]
            if key[1] == "finetune":
                runs = [[str(TINY / LAYOUTS[k[0]][0]), *SHORT, *LAYOUTS[k[0]][1]] for k in keys]
                outs = dict(zip(keys, shared_finetune_runs(tmp_path_factory, runs), strict=True))
            else:
                recipe, extra = LAYOUTS[layout]
                outs = {key: root / f"{key[0]}_{key[1]}"}
                _run(_command(key[1], TINY / recipe, outs[key], extra, kill=False))
            for k in keys:
                found[k] = _losses(outs[k])
                assert [step for step, _ in found[k]] == list(range(STEPS)), found[k]
        return found[key]

    return reference


IDS = [f"{c[0]}-{c[1]}" + ("-async" if c[5] else "") for c in (getattr(c, "values", c) for c in CASES)]


@pytest.mark.parametrize(("layout", "door", "kill", "resumed", "partial", "options"), CASES, ids=IDS)
def test_killed_run_resumes_on_the_same_trajectory(
    references: Callable[[str, str], list[tuple[int, float]]],
    tmp_path: Path,
    layout: str,
    door: str,
    kill: str,
    resumed: int,
    partial: int | None,
    options: list[str],
) -> None:
    recipe, extra = LAYOUTS[layout]
    extra = [*extra, *options]
    out = tmp_path / "run"
    killed = _run(_command(door, TINY / recipe, out, extra, kill=True), None, LIGHTNING_PLUGINS_TEST_KILL=kill)
    assert killed.returncode != 0 and "kill_run: SIGKILL" in killed.stderr, killed.stderr[-6000:]
    if options == ASYNC:  # the save was written in the background, not by the training thread
        assert "(thread AsyncCheckpointExecutor" in killed.stderr, killed.stderr[-3000:]
    checkpoints = out / "checkpoints"
    complete = sorted(p.name for p in checkpoints.glob("step=*.ckpt"))
    assert complete == [f"step={s}.ckpt" for s in range(2, resumed + 1, 2)], complete
    if partial is not None:  # the interrupted save is left aside, never under the final name
        assert (checkpoints / f"step={partial}.ckpt.partial").is_dir()
        if kill.endswith("mid_dcp"):
            assert not (checkpoints / f"step={partial}.ckpt.partial" / ".metadata").exists()

    proc = _run(_command(door, TINY / recipe, out, extra, kill=False))
    assert "warning" not in proc.stderr.lower(), proc.stderr[-3000:]
    assert f"resumed_from: {checkpoints / f'step={resumed}.ckpt'}" in proc.stdout, proc.stdout[-3000:]
    assert not list(checkpoints.glob("*.partial")) and not list(checkpoints.glob("*.previous"))
    assert (checkpoints / f"step={STEPS}.ckpt" / ".metadata").is_file()  # the last save was complete before the exit
    if layout == "lora_fsdp2" and door == "accelerate":
        _exports_the_door_adapter(checkpoints / f"step={STEPS}.ckpt", out / "adapter", tmp_path / "export")
    got, want = _losses(out), references(layout, door)
    assert [s for s, _ in got] == [s for s, _ in want], (got, want)
    torch.testing.assert_close(
        torch.tensor([v for _, v in got]), torch.tensor([v for _, v in want]), rtol=1e-5, atol=1e-5, msg=str(got)
    )


# Interruptions chained in one output directory (the signal is sent before rank 0's K-th forward of the attempt; two
# micro-batches per step): (kill point, the step the attempt stops at with a checkpoint, or None: killed outright).
CHAINS = {
    # Lightning: SIGTERM to the process group, SIGUSR1 to the launching rank, the launching rank SIGKILLed.
    "finetune": [("signal:5:SIGTERM:group", 3), ("signal:1:SIGUSR1:launcher", 4), ("batch:1:0", None)],
    # Accelerate: SIGTERM to `accelerate launch` (torchrun forwards it); SIGUSR1 to it and to every rank, as SLURM's
    # --signal delivers it, the launcher ignoring it as recipes/slurm/accelerate.sbatch makes it; SIGKILL to the
    # launcher (the workers' watchdogs see it gone).
    "accelerate": [
        ("signal:5:SIGTERM:launcher", 3), ("signal:1:SIGUSR1:step", 4), ("signal:1:SIGKILL:launcher", 5)
    ],
}


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] in ("Z", "X")  # reaped soon
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.mark.parametrize("door", [pytest.param("finetune", marks=SLOW), "accelerate"])
def test_preempted_run_resumes_on_the_same_trajectory(
    references: Callable[[str, str], list[tuple[int, float]]], tmp_path: Path, door: str
) -> None:
    recipe, extra = LAYOUTS["tp"]
    out, pids, stub = tmp_path / "run", tmp_path / "pids", tmp_path / "bin"
    checkpoints = out / "checkpoints"
    stub.mkdir()
    (stub / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    (stub / "scontrol").chmod(0o755)
    slurm = {"SLURM_JOB_ID": "4242", "PATH": f"{stub}:{os.environ['PATH']}"}
    resumed = None
    for attempt, (kill, stopped) in enumerate(CHAINS[door]):
        pids.mkdir()
        env = {ENV: kill, "LIGHTNING_PLUGINS_TEST_PIDS": str(pids), **(slurm if attempt == 0 else {})}
        command = _command(door, TINY / recipe, out, extra, kill=True)
        if kill.endswith(":step"):  # the launcher ignores the signal, as in recipes/slurm/accelerate.sbatch
            command = ["bash", "-c", 'trap "" USR1; exec "$@"', "bash", *command]
        proc = _run(command, None, **env)
        assert proc.returncode != 0, proc.stderr[-3000:]
        if kill.endswith(":step"):  # the launcher lived on to report its workers' status 75
            assert proc.returncode == 1, proc.stderr[-3000:]
        workers = [int(p.read_text()) for p in pids.iterdir()]
        assert len(workers) == 2 and all(_gone(pid) for pid in workers), (workers, proc.stderr[-3000:])  # no orphans
        if stopped is None:  # killed outright: nothing new written
            assert not (checkpoints / f"step={resumed + 1}.ckpt").exists()
        else:
            if door == "finetune":
                assert proc.returncode == 75, proc.stderr[-3000:]  # the launching rank's own status
            said = f"at step {stopped}: checkpoint saved to {checkpoints / f'step={stopped}.ckpt'}; the same command"
            assert said in proc.stderr, proc.stderr[-3000:]
            assert (checkpoints / f"step={stopped}.ckpt" / ".metadata").is_file()
            assert not (checkpoints / f"step={stopped + 1}.ckpt").exists()
            resumed = stopped
        if attempt == 0:  # under SLURM the job requeued itself, once, from rank 0
            assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
            assert "SLURM job 4242 requeued." in proc.stderr
        pids.rename(tmp_path / f"pids{attempt}")
    assert not list(checkpoints.glob("*.partial"))
    proc = _run(_command(door, TINY / recipe, out, extra, kill=False))
    assert "warning" not in proc.stderr.lower(), proc.stderr[-3000:]
    assert f"resumed_from: {checkpoints / f'step={resumed}.ckpt'}" in proc.stdout, proc.stdout[-3000:]
    got, want = _losses(out), references("tp", door)
    assert [s for s, _ in got] == [s for s, _ in want], (got, want)
    torch.testing.assert_close(
        torch.tensor([v for _, v in got]), torch.tensor([v for _, v in want]), rtol=1e-5, atol=1e-5, msg=str(got)
    )


def test_a_preempted_rank_stuck_before_its_step_end_exits_within_the_bound() -> None:
    """The watchdog ends a preempted process that never reaches the agreement (blocked for good) after the bound."""
    code = (
        "import os, signal, sys, time, types\n"
        # The package registered bare (its path only): its __init__ (torch, transformers, the engine: seconds) is not
        # what this process tests; preemption.py itself imports torch.
        "sys.modules['lightning_plugins'] = package = types.ModuleType('lightning_plugins')\n"
        f"package.__path__ = [{str(ROOT / 'lightning_plugins')!r}]\n"
        "from lightning_plugins.run.preemption import Preemption\n"
        "Preemption(['SIGTERM'], watch_parent=False, exit_within_s=0.5, poll_s=0.05).install()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    proc = _run([sys.executable, "-c", code], 75)
    assert time.monotonic() - start < 30, proc.stderr
    assert "preempted (SIGTERM): rank 0" in proc.stderr and "within 0.5 s; ended without a checkpoint" in proc.stderr


def _agreement_cases(rank: int, world_size: int) -> None:
    import signal

    from lightning_plugins.run.preemption import Preemption

    preemption = Preemption(["SIGUSR1"], watch_parent=False)
    preemption.install()
    try:
        assert preemption.agree() is False and preemption.reason is None
        if rank >= 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        assert preemption.agree() is True  # every rank, in the same step
        want = "SIGUSR1" if rank >= 1 else f"SIGUSR1 to rank(s) {list(range(1, world_size))}"
        assert preemption.reason == want, preemption.reason  # rank 0, which says it, names who got what
    finally:
        preemption.uninstall()


def test_every_rank_agrees_on_a_preemption_that_reached_some_and_rank_0_names_them() -> None:
    run_world(_agreement_cases, 3)
