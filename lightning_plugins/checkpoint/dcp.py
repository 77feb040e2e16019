"""The atomic sharded (DCP) checkpoint both doors write and read: one protocol, framework-free.

A save (:func:`save_sharded`) writes everything under ``<name>.partial``: each rank's random states, what the door
adds on the first rank (its own state file, the export info, the recipe), each file checksummed as it is written
(:mod:`~lightning_plugins.checkpoint.integrity`), then the tensors through DCP. Only once all of it is complete is
the directory moved to its final name (:func:`~lightning_plugins.checkpoint.resume.publish`, which writes the
checksum manifest first), so a save killed at any point leaves the previous checkpoints untouched. A disk without
room refuses the save on every rank before any write (:mod:`~lightning_plugins.checkpoint.disk_space`). With an
:class:`~lightning_plugins.checkpoint.async_save.AsyncCheckpointer` the tensors are written in the background and
publishing waits for them.

Optimizer state has one format in every checkpoint (:func:`optimizer_state` / :func:`load_optimizer_state`): see
:data:`FLAT_OPTIMIZER`.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from lightning_plugins.checkpoint.async_save import AsyncCheckpointer
from lightning_plugins.checkpoint.disk_space import check_room, writing_checkpoint
from lightning_plugins.checkpoint.integrity import ChecksummedWriter
from lightning_plugins.checkpoint.resume import publish, save_rng
from lightning_plugins.checkpoint.safe_read import load_dcp
from lightning_plugins.parallel.grad import reduce_partial_state

__all__ = [
    "FLAT_OPTIMIZER",
    "begin_save",
    "load_optimizer_state",
    "load_tensors",
    "optimizer_state",
    "partial_of",
    "save_sharded",
]

#: The optimizer state of every checkpoint, both doors: flattened to one entry per parameter name. Pipeline ranks
#: hold different parameters, so their ``param_groups`` differ, and DCP keeps one copy of a non-tensor entry per key
#: (it would hand every rank the first rank's groups); flattened, every hyper-parameter is stored under its
#: parameter's name and each rank reads back its own, so a checkpoint resumes under any other layout. The tensors
#: stay where they live (no ``cpu_offload``): the files are the same either way, DCP stages what it writes to host
#: memory itself (the asynchronous save copies it anyway), and a resume loads straight into the optimizer's own
#: device instead of through a second host copy. (The Lightning door used to ask for ``cpu_offload=True``, the
#: Accelerate door did not; the bytes on disk never differed.)
FLAT_OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True)


def optimizer_state(model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """This rank's state of ``optimizer`` (over ``model``'s parameters) as a checkpoint keeps it: flattened per
    parameter name (:data:`FLAT_OPTIMIZER`), pending sums over tensor-parallel ranks reduced (DCP stores no partial
    DTensors). Also the template a resume loads into."""
    return reduce_partial_state(get_optimizer_state_dict(model, optimizer, options=FLAT_OPTIMIZER))


def load_optimizer_state(model: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> None:
    """Give ``optimizer`` the ``state`` that :func:`optimizer_state` described and DCP filled."""
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=FLAT_OPTIMIZER)


def load_tensors(state: dict[str, Any], path: str | Path) -> None:
    """Fill ``state`` (templates of this rank's tensors) from the DCP checkpoint ``path``, resharding as needed (its
    pickles read by :mod:`~lightning_plugins.checkpoint.safe_read`: nothing in it runs)."""
    load_dcp(state, Path(path))


def partial_of(path: str | Path) -> Path:
    """Where the checkpoint ``path`` is written until complete."""
    path = Path(path)
    return path.with_name(path.name + ".partial")


def begin_save(path: str | Path, rank: int, barrier: Callable[[], None], saver: AsyncCheckpointer | None) -> Path:
    """Start a save of ``path`` (collective): wait for the save in flight (never two at once, and the previous one's
    ``.partial`` is not removed under it), remove a stale ``.partial`` on the first rank; return the ``.partial``."""
    partial = partial_of(path)
    if saver is not None:
        saver.wait()
    if rank == 0 and partial.exists():
        shutil.rmtree(partial) if partial.is_dir() else partial.unlink()
    barrier()
    return partial


def save_sharded(
    tensors: dict[str, Any],
    path: str | Path,
    *,
    rank: int,
    barrier: Callable[[], None],
    write_files: Callable[[Path], None],
    saver: AsyncCheckpointer | None = None,
) -> None:
    """Write one atomic DCP checkpoint to the directory ``path`` (collective: every rank calls it).

    Args:
        tensors: This rank's tensors (model, optimizer, ...), written by DCP.
        path: The checkpoint directory; one already there is replaced once the new one is complete.
        rank: This process's global rank.
        barrier: The door's barrier over all ranks.
        write_files: Writes the door's other files into the ``.partial`` directory it is given, on the first rank
            (called only there, after the random states and before the tensors; write them with
            :func:`~lightning_plugins.checkpoint.integrity.save_checksummed`).
        saver: Write the tensors in the background with it (everything else, the state at this step, is written
            now) and publish once they are complete; ``None``: write everything now and publish before returning.
    """
    path = Path(path)
    partial = begin_save(path, rank, barrier, saver)
    needed = check_room(partial, tensors)  # a disk without room refuses it on every rank, before any write
    with writing_checkpoint(partial, needed):  # a write failing for lack of room: named, and .partial removed
        partial.mkdir(parents=True, exist_ok=True)
        save_rng(partial, rank)
        if rank == 0:
            write_files(partial)
        publish_it = (lambda: publish(partial, path)) if rank == 0 else None
        if saver is not None:  # everything but the tensors is on disk: publishing waits for them alone
            saver.save(tensors, partial, publish_it, needed)
            return
        dcp.save(tensors, storage_writer=ChecksummedWriter(partial))
        barrier()
        if publish_it is not None:
            publish_it()
    barrier()
