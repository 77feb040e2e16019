"""The layout search: every valid layout of a model on a cluster, times the memory levers, ranked by step time.

Enumeration: TP within a node dividing heads, kv heads, the MLP and the vocabulary; PP dividing the
world (stages of at least one layer; 1F1B, or interleaved 1F1B with 2 stages per rank); CP when the
sequence is long (>= 16K tokens); data parallel with the rest, as FSDP2 or, across nodes, HSDP (replicas
of one node); activation checkpointing none / selective / full; FSDP2 CPU offload or optimizer offload (AdamW
on the host); micro-batch sizes.

Screening: a closed-form memory estimate (:func:`estimate_peak`, conservative by construction) drops what
cannot fit and the step-time model ranks the rest; then the dry run (:func:`~lightning_plugins.planner.report.plan`)
checks candidates in rank order until ``top`` of them fit, so a layout the dry run says does not fit is
never returned.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from lightning_plugins.parallel.layout import ParallelLayout
from lightning_plugins.errors import LayoutError
from lightning_plugins.adapters.lora import LoraOptions
from lightning_plugins.parallel.options import SCHEDULES, MemoryOptions, ParallelOptions
from lightning_plugins.planner.dryrun import dry_run
from lightning_plugins.parallel.optim.optimizers import STATE_BYTES_PER_PARAM
from lightning_plugins.planner.rank_memory import RankMemory, korthikanti_activations, with_offload, with_optimizer_offload
from lightning_plugins.planner.hardware import Cluster
from lightning_plugins.planner.model_stats import model_stats
from lightning_plugins.errors import PlannerError
from lightning_plugins.planner.report import DEFAULT_MARGIN, Plan, step_time
from lightning_plugins.planner.timing import StepTime
from lightning_plugins.planner.workload import Workload

_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
#: Saved activations of a Llama layer (HF, SDPA) over Korthikanti's flash formula, as the dry run measures them
#: with the default levers (``efficient_norms``, ``efficient_mlp``; with sequence parallelism also the gathered region
#: inputs): Llama-3.1-8B at 8K tokens, fp32 weights computing in bf16, FSDP8 1.00, TP2 x FSDP4 without SP 0.96 (the
#: screen takes the larger), with SP 1.12 (0.59 GiB a layer against 0.66 without: SP saves, as measured). Numbers:
#: benchmarks/RESULTS.md, "Activation floor (issue 28, part A)" (``python benchmarks/activation_floor.py``).
ACTIVATION_FACTOR = {"plain": 1.00, "sequence_parallel": 1.12}
#: With ``sp_regather`` the SP regions keep their input's shard instead of the gathered input: the same TP2 + SP run
#: measures 1.00 (0.53 GiB a layer).
SP_REGATHER_FACTOR = 1.00 / 1.12
#: With ``efficient_mlp=False`` the gated MLPs also keep their activation's output: the same runs measure 1.21 (FSDP8)
#: and 1.32 (TP2 + SP) times the floor.
OWN_MLP_FACTOR = {"plain": 1.21 / 1.00, "sequence_parallel": 1.32 / 1.12}
#: ``mlp_chunk_tokens`` (the tiled MLP) is left out of this screen: it only lowers what a layer keeps, so the screen
#: over-estimates such layouts and the dry run, which runs the tiles, gives their peak.
#: With ``efficient_norms=False`` the models' own RMSNorms keep fp32 copies: with neither lever the same runs measure
#: 1.44 (FSDP8) and 1.56 (TP2 + SP) times the floor.
OWN_NORMS_FACTOR = {"plain": 1.44 / 1.21, "sequence_parallel": 1.56 / 1.32}
#: Selective (op-level) checkpointing keeps this share of the saved activations (8B FSDP8 at 8K: 31.2 / 55.2 GiB).
SELECTIVE_KEEPS = 0.57
#: Full checkpointing keeps this many times Korthikanti's 2sbh per layer (the layer input and what HF passes
#: along: position embeddings, the mask; 8B FSDP8 at 8K measures 3.0).
FULL_KEEPS = 3.0
#: Sequences at least this long are also tried with context parallelism.
CP_FROM_SEQ_LEN = 16384


@dataclass
class Candidate:
    """A workload the screen kept: its estimated peak, its step time, and (once checked) its dry-run plan."""

    workload: Workload
    estimated_peak: int
    step: StepTime
    plan: Plan | None = None


def search(
    config: Any,
    cluster: Cluster,
    *,
    seq_len: int,
    global_batch_size: int,
    lora: LoraOptions | None = None,
    dtype: str = "bf16",
    top: int = 5,
    margin: float = DEFAULT_MARGIN,
    verify: bool = True,
) -> list[Candidate]:
    """The ``top`` fastest layouts that fit, fastest first (checked by the dry run unless ``verify=False``).

    Args:
        config: The model's transformers config (real size).
        cluster: The GPUs.
        seq_len: Tokens per row.
        global_batch_size: Rows per optimizer step.
        lora: LoRA settings (``quantize="nf4"`` for QLoRA), or ``None`` for a full fine-tune.
        dtype: Weight dtype; full fine-tunes keep fp32 master weights with bf16 compute (FSDP2 mixed precision).
        top: How many to return.
        margin: Share of each GPU's memory kept free.
        verify: Dry-run the candidates (slow for the largest models; the screen alone is an estimate).

    Raises:
        PlannerError: when nothing fits, naming the smallest estimated peak and what to change.
    """
    budget = cluster.memory * (1 - margin)
    screened, smallest = [], None
    for workload in candidate_workloads(config, cluster, seq_len, global_batch_size, lora, dtype):
        peak = estimate_peak(workload)
        smallest = peak if smallest is None else min(smallest, peak)
        if peak <= budget:
            screened.append(Candidate(workload, peak, step_time(workload, cluster)))
    screened.sort(key=lambda c: c.step.step_s)
    chosen: list[Candidate] = []
    measured: dict[tuple, list[RankMemory]] = {}
    for candidate in screened:
        if len(chosen) == top:
            break
        if verify:
            candidate.plan = _dry_run_plan(candidate, cluster, margin, measured)
            if not candidate.plan.fits:
                continue
        chosen.append(candidate)
    if not chosen:
        smallest_text = (
            "no valid layout" if smallest is None else f"the smallest estimated peak is {smallest / 2**30:.1f} GiB"
        )
        raise PlannerError(
            f"No layout of this model fits {cluster.gpus} x {cluster.memory / 2**30:.0f} GiB with a {margin:.0%} margin:"
            f" {smallest_text}. Use more or larger GPUs, LoRA or QLoRA (--method), or a shorter --seq-len."
        )
    return chosen


def _dry_run_plan(candidate: Candidate, cluster: Cluster, margin: float, measured: dict) -> Plan:
    """The candidate's dry run; with and without CPU or optimizer offload the step measures the same (they move
    state to the host afterwards), so one dry run serves all three."""
    workload = candidate.workload
    dense = replace(workload, memory=replace(workload.memory, cpu_offload=False, optimizer_offload=False))
    key = (dense.layout, dense.options, dense.memory, dense.micro_batch_size)
    if key not in measured:
        measured[key] = dry_run(dense)
    ranks = copy.deepcopy(measured[key])
    for rank in ranks:
        if workload.memory.optimizer_offload:
            with_optimizer_offload(rank)
        if workload.memory.cpu_offload:
            with_offload(rank)
    return Plan(workload, cluster, ranks, candidate.step, margin)


def candidate_workloads(
    config: Any, cluster: Cluster, seq_len: int, global_batch_size: int, lora: LoraOptions | None, dtype: str
) -> Iterator[Workload]:
    """Every valid layout x memory lever for the cluster (see the module docstring)."""
    gpus, per_node = cluster.gpus, cluster.gpus_per_node
    full = lora is None
    weights = "fp32" if full and dtype == "bf16" else dtype  # fp32 master weights, bf16 compute
    # NF4 bases do not compose with tensor parallelism (lightning_plugins.parallel.quantized.check_quantized).
    most_tp = 1 if lora is not None and lora.quantize == "nf4" else min(per_node, gpus)
    for tp in _powers_of_two(most_tp):
        for cp in _powers_of_two(gpus // tp) if seq_len >= CP_FROM_SEQ_LEN else [1]:
            for pp in _powers_of_two(gpus // (tp * cp)):
                dp = gpus // (tp * cp * pp)
                if global_batch_size % dp:
                    continue
                for replicate, ep in (
                    (r, e) for r in _replicas(dp, tp * cp, per_node) for e in _expert_sizes(config, dp // r * cp)
                ):
                    try:
                        sizes = {"pp_size": pp, "dp_replicate_size": replicate, "cp_size": cp, "tp_size": tp}
                        layout = ParallelLayout(**sizes, dp_shard_size=dp // replicate, ep_size=ep).resolve(gpus)
                        layout.validate(config)
                    except LayoutError:
                        continue
                    for options in _pipeline_options(pp, config.num_hidden_layers, tp, cp):
                        for memory in _memory_levers(layout, weights, dtype):
                            if memory.pp_reshard_per_microbatch and SCHEDULES[options.pp_schedule].split_backward:
                                continue  # zero-bubble schedules keep the parameters gathered for the weight pass
                            for micro in _micro_batches(global_batch_size // dp, options, pp):
                                if pp > 1:  # one row per pipeline micro-batch
                                    options = replace(options, pp_microbatches=micro)
                                try:
                                    yield Workload(
                                        config,
                                        layout,
                                        options,
                                        memory,
                                        lora,
                                        weights,
                                        seq_len,
                                        micro,
                                        global_batch_size,
                                    )
                                except (LayoutError, PlannerError):
                                    continue


def estimate_peak(workload: Workload) -> int:
    """A closed-form peak per GPU of the busiest rank, for screening (the dry run is the measurement).

    State from the parameter counts and the layout; activations from Korthikanti's formula times
    :data:`ACTIVATION_FACTOR` and the micro-batches a pipeline stage holds; temporaries: the fp32 logits
    and their gradient (one chunk of ``loss_chunk_tokens`` tokens when the loss is chunked), FSDP2's gathered
    embedding or final norm + head (each its own unit; a tied pair: both, in the root) and two gathered layers,
    and under pipeline parallelism the stage's unsharded gradients kept until the last micro-batch (not with
    ``pp_reshard_per_microbatch``, which reduce-scatters them after every micro-batch).
    """
    stats, layout, memory = model_stats(workload.config), workload.layout, workload.memory
    weight, compute = _BYTES[workload.dtype], _BYTES.get(memory.param_dtype or workload.dtype, 2)
    pipeline = workload.pipeline
    v = 1 if pipeline is None else pipeline.stages_per_rank
    layers = math.ceil(stats.num_layers / (layout.pp_size * v)) * v
    ends = max(stats.embedding_params, stats.head_params + stats.norm_params)
    if layout.pp_size == 1:
        ends = stats.embedding_params + stats.head_params + stats.norm_params
    state, trainable = _state_bytes(workload, stats, layers, ends, weight)
    # Activations of one micro-batch, times the micro-batches in flight on the first stage.
    rows = workload.micro_batch_size // (pipeline.microbatches if pipeline else 1)
    in_flight = 1
    if pipeline is not None:
        p = layout.pp_size
        in_flight = pipeline.microbatches if pipeline.schedule in ("gpipe", "looped_bfs") else p + (v - 1) * p // v
    tokens = rows * workload.seq_len / layout.cp_size
    activations = _activation_bytes(workload, stats, layers, in_flight, tokens, compute)
    temporaries = _temporary_bytes(workload, stats, tokens, ends, trainable, weight, compute)
    if memory.cpu_offload:
        state = 0
    return int(state + activations + temporaries)


def _state_bytes(workload: Workload, stats: Any, layers: int, ends: int, weight: float) -> tuple[float, float]:
    """The rank's parameters, gradients and optimizer moments in bytes; and its trainable parameters."""
    layout, memory = workload.layout, workload.memory
    shards = layout.tp_size * layout.fsdp_size
    # Routed experts are replicated over TP and split over ep x their FSDP2 group, i.e. over fsdp_size in all.
    routed = layers * stats.expert_params
    dense = (layers * stats.layer_params - routed + ends) / shards + routed / layout.fsdp_size
    if workload.method == "full":
        trainable, params = dense, dense * weight
    else:
        trainable = (
            layers * stats.lora_params_per_layer(workload.lora.target_modules, workload.lora.r) / layout.fsdp_size
        )
        per_param = 0.5 + 1 / 64 if workload.method == "qlora" else weight
        params = ((layers * stats.layer_params - routed) / shards + routed / layout.fsdp_size) * per_param
        params += ends / shards * weight
    # peft upcasts adapters to fp32 unless lora.autocast_adapter_dtype is off (then they keep the model's dtype).
    trained = 4 if workload.lora is not None and workload.lora.autocast_adapter_dtype else weight
    # AdamW's two moments in the trained parameters' dtype; 8-bit: bytes per value whatever the dtype.
    moments = 2 * trained if workload.optimizer == "adamw" else STATE_BYTES_PER_PARAM[workload.optimizer]
    moments *= not memory.optimizer_offload
    # Gradients: all of them; in backward, each applied and freed as produced (the largest, the embedding, at most).
    grads = trainable * trained
    if memory.optimizer_in_backward:
        grads = min(grads, stats.embedding_params / shards * weight)
    return params + grads + trainable * moments, trainable  # gradients and the optimizer's moments


