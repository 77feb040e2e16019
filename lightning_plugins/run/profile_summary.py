"""Where a profiled window's time goes, from torch.profiler's events: compute, communication, data wait, idle.

Every figure is a measure (seconds) of a union of intervals on one rank's timeline, clipped to the window:

* **window**: the span of the ``perf:window`` annotation :class:`~lightning_plugins.run.perf.PerfMonitor` opens right
  after the profiler starts and closes right before it stops (from the end of one optimizer step to the end of the
  last profiled one); its thread is the *main thread*.
* **data wait**: the DataLoader ``__next__`` events (fetching and collating a batch, waiting for workers).
* **compute**: on CPU, the operator events of the main thread, less the time inside collective ones (``c10d::*``,
  ``_c10d_functional::wait_tensor``, ``FSDP::all_gather``, ...: a DTensor op such as ``aten::add`` holds a
  ``wait_tensor`` in which the rank waits for its peers, and FSDP2 waits in ``FSDP::all_gather``'s own time) and less
  data wait; on GPU (when device kernels were recorded), the kernels that are not NCCL's.
* **communication**: the collectives' own events: on CPU/gloo the ``gloo:<op>`` events on gloo's worker threads,
  which span from the start of the collective to its completion (so they include waiting for peers); on GPU the
  NCCL kernels. ``comm_by_op`` sums each collective's event durations (``all_reduce``, ``all_gather``,
  ``reduce_scatter``, ``send/recv``, ``all_to_all``, ``broadcast``, ...), as ``key_averages`` does; ``comm`` is their
  union (overlapping collectives counted once).
* **exposed communication**: communication not hidden behind compute or data wait: comm less (compute u data wait).
  Collectives synchronise the ranks, so a rank that waits for a slow peer shows that wait here.
* **idle**: the window less (compute u comm u data wait): host time in no operator (Python, sleeps, waits that no
  event records).

``compute + exposed_comm + data_wait + idle = window`` exactly, so their shares sum to 1. A rank's **own time**
(``window - exposed_comm``) is what it would take without waiting on its peers: the slowest rank has the largest.
This module imports neither Lightning nor Accelerate; CPU and GPU events go through the same :func:`summarize`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any, Literal, NamedTuple

#: The annotation that marks the profiled window on the main thread.
WINDOW = "perf:window"
Kind = Literal["compute", "wait", "comm", "data", "skip"]
_COLLECTIVE = re.compile(
    r"c10d|gloo|nccl|wait_tensor|all_?gather|all_?reduce|reduce_?scatter|broadcast|all_?to_?all|barrier|send|recv"
    r"|record_param_comms",
    re.IGNORECASE,
)
_OPS = (
    ("allreduce", "all_reduce"), ("allgather", "all_gather"), ("reducescatter", "reduce_scatter"),
    ("alltoall", "all_to_all"), ("broadcast", "broadcast"), ("sendrecv", "send/recv"), ("send", "send/recv"),
    ("recv", "send/recv"), ("barrier", "barrier"), ("reduce", "reduce"), ("gather", "gather"), ("scatter", "scatter"),
)  # fmt: skip


class Event(NamedTuple):
    """One profiler event, as :func:`kineto_events` reads it (times in nanoseconds, the profiler's clock)."""

    name: str
    thread: int
    kernel: bool  # a device (CUDA) kernel
    start: int
    end: int
    annotation: bool = False  # a ``record_function`` range (gloo's ``gloo:<op>`` events are ones)


class Span(NamedTuple):
    """A classified event."""

    kind: Kind
    start: int
    end: int
    op: str = ""


@dataclass
class WindowSummary:
    """One rank's window, in seconds (see the module docstring for the definitions)."""

    rank: int
    window_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    data_wait_s: float
    idle_s: float
    comm_by_op: dict[str, float] = field(default_factory=dict)

    @property
    def own_s(self) -> float:
        """The window less the time spent waiting on peers (exposed communication)."""
        return self.window_s - self.exposed_comm_s

    def shares(self) -> dict[str, float]:
        """Compute, exposed communication, data wait and idle as fractions of the window (they sum to 1)."""
        parts = {"compute": self.compute_s, "exposed_comm": self.exposed_comm_s, "data_wait": self.data_wait_s}
        parts["idle"] = self.idle_s
        return {k: v / self.window_s if self.window_s > 0 else 0.0 for k, v in parts.items()}

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "own_s": self.own_s, "shares": self.shares()}


def collective_name(name: str) -> str:
    """The collective an event or kernel runs: ``gloo:all_reduce`` and ``ncclDevKernel_AllReduce_Sum_f32`` are both
    ``all_reduce``; an unknown one keeps its name."""
    key = name.split(":", 1)[-1].lower().replace("_", "")
    key = key.removeprefix("nccldevkernel").removeprefix("ncclkernel")
    return next((op for part, op in _OPS if part in key), name)


