"""The memory report of one kind of rank, and the closed-form adjustments made to it after the dry run.

The dry run (:mod:`lightning_plugins.planner.dryrun`) measures a step; CPU and optimizer offload only move
state to the host, so they are applied to its report here, and :func:`korthikanti_activations` is the
textbook estimate the report compares the measured activations with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lightning_plugins.planner.host_memory import LargestRead
from lightning_plugins.planner.workload import Workload

__all__ = ["PEAK_CATEGORIES", "RankMemory", "korthikanti_activations", "with_offload", "with_optimizer_offload", "worst_interval"]

#: Categories of a peak, in report order.
PEAK_CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries", "other")



@dataclass
class RankMemory:
    """Memory of one kind of rank, in bytes.

    Attributes:
        kind: ``"every rank"``, or ``"first stage"`` / ``"middle stages"`` / ``"last stage"`` under PP.
        rank: The global rank measured.
        layers: Decoder layers this rank holds.
        state: Resident ``parameters``, ``gradients`` and ``optimizer`` bytes counted from the sharded tensors.
        peak: GPU bytes by category at the moment of the step's peak (:data:`PEAK_CATEGORIES`), and ``total``.
        host_terms: Bytes this rank keeps in host memory while training, by term
            (:data:`~lightning_plugins.planner.host_memory.HOST_TERMS`): offloaded state (CPU or optimizer offload),
            the most activations offloaded at once (activation offload), the pinned allocator's rounding;
            :attr:`host` is their sum.
        load_terms: Bytes this rank keeps in host memory while the weights are loaded, by term: the tensor in flight
            and, with CPU offload, its parameters (pinned); :attr:`load` is their sum.
        largest_read: The tensor whose load holds the most host bytes at once (the load peak's "in flight").
        pinned_rounding: What the pinned allocator would add to this rank's ``parameters`` and ``gradients``
            allocations (:func:`~lightning_plugins.planner.host_memory.pinned_rounding` of each tensor), counted on
            the host by the levers that pin them.
        activations_per_layer: Measured bytes one decoder layer adds to the peak (all micro-batches in flight).
        notes: What is modelled rather than measured.
        intervals: The peak of each interval of the step (the last one the optimizer step), by category, before
            the levers that only move state (CPU and optimizer offload): :attr:`peak` is the largest once they
            are applied.
    """

    kind: str
    rank: int
    layers: int
    state: dict[str, int]
    peak: dict[str, int]
    host_terms: dict[str, int] = field(default_factory=dict)
    load_terms: dict[str, int] = field(default_factory=dict)
    largest_read: LargestRead = field(default_factory=LargestRead)
    pinned_rounding: dict[str, int] = field(default_factory=dict)
    activations_per_layer: int = 0
    notes: list[str] = field(default_factory=list)
    intervals: list[dict[str, int]] = field(default_factory=list, repr=False)

    @property
    def total(self) -> int:
        return self.peak["total"]

    @property
    def host(self) -> int:
        """Host bytes of this rank while training."""
        return sum(self.host_terms.values())

    @property
    def load(self) -> int:
        """Host bytes of this rank while its weights are loaded."""
        return sum(self.load_terms.values())

    def on_host(self, phase: str, terms: dict[str, int]) -> None:
        """Add bytes by term to the host memory of a phase (``"training"`` or ``"loading"``)."""
        held = self.host_terms if phase == "training" else self.load_terms
        for term, nbytes in terms.items():
            held[term] = held.get(term, 0) + nbytes

    def as_dict(self) -> dict:
        return {
            "kind": self.kind,
            "rank": self.rank,
            "layers": self.layers,
            "state": dict(self.state),
            "peak": dict(self.peak),
            "host": self.host,
            "host_terms": dict(self.host_terms),
            "load": self.load,
            "load_terms": dict(self.load_terms),
            "activations_per_layer": self.activations_per_layer,
            "notes": list(self.notes),
        }


def worst_interval(intervals: list[dict[str, int]]) -> dict[str, int]:
    """The step's peak: the interval whose peak is largest."""
    return dict(max(intervals, key=lambda peak: peak["total"]))


def with_optimizer_offload(report: RankMemory) -> None:
    """Optimizer offload: the optimizer state lives on the host, with a copy of the trainable parameters and a
    buffer for their gradients, and the optimizer step leaves nothing on the GPU. The step's peak is taken again
    over the intervals without them."""
    state, rounding = report.state, report.pinned_rounding
    # AdamW's state (pageable), and pinned host copies of the trainable parameters and buffers for their gradients,
    # created at the first step (HostOffloadOptimizer._ensure_host): nothing of it while loading.
    report.on_host(
        "training",
        {
            "parameters": state["gradients"],
            "gradients": state["gradients"],
            "optimizer": state["optimizer"],
            "pinned rounding": 2 * rounding.get("gradients", 0),
        },
    )
    intervals = [dict(peak) for peak in report.intervals]
    for peak in intervals:
        peak["total"] -= peak["optimizer"]
        peak["optimizer"] = 0
    step = intervals[-1]  # the optimizer step: AdamW's temporaries were on the GPU, the host's step has none
    step["total"] -= step["temporaries"]
    step["temporaries"] = 0
    report.peak = worst_interval(intervals)
    report.notes.append(
        "optimizer offload modelled: AdamW state on the host with a copy of the trainable parameters and"
        " gradients; the optimizer step's GPU temporaries dropped"
    )


def with_offload(report: RankMemory) -> None:
    """FSDP2 CPU offload: sharded parameters, gradients and optimizer state live on the host."""
    state, rounding = report.state, report.pinned_rounding
    # FSDP2's CPUOffloadPolicy pins the sharded parameters from the start (the loaded weights are read into them) and
    # the gradients it copies back; AdamW's state, created at the first step, is pageable.
    report.on_host("loading", {"parameters": state["parameters"], "pinned rounding": rounding.get("parameters", 0)})
    report.on_host(
        "training",
        {
            "parameters": state["parameters"],
            "gradients": state["gradients"],
            "optimizer": state["optimizer"],
            "pinned rounding": rounding.get("parameters", 0) + rounding.get("gradients", 0),
        },
    )
    intervals = [dict(peak) for peak in report.intervals]
    for peak in intervals:  # each interval without what lives on the host, then the largest
        moved = {
            "parameters": min(peak["parameters"], state["parameters"]),
            "gradients": min(peak["gradients"], state["gradients"]),
            "optimizer": peak["optimizer"],
        }
        for key, nbytes in moved.items():
            peak[key] -= nbytes
        peak["total"] -= sum(moved.values())
    report.peak = worst_interval(intervals)
    report.notes.append("CPU offload modelled: sharded parameters, gradients and AdamW state counted on the host")


def korthikanti_activations(workload: Workload, layers: int, *, flash: bool = True) -> int:
    """Closed-form saved activations of ``layers`` decoder layers for one micro-batch (Korthikanti et al. 2022).

    ``sbh(34 + 5as/h)`` bytes per layer in 16-bit, divided by ``t`` with tensor + sequence parallelism,
    ``2sbh`` (``/t`` with SP) with full recomputation; flash/SDPA attention drops the ``5as/h`` term; ``s`` is
    the sequence shard a context-parallel rank holds. GPT-style: no SwiGLU, no GQA, no fp32 norms.
    """
    layout, config = workload.layout, workload.config
    pipeline = workload.pipeline
    b = workload.micro_batch_size // (pipeline.microbatches if pipeline is not None else 1)
    s, h, a, t = workload.seq_len // layout.cp_size, config.hidden_size, config.num_attention_heads, layout.tp_size
    sp = t > 1 and workload.options.sequence_parallel
    if workload.memory.activation_checkpointing == "full":
        per_layer = 2 * s * b * h / (t if sp else 1)
    else:
        attention = 0 if flash else 5 * a * s / h
        per_layer = s * b * h * (34 + attention) / t if sp else s * b * h * (10 + 24 / t + attention / t)
    return math.ceil(per_layer * layers)