def _activation_bytes(
    workload: Workload, stats: Any, layers: int, in_flight: int, tokens: float, compute: float
) -> float:
    """Activations kept for backward: Korthikanti's per layer, scaled by the levers, times the layers in flight."""
    layout, memory = workload.layout, workload.memory
    # korthikanti_activations takes one pipeline micro-batch of the workload's rows itself.
    one = replace(workload, memory=replace(memory, activation_checkpointing="none"))
    sp = layout.tp_size > 1 and workload.options.sequence_parallel
    kind = "sequence_parallel" if sp else "plain"
    factor = ACTIVATION_FACTOR[kind] * (1 if memory.efficient_norms else OWN_NORMS_FACTOR[kind])
    factor *= 1 if memory.efficient_mlp else OWN_MLP_FACTOR[kind]
    factor *= SP_REGATHER_FACTOR if sp and memory.sp_regather else 1
    whole_layer = factor * korthikanti_activations(one, 1)
    per_layer = {
        "none": whole_layer,
        "selective": SELECTIVE_KEEPS * whole_layer,
        "full": FULL_KEEPS * korthikanti_activations(replace(one, memory=memory), 1),
    }[memory.activation_checkpointing]
    activations = per_layer * layers * in_flight
    if memory.activation_checkpointing != "none":  # one layer is recomputed whole in backward
        activations += whole_layer
    if stats.is_moe:  # the routed rows, gathered, dispatched and combined (bf16), kept for backward per MoE layer
        routed_rows = 3 * tokens / layout.tp_size * stats.experts_per_token * stats.hidden_size * compute
        kept = layers * in_flight if memory.activation_checkpointing == "none" else 1
        activations += routed_rows * kept
    return activations


