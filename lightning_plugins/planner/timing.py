"""Step time of a layout: FLOPs at a calibrated efficiency, communication over stated links, the pipeline bubble.

The model, per optimizer step, for the slowest rank (pipeline stages differ: the last one runs ``lm_head``):

* **Compute.** Model FLOPs (:meth:`ModelStats.flops_per_token`: ``6N`` plus attention; ``4N`` for the frozen
  base of LoRA) divided by ``peak x efficiency``; an image-text model's first stage adds its image path's
  (:class:`~lightning_plugins.planner.rank_time.VisionCompute`: each image's measured forward FLOPs through the vision
  tower and the projector, 3x where a part trains, 1x for a frozen tower, its checkpointed blocks recomputed). The
  efficiency is calibrated, one per class of kernels (:data:`KERNELS`), against published runs (:data:`CALIBRATION`).
  Recomputation adds forward FLOPs: full checkpointing one more forward of every layer, ``every_n_layers`` of every
  N-th, op-level selective the elementwise ops (:data:`SELECTIVE_RECOMPUTE`); the tiled MLP (``mlp_chunk_tokens``) one
  more forward of each dense MLP (:data:`~lightning_plugins.planner.rank_time.MLP_LINEARS`). QLoRA's NF4
  dequantisation slows compute by :data:`QLORA_SLOWDOWN`.
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

from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_plugins.parallel.layout import ParallelLayout
from lightning_plugins.parallel.options import MemoryOptions, ParallelOptions
from lightning_plugins.planner.assumptions import SELECTIVE_RECOMPUTE, step_assumptions
from lightning_plugins.planner.hardware import Cluster
from lightning_plugins.planner.model_stats import TRAINABLE, ModelStats, model_stats
from lightning_plugins.errors import PlannerError
from lightning_plugins.planner.rank_time import VisionCompute, rank_time
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
        vision_s: The image path's compute and recomputation on that rank (in ``compute_s`` and ``recompute_s``).
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
    vision_s: float = 0.0

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
    no_grad_forwards: int = 0,
    vision: VisionCompute | None = None,
) -> StepTime:
    """Estimate one optimizer step of ``layout`` on ``cluster``.

    Args:
        config_or_stats: A transformers config, a :class:`ModelStats` or a config spec.
        layout: A resolved :class:`ParallelLayout` whose world size is ``cluster.gpus``.
        options: Sequence/loss parallel, CP backend, pipeline schedule and micro-batches.
        memory: Activation checkpointing, FSDP2 dtypes, CPU or optimizer offload, ``reshard_after_forward``.
        cluster: The GPUs and links.
        seq_len: Tokens per row.
        micro_batch_size: Rows per data rank per forward (under PP: what it splits into ``pp_microbatches``).
        global_batch_size: Rows per optimizer step over all data ranks (``dp_replicate x dp_shard``); a data
            rank accumulates ``global_batch_size // (micro_batch_size x data ranks)`` forwards.
        method: ``"full"``, ``"lora"`` or ``"qlora"``.
        lora: The :class:`~lightning_plugins.adapters.lora.LoraOptions` for LoRA/QLoRA; ``None``: their defaults.
        kernels: A key of :data:`KERNELS` (or a :class:`Kernels`): the calibrated efficiency class; ``None``
            follows ``options`` (:func:`kernels_for`). ``cluster.mfu`` overrides its efficiency.
        async_tp: Whether tensor-parallel collectives are micro-pipelined with the matmuls (hides
            :data:`ASYNC_TP_HIDDEN` of them); ``None`` follows ``options.async_tp``.
        recompute_fraction: Overrides the share of a checkpointed layer's forward that is recomputed (e.g.
            torchtitan's op-level policy, :func:`torchtitan_op_sac`); ``None`` follows ``memory``.
        float8_tp: With float8 kernels, whether the sequence-parallel all-gathers carry float8 activations
            (torchao's ``Float8ColwiseParallel``/``PrepareFloat8ModuleInput``, as torchtitan's calibrating runs use);
            ``False``: this engine's TP plans, which gather bf16 activations (the float8 cast follows the gather).
        no_grad_forwards: Forwards of every micro-batch without backward, beside the policy's own: DPO's reference 1
            (rows: a pair's two), KTO's 3 (the policy's of the KL rows, the reference's of the rows and KL rows).
        vision: An image-text model's image path (its images and their FLOPs): computed on the first stage.

    Raises:
        PlannerError: for an unresolved layout, a world size that is not the cluster's, an unknown method or
            kernels class, batch sizes that do not divide, or a layout the model cannot take.
    """
    stats = model_stats(config_or_stats)
    kern = _kernels(kernels_for(options) if kernels is None else kernels)
    async_tp = options.async_tp if async_tp is None else async_tp
    shape = StepShape.of(stats, layout, options, cluster, seq_len, micro_batch_size, global_batch_size,
                         no_grad_forwards)  # fmt: skip
    (method, lora), (efficiency, attention_efficiency) = _method(method, lora), _efficiencies(cluster, kern)
    lora_layer = stats.lora_params_per_layer(lora.target_modules, lora.r) if lora is not None else 0
    efficiencies, float8_tp = (efficiency, attention_efficiency), float8_tp and kern.float8
    ranks = [rank_time(stats, shape, memory, cluster, kern.float8, efficiencies, method, lora_layer, async_tp,
                       recompute_fraction, r, float8_tp=float8_tp, vision=vision) for r in range(layout.pp_size)]
    rank = ranks[worst := max(range(len(ranks)), key=lambda r: ranks[r]["step"])]
    tokens = shape.accumulation * micro_batch_size * layout.dp_size * seq_len
    tokens_per_s_per_gpu = tokens / (rank["step"] * layout.world_size)
    model_flops = _model_flops_per_token(stats, seq_len, method, stats.num_layers * lora_layer, vision)
    return StepTime(
        step_s=rank["step"],
        compute_s=rank["compute"],
        recompute_s=rank["recompute"],
        comm_s=rank["comm"],
        exposed_comm_s=sum(rank["exposed"].values()),
        bubble=rank["bubble_s"] / rank["step"],
        tokens_per_s_per_gpu=tokens_per_s_per_gpu,
        mfu=tokens_per_s_per_gpu * model_flops / cluster.gpu.peak_flops,
        assumptions=step_assumptions(shape, memory, cluster, kern, efficiency, method, async_tp, recompute_fraction,
                                     stats) + _vision_lines(vision),  # fmt: skip
        efficiency=efficiency,
        exposed_s=rank["exposed"],
        bottleneck_pp_rank=worst,
        vision_s=rank["vision"],
    )


def _model_flops_per_token(
    stats: ModelStats, seq_len: int, method: str, adapter_params: int, vision: VisionCompute | None
) -> float:
    """The model FLOPs (forward and backward, no recomputation) of a token: the language model's, and its row's images'
    (counted once per data rank, not the TP and CP ranks' copies) spread over the row's tokens."""
    flops = stats.flops_per_token(seq_len, trainable=method, adapter_params=adapter_params)
    return flops + (0.0 if vision is None else vision.images_per_row * vision.training_flops() / seq_len)


def _vision_lines(vision: VisionCompute | None) -> tuple[str, ...]:
    if vision is None:
        return ()
    tower = "trained" if vision.tower_trains else "frozen: forward only"
    projector = "trained" if vision.projector_trains else "frozen"
    return (
        f"image path: {vision.images_per_row} image(s) per row, {vision.forward_flops() / 1e9:,.1f} GFLOP forward"
        f" each (vision tower {(vision.block_flops + vision.tower_flops) / 1e9:,.1f}, {tower}; projector"
        f" {vision.projector_flops / 1e9:,.1f}, {projector}), measured; run whole on every TP and CP rank of the first"
        " stage, at the matmuls' efficiency",
    )


def _efficiencies(cluster: Cluster, kern: Kernels) -> tuple[float, float]:
    """The efficiency of the matmuls and of attention: the cluster's MFU if given, else the kernels' calibrated ones."""
    efficiency = cluster.mfu if cluster.mfu is not None else kern.efficiency
    attention_efficiency = efficiency
    if cluster.mfu is None and kern.attention is not None:
        attention_efficiency = KERNELS[kern.attention].efficiency
    return efficiency, attention_efficiency


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
