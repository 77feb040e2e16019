"""Step time of a layout: FLOPs at a calibrated efficiency, communication over stated links, the pipeline bubble.

The model, per optimizer step, for the slowest rank (pipeline stages differ: the last one runs ``lm_head``):

* **Compute.** Model FLOPs (:meth:`ModelStats.flops_per_token`: ``6N`` plus attention; ``4N`` for the frozen
  base of LoRA) divided by ``peak x efficiency``. The efficiency is calibrated, one per class of kernels
  (:data:`KERNELS`), against published runs (:data:`CALIBRATION`). Recomputation adds forward FLOPs:
  full checkpointing one more forward of every layer, ``every_n_layers`` of every N-th, op-level selective
  the elementwise ops (:data:`SELECTIVE_RECOMPUTE`). QLoRA's NF4 dequantisation slows compute by
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
* **CPU offload.** Parameters host->GPU at every gather and gradients back over PCIe (overlapped like FSDP),
  plus the optimizer step on the host (:data:`HOST_ADAM_PARAMS_PER_S`), exposed.

Absolute step times are +-25%: good enough to rank layouts and to size a rental, not to quote.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from lightning_plugins.layout import LayoutError, ParallelLayout
from lightning_plugins.options import MemoryOptions, ParallelOptions
from lightning_plugins.planner.hardware import GPUS, Cluster
from lightning_plugins.planner.model_stats import NF4_BYTES_PER_PARAM, ModelStats, PlannerError, model_stats

__all__ = [
    "CALIBRATION",
    "DEFAULT_KERNELS",
    "KERNELS",
    "VALIDATION",
    "Kernels",
    "StepTime",
    "calibration_table",
    "estimate_step_time",
    "fit_efficiencies",
    "format_calibration",
    "print_calibration",
    "torchtitan_op_sac",
]

METHODS = ("full", "lora", "qlora")

#: Op-level selective checkpointing (the engine's: matmul and attention outputs saved) re-runs the norms,
#: SwiGLU, rotary and residual ops. They do few FLOPs but are memory-bound: for a Llama-3.1-8B layer at 8K
#: tokens ~300 KB of HBM traffic per token against ~570 MFLOP per token, ~8% of the layer's forward time on
#: an H100. Charged as this fraction of the layer's forward FLOPs.
SELECTIVE_RECOMPUTE = 0.1
#: QLoRA over LoRA: NF4 weights are dequantised before every matmul (forward, input gradient, recompute).
#: Measured 1.39x the LoRA run time for a 7B model on an A100 (S. Raschka, "Practical Tips for Finetuning
#: LLMs Using LoRA", 2023: "39% increased runtime" for 33% less memory).
QLORA_SLOWDOWN = 1.39
#: Async TP (micro-pipelined matmul + collective) hides this share of the TP collectives. torchtitan's async-TP
#: benchmark (Llama 3 70B, FSDP32 x TP8, H100) gains 9% (bf16) to 16% (float8) with TP collectives ~18-20%
#: of the step in this model: roughly half of them hidden.
ASYNC_TP_HIDDEN = 0.5
#: AdamW on the host (FSDP2 CPU offload runs the optimizer there), parameters per second per GPU's share of
#: the node's cores and memory bandwidth: ~28 bytes of fp32 state read and written per parameter at ~30 GB/s.
HOST_ADAM_PARAMS_PER_S = 1e9


@dataclass(frozen=True)
class Kernels:
    """A class of kernels and training-loop settings whose compute efficiency is calibrated as one.

    Attributes:
        name: Key in :data:`KERNELS`.
        efficiency: Fraction of the dense bf16 peak the model FLOPs and recomputation run at (everything
            but communication and the bubble; fitted by :func:`fit_efficiencies`).
        float8: float8 linears (torchao, tensorwise scaling): FSDP all-gathers float8 weights and tensor
            parallelism all-gathers float8 activations; the FLOPs still count against the bf16 peak.
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
#: them; ``tests/test_planner_timing.py`` checks these constants against the refit).
KERNELS: dict[str, Kernels] = {
    "bf16": Kernels("bf16", 0.385, description="torchtitan's bf16 eager runs"),
    "compile_float8": Kernels(
        "compile_float8",
        0.748,
        float8=True,
        attention="bf16",
        description="torchtitan's torch.compile + float8 runs",
    ),
    "llama3": Kernels("llama3", 0.654, description="the Llama 3 paper's bf16 runs"),
}
#: What the planner assumes for a run of this engine: bf16, eager, like torchtitan's eager runs. Those ran
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
    kernels: str | Kernels = DEFAULT_KERNELS,
    async_tp: bool = False,
    recompute_fraction: float | None = None,
) -> StepTime:
    """Estimate one optimizer step of ``layout`` on ``cluster``.

    Args:
        config_or_stats: A transformers config, a :class:`ModelStats` or a config spec.
        layout: A resolved :class:`ParallelLayout` whose world size is ``cluster.gpus``.
        options: Sequence/loss parallel, CP backend, pipeline schedule and micro-batches.
        memory: Activation checkpointing, FSDP2 dtypes, CPU offload, ``reshard_after_forward``.
        cluster: The GPUs and links.
        seq_len: Tokens per row.
        micro_batch_size: Rows per data rank per forward (under PP: the batch the pipeline splits into
            ``pp_microbatches`` micro-batches), as in a recipe.
        global_batch_size: Rows per optimizer step over all data ranks (``dp_replicate x dp_shard``); a data
            rank accumulates ``global_batch_size // (micro_batch_size x data ranks)`` forwards.
        method: ``"full"``, ``"lora"`` or ``"qlora"``.
        lora: The :class:`~lightning_plugins.lora.LoraOptions` (rank, targets) for LoRA/QLoRA; ``None`` takes
            their defaults.
        kernels: A key of :data:`KERNELS` (or a :class:`Kernels`): the calibrated efficiency class.
            ``cluster.mfu`` overrides its efficiency.
        async_tp: Whether tensor-parallel collectives are micro-pipelined with the matmuls (hides
            :data:`ASYNC_TP_HIDDEN` of them).
        recompute_fraction: Overrides the share of a checkpointed layer's forward that is recomputed (e.g.
            torchtitan's op-level policy, :func:`torchtitan_op_sac`); ``None`` follows ``memory``.

    Raises:
        PlannerError: for an unresolved layout, a world size that is not the cluster's, an unknown method or
            kernels class, batch sizes that do not divide, or a layout the model cannot take.
    """
    stats = model_stats(config_or_stats)
    kern = _kernels(kernels)
    shape = _Shape.of(stats, layout, options, cluster, seq_len, micro_batch_size, global_batch_size)
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
        assumptions=_assumptions(shape, memory, cluster, kern, efficiency, method, async_tp, recompute_fraction),
        efficiency=efficiency,
        exposed_s=rank["exposed"],
        bottleneck_pp_rank=worst,
    )