def _temporary_bytes(
    workload: Workload, stats: Any, tokens: float, ends: int, trainable: float, weight: float, compute: float
) -> float:
    """The fp32 logits and their gradient, FSDP2's gathered units, a pipeline stage's unsharded gradients."""
    layout, memory = workload.layout, workload.memory
    vocab = stats.vocab_size / (layout.tp_size if workload.options.loss_parallel else 1)
    # Chunked cross entropy (memory.loss_chunk_tokens) holds one chunk's fp32 logits and their gradient at a time.
    chunk = memory.loss_chunk_tokens
    temporaries = 3 * (min(tokens, chunk) if chunk else tokens) * vocab * 4
    if layout.fsdp_size > 1:
        gathered = stats.layer_params - stats.expert_params + stats.expert_params / layout.ep_size * layout.tp_size
        # The embedding and the final norm + head are FSDP2 units of their own, gathered at different moments; a
        # tied pair stays in the root, gathered through the whole step with the rest of it.
        gathered_ends = max(stats.embedding_params, stats.head_params + stats.norm_params)
        gathered_ends = ends if stats.tied_embeddings else gathered_ends
        temporaries += (gathered_ends + 2 * gathered) / layout.tp_size * compute
        if layout.pp_size > 1 and not memory.pp_reshard_per_microbatch:
            temporaries += trainable * layout.fsdp_size * weight
    return temporaries


