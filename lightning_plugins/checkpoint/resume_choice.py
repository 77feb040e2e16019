"""One resume decision per job: global rank 0 picks the checkpoint to resume from (or none), every rank follows it.

Each rank looking at ``output_dir`` on its own is a race: a complete checkpoint published while a job starts (a run
still finishing its save, a copy) makes some ranks resume it and others start fresh, and the job hangs until the
collective timeout. Framework-free: the doors hand in how their ranks talk.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_plugins.checkpoint.checks import CHECKPOINT_DIR
from lightning_plugins.checkpoint.integrity import say_unverified, verify_checkpoint
from lightning_plugins.errors import CheckpointError

#: ``resume=LATEST``: resume from the newest intact checkpoint in the output directory, if any (decided once per job).
LATEST = "latest"
#: How the Lightning door's launching rank hands its decision to the ranks it starts (they inherit its environment).
RESUME_ENV = "LIGHTNING_PLUGINS_RESUME_FROM"


def latest_checkpoint(output_dir: str | Path, say: Callable[[str], None] | None = None) -> Path | None:
    """The newest intact checkpoint in ``output_dir/checkpoints`` (partial ones never count).

    A newer one that is damaged (a file missing, truncated or changed: see
    :func:`~lightning_plugins.checkpoint.integrity.verify_checkpoint`) is skipped, and ``say`` (a door's rank-zero
    printer) is told which and why. The doors call it on one rank and every rank follows (:func:`agreed_resume`,
    :func:`handed_down_resume`).
    """
    candidates = (Path(output_dir) / "checkpoints").glob("step=*")
    found = sorted(((int(m.group(1)), p) for p in candidates if (m := CHECKPOINT_DIR.match(p.name))), reverse=True)
    for _, path in found:
        try:
            verified = verify_checkpoint(path)
        except CheckpointError as error:
            if say is not None:
                say(f"Skipping {path.name} for auto-resume: {error}")
            continue
        if not verified and say is not None:
            say_unverified(path, say)
        return path
    return None


def agreed_resume(
    output_dir: str | Path,
    choice: str | Path | None,
    say: Callable[[str], None] | None,
    broadcast: Callable[[Any], Any],
) -> Path | None:
    """The checkpoint every rank resumes from: rank 0's ``choice`` (collective).

    Args:
        output_dir: The run's output directory.
        choice: This rank's: a checkpoint, ``None`` (start fresh) or :data:`LATEST` (rank 0 looks now for the
            newest intact one in ``output_dir``). Only rank 0's counts.
        say: Rank 0's printer (told about checkpoints skipped as damaged).
        broadcast: Returns rank 0's object on every rank (every rank calls it once).
    """
    if _rank() == 0 and choice == LATEST:
        choice = latest_checkpoint(output_dir, say)
    chosen = broadcast(None if choice is None else str(choice))
    return None if chosen is None else Path(chosen)


def handed_down_resume(output_dir: str | Path, say: Callable[[str], None] | None, launching: bool) -> Path | None:
    """The checkpoint to resume from, decided once by the launching rank before it starts the other ranks.

    The launching rank decides and leaves its decision in :data:`RESUME_ENV`, which the ranks it starts inherit and
    follow. A rank started by another launcher (another node's) decides the same way; the strategy checks that
    every rank holds the same decision once they can talk (:func:`check_same_decision`).
    """
    if not launching and RESUME_ENV in os.environ:
        handed = os.environ[RESUME_ENV]
        return Path(handed) if handed else None
    choice = latest_checkpoint(output_dir, say)
    os.environ[RESUME_ENV] = "" if choice is None else str(choice)
    return choice


def check_same_decision(all_gather: Callable[[Any], list[Any]]) -> None:
    """Refuse, on every rank at once, a job whose ranks did not all take the same resume decision (collective; passes
    where none was handed down, e.g. a Trainer the script builds itself).

    Args:
        all_gather: Returns every rank's object, in rank order (every rank calls it once).

    Raises:
        RuntimeError: The decisions differ: names them and what to do.
    """
    decisions = all_gather(os.environ.get(RESUME_ENV))
    if len(set(decisions)) <= 1:
        return
    said = "; ".join(f"rank {r}: {d or 'no checkpoint'}" for r, d in enumerate(decisions))
    raise RuntimeError(
        f"The ranks of this job chose different checkpoints to resume from ({said}): a checkpoint appeared in the"
        " output directory while the job started. Start the job again, or pass --resume PATH."
    )


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
