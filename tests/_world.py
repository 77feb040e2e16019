"""Launch a gloo world of N CPU processes that runs one function; failures surface in the test."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, errors: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


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
#: worlds and torch's thread pools, could leave a child waiting on a lock another thread held).
_PRELOAD = ["torch.distributed", "transformers", "peft", "lightning_plugins.parallel", "tiny_models"]


def run_world(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; re-raise the first failure."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(
            _entry, args=(world_size, free_port(), fn, args, errors), nprocs=world_size, start_method="forkserver"
        )
    except Exception as exc:  # the child's own traceback is more useful than the spawn wrapper's
        raise AssertionError(errors.get() if not errors.empty() else str(exc)) from None


def run_script(script: Path, tmp_path: Path, *args: str, timeout: int = 900) -> dict[str, Any]:
    """Run a test script that starts its own world (``--out results.json`` added); return its JSON results."""
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, str(script), *args, "--out", str(out)],
        cwd=tmp_path, env=script_env(), capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())
