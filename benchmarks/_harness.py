"""What the benchmarks that launch a world share: a free port, a gloo world of spawned CPU processes, a tiny Llama.

Run a benchmark as a script (``python benchmarks/x.py``): its folder is on ``sys.path``, so ``from _harness import
...`` finds this file, in the spawned processes too.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the world's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_world(
    entry: Callable[..., None],
    world: int,
    *args: Any,
    threads: int | None = 1,
    errors: str | Path | None = None,
) -> None:
    """Run ``entry(rank, *args)`` in ``world`` spawned processes that form one gloo group (torch's launcher
    variables set as ``torchrun`` sets them); returns once every process ended.

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


def tiny_llama(
    hidden: int, layers: int, heads: int, kv_heads: int, vocab: int, seq: int, intermediate: int, **extra: Any
) -> Any:
    """A Llama config of the given size with SDPA attention (``extra``: other ``LlamaConfig`` fields)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=seq, attn_implementation="sdpa",
        **extra,
    )  # fmt: skip
