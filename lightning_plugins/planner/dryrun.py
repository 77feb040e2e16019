"""The dry run: a model at real size, parallelized on a fake process group, its memory per rank counted and measured.

For every distinct kind of rank (one kind without pipeline parallelism; the first, a middle and the last
pipeline stage with it) the dry run

1. builds the real-size model on the meta device, applies LoRA and :func:`lightning_plugins.parallelize`
   with the workload's layout on a fake process group of the real world size (no communication, no
   memory), and counts the parameters, gradients and optimizer state this rank holds from the sharded
   tensors the engine created, with their real dtypes (**state**);
2. runs one training step (forward, backward, AdamW) of the same layout under ``FakeTensorMode`` with
   :class:`~lightning_plugins.planner.measure.StepMemTracker` (the tracker of the real runs it is checked against),
   after an untracked warm-up step, on copies of the model with 4 and with 8 decoder layers on the rank
   (:data:`MEASURED_LAYERS`) when it holds more, and extrapolates every interval's peak linearly to the layers the
   rank really holds (**peak**, measured). The pipeline
   schedule runs for real, so the micro-batches a stage holds at once are the schedule's own.

Host memory is measured where a lever changes the step: with ``memory.activation_offload`` the offload hooks
run in the measured step and move what each layer saves to the meta device, which the tracker counts apart from
the (fake, CPU) GPU: the GPU peak is what stays, :attr:`RankMemory.host` the most the host holds at once. The
counted state also gives what loading holds on the host (the tensor whose local slice holds the most bytes in flight)
and what the pinned allocator would round up (:mod:`lightning_plugins.planner.host_memory`).

NF4 bases (QLoRA) are measured as they run: the frozen linears are NF4 tensors of the real sizes
(:func:`~lightning_plugins.adapters.qlora.quantize_base_to_nf4` with ``shapes_only``), FSDP2 shards and gathers
their 4-bit codes and scalers through torchao's all-gather extension, and each matmul dequantizes its weight, all
under ``FakeTensorMode``.
Modelled rather than measured, and said so in :attr:`RankMemory.notes`: with ``memory.cpu_offload`` the sharded parameters, gradients and optimizer state are moved to the host; with
``memory.optimizer_offload`` the optimizer state is (and the optimizer step's GPU temporaries vanish), the host
holding it with a copy of the trainable parameters and their gradients. Both only move resident state, so one
measured step serves a workload with and without them (the layout search relies on it).
float8 linears (``parallel.float8``) are measured as a GPU runs them: on the fake process group the engine converts
the decoder's linears to torchao's ``Float8Linear`` and FSDP2 gathers their weights in float8 under
``FakeTensorMode``; ``compile`` and ``async_tp`` are left out there, changing the kernels (the step time), not the
tensors (:mod:`lightning_plugins.parallel.compile`).
A mixture-of-experts step routes balanced (:func:`~lightning_plugins.planner.fake_step.balanced_routing`): fake
tensors have no routing counts, so every expert gets the same pairs; the all-to-all buffers of expert parallelism
are measured with them.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_plugins.parallel.dtypes import DTYPES
from lightning_plugins.planner.fake_step import (
    balanced_routing,
    default_dtype,
    fake_world,
    one_loss_chunk_only,
    one_row_tile_only,
    static_pipeline_shapes,
    unpacked_rows,
)
from lightning_plugins.planner.forked import forked
from lightning_plugins.planner.host_memory import largest_read, pinned_rounding
from lightning_plugins.planner.image_text import image_batch, real_metadata
from lightning_plugins.planner.intervals import mark_intervals
from lightning_plugins.planner.measure import StepMemTracker
from lightning_plugins.planner.meta_model import meta_model
from lightning_plugins.planner.objective_step import packed_pairs_batch, run_step
from lightning_plugins.planner.replay import MISMATCH, counted_step, replayable, without_replay
from lightning_plugins.planner.reference_kernels import LINEAR_ATTENTION_NOTE, reference_kernels_quietly
from lightning_plugins.planner.rank_memory import RankMemory, with_offload, with_optimizer_offload, worst_interval
from lightning_plugins.planner.workload import Workload

#: Decoder layers per rank of the two measured copies of a model whose ranks hold more than the second. Each
#: interval's peak is linear in the layers from 4 on (at 2 the head's backward still overlaps the last layer's);
#: every shipped recipe's peak is the same (0.05 GiB) as from 8 and 16, at half the cost.
MEASURED_LAYERS = (4, 8)
def dry_run(workload: Workload) -> list[RankMemory]:
    """The memory of every kind of rank of ``workload`` (see the module docstring); no GPU, no network.

    Every fake world (a count, a measured step) runs in its own forked process, as many at once as there are
    cores. Must not run inside an initialized process group.
    """
    return dry_runs([workload])[0]


def dry_runs(workloads: list[Workload]) -> list[list[RankMemory]]:
    """:func:`dry_run` of each workload, their fake worlds all in one pool of processes (no core waits for the
    last world of one workload before the next workload starts)."""
    if dist.is_initialized():
        raise RuntimeError("dry_run makes its own fake process groups: call it outside torch.distributed.")
    plans = []
    for workload in workloads:
        kinds = rank_kinds(workload)
        plans.append((workload, kinds, [_calls_of(workload, rank) for _, rank in kinds]))
    calls = [call for _, _, rank_calls in plans for rank_call in rank_calls for call in rank_call]
    # Longest first: a pool that starts the longest world last waits on it alone at the end (the 405B pipeline
    # recipes: the last stage's 8-layer copy, a third of the dry run, started when the other core had nothing left).
    order = sorted(range(len(calls)), key=lambda index: _expected_cost(calls[index]), reverse=True)
    results = dict(zip(order, forked([calls[index] for index in order])))
    again = [index for index, result in results.items() if MISMATCH in result]  # measured again, every micro-batch
    results.update(zip(again, forked([without_replay(calls[index]) for index in again])))
    done = iter([results[index] for index in range(len(calls))])
    return [_assembled(workload, kinds, rank_calls, done) for workload, kinds, rank_calls in plans]


def _expected_cost(call: tuple[Callable[..., Any], tuple]) -> tuple[int, int]:
    """What orders the pool's calls, the longest first: a measured step costs about its layers on the rank times the
    micro-batches it runs (later pipeline ranks first among equals: the last stage runs the head and the loss); a count
    costs little."""
    fn, (workload, rank) = call
    if getattr(fn, "func", fn) is count_state:
        return 0, rank
    pipeline = workload.pipeline
    return layers_of_rank(workload, rank) * (pipeline.microbatches if pipeline is not None else 1), rank


def _assembled(
    workload: Workload, kinds: list[tuple[str, int]], calls: list[list], results: Iterator[Any]
) -> list[RankMemory]:
    """Each kind of rank's report from the results of its calls (:func:`_calls_of`), taken from ``results`` in order."""
    reports = []
    for (kind, rank), rank_calls in zip(kinds, calls):
        done = [next(results) for _ in rank_calls]
        if len(done) == 1:  # measured as it is: the step's own model was counted
            state = done[0].pop("state")
        else:
            state = done.pop(0)
        reports.append(_rank_memory(workload, kind, rank, state, done))
    return reports


