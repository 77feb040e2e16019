"""Launch worlds of CPU processes for the tests and the benchmarks, and check how every one of them ended.

Every place the tests start processes goes through here: :func:`run_world` (a gloo world running one function),
:func:`run_script` and :func:`run_command` (a script, ``lightning-plugins ...`` or ``accelerate launch ...`` that
starts its own ranks). Each checks the exit status of every rank and that no rank crashed in native code
(:func:`check_exit`): a rank that aborts while exiting, after the results are written, fails the test, because a
scheduler would see that job fail. The Lightning door's launching rank and torchrun wait for the ranks they start
and fail when one does, so a script's status covers its ranks. The benchmarks time their worlds with
:func:`spawn_world` and :func:`world_rows` (spawned processes, a chosen number of torch threads each).
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_plugins.testing.exit_report import EXIT_REPORTS, backend_threads, read_exit_reports

#: What a process prints when it dies in native code: the C++ runtime's abort (``terminate called ...``), a
#: fatal signal (the shell, or ``faulthandler``: every test process runs with it).
CRASH_MARKERS = ("terminate called", "Segmentation fault", "Fatal Python error")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (a world's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check_exit(returncodes: dict[str, int | None], output: str, expected: int | None = 0) -> None:
    """Assert that every process exited with ``expected`` (``None``: any status) and that none crashed in native code.

    Args:
        returncodes: Each process's exit status (a negative one is the signal that killed it).
        output: What the processes printed; it must not contain any of :data:`CRASH_MARKERS`.
        expected: The status every process must have.
    """
    wrong = {who: code for who, code in returncodes.items() if expected is not None and code != expected}
    crashed = [line for line in output.splitlines() if any(marker in line for marker in CRASH_MARKERS)]
    if wrong or crashed:
        # Every exception line first: the rank that failed first is often not the one whose traceback ends the log.
        causes = "\n".join(dict.fromkeys(re.findall(r"^.*\w+(?:Error|Exception|Killed|Failure)\b.*$", output, re.M)))
        raise AssertionError(
            f"exit status {wrong} (expected {expected}); native crash: {crashed}\n{causes[-4000:]}\n---\n{output[-8000:]}"
        )


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], errors: Any, logs: str) -> None:
    # What this rank prints (a native crash's last words included) goes to its log, checked after the world ends.
    log = os.open(Path(logs, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    for fd in (1, 2):
        os.dup2(log, fd)
    faulthandler.enable()  # a rank that dies of a signal prints every thread's Python stack
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from lightning_plugins.parallel.teardown import release_process_groups

    torch.set_num_threads(1)
    # Not a file from someone else: run_world wrote it a moment ago into its own private temporary directory (0700),
    # holding the test's own callables' arguments, which weights-only loading cannot carry.
    args = torch.load(Path(logs, "args.pt"), weights_only=False)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        try:
            fn(rank, world_size, *args)
        finally:
            release_process_groups()
        alive = backend_threads()
        if alive:  # the groups (and their threads) must not outlive the work: see lightning_plugins.parallel.teardown
            raise AssertionError(f"process-group threads still alive after the groups were released: {alive}")
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise


#: Variables through which a launcher tells a process its place in a world.
_LAUNCH_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def script_env(**extra: str) -> dict[str, str]:
    """The environment for a script that starts its own world (e.g. a Lightning Trainer on N devices).

    Inherited launch variables would make Lightning think the ranks already exist; a fresh port keeps
    concurrent worlds apart. A rank that dies of a signal (a segfault in native code) prints every thread's Python
    stack (``PYTHONFAULTHANDLER``), so the failure says where it happened.
    """
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES}
    port = str(free_port())
    fixed = {"OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    return {**env, **fixed, **extra}


#: Imported once by the fork server that every world's ranks are forked from: a spawned rank spent seconds
#: importing them again. The server is single-threaded (forking the test runner itself, which has run gloo
#: worlds and torch's thread pools, could leave a child waiting on a lock another thread held). The tests add
#: their own helpers (``tests/conftest.py``).
PRELOAD = ["torch.distributed", "transformers", "peft", "lightning_plugins.parallel"]


def run_world(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; re-raise the first failure.

    Each rank's process groups are released when ``fn`` returns, and no process-group thread may outlive them.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    errors = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as logs:
        # The arguments go through a file: passed to the processes, each tensor in them (e.g. a reference's weights)
        # would be shared through a file descriptor, and the forkserver sends at most a few hundred.
        torch.save(args, Path(logs, "args.pt"))
        context = mp.start_processes(
            _entry,
            args=(world_size, free_port(), fn, errors, logs),
            nprocs=world_size,
            start_method="forkserver",
            join=False,
        )
        try:
            while not context.join():
                pass
        except Exception:  # torch stopped the other ranks; every rank's status and output say what happened
            pass
        returncodes = {f"rank {rank}": process.exitcode for rank, process in enumerate(context.processes)}
        output = "".join(f"--- rank {r}:\n{_rank_log(Path(logs, f'rank{r}.log'))}" for r in range(world_size))
    first = errors.get() if not errors.empty() else ""  # the child's own traceback is more useful than the wrapper's
    check_exit(returncodes, first + output)


def _rank_log(path: Path) -> str:
    """A rank's captured output, or why there is none (the process died before it redirected its output)."""
    if not path.exists():
        return "(no output: the process ended before it opened its log; see its exit code)\n"
    return path.read_text(errors="replace")


