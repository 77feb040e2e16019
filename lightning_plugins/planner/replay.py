"""The micro-batches a pipeline stage repeats, counted from one it ran rather than run again (the dry run's replay).

A pipeline step runs every stage's forward and backward once per micro-batch, the same operations on tensors of the
same sizes each time: under ``FakeTensorMode`` a 405B stage's 16 micro-batches cost 16 times one, for nothing the
tracker does not already know after one of them. :func:`replayed_microbatches` runs a stage's forward or backward of
a micro-batch for real until two consecutive runs that start from the same state (:func:`_state`: each FSDP2
parameter's sharded state and which gradients exist) have counted exactly the same (:class:`_Window`: the peak of each
interval the step's marks cut inside it, what it leaves held, what it hands on). From then on, a micro-batch whose
forward starts from that state is *replayed*, forward and backward alike: the tracker's counts move as the recorded
run moved them (each peak at the same moment, relative to where the counts stand), the intervals are marked as they
were, and the tensors the schedule passes on (a stage's output, a loss, the gradient sent to the previous stage) are
made with their sizes and categories, so that they are freed where the real ones would be. The first and the last
micro-batch always run (the last finishes the gradient reduction), and a run that leaves the state changed (a first
gradient, parameters left gathered) is never replayed. Forward-only passes (a preference objective's reference and KTO's
KL rows, under ``no_grad``) always run.

Which micro-batches a stage replays is planned from the order its schedule runs them (:func:`_plan`), so that a
replayed forward's backward is replayed too (its saved activations are counted, never made) and each stretch of
replayed runs ends in the state it began from. What the plan assumes is checked as the step runs: a replayed run
needs a recorded one from its exact state, a real run must start from the state the real objects are in, and a
recorded forward that left anything alive after its own backward (besides what it hands on and the stage's loss sum)
stops the replay of that stage. A step that breaks one of these raises :class:`ReplayMismatch`, and the dry run
measures it again without the replay. ``tests/planner/test_replay.py`` compares replayed and fully run steps: every
interval equal to the byte.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, _MemRefType
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    _ComputationType,
)
from torch.distributed.pipelining.stage import PipelineStage
from torch.distributed.tensor import DTensor

from lightning_plugins.errors import LightningPluginsError

__all__ = [
    "MISMATCH", "ReplayMismatch", "counted_step", "mismatched", "replayable", "replayed_microbatches", "without_replay"
]  # fmt: skip

Snapshot = dict[torch.device, dict[Any, int]]


@dataclass
class _Made:
    """A tensor a window hands on (or leaves in ``loss_sums``): made again, as it was, by a replay."""

    shape: torch.Size
    stride: tuple[int, ...]
    offset: int
    values: int  # in its storage
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    reftype: _MemRefType | None  # None: not tracked

    @classmethod
    def of(cls, tensor: Tensor, tracker: Any) -> _Made:
        winfo, _ = tracker._WINFO.get(tensor.untyped_storage(), (None, None))
        values = tensor.untyped_storage().nbytes() // tensor.element_size()
        return cls(tensor.shape, tensor.stride(), tensor.storage_offset(), values, tensor.dtype, tensor.device,
                   tensor.requires_grad, None if winfo is None else winfo.reftype)  # fmt: skip

    def make(self, tracker: Any) -> Tensor:
        tracker._propagating += 1  # made past the tracker, then filed under the recorded category
        try:
            storage = torch.empty(self.values, dtype=self.dtype, device=self.device)
            tensor = storage.as_strided(self.shape, self.stride, self.offset).detach()
        finally:
            tracker._propagating -= 1
        tensor.requires_grad_(self.requires_grad)
        if self.reftype is not None:
            tracker._update_and_maybe_create_winfos(tensor, self.reftype)
        return tensor


@dataclass
class _Window:
    """What one forward or backward of a micro-batch did to the tracker, relative to where it started."""

    peaks: list[dict[torch.device, dict[Any, int]]]  # per interval inside the window: each device's peak, as a change
    moved: dict[torch.device, dict[Any, int]]  # the counts' change at its end, less the tensors it makes (``made``)
    output: Any  # the structure handed on: a _Made, None, or a tuple/list of them
    end: tuple  # the state it left (:func:`_state`)
    sums: list[_Made] = field(default_factory=list)  # entries it appended to the stage's ``loss_sums``

    def same(self, other: _Window) -> bool:
        return (self.peaks, self.moved, self.output, self.end, self.sums) == (
            other.peaks, other.moved, other.output, other.end, other.sums
        )  # fmt: skip


#: The key of what :func:`~lightning_plugins.planner.dryrun.measure_step` returns for a step the replay could not count.
MISMATCH = "replay mismatch"


def replayable(workload: Any) -> bool:
    """Whether a workload's step may replay micro-batches: a pipeline whose backward runs whole (not split into input
    and weight passes), training on the SFT loss (a preference objective's stages keep more than their loss sums)."""
    pipeline = workload.pipeline
    return pipeline is not None and not pipeline.spec.split_backward and not workload.objective.paired


def mismatched(error: BaseException | None) -> bool:
    """Whether ``error`` (or what caused it: torch's stages wrap a forward's errors) is a :class:`ReplayMismatch`."""
    while error is not None:
        if isinstance(error, ReplayMismatch):
            return True
        error = error.__cause__
    return False


def counted_step(step: Callable[[], None], tracker: Any, mark: Callable[[], None], *, replay: bool) -> int | None:
    """Run a tracked pipeline step (with :func:`replayed_microbatches` when ``replay``): how many micro-batches it
    replayed, or ``None`` for a step the replay could not count (to be measured again without it)."""
    if not replay:
        step()
        return 0
    with replayed_microbatches(tracker, mark) as replaying:
        try:
            step()
        except RuntimeError as error:
            if not mismatched(error):
                raise
            return None
    return len(replaying.replayed)


def without_replay(call: tuple[Callable[..., Any], tuple]) -> tuple[Callable[..., Any], tuple]:
    """A dry-run pool's call of ``measure_step`` made to run every micro-batch."""
    fn, args = call
    return partial(fn, replay=False), args


class ReplayMismatch(LightningPluginsError, RuntimeError):
    """A step the replay cannot count: a micro-batch must run for real from a state only replayed runs reached."""


def replayed_microbatches(tracker: Any, mark: Callable[[], None]) -> contextlib.AbstractContextManager[_Replay]:
    """Inside it, pipeline stages replay the micro-batches they repeat (see the module docstring); ``mark`` is the
    tracked step's interval mark (:func:`~lightning_plugins.planner.intervals.mark_intervals`). It gives the replay,
    whose ``replayed`` holds the ``(stage, micro-batch)`` pairs counted without running them."""
    return _patched(_Replay(tracker, mark))


@contextlib.contextmanager
def _patched(replay: _Replay) -> Iterator[_Replay]:
    forward, backward = PipelineStage.forward_one_chunk, PipelineStage.backward_one_chunk

    def forward_one_chunk(stage: PipelineStage, chunk: int, *args: Any, **kwargs: Any) -> Any:
        run = stage.forward_maybe_with_nosync
        stage.forward_maybe_with_nosync = lambda *a, **k: replay.forward(stage, chunk, lambda: run(*a, **k))
        try:
            return forward(stage, chunk, *args, **kwargs)
        finally:
            del stage.forward_maybe_with_nosync

    def backward_one_chunk(stage: PipelineStage, chunk: int, *args: Any, **kwargs: Any) -> Any:
        run = stage.backward_maybe_with_nosync

        def window(kind: str, *a: Any, **k: Any) -> Any:
            return replay.backward(stage, chunk, kind, lambda: run(kind, *a, **k))

        stage.backward_maybe_with_nosync = window
        try:
            return backward(stage, chunk, *args, **kwargs)
        finally:
            del stage.backward_maybe_with_nosync

    steps = {cls: cls.step for cls in (PipelineScheduleSingle, PipelineScheduleMulti)}

    def seen(step: Callable[..., Any]) -> Callable[..., Any]:
        def step_seen(schedule: Any, *args: Any, **kwargs: Any) -> Any:
            replay.schedule, replay.plans = schedule, {}
            return step(schedule, *args, **kwargs)

        return step_seen

    PipelineStage.forward_one_chunk, PipelineStage.backward_one_chunk = forward_one_chunk, backward_one_chunk
    for cls, step in steps.items():
        cls.step = seen(step)
    try:
        yield replay
    finally:
        PipelineStage.forward_one_chunk, PipelineStage.backward_one_chunk = forward, backward
        for cls, step in steps.items():
            cls.step = step


class _Replay:
    def __init__(self, tracker: Any, mark: Callable[[], None]) -> None:
        self.tracker = tracker
        self.mark = mark
        self.last: dict[tuple, _Window] = {}  # (stage, kind, state) -> the window last run from that state
        self.sure: dict[tuple, _Window] = {}  # ... -> a window two consecutive runs from that state agreed on
        self.replayed: set[tuple[int, int]] = set()  # (stage, chunk) whose forward was replayed
        self.stopped: set[int] = set()  # stages that left something alive the replay cannot account for
        self.pending: dict[tuple[int, int], list] = {}  # (stage, chunk) -> what its recorded forward created
        self.virtual: dict[int, tuple] = {}  # stage -> the state its last run (replayed or not) left
        self.schedule: Any = None  # the schedule whose step runs
        self.plans: dict[int, set[int]] = {}  # stage -> the micro-batches it may replay (:func:`_plan`)

    def forward(self, stage: PipelineStage, chunk: int, run: Callable[[], Any]) -> Any:
        if not torch.is_grad_enabled():  # a forward-only pass (DPO's reference, KTO's three): run, neither replayed
            return run()  # nor taken for a training forward that starts from the same state
        index = stage.stage_index
        key = (index, "forward", self._state(stage))
        window = self.sure.get(key)
        if window is not None and chunk in self._planned(stage) and index not in self.stopped:
            self.replayed.add((index, chunk))
            return self._replay(stage, window)
        output, window, created = self._record(stage, run)
        if any(isinstance(t, DTensor) for t in _tensors(output)):
            self.stopped.add(index)  # not made again here (stages hand on local tensors)
        self._agreed(key, window)
        self.pending[index, chunk] = created
        return output

    def backward(self, stage: PipelineStage, chunk: int, kind: str, run: Callable[[], Any]) -> Any:
        index = stage.stage_index
        key = (index, "backward", self._state(stage))
        if (index, chunk) in self.replayed:
            window = self.sure.get(key)
            if kind != "full" or window is None:
                raise ReplayMismatch(f"stage {index}'s micro-batch {chunk}: its {kind} backward was never recorded")
            return self._replay(stage, window)
        output, window, _ = self._record(stage, run)
        if kind == "full":
            self._agreed(key, window)
        self._check_left_alive(stage, chunk)
        return output

    def _planned(self, stage: PipelineStage) -> set[int]:
        index = stage.stage_index
        if index not in self.plans:
            timeline = _timeline(self.schedule, stage) if _known_stage(stage) else None
            self.plans[index] = _plan(timeline, stage.chunks) if timeline is not None else set()
        return self.plans[index]

    def _state(self, stage: PipelineStage) -> tuple:
        """The stage's state as the step has it: after a replayed run, the state that run would have left."""
        virtual = self.virtual.get(stage.stage_index)
        return virtual if virtual is not None else _state(stage)

    def _agreed(self, key: tuple, window: _Window) -> None:
        previous = self.last.get(key)
        self.last[key] = window
        if previous is not None and previous.same(window):
            self.sure.setdefault(key, window)

    def _check_left_alive(self, stage: PipelineStage, chunk: int) -> None:
        """Stop replaying a stage whose recorded forward left tensors alive past its backward (other than what it hands
        on or keeps in ``loss_sums``): a replay would not hold them. Replays of it before this was known (a pipeline's
        warm-up forwards) make the step one the replay cannot count."""
        index = stage.stage_index
        if any(ref() is not None for ref in self.pending.pop((index, chunk), ())):
            if any(replayed == index for replayed, _ in self.replayed):
                raise ReplayMismatch(f"stage {index}'s forward left tensors alive past its backward")
            self.stopped.add(index)

    def _record(self, stage: PipelineStage, run: Callable[[], Any]) -> tuple[Any, _Window, list]:
        tracker = self.tracker
        if self._state(stage) != _state(stage):
            raise ReplayMismatch(f"stage {stage.stage_index} must run from a state its replayed runs did not leave")
        start = _copy(tracker._curr_mem_snap)
        peaks: list[dict] = [{}]
        seen = {winfo for winfo, _ in tracker._WINFO.values()}
        sums = _loss_sums(stage)
        before = len(sums) if sums is not None else 0
        update, restart = tracker._update_peak_stats, tracker.restart_peak

        def watched_update(*args: Any) -> None:
            update(*args)
            for dev, snap in tracker._curr_mem_snap.items():
                held = peaks[-1].get(dev)
                if held is None or tracker.on_device(held) < tracker.on_device(snap):
                    peaks[-1][dev] = dict(snap)

        def watched_restart() -> None:
            restart()
            peaks.append({})

        tracker._update_peak_stats, tracker.restart_peak = watched_update, watched_restart
        try:
            output = run()
        finally:
            del tracker._update_peak_stats, tracker.restart_peak
        added = list(sums[before:]) if sums is not None else []
        handed = _tensors(output)
        moved = _minus(tracker._curr_mem_snap, start)
        for tensor in (*handed, *added):
            _uncount(moved, tensor, tracker)
        window = _Window(
            [{dev: _minus_one(snap, start.get(dev, {})) for dev, snap in peak.items()} for peak in peaks],
            moved,
            _structure(output, lambda t: _Made.of(t, tracker)),
            _state(stage),
            [_Made.of(t, tracker) for t in added],
        )
        self.virtual[stage.stage_index] = window.end
        exempt = {tracker._WINFO.get(t.untyped_storage(), (None, None))[0] for t in (*handed, *added)}
        created = [ref for winfo, ref in tracker._WINFO.values() if winfo not in seen and winfo not in exempt]
        return output, window, created

    def _replay(self, stage: PipelineStage, window: _Window) -> Any:
        tracker = self.tracker
        start = _copy(tracker._curr_mem_snap)
        for index, peak in enumerate(window.peaks):
            if index:
                self.mark()
            for dev, change in peak.items():
                candidate = _plus(start.get(dev, {}), change)
                if tracker._peak_mem.get(dev, -1) < tracker.on_device(candidate):
                    tracker._peak_mem[dev] = tracker.on_device(candidate)
                    tracker._peak_mem_snap[dev] = candidate
        for dev, change in window.moved.items():
            snap = tracker._curr_mem_snap.setdefault(dev, dict.fromkeys(tracker._ref_class, 0))
            snap.setdefault(_TOTAL_KEY, 0)
            for key, value in change.items():
                snap[key] = snap.get(key, 0) + value
        sums = _loss_sums(stage)
        for made in window.sums:
            sums.append(made.make(tracker))
        self.virtual[stage.stage_index] = window.end
        return _structure(window.output, lambda made: made.make(tracker))


#: What an FSDP2 parameter group holds between calls that a later call frees or reuses (torch 2.13-2.15 names; a
#: name a version lacks reads as None).
_GROUP_HELD = ("_all_gather_result", "_partial_reduce_output", "_all_reduce_state", "_post_reduce_event",
               "_reshard_after_forward_event")  # fmt: skip


def _state(stage: PipelineStage) -> tuple:
    """What a micro-batch's run may depend on beyond its inputs: each FSDP2 group's sharded and training state, the
    buffers it and its communication context hold from an earlier call (a gather, a reduce-scatter still in flight),
    and each parameter's sharded state and which of its gradients exist (unsharded, accumulated, sharded)."""
    state: list[tuple] = []
    for module in stage.submod.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        if group is None:
            continue
        context = group.comm_ctx
        state.append((
            group._sharded_state,
            group._training_state,
            *(getattr(group, name, None) is None for name in _GROUP_HELD),
            getattr(context, "all_gather_state", None) is None,
            len(getattr(context, "reduce_scatter_states", ())),
        ))  # fmt: skip
        for param in group.fsdp_params:
            unsharded = getattr(param, "_unsharded_param", None)
            state.append((
                param.sharded_state,
                unsharded is None or unsharded.grad is None,
                param.unsharded_accumulated_grad is None,
                param.sharded_param.grad is None,
            ))  # fmt: skip
    return tuple(state)


def _known_stage(stage: PipelineStage) -> bool:
    """Whether torch's stage keeps a micro-batch's inputs the way the replay was built and tested for (torch 2.13's
    and 2.14's ``fwd_cache``, receive buffers allocated once per stage). torch 2.15's stages allocate a receive buffer
    per micro-batch and hold it until the step ends, outside the runs a replay counts (found by
    ``tests/planner/test_replay.py`` on torch 2.15.0: one buffer fewer per replayed micro-batch): there every
    micro-batch runs."""
    return hasattr(stage, "fwd_cache")


def _loss_sums(stage: PipelineStage) -> list | None:
    return getattr(stage.submod, "loss_sums", None)


def _tensors(output: Any) -> list[Tensor]:
    if isinstance(output, Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    return []


def _structure(output: Any, each: Callable[[Any], Any]) -> Any:
    if isinstance(output, (Tensor, _Made)):
        return each(output)
    if isinstance(output, (tuple, list)):
        return type(output)(_structure(item, each) for item in output)
    if output is None:
        return None
    raise TypeError(f"dry run: a pipeline stage handed on {type(output).__name__}, which the replay cannot make")


def _uncount(moved: dict, tensor: Tensor, tracker: Any) -> None:
    winfo, _ = tracker._WINFO.get(tensor.untyped_storage(), (None, None))
    if winfo is not None:
        change = moved.setdefault(winfo.device, {})
        change[winfo.reftype] = change.get(winfo.reftype, 0) - winfo.mem_consumed
        change[_TOTAL_KEY] = change.get(_TOTAL_KEY, 0) - winfo.mem_consumed


def _copy(snapshot: Snapshot) -> Snapshot:
    return {dev: dict(snap) for dev, snap in snapshot.items()}


def _minus_one(now: dict, then: dict) -> dict:
    return {key: now.get(key, 0) - then.get(key, 0) for key in now.keys() | then.keys()}


def _plus(then: dict, change: dict) -> dict:
    return {key: then.get(key, 0) + change.get(key, 0) for key in then.keys() | change.keys()}


def _minus(now: Snapshot, then: Snapshot) -> Snapshot:
    return {dev: _minus_one(now.get(dev, {}), then.get(dev, {})) for dev in now.keys() | then.keys()}


def _timeline(schedule: Any, stage: PipelineStage) -> list[tuple[str, int]] | None:
    """The stage's forward and backward runs in the order ``schedule`` runs them (None: a schedule not known here)."""
    n = stage.chunks
    if isinstance(schedule, ScheduleGPipe):
        return [("forward", i) for i in range(n)] + [("backward", i) for i in range(n)]
    if isinstance(schedule, Schedule1F1B):  # torch's loop: warm-up forwards, then a backward before each forward
        warmup = min(n, stage.num_stages - stage.stage_index)
        order = [("forward", i) for i in range(warmup)]
        for i in range(n):
            order.append(("backward", i))
            if warmup + i < n:
                order.append(("forward", warmup + i))
        return order
    actions = getattr(schedule, "pipeline_order", {}).get(getattr(schedule, "rank", None))
    if actions is None:
        return None
    kinds = {_ComputationType.FORWARD: "forward", _ComputationType.FULL_BACKWARD: "backward"}
    order = []
    for action in actions:
        if action is None or action.stage_index != stage.stage_index:
            continue
        if action.computation_type not in kinds:
            return None  # split backward passes: not replayed
        order.append((kinds[action.computation_type], action.microbatch_index))
    return order


def _plan(timeline: list[tuple[str, int]], n: int) -> set[int]:
    """The micro-batches a stage may replay, forward and backward, given the order it runs them.

    Each run is keyed by what it starts from, as far as the order tells (the kind of the stage's previous run and
    whether a backward ran yet; the step checks the real state, :func:`_state`). A micro-batch is replayed when each
    of its two runs has two earlier runs from the same start that ran for real (to be recorded and agree), and each
    stretch of replayed runs ends where it began, so that the next real run starts from the state the real objects
    are in. The first and the last micro-batch run for real.
    """
    starts, previous, backward_yet = [], None, False
    for kind, _ in timeline:
        starts.append((previous, backward_yet))
        previous, backward_yet = kind, backward_yet or kind == "backward"
    starts.append((previous, backward_yet))
    replayed = set(range(1, n - 1))
    changed = True
    while changed:
        changed = False
        real: dict[tuple, int] = {}
        for (kind, chunk), start in zip(timeline, starts):
            if chunk in replayed and real.get((kind, start), 0) < 2:
                replayed.discard(chunk)  # its runs are real from here on: the earliest runs are the recorded ones
                changed = True
            if chunk not in replayed:
                real[kind, start] = real.get((kind, start), 0) + 1
        first = None
        for index, (_, chunk) in enumerate([*timeline, ("end", -1)]):
            if chunk in replayed and first is None:
                first = index
            elif chunk not in replayed and first is not None:
                if index < len(timeline) and starts[first] != starts[index]:
                    replayed.discard(timeline[index - 1][1])
                    changed = True
                first = None
    return replayed