def _calls_of(workload: Workload, rank: int) -> list[tuple[Callable[..., Any], tuple]]:
    """The fake worlds a rank's dry run needs: one measured step that also counts the state when the rank holds
    few layers; else its state and the two measured copies."""
    copies = _measured_copies(workload, rank)
    if len(copies) == 1:
        return [(partial(measure_step, count=True), (copies[0], rank))]
    calls: list[tuple[Callable[..., Any], tuple]] = [(count_state, (workload, rank))]
    return calls + [(measure_step, (copy, rank)) for copy in copies]


def resident_state(workload: Workload) -> list[tuple[str, int, dict[str, int]]]:
    """``(kind, rank, state)`` of every kind of rank: the counted part of :func:`dry_run` alone (fast at any size)."""
    kinds = rank_kinds(workload)
    states = forked([(count_state, (workload, rank)) for _, rank in kinds])
    for state in states:
        for key in _COUNTED_EXTRAS:
            state.pop(key)
    return [(kind, rank, state) for (kind, rank), state in zip(kinds, states)]


def _rank_memory(
    workload: Workload, kind: str, rank: int, state: dict, steps: list[dict]
) -> RankMemory:
    largest, read, rounding = (state.pop(key) for key in _COUNTED_EXTRAS)
    layers = layers_of_rank(workload, rank)
    intervals, per_layer = _extrapolated(steps, layers)
    offloaded = max(interval.pop("host") for interval in intervals)  # activations on the host at most at once
    report = RankMemory(
        kind,
        rank,
        layers,
        state,
        {},
        host_terms={"activations": offloaded} if offloaded else {},
        load_terms={"in flight": read.nbytes},
        largest_read=read,
        pinned_rounding=rounding,
        activations_per_layer=per_layer,
    )
    report.intervals = intervals
    if "linear_attention" in (getattr(workload.config, "layer_types", None) or ()):
        report.notes.append(LINEAR_ATTENTION_NOTE)
    if len(steps) > 1:
        report.notes.append(
            f"peak extrapolated to {layers} layers from copies of the model with {MEASURED_LAYERS[0]} and"
            f" {MEASURED_LAYERS[1]} layers on this rank"
        )
    if workload.optimizer != "adamw":  # the step was measured with torch's AdamW: its state as counted instead
        for peak in report.intervals:
            moments = min(peak["optimizer"], state["optimizer"])
            peak["total"] -= peak["optimizer"] - moments
            peak["optimizer"] = moments
        report.notes.append(f"{workload.optimizer} state counted (the measured step ran torch's AdamW)")
    if workload.memory.optimizer_in_backward:  # each gradient applied and freed as produced: the largest at most
        for peak in report.intervals:
            alive = min(peak["gradients"], largest)
            peak["total"] -= peak["gradients"] - alive
            peak["gradients"] = alive
        report.notes.append(
            f"optimizer in backward modelled: gradients at most the largest parameter's ({largest / 2**30:.2f} GiB);"
            " the optimizer step's temporaries as measured for the whole step (an over-estimate)"
        )
    report.peak = worst_interval(report.intervals)
    if workload.memory.activation_offload:
        report.notes.append(
            f"activation offload measured: the step ran with the offload hooks, {offloaded / 2**30:.2f} GiB of saved"
            " activations on the host at most"
        )
    if workload.memory.optimizer_offload:
        with_optimizer_offload(report)
    if workload.memory.cpu_offload:
        with_offload(report)
    return report


