"""Asynchronous checkpoint saving, framework-free: both doors write DCP checkpoints while training goes on.

``dcp.async_save`` copies the state into host memory (staging) before it returns, then writes the files and
DCP's ``.metadata`` in a background thread; training continues at once. :class:`AsyncCheckpointer` adds what
makes that safe to resume from:

* The checkpoint is written under ``<name>.partial`` and published (moved to its final name by
  :func:`~lightning_plugins.checkpoint.resume.publish`) only when DCP's future has completed on rank 0, which happens after
  every rank's files and the ``.metadata`` are written. Whatever else the checkpoint holds (random states, the
  data position, the door's own state) is written by the caller synchronously, before the DCP save starts: it
  is the state at the save step, and it is on disk before the checkpoint can be published.
* At most one save is in flight: a new save first waits for the previous one.
* :meth:`AsyncCheckpointer.wait` finishes the pending save; the doors call it at the end of training and
  before a failed run exits, so no job ends with a checkpoint still being written. A save that fails (a peer
  died) is never published: its ``.partial`` stays aside and the previous checkpoint is the latest.

The background thread's collectives run on a process group of their own (gloo, which DCP's async save needs for
its host-side plan exchange), so they never interleave with the training's collectives.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lightning_plugins.checkpoint.disk_space import writing_checkpoint
from lightning_plugins.checkpoint.integrity import ChecksummedWriter

__all__ = ["AsyncCheckpointer"]


class AsyncCheckpointer:
    """One rank's asynchronous DCP saves: at most one in flight, each published only once complete.

    Every rank of the job holds one and calls :meth:`save` and :meth:`wait` at the same points (both are
    collective the first time: the background process group is created then).
    """

    def __init__(self) -> None:
        self._group: dist.ProcessGroup | None = None
        self._pending: tuple[Future, threading.Event, list[BaseException], Path, int] | None = None

    @property
    def pending(self) -> bool:
        """Whether a save was started and not yet waited for."""
        return self._pending is not None

    def _process_group(self) -> dist.ProcessGroup | None:
        if not dist.is_initialized():
            return None
        if self._group is None:  # collective: every rank creates it at its first save
            self._group = dist.new_group(backend="gloo")
        return self._group

    def save(
        self, state: dict[str, Any], partial: str | Path, publish: Callable[[], None] | None, needed: int = 0
    ) -> None:
        """Start writing ``state`` to the directory ``partial`` and return once it is staged (copied).

        The previous save is waited for first (its errors are raised here). ``publish`` (rank 0's move of the
        complete checkpoint into place; ``None`` on the other ranks) runs in the background thread as soon as the
        save has completed, and never when it failed. ``needed``: the bytes the checkpoint takes, said when the
        disk cannot take it (see :func:`~lightning_plugins.checkpoint.disk_space.writing_checkpoint`).
        """
        self.wait()
        writer = ChecksummedWriter(partial)  # each file's checksum, for the manifest written when it is published
        future = dcp.async_save(state, storage_writer=writer, process_group=self._process_group())
        done, errors = threading.Event(), []

        def finish(saved: Future) -> None:
            try:
                if saved.exception() is None and publish is not None:
                    publish()
            except BaseException as err:  # noqa: BLE001 - handed to the thread that waits
                errors.append(err)
            finally:
                done.set()

        future.add_done_callback(finish)
        self._pending = (future, done, errors, Path(partial), needed)

    def wait(self) -> None:
        """Block until the pending save (if any) is written and published; raise what it failed with."""
        if self._pending is None:
            return
        future, done, errors, partial, needed = self._pending
        self._pending = None
        with writing_checkpoint(partial, needed):  # a disk that filled up meanwhile: named, and .partial removed
            try:
                future.result()
            finally:
                done.wait()  # the done-callback (publish) has run, whatever the outcome
            if errors:
                raise errors[0]

    def close(self, *, failed: bool = False) -> None:
        """Wait for the pending save and let go of the background process group (the next save creates another);
        after a failure (``failed``) the save's own error is dropped: the run's error is the one to report, and an
        incomplete save stays unpublished."""
        try:
            self.wait()
        except BaseException:
            if not failed:
                raise
        finally:
            self._group = None  # nothing keeps it (and its threads) alive past the run: see lightning_plugins.parallel.teardown
