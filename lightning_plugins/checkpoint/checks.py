"""Bad checkpoints, said clearly: each gets one :class:`CheckpointError` that names the file and what to do.

* :func:`check_resume_path`: a checkpoint given to resume from (``--resume``) exists, is not a ``.partial``
  directory (an interrupted save) and is complete (DCP writes ``.metadata`` last) -- checked before any
  process starts.
* :func:`reading_checkpoint`: around ``dcp.load``; DCP's ``CheckpointException`` (a ``BaseException``, which
  ``except Exception`` misses) becomes "written by a different model or shape" or "corrupted or truncated".

Loading never writes: a failed load leaves every checkpoint as it was, and the job stops before training.
"""

from __future__ import annotations

import functools
import re
from lightning_plugins.errors import CheckpointError
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from torch.distributed.checkpoint.api import CheckpointException

#: What DCP's planner says when the saved tensors do not fit the model being loaded into.
_MISMATCH = re.compile(r"Size mismatch|Missing key|Unexpected key|shape|dtype mismatch", re.IGNORECASE)
#: Checkpoint directories are named after the optimizer step they were written at (``step=N.ckpt``).
CHECKPOINT_NAME = "step={step}"
#: A checkpoint directory's name; group 1 is the step.
CHECKPOINT_DIR = re.compile(r"^step=(\d+)\.ckpt$")
T = TypeVar("T")


def _complete_neighbours(path: Path) -> str:
    """`` Complete checkpoints next to it: step=10.ckpt, step=20.ckpt.`` (or nothing)."""
    found = sorted(
        (int(m.group(1)), p.name)
        for p in path.parent.glob("step=*.ckpt")
        if (m := CHECKPOINT_DIR.match(p.name)) and (p / ".metadata").is_file() and p != path
    )
    return f" Complete checkpoints next to it: {', '.join(name for _, name in found)}." if found else ""


def check_resume_path(path: str | Path) -> Path:
    """``path`` if it is a complete distributed checkpoint directory to resume from.

    Raises:
        CheckpointError: for a missing path, a ``.partial`` directory, or a directory without ``.metadata``.
    """
    path = Path(path)
    fix = (
        " Give a complete one, or leave --resume out to resume from the latest complete checkpoint of train.output_dir."
    )
    if path.name.endswith(".partial"):
        raise CheckpointError(
            f"{path} is an incomplete checkpoint: a save was interrupted before it was renamed into place, so it is"
            f" never loaded.{_complete_neighbours(path.with_name(path.name.removesuffix('.partial')))}{fix}"
        )
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint.{_complete_neighbours(path)}{fix}")
    if not path.is_dir() or not (path / ".metadata").is_file():
        raise CheckpointError(
            f"{path} is not a complete distributed checkpoint directory (it has no .metadata, which is written last)."
            f"{_complete_neighbours(path)}{fix}"
        )
    return path


def describe_load_failure(path: Path, error: CheckpointException) -> str:
    """Why DCP could not load ``path`` (the first rank's failure), and what to do."""
    failures = [failure[0] if isinstance(failure, tuple) else failure for failure in error.failures.values()]
    detail = "; ".join(dict.fromkeys(f"{type(f).__name__}: {str(f).splitlines()[0][:300]}" for f in failures))
    if any(_MISMATCH.search(str(f)) for f in failures):
        return (
            f"{path} was written for a different model or shape ({detail}). Resume it with the model and recipe that"
            " wrote it (model.path, lora, the model's config), or start from the HF model with another train.output_dir."
        )
    return (
        f"{path} cannot be read: it is corrupted or truncated ({detail}). Move it aside and resume from an earlier"
        f" complete checkpoint.{_complete_neighbours(path)}"
    )


@contextmanager
def reading_checkpoint(path: str | Path) -> Iterator[None]:
    """Turn DCP's failure to load ``path`` into a :class:`CheckpointError` naming it and the fix."""
    try:
        yield
    except CheckpointException as error:
        raise CheckpointError(describe_load_failure(Path(path), error)) from error


def reads_checkpoint(load: Callable[..., T]) -> Callable[..., T]:
    """Decorate a loader whose second argument is the checkpoint path (``Strategy.load_checkpoint(self, path)``,
    ``load_training_state(accelerator, path)``): its DCP failures become :class:`CheckpointError`."""

    @functools.wraps(load)
    def wrapper(owner: Any, path: Any, *args: Any, **kwargs: Any) -> T:
        with reading_checkpoint(path):
            return load(owner, path, *args, **kwargs)

    return wrapper
