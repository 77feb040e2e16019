"""Bounded failures: how a job of several ranks says which rank broke and why, instead of hanging.

Framework-free pieces the doors use:

* :func:`describe_exit` turns a process's return code into words (``was killed by SIGKILL``).
* :func:`record_failure` / :func:`recorded_failure`: a failing rank leaves a one-line cause in the directory
  its launcher named (``LIGHTNING_PLUGINS_FAILURES``), so the launcher's final message can quote it.
* :func:`is_collective_timeout` / :func:`explain_timeout`: a collective that waited past the process
  group's timeout, explained with the setting that bounds it (``train.collective_timeout_s``).
* :func:`join_timeout` / :func:`set_collective_timeout`: the ranks' start (joining the process group) may
  take long on a loaded machine or a big cluster, so it waits at least torch's default (30 min); once joined,
  every collective is bounded by the configured timeout.
* :class:`RankFailure`: the job's final error, naming the rank and the cause.
"""

from __future__ import annotations

import os
import signal
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from lightning_plugins.errors import RankFailure, summarize

#: The directory (set by the launcher, inherited by every rank it starts) where failing ranks leave their cause.
FAILURES_ENV = "LIGHTNING_PLUGINS_FAILURES"
#: The recipe key that bounds every collective (and the doors' ``timeout`` arguments).
TIMEOUT_SETTING = "train.collective_timeout_s"
# How torch's backends word a collective that waited too long (gloo; NCCL's watchdog; c10d's store).
_TIMEOUT_MARKERS = ("Timed out", "timed out", "Watchdog caught collective operation timeout", "DistTimeoutError")


#: The least time ranks wait for each other to join the process group (torch's default process-group timeout).
JOIN_TIMEOUT = timedelta(minutes=30)


def join_timeout(timeout: timedelta | None) -> timedelta:
    """How long ranks wait for each other to join: the collective ``timeout`` or :data:`JOIN_TIMEOUT`, the longer."""
    return JOIN_TIMEOUT if timeout is None else max(timeout, JOIN_TIMEOUT)


def set_collective_timeout(timeout: timedelta | None) -> None:
    """Bound every collective of the (joined) default process group by ``timeout``; the groups a
    :class:`~lightning_plugins.ParallelLayout` mesh creates afterwards inherit it."""
    if timeout is not None and dist.is_initialized():
        # torch 2.15 made this public (and deprecated the private name 2.13 and 2.14 have).
        set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
        set_timeout(timeout)


def describe_exit(returncode: int) -> str:
    """``exited with code 1`` or ``was killed by SIGKILL`` (a negative return code is the signal)."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


def record_failure(rank: int, error: BaseException) -> None:
    """Leave ``rank``'s cause of failure for the launcher (nothing when no launcher asked for it)."""
    folder = os.environ.get(FAILURES_ENV)
    if not folder:
        return
    try:
        (Path(folder) / f"rank{rank}.txt").write_text(summarize(error))
    except OSError:  # the report must never hide the failure itself
        pass


def recorded_failure(rank: int) -> str | None:
    """The cause ``rank`` recorded with :func:`record_failure`, if any."""
    folder = os.environ.get(FAILURES_ENV)
    path = Path(folder) / f"rank{rank}.txt" if folder else None
    return path.read_text() if path is not None and path.is_file() else None


def is_collective_timeout(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is a collective or store operation that waited past its timeout."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if type(error).__name__ == "DistTimeoutError" or mentions_timeout(str(error)):
            return True
        error = error.__cause__ or error.__context__
    return False


def is_peer_gone(error: BaseException) -> bool:
    """Whether ``error`` is this rank's consequence of another rank's end: a collective's connection to it closed."""
    return mentions_peer_gone(str(error))


def mentions_peer_gone(text: str) -> bool:
    """Whether an error's text (e.g. one left by :func:`record_failure`) says a collective's peer ended."""
    return any(marker in text for marker in _PEER_GONE_MARKERS)


def explain_lost_node(rank: int, node: int, nodes: int, error: BaseException) -> str:
    """Rank ``rank`` of node ``node`` lost a peer, and no rank of its own node failed: another node's rank (or its
    launcher, with its ranks) ended. Where to look."""
    others = [n for n in range(nodes) if n != node]
    where = f"node {others[0]}" if len(others) == 1 else f"one of nodes {', '.join(map(str, others))}"
    return (
        f"rank {rank} (node {node} of {nodes}) lost its connection to a rank on {where} ({summarize(error)}): a rank"
        f" or the launcher of {where} ended, and every rank of node {node} stopped. {where.capitalize()}'s log says"
        " why; once that is fixed the same command resumes from the last checkpoint"
    )


#: What gloo says when the rank at the other end of a collective's connection ended.
_PEER_GONE_MARKERS = ("Connection closed by peer", "Connection reset by peer")


def mentions_timeout(text: str) -> bool:
    """Whether an error's text (e.g. one left by :func:`record_failure`) says a collective timed out."""
    return any(marker in text for marker in _TIMEOUT_MARKERS)


def explain_timeout(rank: int, error: BaseException, timeout: timedelta | None) -> str:
    """Rank ``rank``'s collective timed out: what that means and the setting that bounds it."""
    limit = f"{timeout.total_seconds():g} s" if timeout is not None else "the process group's timeout"
    return (
        f"rank {rank}: a collective got no answer from its peers within {limit} ({summarize(error)}). A peer is stuck"
        f" (or much slower than the others). The bound is {TIMEOUT_SETTING} in the recipe (the `timeout` argument of"
        " ParallelismStrategy; InitProcessGroupKwargs(timeout=...) for ParallelAccelerator): raise it if the start, steps, saves"
        " or the first load legitimately take longer."
    )
