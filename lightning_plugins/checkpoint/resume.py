"""Exact resume, framework-free: what both doors keep in a checkpoint besides the model, optimizer and schedule.

* Every rank's random states (``random``, ``numpy``, ``torch``, CUDA), one file per rank in the checkpoint
  directory (:func:`save_rng` / :func:`load_rng`): dropout after a resume draws what it would have drawn.
* A data loader's place in its epoch (:class:`ResumableLoader`): the next batch after the last one trained,
  in the same shuffled order, not the start of the epoch. Lightning saves and restores a loader's
  ``state_dict`` (:class:`ResumableDataLoader`); the Accelerate door's loader keeps a ``position``.

The loaders draw from their own ``torch.Generator`` (see :func:`loader_generator`) so that starting an epoch or an
evaluation never consumes the global random state that dropout uses: the global state saved with a checkpoint is
then exactly the one the next training batch would have seen.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from lightning_plugins.checkpoint.integrity import save_checksummed, write_manifest
from lightning_plugins.checkpoint.safe_read import NUMPY_RANDOM_STATE, load_torch_file

#: Each rank's random states, inside the checkpoint directory (read with NumPy's random state allowed, nothing else:
#: :data:`~lightning_plugins.checkpoint.safe_read.NUMPY_RANDOM_STATE`).
RNG_FILE = "rng_state_{rank}.pt"


def capture_rng() -> dict[str, Any]:
    """This process's random states: Python, NumPy, torch (CPU) and every CUDA device."""
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng(states: dict[str, Any]) -> None:
    """Set the random states :func:`capture_rng` returned."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def save_rng(directory: str | Path, rank: int) -> Path:
    """Write this rank's random states to ``directory/rng_state_<rank>.pt``."""
    return save_checksummed(capture_rng(), Path(directory) / RNG_FILE.format(rank=rank))


def read_rng(directory: str | Path, rank: int) -> dict[str, Any] | None:
    """The random states saved for ``rank`` in ``directory``, or rank 0's when the saving world was smaller
    (ranks of one layout start from the same seed and draw alike); ``None`` when the directory has none."""
    for candidate in (rank, 0):
        path = Path(directory) / RNG_FILE.format(rank=candidate)
        if path.is_file():
            return load_torch_file(path, NUMPY_RANDOM_STATE)  # NumPy's state is an array: allow just that
    return None


def load_rng(directory: str | Path, rank: int) -> bool:
    """Restore the random states :func:`read_rng` finds; whether there were any."""
    states = read_rng(directory, rank)
    if states is not None:
        restore_rng(states)
    return states is not None


def loader_generator(seed: int) -> torch.Generator:
    """A loader's own generator (shuffle order, worker seeds), seeded from the recipe: see the module docstring."""
    return torch.Generator().manual_seed(seed)


class ResumableLoader:
    """Mixin for a ``DataLoader`` (or a subclass such as Accelerate's ``DataLoaderShard``) that knows its place.

    It counts the batches yielded in the current epoch and the state of the generator that orders the epoch
    (:meth:`order_generator`) at the epoch's start. :meth:`position` says where it stands; after
    :meth:`resume_from`, the next iteration restores that generator state (the same shuffle) and skips the
    batches already trained (their samples are read and dropped; the model never sees them). A position taken
    at an epoch's last batch means "the start of the next epoch" (``epochs_done: 1``).
    """

    _seen: int = 0
    _skip: int = 0
    _start_state: torch.Tensor | None = None

    def order_generator(self) -> torch.Generator | None:
        """The generator whose state at an epoch's start fixes that epoch's order (the loader's own by default)."""
        return getattr(self, "generator", None)

    def _positioned(self, start: Callable[[], Iterator[Any]]) -> Iterator[Any]:
        """Iterate ``start()`` (the parent class's ``__iter__``) from the resumed position, counting batches."""
        skip, self._skip = self._skip, 0
        generator = self.order_generator()
        self._start_state = None if generator is None else generator.get_state()
        self._seen = 0
        for index, batch in enumerate(start()):
            self._seen = index + 1
            if index >= skip:
                yield batch
        self._seen = 0  # a whole epoch done: the position is the next epoch's start
        self._start_state = None if generator is None else generator.get_state()

    def samples_per_batch(self) -> int | None:
        """Samples one batch of this loader stands for over all data-parallel ranks (``None``: unknown)."""
        size = getattr(self, "batch_size", None)
        replicas = getattr(getattr(self, "sampler", None), "num_replicas", 1)
        return None if not isinstance(size, int) else size * replicas

    def position(self) -> dict[str, Any]:
        """Where the loader stands: batches yielded in this epoch (and the samples they hold over all data-parallel
        ranks, so that a resume under another ``dp_size`` or micro-batch size finds the same place), whether the
        epoch is finished, and the order generator's state."""
        try:
            done = self._seen > 0 and self._seen >= len(self)  # type: ignore[arg-type]
        except TypeError:  # an iterable dataset of unknown length
            done = False
        generator = self.order_generator()
        per_batch = self.samples_per_batch()
        if done:
            state = None if generator is None else generator.get_state()
            return {"batches": 0, "samples": 0, "epochs_done": 1, "generator": state}
        samples = None if per_batch is None else self._seen * per_batch
        return {"batches": self._seen, "samples": samples, "epochs_done": 0, "generator": self._start_state}

    def resume_from(self, position: dict[str, Any]) -> None:
        """Continue from a :meth:`position`: the next iteration starts after the last batch it counted.

        Raises:
            ValueError: when the samples trained so far are not a whole number of this loader's batches (over all
                data-parallel ranks), so no batch boundary of this layout continues the saved run.
        """
        per_batch, samples = self.samples_per_batch(), position.get("samples")
        if per_batch is None or samples is None:
            self._skip = position["batches"]
        elif samples % per_batch:
            raise ValueError(
                f"The checkpoint was saved after {samples} samples of the epoch, which is not a whole number of"
                f" batches of {per_batch} samples (micro_batch_size x dp_size) here. Resume with a micro-batch size"
                " and data-parallel size whose product divides it, e.g. the saving run's."
            )
        else:
            self._skip = samples // per_batch
        generator = self.order_generator()
        if generator is not None and position.get("generator") is not None:
            generator.set_state(position["generator"])


class ResumableDataLoader(ResumableLoader, DataLoader):
    """A ``DataLoader`` with ``state_dict`` / ``load_state_dict``: Lightning saves its position in every checkpoint
    and restores it on resume (mid-epoch: the next batch). Same constructor as ``DataLoader``, so Lightning can
    re-create it with its ``DistributedSampler``; the epoch is Lightning's (it calls the sampler's ``set_epoch``)."""

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return self._positioned(super().__iter__)

    def state_dict(self) -> dict[str, Any]:
        return self.position()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.resume_from(state)


def publish(partial: str | Path, path: str | Path) -> None:
    """Move a complete checkpoint written under ``partial`` to ``path`` (rank 0 only), its ``checksums.json`` written
    first (:func:`~lightning_plugins.checkpoint.integrity.write_manifest`). One already at ``path`` is moved aside first and
    deleted last, so a crash at any moment leaves a complete checkpoint under a final name, or the previous ones
    (``latest_checkpoint`` never reads ``.partial`` or ``.previous``)."""
    partial, path = Path(partial), Path(path)
    if partial.is_dir():
        write_manifest(partial)
    previous = path.with_name(path.name + ".previous")
    if path.exists():
        path.rename(previous)
    partial.rename(path)
    if previous.is_dir():
        shutil.rmtree(previous)
    elif previous.exists():
        previous.unlink()