def rank_kinds(workload: Workload) -> list[tuple[str, int]]:
    """``(kind, global rank)`` of each distinct kind of rank: pipeline rank r holds global ranks r * W/pp + ..."""
    pp = workload.layout.pp_size
    if pp == 1:
        return [("every rank", 0)]
    per_stage = workload.world_size // pp
    kinds = [("first stage", 0)]
    if pp > 2:
        kinds.append(("middle stages", per_stage))
    kinds.append(("last stage", (pp - 1) * per_stage))
    return kinds


def build_parallel_model(workload: Workload) -> nn.Module:
    """The workload's model on the meta device, with LoRA (an NF4 base of the real sizes for QLoRA) and the layout
    applied.

    Runs inside :func:`fake_world`.
    """
    from lightning_plugins import parallelize
    from lightning_plugins.adapters.lora import apply_lora

    model = meta_model(workload)
    model.config.use_cache = False
    model.train()
    if workload.lora is not None:
        # The adapters on meta too (their initialization costs seconds at real size), created in the base's dtype:
        # peft casts adapters to their base layer's dtype except on meta, then upcasts them to fp32 unless
        # lora.autocast_adapter_dtype is off.
        with torch.device("meta"), default_dtype(DTYPES[workload.dtype]):
            model = apply_lora(model, replace(workload.lora, quantize="none"))
        if workload.method == "qlora":
            from lightning_plugins.adapters.qlora import quantize_base_to_nf4

            quantize_base_to_nf4(model, shapes_only=True)
    # The options as a GPU run takes them: on the fake process group the engine applies float8 (what a step holds)
    # and leaves compile and async TP out (the step time); see lightning_plugins.parallel.compile.
    return parallelize(model, workload.layout, workload.options, workload.memory)


