"""One pipeline rank's optimizer step, in seconds: its compute and recomputation, each dimension's communication,
and what overlap leaves exposed (the model :mod:`lightning_plugins.planner.timing` describes and sums).

Each dimension's communication is a function of its own (:func:`tensor_comm`, :func:`context_comm`, ...), given
the rank's work (:class:`RankWork`): what every dimension reads (its layers, tokens, activations, recomputed share)
worked out once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning_plugins.parallel.options import MemoryOptions
from lightning_plugins.planner.assumptions import (
    ASYNC_TP_HIDDEN,
    HOST_ADAM_PARAMS_PER_S,
    QLORA_SLOWDOWN,
    SELECTIVE_RECOMPUTE,
)
from lightning_plugins.planner.attention_kernels import attention_seconds_per_token
from lightning_plugins.planner.hardware import Cluster
from lightning_plugins.planner.model_stats import NF4_BYTES_PER_PARAM, ModelStats
from lightning_plugins.planner.step_shape import StepShape

#: The linears of a dense gated MLP (a MoE's shared expert's too), which the tiled MLP computes once more in backward.
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
#: The dimensions whose communication is counted, in the order they are reported.
DIMENSIONS = ("fsdp", "tp", "cp", "pp", "dp_replicate", "offload", "ep")


@dataclass(frozen=True)
class VisionCompute:
    """An image-text model's image path, for the step time (:meth:`~lightning_plugins.planner.image_text.ImageInputs.
    compute`): one image's forward FLOPs through the vision blocks (``blocks`` of them), the rest of the tower (patch
    embedding) and the projector, the images in a row, and which parts' own weights train. Counted at the matmuls'
    efficiency, attention included (the tower's attention is a small share: its sequences are one image's patches).

    Every rank of the first pipeline stage runs the whole image path on all of its data rank's images: the tower is
    replicated over tensor-parallel ranks and runs before the sequence is sharded over context-parallel ones.
    """

    block_flops: float
    tower_flops: float
    projector_flops: float
    blocks: int
    images_per_row: int
    tower_trains: bool
    projector_trains: bool

    def training_flops(self) -> float:
        """One image's FLOPs forward and backward: a trained part 3 forwards (its input and weight gradients); a frozen
        projector after a trained tower 2 (the input gradients the tower needs); a frozen tower 1 (forward only, no
        gradient reaches it), and a frozen projector before the language model only 1 too."""
        tower = (3.0 if self.tower_trains else 1.0) * (self.block_flops + self.tower_flops)
        projector = 3.0 if self.projector_trains else 2.0 if self.tower_trains else 1.0
        return tower + projector * self.projector_flops

    def forward_flops(self) -> float:
        """One image's forward FLOPs (a forward without backward: DPO's reference)."""
        return self.block_flops + self.tower_flops + self.projector_flops

    def recomputed_flops(self, share: float) -> float:
        """One image's recomputed FLOPs: activation checkpointing checkpoints trained vision blocks in the decoder
        layers' mode (under TP too), ``share`` of their forward."""
        return share * self.block_flops if self.tower_trains else 0.0


@dataclass(frozen=True)
class RankWork:
    """What one pipeline rank (any data/TP/CP rank of it: they do the same work) computes per optimizer step.

    Attributes:
        layers: Decoder layers of the rank's stages.
        first: Whether the rank holds the embedding.
        last: Whether it holds the norm and ``lm_head``.
        forwards: Micro-batches it runs per optimizer step.
        tokens: Tokens its CP/TP group computes per step.
        act: Bytes of its tokens' bf16 activations at one layer boundary, per step.
        rec: Share of a layer's forward recomputed in backward.
        attn_fwd: Seconds per token of one layer's attention forward.
        compute: Seconds of model FLOPs (forward and backward).
        recompute: Seconds of recomputation.
        ref: Forwards of the reference per micro-batch (DPO: 1, no backward; else 0), counted in ``compute``.
        vision: Seconds of the image path (first stage; counted in ``compute`` and ``recompute``).
    """

    layers: int
    first: bool
    last: bool
    forwards: int
    tokens: float
    act: float
    rec: float
    attn_fwd: float
    compute: float
    recompute: float
    ref: float = 0.0
    vision: float = 0.0

    @property
    def busy(self) -> float:
        """Seconds of compute that communication can hide behind."""
        return self.compute + self.recompute


def rank_work(
    stats: ModelStats,
    shape: StepShape,
    memory: MemoryOptions,
    cluster: Cluster,
    efficiencies: tuple[float, float],
    method: str,
    lora_layer: int,
    recompute_fraction: float | None,
    pp_rank: int,
    vision: VisionCompute | None = None,
) -> RankWork:
    """The compute of pipeline rank ``pp_rank``, and what its communication is sized by."""
    t = shape.layout.tp_size
    layers, first, last = shape.stage_layers[pp_rank]
    forwards = shape.accumulation * shape.microbatches  # micro-batches this rank runs per optimizer step
    tokens = shape.tokens_per_microbatch * forwards  # tokens this rank's CP/TP group computes per step
    rate = cluster.gpu.peak_flops * efficiencies[0]
    attn_rate = cluster.gpu.peak_flops * efficiencies[1]
    slowdown = QLORA_SLOWDOWN if method == "qlora" else 1.0

    # Seconds per token of one layer's forward, matmuls and attention; training runs the matmuls 3x (full) or
    # 2x (frozen base: no weight gradients), attention 3x. Attention is the layers' mean, each layer on the kernel its
    # CP backend runs it on (attention_kernels: sliding windows count their band where the kernel skips the rest).
    attn_fwd = attention_seconds_per_token(stats, shape.seq_len, shape.cp_backend, shape.layout.cp_size, attn_rate)
    attn_fwd /= stats.num_layers
    mm_fwd = 2.0 * stats.layer_active_matmul_params / rate
    mm_factor = 3.0 if method == "full" else 2.0
    layer_time = mm_factor * mm_fwd + 3.0 * attn_fwd + 6.0 * lora_layer / rate
    head_time = mm_factor * 2.0 * stats.vocab_size * stats.hidden_size / rate if last else 0.0
    compute = tokens / t * (layers * layer_time + head_time) * slowdown
    ref = float(shape.no_grad_forwards)  # forwards without backward (DPO's reference): matmuls, attention, head
    compute += ref * tokens / t * (layers * (mm_fwd + attn_fwd) + head_time / mm_factor) * slowdown
    rec = _recompute_share(memory, layers, recompute_fraction)
    tiled = 2.0 * _mlp_matmul_params(stats) / rate if memory.mlp_chunk_tokens else 0.0  # each tile's forward again
    recompute = tokens / t * layers * (rec * (mm_fwd + attn_fwd) + tiled) * slowdown
    act = tokens * stats.hidden_size * 2.0  # bf16 activations of this rank's tokens, one layer boundary, per step
    seen = 0.0
    if vision is not None and first:  # the image path: every image of the data rank's rows, on the first stage
        images = shape.accumulation * shape.micro_batch_size * vision.images_per_row
        trained = images * (vision.training_flops() + ref * vision.forward_flops()) / rate
        share = _recompute_share(memory, vision.blocks, None)  # the blocks are checkpointed in the layers' mode
        again = images * vision.recomputed_flops(share) / rate
        compute, recompute, seen = compute + trained, recompute + again, trained + again
    return RankWork(layers, first, last, forwards, tokens, act, rec, attn_fwd, compute, recompute, ref, seen)


def tensor_comm(
    work: RankWork, shape: StepShape, memory: MemoryOptions, cluster: Cluster, recompute_fraction: float | None,
    async_tp: bool, float8_tp: bool,
) -> tuple[float, float]:  # fmt: skip
    """Tensor parallelism's seconds: (all, exposed)."""
    t = shape.layout.tp_size
    _, bw = cluster.link(t)
    act = work.act
    gather = act * (0.5 if float8_tp and shape.sequence_parallel else 1.0)
    fwd = 2 * (t - 1) / t * (gather + act)  # 2 all-gathers + 2 reduce-scatters (or 2 all-reduces) per layer
    bwd = 4 * (t - 1) / t * act
    # Recomputation re-runs the layer's collectives too; op-level selective saves no collective output.
    op_level = recompute_fraction is None and memory.activation_checkpointing == "selective"
    rec_comm = 1.0 if op_level and memory.every_n_layers is None else work.rec
    # The vocab-parallel embedding output and the lm_head input: one collective each way per end.
    ends = 2 * (t - 1) / t * act * (int(work.first) + int(work.last)) * (1 + work.ref / 2)
    comm = (work.layers * (fwd + bwd + (rec_comm + work.ref) * fwd) + ends) / bw
    return comm, comm * (1 - ASYNC_TP_HIDDEN if async_tp else 1.0)


def context_comm(work: RankWork, stats: ModelStats, shape: StepShape, cluster: Cluster) -> tuple[float, float]:
    """Context parallelism's seconds: (all, exposed). Ring attention hides its passes behind the attention."""
    t, c = shape.layout.tp_size, shape.layout.cp_size
    _, bw = cluster.link(c * t)
    tokens, layers, rec = work.tokens, work.layers, work.rec + work.ref  # the reference's forward: as recomputed
    kv = 2 * tokens * stats.num_kv_heads * stats.head_dim * 2.0 / t  # this rank's K and V, per layer
    if shape.cp_backend == "ring":
        per_layer = (c - 1) * kv * (1 + 2 + rec)  # forward passes, backward K/V + dK/dV, recompute
        comm = layers * per_layer / bw
        attention = tokens / t * layers * (3 + rec) * work.attn_fwd
        return comm, max(0.0, comm - attention)
    q = tokens * stats.num_heads * stats.head_dim * 2.0 / t
    per_layer = (c - 1) / c * (2 * q + kv) * (2 + rec)  # q, k, v in and the output back; backward alike
    comm = layers * per_layer / bw
    return comm, comm


def expert_comm(work: RankWork, stats: ModelStats, shape: StepShape, cluster: Cluster) -> float:
    """Expert parallelism's seconds, all exposed: the dispatch and combine all-to-alls."""
    t, e = shape.layout.tp_size, shape.layout.ep_size
    _, bw = cluster.link(t * e)
    rows = work.tokens / t * stats.experts_per_token  # routed (token, expert) rows of this rank, per step
    per_layer = 2 * (e - 1) / e * rows * stats.hidden_size * 2.0  # dispatch + combine, bf16
    return work.layers * per_layer * (2 + work.rec + work.ref) / bw  # forward, backward, recomputation, reference


def pipeline_comm(work: RankWork, shape: StepShape, cluster: Cluster) -> tuple[float, float]:
    """Pipeline parallelism's seconds: (all, exposed: the fill and the drain)."""
    layout = shape.layout
    t, p = layout.tp_size, layout.pp_size
    _, bw = cluster.link(layout.world_size)
    boundary = work.act / work.forwards / (t if shape.sequence_parallel and t > 1 else 1)  # one micro-batch's activation
    comm = 2 * work.forwards * shape.stages_per_rank * boundary / bw
    return comm, 2 * (p - 1) * boundary / bw * shape.accumulation


@dataclass(frozen=True)
class RankBytes:
    """What data parallelism and offloading move for one rank, per optimizer step.

    Attributes:
        params: Parameters the rank holds, unsharded by data parallelism.
        routed: Routed experts' parameters of the rank's layers (before expert parallelism).
        stored: Bytes of ``params`` as stored.
        gathered: Bytes of ``params`` as gathered (float8 linears gather at one byte).
        trainable: Parameters trained on the rank.
        grad_bytes: Bytes of their gradients as reduced.
        gathers: All-gathers of the parameters per step.
        reductions: Reductions of the gradients per step.
    """

    params: float
    routed: float
    stored: float
    gathered: float
    trainable: float
    grad_bytes: float
    gathers: int
    reductions: int


def rank_bytes(
    work: RankWork, stats: ModelStats, shape: StepShape, memory: MemoryOptions, method: str, lora_layer: int,
    float8_weights: bool,
) -> RankBytes:  # fmt: skip
    """The bytes one rank's data parallelism gathers and reduces, and how often."""
    layout = shape.layout
    t, e, p, layers = layout.tp_size, layout.ep_size, layout.pp_size, work.layers
    routed = layers * stats.expert_params  # replicated over TP; EP x the experts' FSDP2 group shard them
    params = (
        layers * (stats.layer_params - stats.expert_params)
        + (stats.embedding_params if work.first else 0)
        + (stats.norm_params + stats.head_params if work.last else 0)
        + (stats.embedding_params if work.last and not work.first and stats.tied_embeddings else 0)
    ) / t + routed / e
    linear = layers * stats.layer_matmul_params / t
    weight_bytes = 4.0 if memory.param_dtype in ("fp32", "float32") else 2.0
    stored_linear = NF4_BYTES_PER_PARAM if method == "qlora" else weight_bytes
    stored = linear * stored_linear + (params - linear) * weight_bytes  # this rank's parameters, unsharded
    gathered = stored - linear * (stored_linear - 1.0) if float8_weights and method != "qlora" else stored
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
        # The reference's forward gathers once more, unless the policy's forward keeps the parameters gathered.
        gathers = shape.accumulation * ((2 + int(work.ref)) if memory.reshard_after_forward else 1)
    return RankBytes(params, routed, stored, gathered, trainable, grad_bytes, gathers, reductions)


def data_parallel_comm(
    work: RankWork, moved: RankBytes, shape: StepShape, cluster: Cluster, comm: dict[str, float],
    exposed: dict[str, float],
) -> None:  # fmt: skip
    """FSDP's and HSDP's seconds into ``comm`` and ``exposed``: overlapped with the compute but the first gather,
    the last reduction and what the compute cannot hide."""
    layout = shape.layout
    t, e = layout.tp_size, layout.ep_size
    fsdp_group = layout.dp_shard_size * layout.cp_size
    if fsdp_group > 1:
        _, bw = cluster.link(t * fsdp_group)
        share = (fsdp_group - 1) / fsdp_group
        if moved.routed:  # the experts' share of the bytes moves in groups of dp_shard x cp / ep (none when ep is all)
            experts_group = max(1, fsdp_group // e)
            expert_part = moved.routed / e / moved.params
            share = share * (1 - expert_part) + (experts_group - 1) / experts_group * expert_part
        comm["fsdp"] = share * (moved.gathers * moved.gathered + moved.reductions * moved.grad_bytes) / bw
    if layout.dp_replicate_size > 1:
        r = layout.dp_replicate_size
        _, bw = cluster.link(t * fsdp_group * r)
        comm["dp_replicate"] = moved.reductions * 2 * (r - 1) / r * moved.grad_bytes / fsdp_group / bw
    overlapped = comm["fsdp"] + comm["dp_replicate"]
    if overlapped:
        edge = overlapped / max(1, work.layers)
        spill = max(0.0, overlapped - edge - work.busy)
        total = edge + spill
        exposed["fsdp"] = total * comm["fsdp"] / overlapped
        exposed["dp_replicate"] = total * comm["dp_replicate"] / overlapped


def offload_comm(
    work: RankWork, moved: RankBytes, shape: StepShape, memory: MemoryOptions, cluster: Cluster, method: str
) -> tuple[float, float]:
    """CPU offload's and optimizer offload's seconds: (all, exposed); (0, 0) without either."""
    layout = shape.layout
    fsdp_group = layout.dp_shard_size * layout.cp_size
    comm = exposed = 0.0
    if memory.cpu_offload:
        moved_bytes = moved.gathers * moved.stored + moved.reductions * moved.grad_bytes
        transfer = moved_bytes / fsdp_group / cluster.gpu.pcie_bytes_per_s
        optimizer = moved.trainable / fsdp_group / HOST_ADAM_PARAMS_PER_S
        comm = transfer + optimizer
        edge = transfer / max(1, work.layers)
        exposed = edge + max(0.0, transfer - edge - work.busy) + optimizer
    if memory.optimizer_offload:
        # Full fine-tunes with FSDP2 mixed precision keep fp32 master weights, LoRA fp32 adapters; gradients match.
        weight_bytes = 4.0 if memory.param_dtype in ("fp32", "float32") else 2.0
        master = 4.0 if method != "full" or memory.param_dtype is not None else weight_bytes
        shard = moved.trainable / fsdp_group
        transfer = 2 * shard * master / cluster.gpu.pcie_bytes_per_s  # gradients to the host, parameters back
        optimizer = shard / HOST_ADAM_PARAMS_PER_S
        comm = exposed = transfer + optimizer
    return comm, exposed


def rank_time(
    stats: ModelStats,
    shape: StepShape,
    memory: MemoryOptions,
    cluster: Cluster,
    float8_weights: bool,
    efficiencies: tuple[float, float],
    method: str,
    lora_layer: int,
    async_tp: bool,
    recompute_fraction: float | None,
    pp_rank: int,
    *,
    float8_tp: bool = False,
    vision: VisionCompute | None = None,
) -> dict[str, Any]:
    """Time of pipeline rank ``pp_rank`` (any data/TP/CP rank of it: they do the same work): ``step``, ``compute``,
    ``recompute``, ``comm`` and ``exposed`` (seconds per dimension), ``bubble_s``, ``vision`` (the image path's
    seconds, in ``compute`` and ``recompute``)."""
    layout = shape.layout
    work = rank_work(stats, shape, memory, cluster, efficiencies, method, lora_layer, recompute_fraction, pp_rank,
                     vision)  # fmt: skip
    comm: dict[str, float] = {k: 0.0 for k in DIMENSIONS}
    exposed = dict(comm)
    if layout.tp_size > 1:
        comm["tp"], exposed["tp"] = tensor_comm(work, shape, memory, cluster, recompute_fraction, async_tp, float8_tp)
    if layout.cp_size > 1:
        comm["cp"], exposed["cp"] = context_comm(work, stats, shape, cluster)
    if layout.ep_size > 1 and stats.is_moe:
        comm["ep"] = exposed["ep"] = expert_comm(work, stats, shape, cluster)
    if layout.pp_size > 1:
        comm["pp"], exposed["pp"] = pipeline_comm(work, shape, cluster)
    moved = rank_bytes(work, stats, shape, memory, method, lora_layer, float8_weights)
    data_parallel_comm(work, moved, shape, cluster, comm, exposed)
    if memory.cpu_offload or memory.optimizer_offload:
        comm["offload"], exposed["offload"] = offload_comm(work, moved, shape, memory, cluster, method)

    in_pipeline = work.busy + exposed["tp"] + exposed["cp"] + exposed["ep"]
    bubble = shape.bubble_fraction()
    bubble_s = in_pipeline * bubble / (1 - bubble)
    step = in_pipeline + bubble_s + exposed["pp"] + exposed["fsdp"] + exposed["dp_replicate"] + exposed["offload"]
    return {
        "step": step,
        "compute": work.compute,
        "recompute": work.recompute,
        "comm": comm,
        "exposed": exposed,
        "bubble_s": bubble_s,
        "vision": work.vision,
    }


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
