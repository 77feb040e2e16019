"""The profiler window (``train.profile``) and the per-log-step straggler and data-stall figures, for both doors.

Both are measured by ``torch.profiler`` over whole optimizer steps, from the end of one optimizer step (after the
door's bookkeeping; in the Lightning door a checkpoint written at that step falls in the window, as Lightning runs
``ModelCheckpoint`` after the other callbacks) to the end of the last one measured, and read by :mod:`lightning_plugins.run.profile_summary`:

* **Profile** (``train.profile: {start_step: N, steps: K}``): optimizer steps ``N..N+K-1`` on every rank; each rank
  writes a Chrome trace ``output_dir/profile/rank<R>.json``; rank 0 gathers every rank's summary, prints it as a table
  and writes ``output_dir/profile/summary.json``.
* **Stragglers and data stalls** (``train.perf_sample``, on by default): the last optimizer step of every
  ``train.log_every`` window is profiled the same way (activities CPU, plus CUDA on GPUs). Collectives synchronise
  the ranks, so every rank's wall step time is the same whichever is slow: a straggler shows only as the *other*
  ranks waiting in communication. Each rank's own time (the step less its exposed communication) names the slowest
  rank; its ratio to the median own time, each rank's step and data-wait time are returned as metrics
  (``perf/step_s``, ``perf/own_s``, ``perf/data_wait_s``, ``perf/slowest_rank``, ``perf/slowest_ratio``), appended
  to ``output_dir/ranks.jsonl`` and, past ``train.straggler_ratio`` (and :data:`NOISE_S` above the median), printed
  by rank 0 as one line. Data wait is the
  profiled DataLoader ``__next__`` time (both doors fetch through it). A log step inside the profile window takes no
  sample (one profiler at a time).

Kineto's ``profiler_start``/``profiler_stop`` lines go to a closed stderr (fd 2 is redirected only around the
profiler's start and stop). This module imports neither Lightning nor Accelerate.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from lightning_plugins.run.profile_summary import WINDOW, WindowSummary, classify, format_table, kineto_events, summarize


#: A slowest rank less than this many seconds above the median is not named (a hiccup on a millisecond step).
NOISE_S = 0.05


@dataclass
class ProfileOptions:
    """``train.profile``: which optimizer steps ``torch.profiler`` records on every rank."""

    start_step: int = 2
    """The first profiled optimizer step (1-based; leave the first few out: they warm up)."""
    steps: int = 1
    """How many optimizer steps to profile."""

    def __post_init__(self) -> None:
        for name in ("start_step", "steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"train.profile.{name}={value!r} must be an integer >= 1 (e.g. start_step: 5, steps: 2)"
                )

    @property
    def last_step(self) -> int:
        return self.start_step + self.steps - 1

    def check_within(self, total_steps: int) -> None:
        """Refuse a window that ends after the run's last optimizer step (it would never be written)."""
        if self.last_step > total_steps:
            raise ValueError(
                f"train.profile covers optimizer steps {self.start_step}..{self.last_step}, past the run's last step"
                f" {total_steps}: lower train.profile.start_step or train.profile.steps (e.g. start_step:"
                f" {max(1, total_steps - self.steps + 1)})."
            )