def _frozen_copy(workload: Workload) -> bool:
    """Whether the run holds a frozen copy of the model as its DPO reference (a full fine-tune)."""
    return workload.objective.frozen_copy(workload.lora)


def count_state(workload: Workload, rank: int) -> dict[str, int]:
    """Resident parameter, gradient and AdamW bytes of ``rank``, from the engine's sharded tensors (:func:`_state_of`)."""
    with fake_world(rank, workload.world_size):
        return _state_of(build_parallel_model(workload), workload)


#: What :func:`_state_of` counts besides the resident state: the largest gradient, the load's largest read, and the
#: pinned allocator's rounding of the parameters and gradients.
_COUNTED_EXTRAS = ("largest_gradient", "largest_read", "pinned_rounding")


def _state_of(model: nn.Module, workload: Workload) -> dict[str, Any]:
    """Parameter, gradient and optimizer bytes of a parallelized model's local shards, and :data:`_COUNTED_EXTRAS`.

    An NF4 shard (QLoRA) counts the bytes it holds (:func:`lightning_plugins.adapters.qlora.nf4_nbytes`: 4-bit
    codes, block scalers, their factors). With ``optimizer="adamw8bit"`` the moments of a shard torchao quantizes
    are 1 byte per value plus an fp32 scale per block (:func:`lightning_plugins.parallel.optim.optimizers.state_nbytes`).
    The counted rank is the first of its FSDP2 group, whose shard has the padded size FSDP2 allocates (and pins).
    """
    from lightning_plugins.adapters.qlora import nf4_nbytes
    from lightning_plugins.parallel.quantized import is_nf4
    from lightning_plugins.parallel.optim.optimizers import state_nbytes

    copies = 2 if _frozen_copy(workload) else 1  # a full fine-tune's DPO reference: the parameters again, frozen
    params = grads = moments = largest = 0
    rounding = {"parameters": 0, "gradients": 0}
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        nbytes = local.numel() * local.element_size()
        held = nf4_nbytes(local) if is_nf4(local) else nbytes
        params += copies * held
        rounding["parameters"] += copies * pinned_rounding(held)
        if param.requires_grad:
            grads += nbytes
            rounding["gradients"] += pinned_rounding(nbytes)
            largest = max(largest, nbytes)
            moments += state_nbytes(workload.optimizer, local)
    return {
        "parameters": params,
        "gradients": grads,
        "optimizer": moments,
        "largest_gradient": largest,
        "largest_read": largest_read(model, workload.config, DTYPES[workload.dtype]),
        "pinned_rounding": rounding,
    }


