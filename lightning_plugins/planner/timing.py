"""Step time of a layout: FLOPs at a calibrated efficiency, communication over stated links, the pipeline bubble.

The model, per optimizer step, for the slowest rank (pipeline stages differ: the last one runs ``lm_head``):

* **Compute.** Model FLOPs (:meth:`ModelStats.flops_per_token`: ``6N`` plus attention; ``4N`` for the frozen
  base of LoRA) divided by ``peak x efficiency``. The efficiency is calibrated, one per class of kernels
  (:data:`KERNELS`), against published runs (:data:`CALIBRATION`). Recomputation adds forward FLOPs:
  full checkpointing one more forward of every layer, ``every_n_layers`` of every N-th, op-level selective
  the elementwise ops (:data:`SELECTIVE_RECOMPUTE`); the tiled MLP (``mlp_chunk_tokens``) one more forward of each
  dense MLP (:data:`MLP_LINEARS`). QLoRA's NF4 dequantisation slows compute by
  :data:`QLORA_SLOWDOWN`.
* **Tensor parallel.** Per layer and micro-batch, forward and backward: two all-gathers and two
  reduce-scatters of the activations (sequence parallel) or two all-reduces (the same bytes), on the
  link the TP group spans, exposed (no overlap) unless async TP hides :data:`ASYNC_TP_HIDDEN` of it.
* **Context parallel.** Ring: K/V blocks pass ``cp - 1`` times per layer forward (K/V and their gradients
  in backward), hidden behind the attention they feed. Ulysses: four all-to-alls per layer forward and
  backward, exposed.
* **Pipeline.** Point-to-point activations per micro-batch, hidden in steady state, exposed on the fill and
  drain; the bubble ``(p-1)/(m+p-1)`` of GPipe/1F1B, with ``(p-1)`` divided by the stages per rank for
  interleaved schedules, a third of that for interleaved zero bubble (ZB-H1), 0 for ZB-V and DualPipeV.
* **FSDP / HSDP.** All-gathers of each rank's parameters (again in backward with ``reshard_after_forward``;
  under a pipeline once per step), reduce-scatters of gradients, HSDP's all-reduce across replicas; over
  NVLink when the group fits in a node, else the NICs. Overlapped with compute except the first layer's
  gather and the last reduce-scatter (``1 / layers`` of it), and except what exceeds the compute.
* **Expert parallel.** Per MoE layer and micro-batch, the all-to-all dispatch and combine of the ``tokens x top-k``
  routed rows (bf16 hidden vectors), forward, backward and recomputed forward, ``(ep - 1) / ep`` of them leaving
  the rank, over NVLink while the EP group (``tp x ep`` consecutive ranks) fits in a node, else the NICs;
  exposed (the engine waits for it). The experts' FSDP2 group is ``dp_shard x cp / ep`` ranks, gathering
  ``E / ep`` experts of a layer; the routed experts are replicated over TP (each TP rank runs its own tokens).
* **CPU offload.** Parameters host->GPU at every gather and gradients back over PCIe (overlapped like FSDP),
  plus the optimizer step on the host (:data:`HOST_ADAM_PARAMS_PER_S`), exposed.
* **Optimizer offload.** Once per optimizer step, the rank's trainable shard's gradients to the host and its
  updated parameters back over PCIe, and the optimizer step on the host, all exposed (the engine runs them
  between backward and the next forward).

Absolute step times are +-25%: good enough to rank layouts and to size a rental, not to quote.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_plugins.parallel.layout import ParallelLayout
from lightning_plugins.parallel.options import MemoryOptions, ParallelOptions
from lightning_plugins.planner.assumptions import (
    ASYNC_TP_HIDDEN,
    HOST_ADAM_PARAMS_PER_S,
    QLORA_SLOWDOWN,
    SELECTIVE_RECOMPUTE,
    step_assumptions,
)
from lightning_plugins.planner.hardware import Cluster
from lightning_plugins.planner.model_stats import NF4_BYTES_PER_PARAM, TRAINABLE, ModelStats, model_stats
from lightning_plugins.errors import PlannerError
from lightning_plugins.planner.step_shape import StepShape

__all__ = [
    "DEFAULT_KERNELS",
    "KERNELS",
    "Kernels",
    "StepTime",
    "estimate_step_time",
    "kernels_for",
    "torchtitan_op_sac",
]



@dataclass(frozen=True)
class Kernels:
    """A class of kernels and training-loop settings whose compute efficiency is calibrated as one.

    Attributes:
        name: Key in :data:`KERNELS`.
        efficiency: Fraction of the dense bf16 peak the model FLOPs and recomputation run at (everything
            but communication and the bubble; fitted by :func:`fit_efficiencies`).
        float8: float8 linears (torchao, tensorwise scaling): FSDP all-gathers float8 weights; the FLOPs still
            count against the bf16 peak. Tensor parallelism gathers float8 activations only with torchao's float8
            TP styles (torchtitan's runs; ``estimate_step_time(float8_tp=True)``): this engine's plans gather bf16.
        attention: The class whose efficiency attention (scores and weighted values) runs at; ``None`` is this
            one. float8 speeds up the linears only: the attention kernel stays bf16.
        description: What runs, for the printed assumptions.
    """

    name: str
    efficiency: float
    float8: bool = False
    attention: str | None = None
    description: str = ""


#: The calibrated classes. Efficiencies are the geometric mean, over the class's runs in :data:`CALIBRATION`,
#: of the efficiency that reproduces each run exactly (``print_calibration(refit=True)`` refits and prints
#: them; ``tests/planner/test_planner_timing.py`` checks these constants against the refit).
KERNELS: dict[str, Kernels] = {
    "bf16": Kernels("bf16", 0.385, description="torchtitan's bf16 eager runs"),
    "compile": Kernels(
        "compile",
        0.471,
        attention="bf16",
        description="torchtitan's torch.compile (bf16) runs",
    ),
    "compile_float8": Kernels(
        "compile_float8",
        0.748,
        float8=True,
        attention="bf16",
        description="torchtitan's torch.compile + float8 runs",
    ),
    "llama3": Kernels("llama3", 0.654, description="the Llama 3 paper's bf16 runs"),
}
#: What the planner assumes for a run of this engine without ``ParallelOptions.compile``: bf16, eager, like torchtitan's eager runs. Those ran
#: torchtitan's own Llama on 500 W H100s; transformers' modeling code may run slower, 700 W parts faster.
#: ``Cluster.mfu`` overrides the efficiency.
DEFAULT_KERNELS = "bf16"


@dataclass(frozen=True)
class StepTime:
    """One optimizer step's estimated time and what makes it up (seconds, slowest rank).

    Attributes:
        step_s: The whole step.
        compute_s: Model FLOPs (forward and backward) at the calibrated efficiency.
        recompute_s: Activation-checkpointing recomputation.
        comm_s: Communication per dimension (``"fsdp"``, ``"tp"``, ``"cp"``, ``"pp"``, ``"dp_replicate"``,
            ``"offload"``), before overlap.
        exposed_comm_s: The communication that overlap leaves on the critical path (all dimensions).
        bubble: Fraction of the step the pipeline idles.
        tokens_per_s_per_gpu: Training tokens per second per GPU.
        mfu: Model FLOPs (:meth:`ModelStats.flops_per_token`, no recomputation) per second over the peak.
        assumptions: The efficiency, links and overlap assumed, printable.
        efficiency: The compute efficiency used.
        exposed_s: Exposed communication per dimension.
        bottleneck_pp_rank: The pipeline rank whose time is the step time (0 without pipelining).
    """

    step_s: float
    compute_s: float
    recompute_s: float
    comm_s: dict[str, float]
    exposed_comm_s: float
    bubble: float
    tokens_per_s_per_gpu: float
    mfu: float
    assumptions: tuple[str, ...]
    efficiency: float = 0.0
    exposed_s: dict[str, float] = field(default_factory=dict)
    bottleneck_pp_rank: int = 0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        out = asdict(self)
        out["assumptions"] = list(self.assumptions)
        return out


def estimate_step_time(
    config_or_stats: Any,
    layout: ParallelLayout,
    options: ParallelOptions,
    memory: MemoryOptions,
    cluster: Cluster,
    *,
    seq_len: int,
    micro_batch_size: int,
    global_batch_size: int,
    method: str = "full",
    lora: Any | None = None,
    kernels: str | Kernels | None = None,
    async_tp: bool | None = None,
    recompute_fraction: float | None = None,
    float8_tp: bool = False,
) -> StepTime:
    """Estimate one optimizer step of ``layout`` on ``cluster``.

    Args:
        config_or_stats: A transformers config, a :class:`ModelStats` or a config spec.
        layout: A resolved :class:`ParallelLayout` whose world size is ``cluster.gpus``.
        options: Sequence/loss parallel, CP backend, pipeline schedule and micro-batches.
        memory: Activation checkpointing, FSDP2 dtypes, CPU or optimizer offload, ``reshard_after_forward``.
        cluster: The GPUs and links.
        seq_len: Tokens per row.
        micro_batch_size: Rows per data rank per forward (under PP: the batch the pipeline splits into
            ``pp_microbatches`` micro-batches), as in a recipe.
        global_batch_size: Rows per optimizer step over all data ranks (``dp_replicate x dp_shard``); a data
            rank accumulates ``global_batch_size // (micro_batch_size x data ranks)`` forwards.
        method: ``"full"``, ``"lora"`` or ``"qlora"``.
        lora: The :class:`~lightning_plugins.adapters.lora.LoraOptions` (rank, targets) for LoRA/QLoRA; ``None`` takes
            their defaults.
        kernels: A key of :data:`KERNELS` (or a :class:`Kernels`): the calibrated efficiency class; ``None``
            follows ``options`` (:func:`kernels_for`). ``cluster.mfu`` overrides its efficiency.
        async_tp: Whether tensor-parallel collectives are micro-pipelined with the matmuls (hides
            :data:`ASYNC_TP_HIDDEN` of them); ``None`` follows ``options.async_tp``.
        recompute_fraction: Overrides the share of a checkpointed layer's forward that is recomputed (e.g.
            torchtitan's op-level policy, :func:`torchtitan_op_sac`); ``None`` follows ``memory``.
        float8_tp: With float8 kernels, whether the sequence-parallel all-gathers carry float8 activations
            (torchao's ``Float8ColwiseParallel``/``PrepareFloat8ModuleInput``, as torchtitan's calibrating runs use);
            ``False``: this engine's TP plans, which gather bf16 activations (the float8 cast follows the gather).

    Raises:
        PlannerError: for an unresolved layout, a world size that is not the cluster's, an unknown method or
            kernels class, batch sizes that do not divide, or a layout the model cannot take.
    """
    stats = model_stats(config_or_stats)
    kern = _kernels(kernels_for(options) if kernels is None else kernels)
    async_tp = options.async_tp if async_tp is None else async_tp
    shape = StepShape.of(stats, layout, options, cluster, seq_len, micro_batch_size, global_batch_size)
    method, lora = _method(method, lora)
    efficiency = cluster.mfu if cluster.mfu is not None else kern.efficiency
    attention_efficiency = efficiency
    if cluster.mfu is None and kern.attention is not None:
        attention_efficiency = KERNELS[kern.attention].efficiency
    lora_layer = stats.lora_params_per_layer(lora.target_modules, lora.r) if lora is not None else 0

    ranks = [
        _rank_time(
            stats,
            shape,
            memory,
            cluster,
            kern,
            (efficiency, attention_efficiency),
            method,
            lora_layer,
            async_tp,
            recompute_fraction,
            r,
            float8_tp=float8_tp and kern.float8,
        )
        for r in range(layout.pp_size)
    ]
    worst = max(range(len(ranks)), key=lambda r: ranks[r]["step"])
    rank = ranks[worst]
    tokens = shape.accumulation * micro_batch_size * layout.dp_size * seq_len
    tokens_per_s_per_gpu = tokens / (rank["step"] * layout.world_size)
    model_flops = stats.flops_per_token(seq_len, trainable=method, adapter_params=stats.num_layers * lora_layer)
    return StepTime(
        step_s=rank["step"],
        compute_s=rank["compute"],
        recompute_s=rank["recompute"],
        comm_s=rank["comm"],
        exposed_comm_s=sum(rank["exposed"].values()),
        bubble=rank["bubble_s"] / rank["step"],
        tokens_per_s_per_gpu=tokens_per_s_per_gpu,
        mfu=tokens_per_s_per_gpu * model_flops / cluster.gpu.peak_flops,
        assumptions=step_assumptions(shape, memory, cluster, kern, efficiency, method, async_tp, recompute_fraction),
        efficiency=efficiency,
        exposed_s=rank["exposed"],
        bottleneck_pp_rank=worst,
    )


# ----------------------------------------------------------------------------------------------------------
# The model


def _rank_time(
    stats: ModelStats,
    shape: StepShape,
    memory: MemoryOptions,
    cluster: Cluster,
    kern: Kernels,
    efficiencies: tuple[float, float],
    method: str,
    lora_layer: int,
    async_tp: bool,
    recompute_fraction: float | None,
    pp_rank: int,
    *,
    float8_tp: bool = False,
) -> dict[str, Any]:
    """Time of pipeline rank ``pp_rank`` (any data/TP/CP rank of it: they do the same work)."""
    layout = shape.layout
    t, c, p = layout.tp_size, layout.cp_size, layout.pp_size
    layers, first, last = shape.stage_layers[pp_rank]
    forwards = shape.accumulation * shape.microbatches  # micro-batches this rank runs per optimizer step
    tokens = shape.tokens_per_microbatch * forwards  # tokens this rank's CP/TP group computes per step
    rate = cluster.gpu.peak_flops * efficiencies[0]
    attn_rate = cluster.gpu.peak_flops * efficiencies[1]
    slowdown = QLORA_SLOWDOWN if method == "qlora" else 1.0

    # Seconds per token of one layer's forward, matmuls and attention; training runs the matmuls 3x (full) or
    # 2x (frozen base: no weight gradients), attention 3x. Attention is the layers' mean (sliding windows count their
    # band, see ModelStats.attention_flops_per_token).
    attn_fwd = stats.attention_flops_per_token(shape.seq_len) / stats.num_layers / attn_rate
    mm_fwd = 2.0 * stats.layer_active_matmul_params / rate
    mm_factor = 3.0 if method == "full" else 2.0
    layer_time = mm_factor * mm_fwd + 3.0 * attn_fwd + 6.0 * lora_layer / rate
    head_time = mm_factor * 2.0 * stats.vocab_size * stats.hidden_size / rate if last else 0.0
    compute = tokens / t * (layers * layer_time + head_time) * slowdown
    rec = _recompute_share(memory, layers, recompute_fraction)
    tiled = 2.0 * _mlp_matmul_params(stats) / rate if memory.mlp_chunk_tokens else 0.0  # each tile's forward again
    recompute = tokens / t * layers * (rec * (mm_fwd + attn_fwd) + tiled) * slowdown
    busy = compute + recompute

    comm: dict[str, float] = {k: 0.0 for k in ("fsdp", "tp", "cp", "pp", "dp_replicate", "offload", "ep")}
    exposed = dict(comm)
    act = tokens * stats.hidden_size * 2.0  # bf16 activations of this rank's tokens, one layer boundary, per step

    if t > 1:
        _, bw = cluster.link(t)
        gather = act * (0.5 if float8_tp and shape.sequence_parallel else 1.0)
        fwd = 2 * (t - 1) / t * (gather + act)  # 2 all-gathers + 2 reduce-scatters (or 2 all-reduces) per layer
        bwd = 4 * (t - 1) / t * act
        # Recomputation re-runs the layer's collectives too; op-level selective saves no collective output.
        op_level = recompute_fraction is None and memory.activation_checkpointing == "selective"
        rec_comm = 1.0 if op_level and memory.every_n_layers is None else rec
        # The vocab-parallel embedding output and the lm_head input: one collective each way per end.
        ends = 2 * (t - 1) / t * act * (int(first) + int(last))
        comm["tp"] = (layers * (fwd + bwd + rec_comm * fwd) + ends) / bw
        exposed["tp"] = comm["tp"] * (1 - ASYNC_TP_HIDDEN if async_tp else 1.0)

    if c > 1:
        _, bw = cluster.link(c * t)
        kv = 2 * tokens * stats.num_kv_heads * stats.head_dim * 2.0 / t  # this rank's K and V, per layer
        if shape.cp_backend == "ring":
            per_layer = (c - 1) * kv * (1 + 2 + rec)  # forward passes, backward K/V + dK/dV, recompute
            comm["cp"] = layers * per_layer / bw
            attention = tokens / t * layers * (3 + rec) * attn_fwd
            exposed["cp"] = max(0.0, comm["cp"] - attention)
        else:
            q = tokens * stats.num_heads * stats.head_dim * 2.0 / t
            per_layer = (c - 1) / c * (2 * q + kv) * (2 + rec)  # q, k, v in and the output back; backward alike
            comm["cp"] = layers * per_layer / bw
            exposed["cp"] = comm["cp"]

    e = layout.ep_size
    if e > 1 and stats.is_moe:
        _, bw = cluster.link(t * e)
        rows = tokens / t * stats.experts_per_token  # routed (token, expert) rows of this rank, per step
        per_layer = 2 * (e - 1) / e * rows * stats.hidden_size * 2.0  # dispatch + combine, bf16
        comm["ep"] = layers * per_layer * (2 + rec) / bw  # forward, backward (the same bytes), recomputation
        exposed["ep"] = comm["ep"]

    if p > 1:
        _, bw = cluster.link(layout.world_size)
        boundary = act / forwards / (t if shape.sequence_parallel and t > 1 else 1)  # one micro-batch's activation
        comm["pp"] = 2 * forwards * shape.stages_per_rank * boundary / bw
        exposed["pp"] = 2 * (p - 1) * boundary / bw * shape.accumulation  # the fill and the drain

    fsdp_group = layout.dp_shard_size * c
    routed = layers * stats.expert_params  # replicated over TP; EP x the experts' FSDP2 group shard them
    params = (
        layers * (stats.layer_params - stats.expert_params)
        + (stats.embedding_params if first else 0)
        + (stats.norm_params + stats.head_params if last else 0)
        + (stats.embedding_params if last and not first and stats.tied_embeddings else 0)
    ) / t + routed / e
    linear = layers * stats.layer_matmul_params / t
    weight_bytes = 4.0 if memory.param_dtype in ("fp32", "float32") else 2.0
    stored_linear = NF4_BYTES_PER_PARAM if method == "qlora" else weight_bytes
    stored = linear * stored_linear + (params - linear) * weight_bytes  # this rank's parameters, unsharded
    gathered = stored - linear * (stored_linear - 1.0) if kern.float8 and method != "qlora" else stored
    trainable = params if method == "full" else layers * lora_layer / t
    reduce_dtype = memory.reduce_dtype or memory.param_dtype
    grad_bytes = trainable * (4.0 if reduce_dtype in ("fp32", "float32") else 2.0)
    reductions = shape.accumulation
    if p > 1 and memory.pp_reshard_per_microbatch:
        # Each micro-batch gathers for its forward and again for its backward, and reduce-scatters its gradients.
        gathers = shape.accumulation * 2 * shape.microbatches
        reductions = shape.accumulation * shape.microbatches
    elif p > 1:
        regather = memory.reshard_after_forward and not shape.split_backward
        gathers = shape.accumulation * (2 * shape.microbatches if regather else 1)
    else:
        gathers = shape.accumulation * (2 if memory.reshard_after_forward else 1)
    if fsdp_group > 1:
        _, bw = cluster.link(t * fsdp_group)
        share = (fsdp_group - 1) / fsdp_group
        if routed:  # the experts' share of the bytes moves in groups of dp_shard x cp / ep (none when ep is all)
            experts_group = max(1, fsdp_group // e)
            expert_part = routed / e / params
            share = share * (1 - expert_part) + (experts_group - 1) / experts_group * expert_part
        comm["fsdp"] = share * (gathers * gathered + reductions * grad_bytes) / bw
    if layout.dp_replicate_size > 1:
        r = layout.dp_replicate_size
        _, bw = cluster.link(t * fsdp_group * r)
        comm["dp_replicate"] = reductions * 2 * (r - 1) / r * grad_bytes / fsdp_group / bw
    overlapped = comm["fsdp"] + comm["dp_replicate"]
    hidden_budget = busy
    if overlapped:
        edge = overlapped / max(1, layers)
        spill = max(0.0, overlapped - edge - hidden_budget)
        total = edge + spill
        exposed["fsdp"] = total * comm["fsdp"] / overlapped
        exposed["dp_replicate"] = total * comm["dp_replicate"] / overlapped

    if memory.cpu_offload:
        transfer = (gathers * stored + reductions * grad_bytes) / fsdp_group / cluster.gpu.pcie_bytes_per_s
        optimizer = trainable / fsdp_group / HOST_ADAM_PARAMS_PER_S
        comm["offload"] = transfer + optimizer
        edge = transfer / max(1, layers)
        exposed["offload"] = edge + max(0.0, transfer - edge - hidden_budget) + optimizer
    if memory.optimizer_offload:
        # Full fine-tunes with FSDP2 mixed precision keep fp32 master weights, LoRA fp32 adapters; gradients match.
        master = 4.0 if method != "full" or memory.param_dtype is not None else weight_bytes
        shard = trainable / fsdp_group
        transfer = 2 * shard * master / cluster.gpu.pcie_bytes_per_s  # gradients to the host, parameters back
        optimizer = shard / HOST_ADAM_PARAMS_PER_S
        comm["offload"] = transfer + optimizer
        exposed["offload"] = transfer + optimizer

    in_pipeline = busy + exposed["tp"] + exposed["cp"] + exposed["ep"]
    bubble = shape.bubble_fraction()
    bubble_s = in_pipeline * bubble / (1 - bubble)
    step = in_pipeline + bubble_s + exposed["pp"] + exposed["fsdp"] + exposed["dp_replicate"] + exposed["offload"]
    return {
        "step": step,
        "compute": compute,
        "recompute": recompute,
        "comm": comm,
        "exposed": exposed,
        "bubble_s": bubble_s,
    }


#: The linears of a dense gated MLP (a MoE's shared expert's too), which the tiled MLP computes once more in backward.
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")


def _mlp_matmul_params(stats: ModelStats) -> int:
    """Matmul weights of a decoder layer's dense MLPs (what ``mlp_chunk_tokens`` tiles)."""
    return sum(fan_in * fan_out for name, fan_in, fan_out in stats.linears if name in MLP_LINEARS)


def _recompute_share(memory: MemoryOptions, layers: int, override: float | None) -> float:
    """Share of a layer's forward FLOPs recomputed in backward, averaged over the rank's layers."""
    if override is not None:
        return override
    mode = memory.activation_checkpointing
    if mode == "none" or layers == 0:
        return 0.0
    if mode == "full":
        return 1.0
    if memory.every_n_layers is not None:
        return math.ceil(layers / memory.every_n_layers) / layers
    return SELECTIVE_RECOMPUTE


def torchtitan_op_sac(stats: ModelStats) -> float:
    """Forward share recomputed by torchtitan's op-level selective AC (its Llama 3.1 runs, 2024).

    Its policy saves matmul and attention outputs *except every second matmul* of a block: of
    ``wq, wk, wv, wo, w1, w3, w2`` it recomputes ``wk, wo, w3`` (and the elementwise ops, as the engine's
    selective mode does). Returned as a share of the layer's matmul forward, plus :data:`SELECTIVE_RECOMPUTE`.
    """
    sizes = {name: fan_in * fan_out for name, fan_in, fan_out in stats.linears}
    recomputed = sizes["k_proj"] + sizes["o_proj"] + sizes["up_proj"]
    return recomputed / stats.layer_matmul_params + SELECTIVE_RECOMPUTE


def _method(method: str, lora: Any | None) -> tuple[str, Any | None]:
    if method not in TRAINABLE:
        raise PlannerError(f"method={method!r} is not one of {TRAINABLE}.")
    if method == "full":
        if lora is not None:
            raise PlannerError(
                "method='full' was given LoRA options: pass method='lora' (or 'qlora' for an NF4 base), or lora=None."
            )
        return method, None
    if lora is None:
        from lightning_plugins.adapters.lora import LoraOptions

        lora = LoraOptions()
    return method, lora


def kernels_for(options: ParallelOptions) -> str:
    """The calibrated class a run with ``options`` falls in: ``compile`` and ``float8`` pick the compiled classes."""
    if options.compile:
        return "compile_float8" if options.float8 else "compile"
    return DEFAULT_KERNELS


def _kernels(kernels: str | Kernels) -> Kernels:
    if isinstance(kernels, Kernels):
        return kernels
    if kernels not in KERNELS:
        raise PlannerError(f"kernels={kernels!r} is not a calibrated class; use one of {sorted(KERNELS)}.")
    return KERNELS[kernels]