# ----------------------------------------------------------------------------------------------------------
# The model


@dataclass(frozen=True)
class _Shape:
    """Sizes of one step: the layout, the pipeline and the batch, checked."""

    layout: ParallelLayout
    seq_len: int
    micro_batch_size: int
    accumulation: int
    microbatches: int  # pipeline micro-batches per forward (1 without PP)
    stages_per_rank: int
    schedule: str
    split_backward: bool
    sequence_parallel: bool
    cp_backend: str
    stage_layers: tuple[tuple[int, bool, bool], ...]  # per pp rank: (layers, holds the embedding, holds lm_head)

    @classmethod
    def of(
        cls,
        stats: ModelStats,
        layout: ParallelLayout,
        options: ParallelOptions,
        cluster: Cluster,
        seq_len: int,
        micro_batch_size: int,
        global_batch_size: int,
    ) -> _Shape:
        if not isinstance(layout, ParallelLayout):
            raise PlannerError(f"layout must be a ParallelLayout, got {type(layout).__name__}.")
        if layout.dp_shard_size == -1:
            raise PlannerError(
                f"estimate_step_time needs a resolved layout (dp_shard_size=-1 is open): pass"
                f" `layout.resolve({cluster.gpus})`."
            )
        if layout.world_size != cluster.gpus:
            raise PlannerError(
                f"The layout spans {layout.world_size} ranks ({_layout_str(layout)}) but the cluster has {cluster.gpus}"
                f" GPUs. Resolve the layout for the cluster: `layout.resolve({cluster.gpus})` with dp_shard_size=-1."
            )
        for name, value in (
            ("seq_len", seq_len),
            ("micro_batch_size", micro_batch_size),
            ("global_batch_size", global_batch_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlannerError(f"{name}={value!r} must be a positive integer.")
        _check_divisible(stats, layout, seq_len)
        dp = layout.dp_size
        accumulation = global_batch_size // (micro_batch_size * dp)
        if accumulation < 1:
            raise PlannerError(
                f"global_batch_size={global_batch_size} rows cannot feed {dp} data ranks with micro_batch_size="
                f"{micro_batch_size} each. Use global_batch_size >= {micro_batch_size * dp} (a multiple of"
                f" micro_batch_size x data ranks) or a smaller micro_batch_size."
            )
        m, v, schedule, split_backward = 1, 1, "", False
        stage_layers: tuple[tuple[int, bool, bool], ...] = ((stats.num_layers, True, True),)
        if layout.pp_size > 1:
            from lightning_plugins.parallel.pipeline import layer_ranges, stages_of_rank

            try:
                pipe = options.pipeline.resolve(layout.pp_size, stats.num_layers)
            except LayoutError as err:
                raise PlannerError(str(err)) from None
            m, v, schedule, split_backward = (
                pipe.microbatches,
                pipe.stages_per_rank,
                pipe.schedule,
                pipe.spec.split_backward,
            )
            if micro_batch_size % m:
                raise PlannerError(
                    f"micro_batch_size={micro_batch_size} rows per data rank do not split into pp_microbatches={m}"
                    f" equal micro-batches. Use a micro_batch_size that is a multiple of {m}, or fewer pp_microbatches."
                )
            ranges = layer_ranges(stats.num_layers, layout.pp_size * v)
            last = layout.pp_size * v - 1
            stage_layers = tuple(
                (sum(len(ranges[s]) for s in stages), 0 in stages, last in stages)
                for stages in (stages_of_rank(r, layout.pp_size, pipe) for r in range(layout.pp_size))
            )
        return cls(
            layout=layout,
            seq_len=seq_len,
            micro_batch_size=micro_batch_size,
            accumulation=accumulation,
            microbatches=m,
            stages_per_rank=v,
            schedule=schedule,
            split_backward=split_backward,
            sequence_parallel=options.sequence_parallel,
            cp_backend=options.cp_backend,
            stage_layers=stage_layers,
        )

    @property
    def tokens_per_microbatch(self) -> float:
        """Tokens one rank handles per pipeline micro-batch (its CP share of the sequence)."""
        return self.micro_batch_size / self.microbatches * self.seq_len / self.layout.cp_size

    def bubble_fraction(self) -> float:
        """Share of the pipeline's time idle (0 without pipelining)."""
        p, m, v = self.layout.pp_size, self.microbatches, self.stages_per_rank
        if p == 1 or self.schedule in ("zbv_zero_bubble", "dualpipev"):
            return 0.0
        idle = (p - 1) / v
        if self.schedule == "interleaved_zero_bubble":
            idle /= 3
        return idle / (m + idle)


def _rank_time(
    stats: ModelStats,
    shape: _Shape,
    memory: MemoryOptions,
    cluster: Cluster,
    kern: Kernels,
    efficiencies: tuple[float, float],
    method: str,
    lora_layer: int,
    async_tp: bool,
    recompute_fraction: float | None,
    pp_rank: int,
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
    # 2x (frozen base: no weight gradients), attention 3x.
    attn_fwd = 4.0 * stats.num_heads * stats.head_dim * shape.seq_len / attn_rate
    mm_fwd = 2.0 * stats.layer_matmul_params / rate
    mm_factor = 3.0 if method == "full" else 2.0
    layer_time = mm_factor * mm_fwd + 3.0 * attn_fwd + 6.0 * lora_layer / rate
    head_time = mm_factor * 2.0 * stats.vocab_size * stats.hidden_size / rate if last else 0.0
    compute = tokens / t * (layers * layer_time + head_time) * slowdown
    rec = _recompute_share(memory, layers, recompute_fraction)
    recompute = tokens / t * layers * rec * (mm_fwd + attn_fwd) * slowdown
    busy = compute + recompute

    comm: dict[str, float] = {k: 0.0 for k in ("fsdp", "tp", "cp", "pp", "dp_replicate", "offload")}
    exposed = dict(comm)
    act = tokens * stats.hidden_size * 2.0  # bf16 activations of this rank's tokens, one layer boundary, per step

    if t > 1:
        _, bw = cluster.link(t)
        gather = act * (0.5 if kern.float8 and shape.sequence_parallel else 1.0)
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

    if p > 1:
        _, bw = cluster.link(layout.world_size)
        boundary = act / forwards / (t if shape.sequence_parallel and t > 1 else 1)  # one micro-batch's activation
        comm["pp"] = 2 * forwards * shape.stages_per_rank * boundary / bw
        exposed["pp"] = 2 * (p - 1) * boundary / bw * shape.accumulation  # the fill and the drain

    fsdp_group = layout.dp_shard_size * c
    params = (
        layers * stats.layer_params
        + (stats.embedding_params if first else 0)
        + (stats.norm_params + stats.head_params if last else 0)
        + (stats.embedding_params if last and not first and stats.tied_embeddings else 0)
    ) / t
    linear = layers * stats.layer_matmul_params / t
    weight_bytes = 4.0 if memory.param_dtype in ("fp32", "float32") else 2.0
    stored_linear = NF4_BYTES_PER_PARAM if method == "qlora" else weight_bytes
    stored = linear * stored_linear + (params - linear) * weight_bytes  # this rank's parameters, unsharded
    gathered = stored - linear * (stored_linear - 1.0) if kern.float8 and method != "qlora" else stored
    trainable = params if method == "full" else layers * lora_layer / t
    reduce_dtype = memory.reduce_dtype or memory.param_dtype
    grad_bytes = trainable * (4.0 if reduce_dtype in ("fp32", "float32") else 2.0)
    if p > 1:
        regather = memory.reshard_after_forward and not shape.split_backward
        gathers = shape.accumulation * (2 * shape.microbatches if regather else 1)
    else:
        gathers = shape.accumulation * (2 if memory.reshard_after_forward else 1)
    reductions = shape.accumulation
    if fsdp_group > 1:
        _, bw = cluster.link(t * fsdp_group)
        share = (fsdp_group - 1) / fsdp_group
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

    in_pipeline = busy + exposed["tp"] + exposed["cp"]
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


def _check_divisible(stats: ModelStats, layout: ParallelLayout, seq_len: int) -> None:
    t, c = layout.tp_size, layout.cp_size
    for name, value in (("num_attention_heads", stats.num_heads), ("num_key_value_heads", stats.num_kv_heads)):
        if value % t:
            raise PlannerError(
                f"tp_size={t} does not divide {name}={value}: each tensor-parallel rank needs whole heads. Use a"
                f" tp_size that divides {name}."
            )
    if seq_len % c:
        raise PlannerError(
            f"seq_len={seq_len} does not split into cp_size={c} equal chunks. Use a seq_len that is a multiple of {c}."
        )
    if layout.pp_size > stats.num_layers:
        raise PlannerError(f"pp_size={layout.pp_size} exceeds the model's {stats.num_layers} layers.")


def _method(method: str, lora: Any | None) -> tuple[str, Any | None]:
    if method not in METHODS:
        raise PlannerError(f"method={method!r} is not one of {METHODS}.")
    if method == "full":
        if lora is not None:
            raise PlannerError(
                "method='full' was given LoRA options: pass method='lora' (or 'qlora' for an NF4 base), or lora=None."
            )
        return method, None
    if lora is None:
        from lightning_plugins.lora import LoraOptions

        lora = LoraOptions()
    return method, lora


def _kernels(kernels: str | Kernels) -> Kernels:
    if isinstance(kernels, Kernels):
        return kernels
    if kernels not in KERNELS:
        raise PlannerError(f"kernels={kernels!r} is not a calibrated class; use one of {sorted(KERNELS)}.")
    return KERNELS[kernels]


def _layout_str(layout: ParallelLayout) -> str:
    names = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    return " x ".join(f"{n}{s}" for n, s in zip(names, layout.sizes) if s > 1) or "1 rank"


def _assumptions(
    shape: _Shape,
    memory: MemoryOptions,
    cluster: Cluster,
    kern: Kernels,
    efficiency: float,
    method: str,
    async_tp: bool,
    recompute_fraction: float | None,
) -> tuple[str, ...]:
    layout, gpu = shape.layout, cluster.gpu
    source = "set by Cluster.mfu" if cluster.mfu is not None else f"calibrated on {kern.description}"
    peak = f"{gpu.peak_flops / 1e12:.0f} TFLOP/s"
    lines = [
        f"compute at {efficiency:.1%} of the {gpu.name} dense bf16 peak of {peak} ({source})",
        "FLOPs per token: 6N + 12 x layers x heads x head_dim x seq (torchtitan's MFU convention; attention not"
        " halved for the causal mask)" + ("; frozen base 4N" if method != "full" else ""),
    ]
    if recompute_fraction is not None:
        lines.append(f"recomputation: {recompute_fraction:.0%} of each layer's forward")
    elif memory.activation_checkpointing == "full":
        lines.append("full activation checkpointing: one more forward of every layer")
    elif memory.activation_checkpointing == "selective":
        lines.append(
            f"selective checkpointing: every {memory.every_n_layers}-th layer recomputed"
            if memory.every_n_layers
            else f"op-level selective checkpointing: elementwise ops recomputed, {SELECTIVE_RECOMPUTE:.0%} of a"
            " layer's forward"
        )
    if method == "qlora":
        lines.append(f"QLoRA: NF4 dequantisation makes compute {QLORA_SLOWDOWN:.2f}x LoRA's")

    def link(extent: int) -> str:
        name, bw = cluster.link(extent)
        return f"{name} {bw / 1e9:.0f} GB/s per GPU"

    t, c = layout.tp_size, layout.cp_size
    fsdp = layout.dp_shard_size * c
    if fsdp > 1:
        regather = memory.reshard_after_forward and not shape.split_backward
        if layout.pp_size > 1:
            gathers = "per micro-batch forward and backward" if regather else "once per pipeline step"
        else:
            gathers = "per forward and again per backward" if regather else "per forward"
        lines.append(
            f"FSDP over {fsdp} ranks on {link(t * fsdp)}: parameters all-gathered {gathers}, gradients reduce-scattered"
            " per backward; overlapped with compute except the first gather / last reduce-scatter and any excess"
            " over compute"
        )
    if layout.dp_replicate_size > 1:
        replicas = layout.dp_replicate_size
        lines.append(
            f"HSDP: gradient all-reduce over {replicas} replicas on {link(t * fsdp * replicas)}, overlapped like FSDP"
        )
    if t > 1:
        hidden = f", {ASYNC_TP_HIDDEN:.0%} hidden by async TP" if async_tp else ", exposed (not overlapped)"
        lines.append(
            f"TP {t} on {link(t)}: {'all-gather + reduce-scatter' if shape.sequence_parallel else 'all-reduce'} of the"
            f" activations twice per layer, forward and backward{hidden}"
        )
    if c > 1:
        how = (
            "ring: K/V passed cp-1 times per layer, hidden behind attention"
            if shape.cp_backend == "ring"
            else "Ulysses: 4 all-to-alls per layer forward and backward, exposed"
        )
        lines.append(f"CP {c} on {link(c * t)}: {how}")
    if layout.pp_size > 1:
        bubble = shape.bubble_fraction()
        zero = " (zero-bubble schedule: assumed 0, needs pp_microbatches >= 2 x pp_size)" if bubble == 0 else ""
        lines.append(
            f"PP {layout.pp_size} ({shape.schedule}, {shape.microbatches} micro-batches, {shape.stages_per_rank}"
            f" stage(s) per rank): bubble {bubble:.1%} of the pipeline's time{zero}; activations point-to-point on"
            f" {link(layout.world_size)}, exposed on fill and drain only"
        )
    if memory.cpu_offload:
        lines.append(
            f"CPU offload: parameters and gradients over PCIe at {gpu.pcie_bytes_per_s / 1e9:.0f} GB/s, optimizer on"
            f" the host at {HOST_ADAM_PARAMS_PER_S:.0e} parameters/s per GPU (exposed)"
        )
    lines.append("optimizer step on the GPU, data loading and logging: not counted")
    return tuple(lines)


# ----------------------------------------------------------------------------------------------------------
# Calibration: published runs, their settings, and the efficiency per kernels class they imply

#: Published runs with the settings they were run with. Sources:
#: torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md`` (H100 96 GB HBM2e at 500 W, 8 per node, 400 Gb/s
#: RDMA per GPU; seq_len 8192 from its ``train_configs/llama3_*.toml`` at commit 9dec370, AdamW, FSDP2 bf16
#: parameters with fp32 gradient reduction, pipeline micro-batches = pp degree); Llama 3 paper (Dubey et al.
#: 2024, Table 4: 700 W H100 80 GB, bf16; TFLOP/s per GPU, converted with this model's FLOP count).
#: ``local batch`` in torchtitan is rows per data rank per step, which is our micro_batch_size.
CALIBRATION: tuple[dict[str, Any], ...] = (
    {
        "name": "torchtitan Llama-3.1-8B FSDP8, 8 H100",
        "model": "Llama-3.1-8B",
        "gpus": 8,
        "layout": {"dp_shard_size": 8},
        "seq_len": 8192,
        "micro_batch_size": 2,
        "global_batch_size": 16,
        "memory": {"activation_checkpointing": "selective", "param_dtype": "bf16", "reduce_dtype": "fp32"},
        "recompute": "torchtitan_op_sac",
        "kernels": "bf16",
        "published_tokens_per_s_per_gpu": 5762,
        "required": True,
        "source": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1 (FSDP, eager, selective op AC)",
    },
    {
        "name": "torchtitan Llama-3.1-8B FSDP128, 128 H100",
        "model": "Llama-3.1-8B",
        "gpus": 128,
        "layout": {"dp_shard_size": 128},
        "seq_len": 8192,
        "micro_batch_size": 2,
        "global_batch_size": 256,
        "memory": {"activation_checkpointing": "selective", "param_dtype": "bf16", "reduce_dtype": "fp32"},
        "recompute": "torchtitan_op_sac",
        "kernels": "bf16",
        "published_tokens_per_s_per_gpu": 5605,
        "source": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 3 (FSDP, eager, selective op AC)",
    },
    {
        "name": "torchtitan Llama-3.1-8B FSDP8, 8 H100, compile + float8",
        "model": "Llama-3.1-8B",
        "gpus": 8,
        "layout": {"dp_shard_size": 8},
        "seq_len": 8192,
        "micro_batch_size": 2,
        "global_batch_size": 16,
        "memory": {"activation_checkpointing": "selective", "param_dtype": "bf16", "reduce_dtype": "fp32"},
        "recompute": "torchtitan_op_sac",
        "kernels": "compile_float8",
        "published_tokens_per_s_per_gpu": 8532,
        "source": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1 (FSDP + torch.compile + Float8)",
    },
    {
        "name": "torchtitan Llama-3.1-70B FSDP32 x TP8, 256 H100",
        "model": "Llama-3.1-70B",
        "gpus": 256,
        "layout": {"dp_shard_size": 32, "tp_size": 8},
        "seq_len": 8192,
        "micro_batch_size": 16,
        "global_batch_size": 512,
        "memory": {"activation_checkpointing": "full", "param_dtype": "bf16", "reduce_dtype": "fp32"},
        "kernels": "compile_float8",
        "published_tokens_per_s_per_gpu": 829,
        "required": True,
        "source": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 4 (2D, compile + Float8, full AC)",
    },
    {
        "name": "torchtitan Llama-3.1-405B FSDP8 x TP8 x PP8 1F1B, 512 H100",
        "model": "Llama-3.1-405B",
        "gpus": 512,
        "layout": {"pp_size": 8, "dp_shard_size": 8, "tp_size": 8},
        "options": {"pp_schedule": "1f1b", "pp_microbatches": 8},
        "seq_len": 8192,
        "micro_batch_size": 32,
        "global_batch_size": 256,
        "memory": {
            "activation_checkpointing": "full",
            "param_dtype": "bf16",
            "reduce_dtype": "fp32",
            "reshard_after_forward": False,
        },
        "kernels": "compile_float8",
        "async_tp": True,
        "published_tokens_per_s_per_gpu": 100,
        "source": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 5 (3D, compile + Float8 + AsyncTP)",
    },
    {
        "name": "torchtitan Llama-3.1-405B FSDP8 x TP8 x PP8 interleaved 1F1B, 512 H100",
        "model": "Llama-3.1-405B",
        "gpus": 512,
        "layout": {"pp_size": 8, "dp_shard_size": 8, "tp_size": 8},
        "options": {"pp_schedule": "interleaved_1f1b", "pp_microbatches": 8, "pp_stages_per_rank": 2},
        "seq_len": 8192,
        "micro_batch_size": 32,
        "global_batch_size": 256,
        "memory": {
            "activation_checkpointing": "full",
            "param_dtype": "bf16",
            "reduce_dtype": "fp32",
            "reshard_after_forward": False,
        },
        "kernels": "compile_float8",
        "async_tp": True,
        "published_tokens_per_s_per_gpu": 128,
        "required": True,
        "source": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 5 (3D, compile + Float8 + AsyncTP)",
    },
    *(
        {
            "name": f"Llama 3 paper 405B {name}, {gpus:,} H100 ({mfu}% MFU)",
            "model": "Llama-3.1-405B",
            "gpus": gpus,
            "layout": {"pp_size": 16, "dp_shard_size": dp, "cp_size": cp, "tp_size": 8},
            # Interleaved 1F1B, one sequence per micro-batch. The paper's stages per rank are not published: 2
            # assumed (126 layers with one fewer in the first and last stage fit 1, 2 or 4 stages per rank).
            "options": {
                "pp_schedule": "interleaved_1f1b",
                "pp_microbatches": rows,
                "pp_stages_per_rank": 2,
                "cp_backend": "ring",
            },
            "seq_len": seq,
            "micro_batch_size": rows,
            "global_batch_size": rows * dp,
            # No activation checkpointing at 8K (paper, 3.3.2); FSDP without resharding after forward; fp32
            # gradient reduce-scatter.
            "memory": {"param_dtype": "bf16", "reduce_dtype": "fp32", "reshard_after_forward": False},
            "kernels": "llama3",
            "published_tflops_per_gpu": tflops,
            "required": required,
            "source": "Dubey et al. 2024, The Llama 3 Herd of Models, Table 4",
        }
        for name, gpus, dp, cp, seq, rows, tflops, mfu, required in (
            ("TP8 x PP16 x DP128, 8K", 16384, 128, 1, 8192, 16, 400, 41, True),
            ("TP8 x PP16 x DP64, 8K", 8192, 64, 1, 8192, 32, 430, 43, False),
            ("TP8 x CP16 x PP16 x DP8, 128K", 16384, 8, 16, 131072, 16, 380, 38, False),
        )
    ),
)

#: Published runs the fit does not use, shown next to it: long sequences with context parallelism, where
#: attention dominates (torchtitan Table 2: Llama-3.1-8B, 8 H100, compile + float8, full AC, local batch 1).
VALIDATION: tuple[dict[str, Any], ...] = tuple(
    {
        "name": f"torchtitan Llama-3.1-8B FSDP{fsdp} x CP{cp} at {seq // 1024}K, 8 H100, compile + float8",
        "model": "Llama-3.1-8B",
        "gpus": 8,
        "layout": {"dp_shard_size": fsdp, "cp_size": cp},
        "options": {"cp_backend": "ring"},
        "seq_len": seq,
        "micro_batch_size": 1,
        "global_batch_size": fsdp,
        "memory": {"activation_checkpointing": "full", "param_dtype": "bf16", "reduce_dtype": "fp32"},
        "kernels": "compile_float8",
        "published_tokens_per_s_per_gpu": tps,
        "source": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 2 (FSDP + CP + compile + Float8)",
    }
    for fsdp, cp, seq, tps in ((8, 1, 32768, 3890), (4, 2, 65536, 2540), (2, 4, 131072, 1071), (1, 8, 262144, 548))
)


def calibration_cluster(run: dict[str, Any], mfu: float | None = None) -> Cluster:
    """The cluster a calibration run used (H100 SXM figures; torchtitan's were 500 W HBM2e parts)."""
    return Cluster(GPUS[run.get("gpu", "H100")], gpus=run["gpus"], gpus_per_node=run.get("gpus_per_node", 8), mfu=mfu)


def predict(run: dict[str, Any], efficiency: float | None = None) -> StepTime:
    """The step-time model's estimate for a calibration run (at ``efficiency``, else its class's)."""
    from lightning_plugins.planner.model_stats import load_model_config

    stats = model_stats(load_model_config(run["model"]))
    cluster = calibration_cluster(run)
    kernels = KERNELS[run["kernels"]]
    if efficiency is not None:
        kernels = replace(kernels, efficiency=efficiency)
    layout = ParallelLayout(**run["layout"]).resolve(run["gpus"])
    recompute = torchtitan_op_sac(stats) if run.get("recompute") == "torchtitan_op_sac" else None
    return estimate_step_time(
        stats,
        layout,
        ParallelOptions(**run.get("options", {})),
        MemoryOptions(**run.get("memory", {})),
        cluster,
        seq_len=run["seq_len"],
        micro_batch_size=run["micro_batch_size"],
        global_batch_size=run["global_batch_size"],
        kernels=kernels,
        async_tp=run.get("async_tp", False),
        recompute_fraction=recompute,
    )


def published_tokens_per_s(run: dict[str, Any]) -> float:
    """The run's published tokens/s/GPU (a TFLOP/s figure is converted with this model's FLOPs per token)."""
    if "published_tokens_per_s_per_gpu" in run:
        return float(run["published_tokens_per_s_per_gpu"])
    from lightning_plugins.planner.model_stats import load_model_config

    stats = model_stats(load_model_config(run["model"]))
    return run["published_tflops_per_gpu"] * 1e12 / stats.flops_per_token(run["seq_len"])


def implied_efficiency(run: dict[str, Any]) -> float:
    """The efficiency at which the model reproduces ``run`` exactly (bisection; throughput rises with it)."""
    target = published_tokens_per_s(run)
    low, high = 0.01, 1.0
    for _ in range(40):
        mid = (low + high) / 2
        if predict(run, mid).tokens_per_s_per_gpu < target:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def fit_efficiencies(runs: tuple[dict[str, Any], ...] = CALIBRATION) -> dict[str, float]:
    """One efficiency per kernels class: the geometric mean of its runs' implied efficiencies.

    Classes whose attention runs at another class's efficiency are fitted after that class (the fit is
    applied to :data:`KERNELS` while it runs and restored afterwards).
    """
    saved = dict(KERNELS)
    fitted: dict[str, float] = {}
    order = sorted({run["kernels"] for run in runs}, key=lambda name: KERNELS[name].attention is not None)
    try:
        for name in order:
            implied = [implied_efficiency(run) for run in runs if run["kernels"] == name]
            fitted[name] = math.exp(sum(map(math.log, implied)) / len(implied))
            KERNELS[name] = replace(KERNELS[name], efficiency=fitted[name])
    finally:
        KERNELS.clear()
        KERNELS.update(saved)
    return fitted


def calibration_table(runs: tuple[dict[str, Any], ...] = CALIBRATION) -> list[dict[str, Any]]:
    """Each run: published and predicted tokens/s/GPU, their ratio, MFU, the efficiency and bubble used."""
    rows = []
    for run in runs:
        step = predict(run)
        published = published_tokens_per_s(run)
        rows.append(
            {
                "name": run["name"],
                "kernels": run["kernels"],
                "published_tokens_per_s_per_gpu": published,
                "predicted_tokens_per_s_per_gpu": step.tokens_per_s_per_gpu,
                "ratio": step.tokens_per_s_per_gpu / published,
                "predicted_mfu": step.mfu,
                "efficiency": step.efficiency,
                "bubble": step.bubble,
                "exposed_comm_share": step.exposed_comm_s / step.step_s,
                "required": bool(run.get("required")),
                "source": run["source"],
            }
        )
    return rows


def format_calibration(rows: list[dict[str, Any]]) -> str:
    """The calibration table as text."""
    lines = [f"{'run':<74} {'published':>10} {'predicted':>10} {'ratio':>6} {'MFU':>6} {'bubble':>7}"]
    for row in rows:
        lines.append(
            f"{row['name']:<74} {row['published_tokens_per_s_per_gpu']:>10,.0f}"
            f" {row['predicted_tokens_per_s_per_gpu']:>10,.0f} {row['ratio']:>6.2f} {row['predicted_mfu']:>6.1%}"
            f" {row['bubble']:>7.1%}"
        )
    return "\n".join(lines)


def print_calibration(refit: bool = False) -> None:
    """Print the calibration (and, with ``refit``, the efficiencies the runs imply next to :data:`KERNELS`'s)."""
    if refit:
        fitted = fit_efficiencies()
        print("refitted efficiencies:", {k: round(v, 3) for k, v in fitted.items()})
        print("KERNELS efficiencies: ", {k: v.efficiency for k, v in KERNELS.items()})
    print(format_calibration(calibration_table()))
    print("Not fitted (long sequences, context parallel):")
    print(format_calibration(calibration_table(VALIDATION)))