class PerfMonitor:
    """Drives the profiler for one training run; the doors call :meth:`begin`, :meth:`step_end`, :meth:`next_step`
    and :meth:`close`.

    Args:
        output_dir: The run's output directory (``profile/`` and ``ranks.jsonl`` go there).
        log_every: Optimizer steps per log window; the last step of each is sampled.
        profile: The profile window, or ``None``.
        straggler_ratio: Rank 0 prints the slowest rank when its own time is this many times the median.
        sample: Whether to sample the last step of every log window (stragglers, data stalls).
        cuda: Whether to record CUDA activity too (GPU runs).
        say: Rank 0's printer (``print`` to stdout by default).
    """

    def __init__(
        self,
        output_dir: str | Path,
        log_every: int,
        profile: ProfileOptions | None = None,
        *,
        straggler_ratio: float = 1.25,
        sample: bool = True,
        cuda: bool = False,
        say: Any = None,
    ) -> None:
        self.out, self.log_every, self.profile = Path(output_dir), log_every, profile
        self.straggler_ratio, self.sample, self.cuda = straggler_ratio, sample, cuda
        self.say = say or (lambda line: print(line, flush=True))
        self._prof: Any = None  # the running recording
        self._last: Any = None  # the last one stopped (its trace is exported from it)
        self._window: Any = None
        self._until = 0  # the optimizer step the running recording ends after

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def begin(self, step: int, total_steps: int) -> None:
        """Before the first optimizer step of this attempt (``step`` already taken, e.g. after a resume)."""
        if self.profile is not None:
            self.profile.check_within(total_steps)
        self.next_step(step)

    def next_step(self, step: int) -> None:
        """After optimizer step ``step`` and the door's bookkeeping: start recording if step ``step + 1`` is sampled."""
        if self._prof is not None:
            return
        profile = self.profile
        if profile is not None and step + 1 == profile.start_step:
            self._start(profile.last_step)
        elif self.sample and (step + 1) % self.log_every == 0 and not self._in_profile(step + 1):
            self._start(step + 1)

    def step_end(self, step: int) -> dict[str, float]:
        """After optimizer step ``step`` (every rank): the perf metrics if a sample ended here, else ``{}``."""
        if self._prof is None or step < self._until:
            return {}
        summary = self._stop()
        profiled = self.profile is not None and step == self.profile.last_step
        try:
            if profiled:
                self._write_profile(summary)
                return {}
            return self._stragglers(step, summary)
        finally:
            self._last = None  # its events are read: let them go

    def close(self) -> None:
        """Stop a recording still running (the run ended or failed); nothing is written."""
        if self._prof is not None:
            self._window.__exit__(None, None, None)
            with _quiet_stderr():
                self._prof.stop()
            self._prof = self._window = None

    def _in_profile(self, step: int) -> bool:
        return self.profile is not None and self.profile.start_step <= step <= self.profile.last_step

    def _start(self, until: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._prof, self._until = profile(activities=activities), until
        with _quiet_stderr():
            self._prof.start()
        self._window = record_function(WINDOW)
        self._window.__enter__()

    def _stop(self) -> WindowSummary:
        if self.cuda:
            torch.cuda.synchronize()
        prof = self._prof
        self.close()
        self._last = prof
        return summarize(self.rank, *classify(kineto_events(prof)))

    def _write_profile(self, summary: WindowSummary) -> None:
        folder = self.out / "profile"
        folder.mkdir(parents=True, exist_ok=True)
        self._last.export_chrome_trace(str(folder / f"rank{self.rank}.json"))
        summaries = _gather(summary)
        if self.rank != 0:
            return
        assert self.profile is not None
        steps = f"{self.profile.start_step}..{self.profile.last_step}"
        record = {"steps": [self.profile.start_step, self.profile.last_step], "ranks": [s.to_dict() for s in summaries]}
        (folder / "summary.json").write_text(json.dumps(record, indent=1))
        lines = [f"profile of optimizer steps {steps} (traces and summary.json in {folder}):", *format_table(summaries)]
        self.say("\n".join(lines))

    def _stragglers(self, step: int, summary: WindowSummary) -> dict[str, float]:
        ranks = _gather_figures(summary, "cuda" if self.cuda else "cpu")
        own = [s.own_s for s in ranks]
        median = statistics.median(own)
        slowest = max(range(len(ranks)), key=lambda r: own[r])
        ratio = own[slowest] / median if median > 0 else 1.0
        metrics = {
            "perf/step_s": statistics.median(s.window_s for s in ranks),
            "perf/own_s": own[slowest],
            "perf/data_wait_s": max(s.data_wait_s for s in ranks),
            "perf/slowest_rank": float(ranks[slowest].rank),
            "perf/slowest_ratio": ratio,
        }
        if self.rank == 0:
            rows = [{"rank": s.rank, "step_s": s.window_s, "own_s": s.own_s, "exposed_comm_s": s.exposed_comm_s,
                     "data_wait_s": s.data_wait_s} for s in ranks]  # fmt: skip
            self.out.mkdir(parents=True, exist_ok=True)
            with open(self.out / "ranks.jsonl", "a") as handle:
                handle.write(json.dumps({"step": step, "ranks": rows, "slowest_rank": ranks[slowest].rank,
                                         "slowest_ratio": ratio}) + "\n")  # fmt: skip
            if ratio >= self.straggler_ratio and own[slowest] - median >= NOISE_S:
                self.say(
                    f"step {step}: rank {ranks[slowest].rank} is the slowest: {ratio:.2f}x the median own time"
                    f" ({own[slowest]:.2f} s vs {median:.2f} s; data wait {ranks[slowest].data_wait_s:.2f} s)"
                )
        return metrics


def _gather(summary: WindowSummary) -> list[WindowSummary]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [summary]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, summary)
    return every


def _gather_figures(summary: WindowSummary, device: str) -> list[WindowSummary]:
    """Every rank's figures, without ``comm_by_op``: one ``all_gather`` of a few numbers (the object gather of whole
    summaries pickles, ~20 ms per sample here)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [summary]
    names = ("window_s", "compute_s", "comm_s", "exposed_comm_s", "data_wait_s", "idle_s")
    figures = [float(summary.rank), *(getattr(summary, n) for n in names)]
    mine = torch.tensor(figures, dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [WindowSummary(int(row[0]), *row[1:].tolist()) for row in every]


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    """fd 2 to ``/dev/null`` for the duration (kineto writes its start/stop lines there, whatever its log level)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)

