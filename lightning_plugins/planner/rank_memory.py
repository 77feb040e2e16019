"""The memory report of one kind of rank, and the closed-form adjustments made to it after the dry run.

The dry run (:mod:`lightning_plugins.planner.dryrun`) measures a step; CPU and optimizer offload only move
state to the host, so they are applied to its report here, and :func:`korthikanti_activations` is the
textbook estimate the report compares the measured activations with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

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
        host: Bytes this rank keeps in host memory at most: offloaded state (CPU or optimizer offload) plus the
            most activations offloaded at once (activation offload).
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
    host: int = 0
    activations_per_layer: int = 0
    notes: list[str] = field(default_factory=list)
    intervals: list[dict[str, int]] = field(default_factory=list, repr=False)

    @property
    def total(self) -> int:
        return self.peak["total"]

    def as_dict(self) -> dict:
        return {
            "kind": self.kind,
            "rank": self.rank,
            "layers": self.layers,
            "state": dict(self.state),
            "peak": dict(self.peak),
            "host": self.host,
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
    state = report.state
    report.host += state["optimizer"] + 2 * state["gradients"]  # state, parameter copies, gradient buffers
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
    state = report.state
    report.host += sum(state.values())
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
