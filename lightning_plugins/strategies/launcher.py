"""``SupervisedLauncher``: Lightning's script launcher, whose job ends with a message naming the rank that broke.

Lightning's own launcher re-runs the script once per extra local rank and watches them every 5 s; when one
dies it SIGKILLs the whole job, itself included, and says only a PID (at info level). A rank that hangs outside
a collective is never noticed: the others time out in their collective and exit, it stays.

This launcher keeps Lightning's way of starting ranks and ends every failure within a bound:

* a rank that dies (killed, or an exception) fails its peers' collectives at once (gloo/NCCL close the
  connection); the launching rank then waits briefly for the dead one's exit status, stops the ranks still
  running and raises :class:`~lightning_plugins.run.faults.RankFailure` naming the rank, its pid and the cause
  (its exception, or the signal that killed it);
* a rank that hangs makes its peers' collectives time out after the strategy's ``timeout``; the message
  names the timeout and the setting, and the stuck rank is stopped;
* if the launching rank itself is stuck when another rank fails, a watcher thread says so and ends the job;
* a rank that fails after the launching rank's run returned (e.g. it crashes while exiting) fails the job too: the
  launching rank waits for the ranks it started when it exits, and exits with 1 naming the rank that failed, as
  torchrun does. Lightning's launcher returns the launching rank's own status only, so a scheduler (or a test)
  would see such a job succeed.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from typing_extensions import override

from lightning_plugins.run.faults import (
    FAILURES_ENV,
    TIMEOUT_SETTING,
    RankFailure,
    describe_exit,
    explain_lost_node,
    explain_timeout,
    is_collective_timeout,
    is_peer_gone,
    mentions_peer_gone,
    mentions_timeout,
    record_failure,
    recorded_failure,
    summarize,
)
from lightning_plugins.errors import NonFiniteError
from lightning_plugins.run.preemption import PREEMPTED_EXIT

if TYPE_CHECKING:
    import lightning.pytorch as pl


class SupervisedLauncher(_SubprocessScriptLauncher):
    """Starts the local ranks as Lightning does and turns any rank's failure into one clear, bounded error.

    Args:
        cluster_environment: As for Lightning's launcher.
        num_processes: Processes per node.
        num_nodes: Nodes.
        timeout: The collective timeout (named in the message when a collective times out).
        grace_s: How long the launching rank waits for a failed rank's exit status (and, when it is the
            launching rank that does not react to another rank's death, how long before the job is ended).
    """

    def __init__(
        self,
        cluster_environment: ClusterEnvironment,
        num_processes: int,
        num_nodes: int,
        timeout: timedelta | None = None,
        grace_s: float = 2.0,
    ) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.timeout = timeout
        self.grace_s = grace_s
        self._watcher: _RankWatcher | None = None

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if not self.cluster_environment.creates_processes_externally:
            self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
            if self.num_processes > 1:  # where the ranks started here leave their cause of failure
                os.environ.setdefault(FAILURES_ENV, tempfile.mkdtemp(prefix="lightning_plugins_failures_"))
            self._call_children_scripts()
            first = self.cluster_environment.node_rank() * self.num_processes
            if self.procs:
                self._watcher = _RankWatcher({first + i + 1: p for i, p in enumerate(self.procs)}, first, self.grace_s)
                self._watcher.start()
                # At exit (after the process groups are released: registered earlier, run later) the job's status.
                atexit.register(self._watcher.join_ranks, self.timeout or _EXIT_WAIT)
        _set_num_threads_if_needed(num_processes=self.num_processes)
        try:
            result = function(*args, **kwargs)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as error:
            rank = self.cluster_environment.global_rank()
            record_failure(rank, error)
            watcher = self._watcher
            message, stopped = watcher.diagnose(error, self.num_nodes > 1) if watcher is not None else (None, "")
            if isinstance(error, NonFiniteError):  # every rank decided it in the same step: the job's cause
                raise
            if message is None and is_collective_timeout(error):
                message = explain_timeout(rank, error, self.timeout) + stopped
            if message is None and self.num_nodes > 1 and is_peer_gone(error):  # no rank of this node failed first
                node = self.cluster_environment.node_rank()
                message = explain_lost_node(rank, node, self.num_nodes, error) + "." + stopped
            if message is not None:
                raise RankFailure(message) from error
            # This rank's own error is the cause: it keeps its type; the note says who else was stopped.
            if stopped:
                error.add_note(f"rank {rank} failed first.{stopped}")
            raise
        if self._watcher is not None:
            self._watcher.finished = True
        return result


#: The exit statuses of a rank that did not fail: it finished, or it was preempted with the rest of the job (and
#: wrote its part of the checkpoint: :mod:`lightning_plugins.run.preemption`).
_CLEAN = (0, PREEMPTED_EXIT)
#: How long the launching rank waits at exit for the ranks it started when no collective timeout bounds the job.
_EXIT_WAIT = timedelta(minutes=30)


class _RankWatcher(threading.Thread):
    """Watches the ranks this process started; ends the job when one fails and this process does not react."""

    def __init__(self, ranks: dict[int, subprocess.Popen], own_rank: int, grace_s: float) -> None:
        super().__init__(daemon=True, name="lightning-plugins-rank-watcher")
        self.ranks, self.own_rank, self.grace_s = ranks, own_rank, grace_s
        #: Whether this process's run returned: a rank failing afterwards is reported when this process exits.
        self.finished = False
        self._lock = threading.Lock()
        self._handled = False
        #: Ranks in the order their failure was seen.
        self._failed: list[int] = []

    def run(self) -> None:
        deadline = None
        while True:
            time.sleep(0.1)
            self._poll()
            with self._lock:
                if self._handled:
                    return
                if all(p.returncode in _CLEAN for p in self.ranks.values()):
                    return
                if self._failed and self.finished:
                    return  # this process is past its run (not stuck): `join_ranks` reports it when it exits
                if self._failed and deadline is None:
                    deadline = time.monotonic() + self.grace_s
                if deadline is None or time.monotonic() < deadline:
                    continue
                # This process did not notice within the grace period (stuck outside a collective): end the job.
                self._handled = True
            message = (
                f"{self._failure_of(self._failed[0])}; rank {self.own_rank} (pid {os.getpid()}) did not stop within"
                f" {self.grace_s:g} s and was stopped with the rest of the job.{self._stop_running()}"
            )
            print(f"{RankFailure.__name__}: {message}", file=sys.stderr, flush=True)
            os._exit(1)

    def diagnose(self, error: BaseException, other_nodes: bool = False) -> tuple[str | None, str]:
        """Why the job failed, given this rank's ``error``: a message naming another rank that failed first
        (``None`` when this rank's error is the cause, when every failure is a collective timeout, or, with
        ``other_nodes`` in the job, when every rank here only lost a peer), and which ranks still running were
        stopped."""
        with self._lock:
            self._handled = True
        deadline = time.monotonic() + self.grace_s
        while not self._poll() and time.monotonic() < deadline:
            time.sleep(0.05)
        causes = [recorded_failure(rank) or "" for rank in self._failed]
        stopped = self._stop_running()
        if not self._failed or (is_collective_timeout(error) and all(mentions_timeout(c) for c in causes)):
            return None, stopped
        if other_nodes and is_peer_gone(error) and all(mentions_peer_gone(c) for c in causes):  # all lost a peer
            return None, stopped
        return (
            f"{self._failure_of(self._failed[0])}; rank {self.own_rank} then stopped: {summarize(error)}." + stopped,
            stopped,
        )

    def join_ranks(self, timeout: timedelta) -> None:
        """At this process's exit: wait up to ``timeout`` for the ranks it started (stopping those still running
        then); when one failed, say which and exit with 1 (this process's own run succeeded)."""
        with self._lock:
            if self._handled:  # a failure during the run was already reported
                return
            self._handled = True
        deadline = time.monotonic() + timeout.total_seconds()
        for proc in self.ranks.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        stopped = self._stop_running()
        self._poll()
        if not self._failed and not stopped:
            return
        said = self._failure_of(self._failed[0]) if self._failed else f"ranks were still running {timeout} later"
        message = f"{said}, after the Trainer run of rank {self.own_rank} (pid {os.getpid()}) had returned.{stopped}"
        print(f"{RankFailure.__name__}: {message}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)  # from an exit handler: the only way to set the status (SystemExit would be printed and ignored)

    def _poll(self) -> bool:
        """Record newly failed ranks; whether any has failed."""
        for rank, proc in self.ranks.items():
            if proc.poll() not in (None, *_CLEAN) and rank not in self._failed:
                self._failed.append(rank)
        return bool(self._failed)

    def _failure_of(self, rank: int) -> str:
        proc = self.ranks[rank]
        cause = recorded_failure(rank)
        said = f"rank {rank} (pid {proc.pid}) {describe_exit(proc.returncode)}" + (f": {cause}" if cause else "")
        if cause and mentions_timeout(cause):
            said += f" (a collective waited past the timeout, {TIMEOUT_SETTING}: a peer is stuck)"
        return said

    def _stop_running(self) -> str:
        """SIGKILL the ranks still running (SIGTERM does not end a process blocked in a collective); say which."""
        running = {rank: p for rank, p in self.ranks.items() if p.poll() is None}
        for proc in running.values():
            proc.kill()
        for proc in running.values():
            proc.wait()
        if not running:
            return ""
        names = ", ".join(f"rank {rank} (pid {p.pid})" for rank, p in running.items())
        return f" Still running, so stopped: {names}."
