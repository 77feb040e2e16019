"""A checkpoint that does not fit, said clearly: the path, the bytes it needs and the bytes free, on every rank.

* :func:`checkpoint_bytes` estimates what a checkpoint's tensors take on disk, over all ranks (collective): each
  rank's DTensor shards divided by how many ranks hold the same shard, plus its plain tensors counted once per name
  (DCP writes a replicated tensor once), each with DCP's framing, and the numbers and settings it pickles.
* :func:`check_room` (every rank, before anything is written): rank 0 compares that with ``shutil.disk_usage`` of
  the checkpoint's directory and whether it may write there, and every rank refuses with the same
  :class:`CheckpointWriteError` (the decision is broadcast, so no rank is left waiting in a collective).
* :func:`writing_checkpoint` turns a write that fails for lack of space or permission (ENOSPC, EDQUOT, EACCES,
  EPERM, EROFS; also when DCP gathered it from another rank) into the same error and removes the ``.partial``
  directory, so the previous complete checkpoint stays the latest. DCP's own collectives carry a failed write to
  every rank; a rank that fails alone outside them ends the job through the doors' failure handling.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning_plugins.errors import CheckpointWriteError
from torch.distributed.tensor import DTensor

#: The errors that mean "this disk will not take the checkpoint" (not a bug to report as a traceback).
DISK_ERRORS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS})


#: DCP's bytes around each item it stores (its torch.save framing: 1.37 KiB per item, measured on the tiny model's
#: 84 tensors x 2 shards and 252 pickled optimizer settings).
_FRAMING = 1536


def _sizes(state: Any, prefix: str, plain: dict[str, int]) -> float:
    """This rank's share of the bytes of ``state``'s DTensors; its plain tensors' bytes go into ``plain`` by name."""
    if isinstance(state, DTensor):
        local = state.to_local()
        copies = math.prod(state.device_mesh.size(i) for i, p in enumerate(state.placements) if p.is_replicate())
        return (local.numel() * local.element_size() + _FRAMING) / copies
    if isinstance(state, torch.Tensor):
        plain[prefix] = state.numel() * state.element_size() + _FRAMING
        return 0.0
    if isinstance(state, dict):
        items: Any = state.items()
    elif isinstance(state, (list, tuple)) and any(isinstance(value, torch.Tensor) for value in state):
        items = enumerate(state)
    else:  # a number, a string, hyperparameters: DCP pickles each such leaf into its own item, once
        plain[prefix] = _FRAMING
        return 0.0
    return sum(_sizes(value, f"{prefix}.{key}", plain) for key, value in items)


def checkpoint_bytes(state: Any) -> int:
    """The bytes the tensors of ``state`` (every rank's, this call is collective when a process group is up) take
    in a DCP checkpoint."""
    plain: dict[str, int] = {}
    shards = _sizes(state, "", plain)
    parts = [(shards, plain)]
    if dist.is_initialized():
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (shards, plain))
    union: dict[str, int] = {}
    for _, names in parts:
        union.update(names)
    return int(sum(part for part, _ in parts) + sum(union.values()))


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def describe(partial: Path, needed: int, cause: str) -> str:
    """The error for a checkpoint that cannot be written to ``partial``: the path, needed and free bytes, the fix."""
    where = _existing(partial.parent)
    free = shutil.disk_usage(where).free
    final = partial.with_name(partial.name.removesuffix(".partial"))
    return (
        f"Cannot write the checkpoint {final}: {cause}. It needs about {needed} bytes ({_size(needed)}) and"
        f" {free} bytes ({_size(free)}) are free on the file system of {where}. Free space there (or raise the quota,"
        " or make it writable), or point train.output_dir at a disk with room; the previous checkpoints are untouched."
    )


def _problem(partial: Path, needed: int) -> str | None:
    where = _existing(partial.parent)
    if not os.access(where, os.W_OK | os.X_OK):
        return describe(partial, needed, f"{where} is not writable by this user")
    if shutil.disk_usage(where).free < needed:
        return describe(partial, needed, "not enough free space")
    return None


def check_room(partial: str | Path, state: Any) -> int:
    """Refuse, on every rank, a save of ``state`` into ``partial`` that cannot fit (collective; before writing).

    Returns:
        The bytes the checkpoint needs (for :func:`writing_checkpoint`).

    Raises:
        CheckpointWriteError: when the disk has less room than the checkpoint needs, or may not be written.
    """
    partial = Path(partial)
    needed = checkpoint_bytes(state)
    rank = dist.get_rank() if dist.is_initialized() else 0
    box = [_problem(partial, needed) if rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise CheckpointWriteError(errno.ENOSPC, box[0])
    return needed


def disk_error(error: BaseException) -> OSError | None:
    """The out-of-space or permission ``OSError`` behind ``error`` (its causes, DCP's gathered failures), if any."""
    seen: set[int] = set()
    todo: list[Any] = [error]
    while todo:
        current = todo.pop()
        if isinstance(current, tuple):  # DCP wraps each rank's failure as (exception, stack)
            current = current[0]
        if not isinstance(current, BaseException) or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in DISK_ERRORS:
            return current
        todo += [current.__cause__, current.__context__, *getattr(current, "failures", {}).values()]
    return None


@contextmanager
def writing_checkpoint(partial: str | Path, needed: int) -> Iterator[None]:
    """Around a rank's writes into ``partial``: a disk that is full or not writable becomes a
    :class:`CheckpointWriteError` naming the path, the bytes needed and free, and ``partial`` is removed."""
    partial = Path(partial)
    try:
        yield
    except BaseException as error:  # DCP's CheckpointException is a BaseException
        cause = disk_error(error)
        if cause is None:
            raise
        shutil.rmtree(partial, ignore_errors=True)
        reason = f"{cause.strerror or cause} ({cause.filename or partial})"
        raise CheckpointWriteError(cause.errno, describe(partial, needed, reason)) from None
