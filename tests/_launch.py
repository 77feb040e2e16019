"""``accelerate launch`` of the tiny recipes, shared by the tests that start the Accelerate door for real."""

from __future__ import annotations

import importlib
import io
import json
import os
import subprocess
import sys
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

from lightning_plugins.testing.world import free_port, run_command, run_world

ROOT = Path(__file__).parents[1]
TINY = ROOT / "recipes" / "tiny"
CONFIG = ROOT / "accelerate_configs" / "cpu_2proc.yaml"
SCRIPTS = ROOT / "tests" / "scripts"


def accelerate_launch(
    recipe: Path, out: Path, *extra: str, config: Path = CONFIG, launch: tuple[str, ...] = (), expected: int | None = 0
) -> subprocess.CompletedProcess:
    """``accelerate launch --config_file CONFIG [options] -m lightning_plugins.accelerate RECIPE [overrides]``, ended with
    status ``expected`` (``None``: any) and no rank crashed (:func:`lightning_plugins.testing.world.run_command`)."""
    launcher = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(config), *launch]
    command = [*launcher, "--main_process_port", str(free_port()), "-m", "lightning_plugins.accelerate", str(recipe),
               f"--train.output_dir={out}", *extra]  # fmt: skip
    return run_command(command, cwd=ROOT, expected=expected)


def clean_stdout(proc: subprocess.CompletedProcess) -> str:
    """The run's standard output, after checking its console is clean (how it ended is checked by run_command)."""
    assert "warning" not in proc.stderr.lower(), proc.stderr[-3000:]
    return proc.stdout


def in_process(module: str, argv: list[str], **env: str) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGV`` run in this process (its ``main``; no interpreter start and its seconds of imports),
    with ``env`` added to the environment meanwhile: the exit status, stdout and stderr the interpreter would give
    (a ``sys.exit`` message is written to stderr with status 1)."""
    main = importlib.import_module("lightning_plugins.cli" if module == "lightning_plugins" else f"{module}.__main__").main
    out, err, saved, code = io.StringIO(), io.StringIO(), dict(os.environ), 0
    os.environ.update(env)
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                main(argv)
            except SystemExit as stop:
                code = stop.code
    finally:
        os.environ.clear()
        os.environ.update(saved)
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=err)
        code = 1
    return subprocess.CompletedProcess([module, *argv], code, out.getvalue(), err.getvalue())


def collected(request, test: str) -> list[dict]:
    """The parameters (``name -> value``) of each test of the function ``test`` (in the requesting module) that this
    session runs, after ``-m``/``-k`` deselection: a module fixture makes for them only what they will read, so a
    shared reference run whose only readers are marked slow costs the default suite nothing."""
    return [getattr(getattr(item, "callspec", None), "params", {}) for item in request.session.items
            if item.module is request.module and getattr(item, "originalname", None) == test]  # fmt: skip


#: Trainer test scripts (``tests/scripts``) that share one launched world of their rank count, each with the test
#: that reads its results: a session runs every one that its tests read in one world (``script_chain.py``), so the
#: ranks start and import once, not once per script.
SHARED_WORLDS: dict[tuple[str, int], str] = {
    ("save_habits_trainer.py", 2): "tests/checkpoint/test_save_habits.py::test_lightning_save_pretrained_after_fit",
    ("lightning_habits.py", 2):
        "tests/strategies/test_lightning_habits.py::test_model_parallel_strategy_modules_train_like_one_process",
    ("pipeline_trainer.py", 2):
        "tests/strategies/test_pipeline_trainer.py::test_pipeline_trainer_matches_one_process_and_resumes[2]",
    ("trainer_parity.py", 2): "tests/strategies/test_trainer_parity.py::test_trainer_matches_one_process_and_resumes[2]",
    ("context_trainer.py", 4): "tests/strategies/test_context_trainer.py::test_context_parallel_trainer_matches_one_process",
    ("lora_trainer.py", 4): "tests/strategies/test_lora_trainer.py::test_lora_under_every_strategy[4]",
    ("preference_trainer.py", 2):
        "tests/preference/test_preference_trainer.py::test_dpo_in_the_users_module_under_each_strategy",
    ("entry_points.py", 2): "tests/strategies/test_entry_points.py::test_every_entry_point_after_fit",
}
#: ``(script, devices) -> its results``, or the failure of the world that ran it, once per session.
_SHARED_RESULTS: dict[tuple[str, int], Any] = {}


def shared_script(request, tmp_path_factory, script: str, devices: int) -> dict[str, Any]:
    """The results of ``tests/scripts/SCRIPT --devices N --out results.json``, run in one world with every other script
    of :data:`SHARED_WORLDS` of that rank count that this session's tests read (made when first asked). A script that
    failed, or did not run because one before it failed, raises that world's failure for its test."""
    key = (script, devices)
    if key not in _SHARED_RESULTS:
        running = {item.nodeid for item in request.session.items}
        keys = [k for k, reader in SHARED_WORLDS.items() if k[1] == devices and reader in running and k not in _SHARED_RESULTS]
        keys += [] if key in keys else [key]
        root = tmp_path_factory.mktemp(f"world{devices}")
        outs = {k: root / Path(k[0]).stem / "results.json" for k in keys}
        runs = [[k[0], "--devices", str(devices), "--out", str(outs[k])] for k in keys]
        for out in outs.values():
            out.parent.mkdir()
        failure: BaseException | None = None
        try:
            run_command([sys.executable, str(SCRIPTS / "script_chain.py"), json.dumps(runs)], cwd=root, timeout=1500)
        except AssertionError as err:
            failure = err
        for k, out in outs.items():
            _SHARED_RESULTS[k] = json.loads(out.read_text()) if out.is_file() else failure
            if _SHARED_RESULTS[k] is None:  # the chain ended well, without this script's results
                _SHARED_RESULTS[k] = AssertionError(f"{k[0]} wrote no results ({out})")
    result = _SHARED_RESULTS[key]
    if isinstance(result, BaseException):
        raise result
    return result