def _powers_of_two(limit: int) -> list[int]:
    return [2**k for k in range(int(math.log2(max(1, limit))) + 1) if limit % 2**k == 0]


def _expert_sizes(config: Any, shard_cp: int) -> list[int]:
    """Expert-parallel sizes to try: 1, and for a mixture-of-experts model every power of two dividing both the
    ``dp_shard x cp`` ranks it is drawn from and the number of routed experts."""
    from lightning_plugins.parallel.moe.experts import num_experts

    experts = num_experts(config) or 1
    return [e for e in _powers_of_two(shard_cp) if experts % e == 0]


def _replicas(dp: int, inner: int, per_node: int) -> list[int]:
    """FSDP2 over all data ranks, and HSDP with one replica per node when the data ranks span nodes."""
    shard = per_node // inner if per_node % inner == 0 else 0
    options = [1]
    if shard > 1 and dp > shard and dp % shard == 0:
        options.append(dp // shard)
    return options


def _pipeline_options(pp: int, layers: int, tp: int, cp: int) -> list[ParallelOptions]:
    options = ParallelOptions(
        sequence_parallel=tp > 1, loss_parallel=tp > 1, cp_backend="ring" if cp > 1 else "ulysses"
    )
    if pp == 1:
        return [options]
    out = [replace(options, pp_schedule="1f1b")]
    if layers >= 2 * pp:
        out.append(replace(options, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2))
    return out


def _memory_levers(layout: ParallelLayout, weights: str, dtype: str) -> list[MemoryOptions]:
    """Checkpointing modes x no offload, FSDP2 CPU offload (with data-parallel shards) or optimizer offload; pipeline
    stages under FSDP2 also resharded per micro-batch (``pp_reshard_per_microbatch``)."""
    param_dtype = "bf16" if weights == "fp32" and dtype == "bf16" and layout.fsdp_size > 1 else None
    offloads = [{}, {"optimizer_offload": True}]
    if layout.fsdp_size > 1:
        offloads.insert(1, {"cpu_offload": True})
        if layout.pp_size > 1:
            offloads.append({"pp_reshard_per_microbatch": True})
    return [
        MemoryOptions(activation_checkpointing=checkpointing, param_dtype=param_dtype, **offload)
        for checkpointing in ("none", "selective", "full")
        for offload in offloads
    ]


def _micro_batches(rows_per_rank: int, options: ParallelOptions, pp: int) -> list[int]:
    """Rows per data rank per forward: powers of two dividing the rank's rows (under PP: one row per micro-batch)."""
    sizes = [m for m in _powers_of_two(rows_per_rank) if m <= 8] if pp == 1 else []
    if pp > 1:
        stages = pp * (options.pp_stages_per_rank or 1)
        sizes = [m for m in _powers_of_two(rows_per_rank) if m >= stages][:2]
    return sizes
