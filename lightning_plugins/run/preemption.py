"""Preemption: a signal (or the launcher's death) ends every rank at the same optimizer step, with a checkpoint.

A scheduler that wants the machines back sends ``SIGTERM`` (or SLURM's ``--signal=USR1@<seconds>``) to the
launcher only, or to the whole process group. :class:`Preemption` turns that into one decision taken by every rank:

* the signal handler only sets a flag (no collective, no I/O: a handler runs between two bytecodes of whatever the
  main thread was doing, a collective included);
* a worker's watchdog thread sets the same flag when its parent (the launcher) is gone, whatever ended it
  (``SIGKILL`` included), so no worker outlives its launcher; once the flag is set, the thread ends the process
  after ``exit_within_s`` if the training loop has not (a rank blocked for good);
* once per optimizer step each door calls :meth:`Preemption.agree` (one ``all_reduce`` of one number), so every rank
  sees the flag in the same step; the door then writes the normal ``step=N.ckpt`` that auto-resume picks and calls
  :meth:`Preemption.finish`, which says, on rank 0, where the run stopped, requeues a SLURM job
  (``scontrol requeue $SLURM_JOB_ID``) and raises :class:`Preempted`: the process exits with
  :data:`PREEMPTED_EXIT`.

Ctrl-C (``SIGINT``) is not a preemption signal: it keeps interrupting the run as before. This module imports neither
Lightning nor Accelerate.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

import torch
import torch.distributed as dist

#: The exit status of a preempted rank (``EX_TEMPFAIL``: a temporary failure, try again).
PREEMPTED_EXIT = 75
#: The signals a recipe may name in ``train.preempt_signals``.
SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGCONT", "SIGXCPU")


class Preempted(SystemExit):
    """Raised by :meth:`Preemption.finish` on every rank once the preemption checkpoint is written."""

    def __init__(self, message: str) -> None:
        super().__init__(PREEMPTED_EXIT)
        self.message = message


class Preemption:
    """The flag a preemption signal or the launcher's death sets, and the per-step agreement on it.

    Args:
        signals: Names of the signals that preempt the run (``"SIGTERM"``, ``"SIGUSR1"``, ...).
        watch_parent: Whether this process is a worker whose launcher must not be outlived (the door's ranks
            started by a launcher; not the launcher itself, whose parent is a shell).
        exit_within_s: Once preempted, how long the training loop has to save and exit before this process is
            ended regardless (exit status :data:`PREEMPTED_EXIT`).
        poll_s: How often the watchdog looks at the parent.
    """

    def __init__(
        self, signals: Sequence[str], *, watch_parent: bool, exit_within_s: float = 300.0, poll_s: float = 0.2
    ) -> None:
        self.signals = [signal.Signals[name] for name in signals]
        self.watch_parent = watch_parent
        self.exit_within_s = exit_within_s
        self.poll_s = poll_s
        #: Why the run is preempted (a signal's name, or the launcher's death); ``None`` while it is not.
        self.reason: str | None = None
        self._code = 0  # the signal's number, _LAUNCHER_GONE or _ELSEWHERE once preempted
        self._since: float | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._parent = os.getppid()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def install(self) -> None:
        """Handle the signals (from the main thread) and start the watchdog thread."""
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                self._previous[signum] = signal.signal(signum, self._on_signal)
        self._thread = threading.Thread(target=self._watch, name="lightning-plugins-preemption", daemon=True)
        self._thread.start()

    def uninstall(self) -> None:
        """Give the signals their previous handlers back and stop the watchdog."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        self._stop.set()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._request(signal.Signals(signum).name, signum)

    def _request(self, reason: str, code: int) -> None:
        if self.reason is None:
            self.reason, self._code, self._since = reason, code, time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.watch_parent and os.getppid() != self._parent:
                self._request(f"the launcher (pid {self._parent}) ended", _LAUNCHER_GONE)
            if self._since is not None and time.monotonic() - self._since > self.exit_within_s:
                print(
                    f"preempted ({self.reason}): rank {_rank()} (pid {os.getpid()}) did not reach the end of an"
                    f" optimizer step within {self.exit_within_s:g} s; ended without a checkpoint.",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(PREEMPTED_EXIT)

    def agree(self, device: torch.device | str = "cpu") -> bool:
        """Whether any rank is preempted: every rank calls it once per optimizer step (one ``all_reduce``)."""
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        codes = torch.zeros(world, dtype=torch.int64, device=device)
        codes[_rank() if world > 1 else 0] = self._code  # each rank its own slot: what preempted it, or 0
        if world > 1:
            dist.all_reduce(codes)
        if not bool(codes.any()):
            return False
        seen: dict[int, list[int]] = {}
        for rank, code in enumerate(codes.tolist()):
            if code not in (0, _ELSEWHERE):
                seen.setdefault(code, []).append(rank)
        self._request("; ".join(_describe(code, ranks) for code, ranks in seen.items()) or "another rank", _ELSEWHERE)
        return True

    def finish(self, step: int, checkpoint: Path | None) -> NoReturn:
        """After the preemption checkpoint is written: say so (rank 0), requeue a SLURM job, raise :class:`Preempted`.

        Args:
            step: The optimizer steps taken (the checkpoint is ``step=<step>.ckpt``).
            checkpoint: Where it was written (``None``: the recipe writes no checkpoints).
        """
        where = f"checkpoint saved to {checkpoint}" if checkpoint else "no checkpoint (train.checkpoint_every: null)"
        message = f"preempted ({self.reason}) at step {step}: {where}; the same command resumes from it."
        if _rank() == 0:
            requeued = requeue()
            print(message + (f" {requeued}" if requeued else ""), file=sys.stderr, flush=True)
        self.uninstall()
        raise Preempted(message)


#: What :meth:`Preemption.agree` shares for a rank whose launcher ended, or that was preempted by another rank only.
_LAUNCHER_GONE, _ELSEWHERE = -1, -2


def _describe(code: int, ranks: list[int]) -> str:
    """What preempted ``ranks`` (as rank 0 says it): ``SIGUSR1 to rank(s) [2, 3]``, ``the launcher of rank(s) [1]
    ended``."""
    if code == _LAUNCHER_GONE:
        return f"the launcher of rank(s) {ranks} ended"
    return f"{signal.Signals(code).name} to rank(s) {ranks}"


def requeue() -> str:
    """Under SLURM (``SLURM_JOB_ID`` set): ``scontrol requeue`` the job; what happened, or ``""`` outside SLURM."""
    job = os.environ.get("SLURM_JOB_ID")
    if job is None:
        return ""
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array is not None:
        job = f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"Requeuing SLURM job {job} failed: {error}."
    if done.returncode != 0:
        return f"Requeuing SLURM job {job} failed (scontrol exited {done.returncode}: {done.stderr.strip()})."
    return f"SLURM job {job} requeued."


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))