#: ``(command without its output directory) -> the output directory of its run``, once per session.
_SHARED_RUNS: dict[tuple[str, ...], Path] = {}


def shared_run(tmp_path_factory, command: list[str], timeout: int = 300) -> Path:
    """The output directory of ``command`` (a door's command line without ``--train.output_dir``) run to its end, once
    per session: test modules whose fixtures run the same command (its ``--`` options in any order) read one run; they
    only read it, or copy it. A Lightning-door run declared by :func:`declare_finetune_run` is made in a chain with the
    other declared runs of its world size (:func:`shared_finetune_runs`)."""
    key = _run_key(command)
    declared = [devices for args, devices, _ in DECLARED_RUNS if _run_key([*FINETUNE, *args]) == key]
    if key not in _SHARED_RUNS and declared and command[: len(FINETUNE)] == FINETUNE:
        return shared_finetune_runs(tmp_path_factory, [command[len(FINETUNE) :]], timeout, devices=declared[0])[0]
    if key not in _SHARED_RUNS:
        out = tmp_path_factory.mktemp("shared_run") / "out"
        run_command([*command, f"--train.output_dir={out}"], cwd=ROOT, timeout=timeout)
        _SHARED_RUNS[key] = out
    return _SHARED_RUNS[key]


def _run_key(command: list[str]) -> tuple[str, ...]:
    return (*[a for a in command if not a.startswith("--")], *sorted(a for a in command if a.startswith("--")))


#: A Lightning-door run's command line, less its arguments.
FINETUNE = [sys.executable, "-m", "lightning_plugins", "finetune"]
#: ``(ARGS, devices, reads)``: Lightning-door runs (``lightning-plugins finetune ARGS``, without
#: ``--train.output_dir``, on ``devices`` ranks) that test modules declare when imported, each with which collected
#: tests read it (``reads(item)``; ``tests/conftest.py`` keeps the session's items in :data:`SESSION_ITEMS`).
DECLARED_RUNS: list[tuple[list[str], int, Callable[[Any], bool]]] = []
SESSION_ITEMS: list[Any] = []


def declare_finetune_run(args: list[str], devices: int, reads: Callable[[Any], bool]) -> None:
    """Declare a run that :func:`shared_run` or :func:`shared_finetune_runs` will be asked for: the session's first
    chain of ``devices`` ranks makes it too, when a test that reads it runs, so one world starts for all of them."""
    DECLARED_RUNS.append((list(args), devices, reads))


def shared_finetune_runs(
    tmp_path_factory, runs: list[list[str]], timeout: int = 300, *, devices: int = 2, clean: bool = False
) -> list[Path]:
    """The output directory of ``lightning-plugins finetune ARGS`` for each ``ARGS`` of ``runs`` (without
    ``--train.output_dir``, on ``devices`` ranks), once per session and shared with :func:`shared_run` (the run of
    ``[python, -m, lightning_plugins, finetune, *ARGS]``): those not made yet, and the declared runs of that world size
    that this session's tests read, run one after another in one launched world (``tests/scripts/finetune_chain.py``),
    so its ranks start and import once. ``clean``: the chain's console holds no warning."""
    keys = [_run_key([*FINETUNE, *args]) for args in runs]
    read = [args for args, size, reads in DECLARED_RUNS if size == devices and any(map(reads, SESSION_ITEMS))]
    todo = [*zip(keys, runs, strict=True), *((_run_key([*FINETUNE, *args]), args) for args in read)]
    missing = {key: args for key, args in todo if key not in _SHARED_RUNS}
    if any(key in missing for key in keys):
        root = tmp_path_factory.mktemp("shared_runs")
        outs = {key: root / f"run{index}" for index, key in enumerate(missing)}
        argvs = [[*args, f"--train.output_dir={outs[key]}"] for key, args in missing.items()]
        command = [sys.executable, str(SCRIPTS / "finetune_chain.py"), json.dumps(argvs)]
        proc = run_command(command, cwd=ROOT, timeout=max(timeout, 150 * len(argvs)))
        if clean:
            clean_stdout(proc)
        _SHARED_RUNS.update(outs)
    return [_SHARED_RUNS[key] for key in keys]


def world_json(world: Any, world_size: int) -> list[dict]:
    """Launch ``world(rank, world_size, out_dir)`` on ``world_size`` ranks; each rank writes ``rank{r}.json`` into
    ``out_dir``: what they wrote, by rank."""
    import tempfile

    with tempfile.TemporaryDirectory() as out_dir:
        run_world(world, world_size, out_dir)
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world_size)]