def run_command(
    command: list[str], *, cwd: Path | None = None, timeout: int = 600, expected: int | None = 0, **env: str
) -> subprocess.CompletedProcess:
    """Run ``command`` (a script that starts its own world, ``lightning-plugins ...``, ``accelerate launch ...``) with
    :func:`script_env` (plus ``env``) and check how it ended (:func:`check_exit`).

    The test scripts that import :mod:`lightning_plugins.testing.exit_report` also report, from the end of each process's exit handlers, the
    process-group threads still alive: there must be none (see :mod:`lightning_plugins.parallel.teardown`).
    """
    with tempfile.TemporaryDirectory() as reports:
        proc = subprocess.run(
            command, cwd=cwd, env=script_env(**{EXIT_REPORTS: reports, **env}), capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip
        check_exit({"launcher": proc.returncode}, proc.stdout + proc.stderr, expected)
        alive = read_exit_reports(reports)
    if expected == 0:
        assert not alive, f"process-group threads alive when the interpreter finalized: {alive}"
    return proc


def run_script(script: Path, tmp_path: Path, *args: str, timeout: int = 900) -> dict[str, Any]:
    """Run a test script that starts its own world (``--out results.json`` added); return its JSON results."""
    out = tmp_path / "results.json"
    run_command([sys.executable, str(script), *args, "--out", str(out)], cwd=tmp_path, timeout=timeout)
    return json.loads(out.read_text())


def spawn_world(
    entry: Callable[..., None],
    world: int,
    *args: Any,
    threads: int | None = 1,
    errors: str | Path | None = None,
) -> None:
    """Run ``entry(rank, *args)`` in ``world`` spawned processes that form one gloo group (torch's launcher
    variables set as ``torchrun`` sets them); returns once every process ended. The benchmarks' launcher: a fresh
    interpreter per rank, with ``threads`` torch threads, so a timing depends on nothing the caller ran before.

    Args:
        entry: A module-level function (it is pickled by name).
        world: Processes.
        threads: Torch threads per process (``None``: torch's default).
        errors: A folder where a failing rank writes its traceback (``rank<N>.error``); they are printed here
            before the failure is raised.
    """
    try:
        mp.start_processes(
            _join, args=(entry, world, free_port(), threads, errors, args), nprocs=world, start_method="spawn"
        )
    except Exception:
        for path in sorted(Path(errors).glob("*.error")) if errors is not None else ():
            print(path.read_text(), file=sys.stderr)
        raise


def world_rows(entry: Callable[..., None], world: int, *args: Any, threads: int | None = 1) -> list[dict[str, Any]]:
    """:func:`spawn_world` for a benchmark whose ranks report table rows: ``entry(rank, *args, out)`` writes its rows
    as JSON to the file ``out`` (rank 0 does, typically); they are returned."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp, "rows.json"))
        spawn_world(entry, world, *args, out, threads=threads)
        return json.loads(Path(out).read_text())


def _join(
    rank: int, entry: Callable[..., None], world: int, port: int, threads: int | None, errors: str | None, args: tuple
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )  # fmt: skip
    if threads is not None:
        torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        entry(rank, *args)
    except BaseException:
        if errors is not None:
            Path(errors, f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