def kineto_events(prof: Any) -> list[Event]:
    """The events of a stopped ``torch.profiler.profile``, read from kineto's results directly: ``prof.events()``
    builds a Python object tree and took ~0.65 s per tiny-model TP step here, this ~0.03 s."""
    return [
        Event(e.name(), e.start_thread_id(), e.device_type().name == "CUDA", e.start_ns(), e.end_ns(),
              e.is_user_annotation())  # fmt: skip
        for e in prof.profiler.kineto_results.events()
    ]


def classify(events: Sequence[Event]) -> tuple[tuple[int, int], list[Span]]:
    """The window and the spans of ``events`` by the module docstring's definitions (CPU and GPU alike).

    Raises:
        ValueError: if no ``perf:window`` annotation was recorded.
    """
    window = next((e for e in events if e.name == WINDOW), None)
    if window is None:
        raise ValueError(f"no {WINDOW!r} event in the profile: the window must be annotated by PerfMonitor")
    main, kernels = window.thread, any(e.kernel for e in events)
    spans = []
    for event in events:
        kind = _kind(event, main, kernels)
        if kind != "skip":
            spans.append(Span(kind, event.start, event.end, collective_name(event.name) if kind == "comm" else ""))
    return (window.start, window.end), spans


def _kind(event: Event, main: int, kernels: bool) -> Kind:
    name = event.name
    if name == WINDOW:
        return "skip"
    if event.kernel:
        return "comm" if "nccl" in name.lower() else "compute"
    if name.startswith("gloo:"):
        return "comm"
    if "DataLoader" in name and "__next__" in name:
        return "data"
    if kernels or event.thread != main or event.annotation:
        return "skip"
    return "wait" if _is_collective(name) else "compute"


@lru_cache(maxsize=4096)
def _is_collective(name: str) -> bool:
    return _COLLECTIVE.search(name) is not None


def summarize(rank: int, window: tuple[int, int], spans: Sequence[Span]) -> WindowSummary:
    """``rank``'s :class:`WindowSummary` of ``spans`` (nanoseconds) in ``window``."""
    lo, hi = window

    def union(kind: Kind) -> list[tuple[int, int]]:
        return _union((max(s.start, lo), min(s.end, hi)) for s in spans if s.kind == kind)

    data, comm = union("data"), union("comm")
    compute = _subtract(_subtract(union("compute"), union("wait")), data)
    busy = _union([*compute, *data])
    exposed = _subtract(comm, busy)
    everything = _union([*busy, *comm])
    by_op: dict[str, float] = {}
    for span in spans:
        if span.kind == "comm":
            by_op[span.op] = by_op.get(span.op, 0.0) + (span.end - span.start) / 1e9
    return WindowSummary(
        rank, (hi - lo) / 1e9, _length(compute) / 1e9, _length(comm) / 1e9, _length(exposed) / 1e9,
        _length(data) / 1e9, (hi - lo - _length(everything)) / 1e9, dict(sorted(by_op.items())),
    )  # fmt: skip


def _union(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _subtract(intervals: list[tuple[int, int]], minus: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``intervals`` less ``minus`` (both sorted, disjoint)."""
    out, j = [], 0
    for start, end in intervals:
        while j < len(minus) and minus[j][1] <= start:
            j += 1
        k, cursor = j, start
        while k < len(minus) and minus[k][0] < end:
            if minus[k][0] > cursor:
                out.append((cursor, minus[k][0]))
            cursor = max(cursor, minus[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def _length(intervals: list[tuple[int, int]]) -> int:
    return sum(end - start for start, end in intervals)


def format_table(summaries: Sequence[WindowSummary]) -> list[str]:
    """One row per rank: seconds and shares of the window, then communication by collective."""
    rows = [f"{'rank':>4} {'window':>8} {'compute':>15} {'exposed comm':>15} {'data wait':>15} {'idle':>15}  comm"]
    for s in summaries:
        share = s.shares()
        cells = [f"{v:7.3f} s {share[k]:5.1%}" for k, v in
                 (("compute", s.compute_s), ("exposed_comm", s.exposed_comm_s), ("data_wait", s.data_wait_s),
                  ("idle", s.idle_s))]  # fmt: skip
        comm = ", ".join(f"{op} {t:.3f} s" for op, t in s.comm_by_op.items()) or "none"
        rows.append(f"{s.rank:>4} {s.window_s:6.3f} s {' '.join(cells)}  {comm}")
    return rows