def layers_of_rank(workload: Workload, rank: int) -> int:
    """Decoder layers global ``rank`` holds (all of them without pipeline parallelism)."""
    from lightning_plugins.parallel.pipeline import layer_ranges, stages_of_rank

    layers = workload.config.num_hidden_layers
    pipeline = workload.pipeline
    if pipeline is None:
        return layers
    pp = workload.layout.pp_size
    ranges = layer_ranges(layers, pp * pipeline.stages_per_rank)
    return sum(len(ranges[s]) for s in stages_of_rank(rank // (workload.world_size // pp), pp, pipeline))


def measure_step(
    workload: Workload, rank: int, *, count: bool = False, replay: bool = True
) -> dict[str, dict[str, int]]:
    """Bytes by category at the peak of each phase of one training step of ``workload`` on ``rank``.

    Returns ``{"intervals": [peak, ...], "bounding": [peak, ...]}``, measured under ``FakeTensorMode`` in the state a
    first step leaves (:func:`_warmed_up`): the peak of each interval of the step, the intervals cut where the
    step's structure does not depend on the number of layers
    (:func:`~lightning_plugins.planner.intervals.mark_intervals`: the head's forward and backward, the optimizer
    step, which is the last; without a pipeline the backward of the first two and the last two decoder layers apart
    from the interior ones; under a pipeline every stage's forward and backward of a micro-batch), each with the
    most bytes offloaded to the host during it (``"host"``, activation offload); ``"bounding"`` without the interior
    of the layers' backward; with ``count`` also the model's ``"state"`` (:func:`_state_of`). With ``replay``, a
    pipeline's stages count the micro-batches they repeat from one they ran (:mod:`.replay`; the same intervals).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_plugins.parallel.optim.offload import host_device
    from lightning_plugins.parallel import mesh_of

    with (
        fake_world(rank, workload.world_size),
        static_pipeline_shapes(),
        one_row_tile_only(),
        one_loss_chunk_only(),
        contextlib.nullcontext() if workload.packed_pairs else unpacked_rows(),
        balanced_routing(),
        default_dtype(DTYPES[workload.dtype]),
        host_device("meta"),  # offloaded activations: tracked on the meta device, apart from the GPU's
        reference_kernels_quietly(),
    ):
        model = build_parallel_model(workload)
        # A full fine-tune's DPO reference: a frozen copy laid out like the policy, its parameters held all along.
        reference = build_parallel_model(workload).requires_grad_(False).eval() if _frozen_copy(workload) else None
        counted = {}
        if count:
            counted["state"] = _state_of(model, workload)
        with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
            # torchao's NF4 all-gather checks its output's storage by data pointer, which fake tensors warn about.
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor", category=UserWarning)
            model.to_empty(device="cpu")
            if reference is not None:
                reference.to_empty(device="cpu")
            optimizer = _warmed_up(model)
            batch = _batch(workload, mesh_of(model), workload.seq_len)
            # The peak's moment is chosen without what the modelled run does not hold on the GPU then: CPU offload's
            # sharded state (on the host: with_offload), optimizer_in_backward's gradients (freed as produced; counted
            # at most the largest afterwards, _rank_memory).
            memory = workload.memory
            left_out = ("parameters", "gradients", "optimizer") if memory.cpu_offload else ()
            left_out += ("gradients",) if memory.optimizer_in_backward else ()
            tracker = StepMemTracker(model, left_out=left_out)
            tracker.track_external(model, optimizer, *batch.values(), *([reference] if reference is not None else []))
            intervals, mark, _ = mark_intervals(
                tracker, model, lambda: {**tracker.by_category("peak"), "host": tracker.by_category("peak", "meta")["total"]}
            )
            with tracker, warnings.catch_warnings(), real_metadata(batch):
                # The first stage's input (token ids) takes no gradient: torch says its backward hook fires anyway.
                warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
                # The head's full backward hook (our measuring mark) hands FSDP2 its logits as a view; nothing
                # writes to them in place, so FSDP2's caution about views does not apply.
                warnings.filterwarnings(
                    "ignore", message="FSDP2-wrapped module .* returned a view", category=UserWarning
                )
                # The run's own loss (SFT's, or the preference objective's); a pipeline's call runs backward too.
                step = partial(run_step, workload.objective, model, batch, reference)
                replayed = counted_step(step, tracker, mark, replay=replay and replayable(workload))
                if replayed is None:
                    return {MISMATCH: True}  # dry_runs measures it again without the replay
                mark()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                mark()
    # Extrapolated from copies with more or fewer layers, the interior of the layers' backward is left out: its peak
    # lies between those of the second layer and the one before the last (mark_intervals), at a moment that may differ
    # between copies.
    return {"intervals": intervals.kept(), "bounding": intervals.kept(interior=False), "replayed": replayed, **counted}


def _warmed_up(model: nn.Module) -> torch.optim.Optimizer:
    """What the first step of a real run leaves behind, without running it (a fake step costs as much as a
    real-size one): AdamW's state (a step on zero gradients) and FSDP2's gather buffers (one unshard and
    reshard of every group)."""
    from torch.distributed.fsdp import FSDPModule

    from lightning_plugins.parallel import pipeline_of

    pipeline = pipeline_of(model)
    for root in (model, *(pipeline.stages.values() if pipeline is not None else ())):
        for module in root.modules():
            if isinstance(module, FSDPModule):
                module.unshard()
                module.reshard()
    trainable = [p for p in model.parameters() if p.requires_grad]
    for param in trainable:
        param.grad = torch.zeros_like(param)
    optimizer = torch.optim.AdamW(trainable, lr=1e-5)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def _batch(workload: Workload, mesh: Any, seq_len: int) -> dict[str, torch.Tensor]:
    from lightning_plugins.parallel import context_parallel_batch

    if workload.images is not None:
        return image_batch(workload, mesh)
    shape = (workload.micro_batch_size, seq_len)
    if workload.packed_pairs:
        return context_parallel_batch(packed_pairs_batch(workload.config.vocab_size, shape), mesh)
    ids = torch.randint(0, workload.config.vocab_size, shape)
    return context_parallel_batch({"input_ids": ids, "labels": ids}, mesh)


def _measured_copies(workload: Workload, rank: int) -> list[Workload]:
    """The workload itself when the rank holds few layers; else copies with :data:`MEASURED_LAYERS` on the rank."""
    measured = _fewer_microbatches(workload)
    if layers_of_rank(workload, rank) <= MEASURED_LAYERS[1]:
        return [measured]
    pipeline = workload.pipeline
    stages = 1 if pipeline is None else workload.layout.pp_size * pipeline.stages_per_rank
    per_rank = 1 if pipeline is None else pipeline.stages_per_rank
    return [measured.with_layers(count // per_rank * stages) for count in MEASURED_LAYERS]


def _extrapolated(steps: list[dict[str, list[dict[str, int]]]], layers: int) -> tuple[list[dict[str, int]], int]:
    """Each interval's peak at ``layers`` layers (buffers folded into "other") and the activations one layer adds.

    Each bounding interval's peak (:func:`measure_step`) is extrapolated linearly from the two measured copies; the
    step's peak is the largest (:func:`worst_interval`): within an interval the peak falls at the same point whatever
    the layer count (the end of forward, inside one of the first two or the last two layers' backward), so each is
    linear in the layers, while the step's overall peak may move from one interval to another as layers are added.
    The interior of the layers' backward, whose peak may fall at its start in one copy and at its end in the other,
    is left out: its peak lies between those of the second layer and the one before the last.
    """
    if len(steps) == 1:
        return [_folded(peak) for peak in steps[0]["intervals"]], 0
    low, high = steps[0]["bounding"], steps[1]["bounding"]
    if len(low) != len(high):
        raise RuntimeError(
            f"dry run: the measured copies ran {len(low)} and {len(high)} intervals; cannot extrapolate."
        )
    small, large = MEASURED_LAYERS
    scale = (layers - small) / (large - small)
    peaks = [_line(a, b, scale) for a, b in zip(low, high)]
    worst = max(range(len(peaks)), key=lambda index: peaks[index]["total"])
    per_layer = (high[worst]["activations"] - low[worst]["activations"]) / (large - small)
    return [_folded(peak) for peak in peaks], round(per_layer)


def _line(low: dict[str, int], high: dict[str, int], scale: float) -> dict[str, int]:
    """One interval's peak extrapolated category by category; where the two copies peaked at different moments (a
    category shrinking with the layers so fast it would go negative), that category is kept at the larger copy's."""
    peak = {key: low[key] + round((high[key] - low[key]) * scale) for key in low if key != "total"}
    for key, nbytes in peak.items():
        if nbytes < 0:
            peak[key] = high[key]
    peak["total"] = sum(nbytes for key, nbytes in peak.items() if key != "host")
    return peak


def _folded(peak: dict[str, int]) -> dict[str, int]:
    """Buffers (the rotary table: bytes) counted with "other" (the batch, pipeline receive buffers)."""
    peak = dict(peak)
    peak["other"] += peak.pop("buffers")
    return peak


def _fewer_microbatches(workload: Workload) -> Workload:
    """The same pipeline with as many micro-batches as stages (of the same size), when that leaves the peak as it is.

    Under 1F1B-like schedules a stage holds at most one micro-batch per later stage in flight, so the
    micro-batches beyond the number of stages repeat the steady state and cost dry-run time only. GPipe and
    looped BFS run every forward first: they keep all of them.
    """
    pipeline = workload.pipeline
    if pipeline is None or pipeline.schedule in ("gpipe", "looped_bfs"):
        return workload
    stages = workload.layout.pp_size * pipeline.stages_per_rank
    if pipeline.microbatches <= stages:
        return workload
    rows = workload.micro_batch_size // pipeline.microbatches
    return replace(workload, micro_batch_size=rows * stages, options=replace(workload.options, pp_microbatches=stages))
