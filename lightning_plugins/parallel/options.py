"""How the layout is applied (``ParallelOptions``) and what memory levers are pulled (``MemoryOptions``).

Each setting is defined once, here. The same frozen objects are the recipe's ``parallel:`` and
``memory:`` sections (pydantic validates them by their type hints and rejects unknown keys), the
arguments of :func:`lightning_plugins.parallelize`, and what the Lightning strategies and the
Accelerate door hold, so a new setting added here reaches every door.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from lightning_plugins.errors import OptionsError
from lightning_plugins.parallel.dtypes import MIXED_PRECISION_DTYPES

@dataclass(frozen=True)
class ScheduleSpec:
    """What the engine needs to know of a pipeline schedule: torch's class and how it places stages."""

    cls: type
    multi: bool  # several stages per rank
    v_shape: bool  # stage s on rank s for s < pp, then back: rank 0 holds the first and the last stage
    split_backward: bool = False  # input and weight gradients in separate passes (zero bubble)


#: Schedule names accepted by ``pp_schedule``.
SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(ScheduleGPipe, multi=False, v_shape=False),
    "1f1b": ScheduleSpec(Schedule1F1B, multi=False, v_shape=False),
    "interleaved_1f1b": ScheduleSpec(ScheduleInterleaved1F1B, multi=True, v_shape=False),
    "looped_bfs": ScheduleSpec(ScheduleLoopedBFS, multi=True, v_shape=False),
    "interleaved_zero_bubble": ScheduleSpec(ScheduleInterleavedZeroBubble, multi=True, v_shape=False, split_backward=True),
    "zbv_zero_bubble": ScheduleSpec(ScheduleZBVZeroBubble, multi=True, v_shape=True, split_backward=True),
    "dualpipev": ScheduleSpec(ScheduleDualPipeV, multi=True, v_shape=True, split_backward=True),
}


def check_schedule(pp_schedule: Any) -> str:
    """The pipeline schedule's name, in lower case.

    Raises:
        OptionsError: for a name that is not in :data:`SCHEDULES`, naming those that are.
    """
    name = pp_schedule.lower() if isinstance(pp_schedule, str) else pp_schedule
    if name not in SCHEDULES:
        raise OptionsError(
            f"pp_schedule={pp_schedule!r} is not a known pipeline schedule. Use one of {sorted(SCHEDULES)}"
            " (e.g. pp_schedule='1f1b')."
        )
    return name


#: Context-parallel attention backends.
CP_BACKENDS = ("ulysses", "ring")
#: Activation checkpointing modes.
CHECKPOINTING_MODES = ("none", "full", "selective")
#: dtype names accepted for FSDP2 mixed precision.
DTYPE_NAMES = tuple(MIXED_PRECISION_DTYPES)


@dataclass(frozen=True)
class ParallelOptions:
    """How each parallel dimension is applied.

    Args:
        sequence_parallel: With TP: shard norms and the residual stream along the sequence.
        loss_parallel: With TP: cross entropy on vocab-sharded logits, never gathering them.
        cp_backend: With ``cp_size > 1``: ``"ulysses"`` (all-to-all over heads) or ``"ring"`` (K/V around
            the ring, online softmax; no head constraint).
        pp_schedule: With ``pp_size > 1``: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"looped_bfs"``,
            ``"interleaved_zero_bubble"``, ``"zbv_zero_bubble"`` or ``"dualpipev"``.
        pp_microbatches: Micro-batches per pipeline step; ``None`` takes the number of stages.
        pp_stages_per_rank: Stages per rank; ``None`` takes 1 (2 for interleaved and V-shaped schedules).
        compile: ``torch.compile`` each decoder layer (after TP and activation checkpointing, before FSDP2, as
            torchtitan does); not with pipeline or context parallelism, nor mixture-of-experts layers.
        float8: float8 linear layers (torchao, tensorwise scaling; FSDP2 all-gathers the weights in float8):
            needs ``compile`` and a GPU of compute capability 8.9 or newer (H100, L4, RTX 4090).
        async_tp: With TP: micro-pipeline the tensor-parallel collectives with the matmuls (inductor's
            ``_micro_pipeline_tp`` with symmetric memory): needs ``compile`` and NCCL GPUs.
    """

    sequence_parallel: bool = True
    loss_parallel: bool = True
    cp_backend: str = "ulysses"
    pp_schedule: str = "1f1b"
    pp_microbatches: int | None = None
    pp_stages_per_rank: int | None = None
    compile: bool = False
    float8: bool = False
    async_tp: bool = False

    def __post_init__(self) -> None:
        for name in ("compile", "float8", "async_tp"):
            if not isinstance(getattr(self, name), bool):
                raise OptionsError(f"{name} must be true or false, got {getattr(self, name)!r}.")
        for name in ("float8", "async_tp"):
            if getattr(self, name) and not self.compile:
                raise OptionsError(
                    f"{name}=True needs compile=True: its kernels are generated by torch.compile (eager {name} runs"
                    " slower than bf16). Set compile=True as well, or leave it off."
                )
        if self.cp_backend not in CP_BACKENDS:
            raise OptionsError(
                f"cp_backend={self.cp_backend!r} is not a context-parallel backend; use one of {CP_BACKENDS}."
            )
        object.__setattr__(self, "pp_schedule", check_schedule(self.pp_schedule))
        for name in ("pp_microbatches", "pp_stages_per_rank"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise OptionsError(f"{name} must be a positive integer or None, got {value!r}.")


@dataclass(frozen=True)
class MemoryOptions:
    """Memory levers: activation checkpointing and offload, FSDP2 mixed precision, CPU and optimizer offload, resharding.

    Args:
        activation_checkpointing: ``"none"``, ``"full"`` (each layer keeps only its input) or
            ``"selective"`` (op-level: matmul and attention outputs kept; or every N-th layer, see below).
        every_n_layers: With ``"selective"``: checkpoint every N-th layer fully instead of op-level.
        param_dtype: FSDP2 compute dtype (``"bf16"``, ``"fp32"``); ``None`` keeps the parameters' dtype.
        reduce_dtype: FSDP2 gradient-reduction dtype; ``None`` follows ``param_dtype``.
        cpu_offload: FSDP2 ``CPUOffloadPolicy``: sharded parameters, gradients and optimizer state on the
            host (pinned on GPUs; unpinned on CPU, where the path still runs).
        reshard_after_forward: FSDP2 ZeRO-3 (``True``) or keep parameters gathered until backward.
        optimizer_offload: The optimizer's state and step on the host, parameters and gradients on the GPU
            (DeepSpeed ZeRO-Offload style; :class:`lightning_plugins.parallel.optim.offload.HostOffloadOptimizer`): saves AdamW's
            8 bytes per trainable fp32 parameter of GPU memory for a host copy of parameters, gradients and
            state, and costs a gradient and a parameter transfer over PCIe plus a host AdamW per step. Applied
            where the optimizer is built (``make_optimizer``; your own: ``lightning_plugins.parallel.optim.offload.offload_optimizer``).
            Not with ``cpu_offload``, which already keeps the optimizer on the host.
        activation_offload: Saved activations of each decoder layer moved to host memory during forward and
            back in backward (pinned on GPUs; on CPU the copies still run). With ``activation_checkpointing``
            only what checkpointing keeps (a fully checkpointed layer's input) moves.
        pp_reshard_per_microbatch: Under pipeline parallelism with FSDP2: reshard each stage's parameters after
            every micro-batch's backward and reduce-scatter its gradients then, accumulating sharded gradients,
            instead of torch's default of keeping the stage's parameters and fp32 gradients unsharded from the first
            micro-batch's backward to the last (the stage's whole unsharded gradient size). Trade-off: one
            all-gather (forward; again in backward with ``reshard_after_forward``) and one reduce-scatter per layer
            per micro-batch instead of per step. Not with zero-bubble schedules (their weight pass needs the
            parameters gathered until then).
        loss_chunk_tokens: Chunked cross entropy: a training forward with labels computes the loss from the final
            hidden states this many tokens at a time and never builds the ``[tokens, vocab]`` logits (backward
            recomputes each chunk's; :mod:`lightning_plugins.parallel.memory.chunked_loss`); ``outputs.logits`` is then
            empty. ``None`` or ``0``: off (full logits, as transformers computes them).
        mlp_chunk_tokens: Tiled MLP: each dense MLP of the decoder computed this many tokens at a time, saving only its
            input and recomputing each tile in backward, so its intermediate-width tensors exist for one tile at a
            time; one more MLP forward per step (:mod:`lightning_plugins.parallel.memory.tiled_mlp`). Not with
            ``tp_size > 1`` or ``compile``. ``None`` or ``0``: off.
        efficient_norms: RMSNorms of a known form (Llama's, OLMo 2's, Gemma's) computed bit-identically but saving
            only their input and the fp32 ``rstd`` per row for backward, not fp32 copies of the activation
            (:mod:`lightning_plugins.parallel.memory.norms`).
        efficient_mlp: Gated MLPs of a known form (SwiGLU/GeGLU: Llama's ``down_proj(act_fn(gate_proj(x)) *
            up_proj(x))``, Phi-3's fused ``gate_up_proj``) computed bit-identically but saving ``gate`` and ``up`` only,
            recomputing the activation in backward: one intermediate-width tensor less per layer
            (:mod:`lightning_plugins.parallel.memory.gated_mlp`).
        sp_regather: With sequence parallelism: each region (attention, MLP) keeps its input's sequence shard for
            backward and all-gathers it again there, instead of keeping the gathered input (one more all-gather per
            region and step; :mod:`lightning_plugins.parallel.memory.regather`). Not with activation checkpointing or
            activation offload, which already decide what a layer keeps.
        optimizer_in_backward: Each parameter's optimizer step runs in backward as soon as its gradient is ready, and
            the gradient is freed (:mod:`lightning_plugins.parallel.optim.optim_in_backward`): a step never holds all the
            gradients. Applied where the optimizer is built (``make_optimizer``; your own:
            ``lightning_plugins.parallel.optim.optim_in_backward.step_in_backward``). Not with gradient clipping, gradient
            accumulation, or pp/tp/cp/ep > 1.
    """

    activation_checkpointing: str = "none"
    every_n_layers: int | None = None
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    cpu_offload: bool = False
    reshard_after_forward: bool = True
    optimizer_offload: bool = False
    activation_offload: bool = False
    pp_reshard_per_microbatch: bool = False
    loss_chunk_tokens: int | None = 512
    mlp_chunk_tokens: int | None = None
    efficient_norms: bool = True
    efficient_mlp: bool = True
    sp_regather: bool = False
    optimizer_in_backward: bool = False

    def __post_init__(self) -> None:
        for name, off in (("loss_chunk_tokens", "the loss from full logits"), ("mlp_chunk_tokens", "the MLP whole")):
            chunk = getattr(self, name)
            if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 0):
                raise OptionsError(
                    f"{name}={chunk!r} must be a number of tokens (e.g. 1024), or 0/None to compute {off}."
                )
        if self.activation_checkpointing not in CHECKPOINTING_MODES:
            raise OptionsError(
                f"activation_checkpointing={self.activation_checkpointing!r} is not one of {CHECKPOINTING_MODES}."
            )
        if self.every_n_layers is not None and (
            self.activation_checkpointing != "selective"
            or not isinstance(self.every_n_layers, int)
            or self.every_n_layers < 1
        ):
            raise OptionsError(
                f"every_n_layers={self.every_n_layers!r} needs activation_checkpointing='selective' and a positive integer."
            )
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if isinstance(value, str) and value not in DTYPE_NAMES:
                raise OptionsError(
                    f"Unknown dtype {name}={value!r} for mixed precision; use one of {sorted(DTYPE_NAMES)}."
                )
        for name in ("optimizer_offload", "activation_offload", "pp_reshard_per_microbatch", "efficient_norms", "efficient_mlp", "sp_regather", "optimizer_in_backward"):
            if not isinstance(getattr(self, name), bool):
                raise OptionsError(f"{name} must be true or false, got {getattr(self, name)!r}.")
        if self.sp_regather and (self.activation_checkpointing != "none" or self.activation_offload):
            raise OptionsError(
                "sp_regather cannot be combined with activation_checkpointing or activation_offload, which already"
                " decide what each layer keeps for backward (a checkpointed layer keeps only its input). Use"
                " sp_regather with activation_checkpointing='none' and activation_offload=False, or drop sp_regather."
            )
        if self.optimizer_offload and self.cpu_offload:
            raise OptionsError(
                "optimizer_offload and cpu_offload cannot be combined: cpu_offload (FSDP2's CPUOffloadPolicy) already"
                " keeps the sharded parameters, gradients and optimizer state on the host and steps there. Keep"
                " cpu_offload alone to free the most GPU memory, or optimizer_offload alone to keep the parameters"
                " and gradients on the GPU."
            )

    @property
    def uses_fsdp_policy(self) -> bool:
        """Whether a setting needs FSDP2 (at least two data-parallel ranks)."""
        return self.cpu_offload or self.param_dtype is not None or self.reduce_dtype is not None


def with_settings(
    owner: str,
    options: ParallelOptions | None = None,
    memory: MemoryOptions | None = None,
    **settings: Any,
) -> tuple[ParallelOptions, MemoryOptions]:
    """``options`` and ``memory`` (defaults when ``None``) with individual fields overridden by ``settings``.

    Lets a door take either the objects or their fields as keyword arguments
    (``TensorParallelStrategy(sequence_parallel=False, activation_checkpointing="full")``).

    Raises:
        OptionsError: for a keyword that is no field of either object, naming the ones that are.
    """
    options, memory = options or ParallelOptions(), memory or MemoryOptions()
    names = {type(options): {f.name for f in fields(options)}, type(memory): {f.name for f in fields(memory)}}
    unknown = sorted(set(settings) - names[type(options)] - names[type(memory)])
    if unknown:
        raise OptionsError(
            f"{owner} got unknown setting(s) {unknown}. Settings are the fields of ParallelOptions"
            f" {sorted(names[type(options)])} and MemoryOptions {sorted(names[type(memory)])}."
        )
    options = replace(options, **{k: v for k, v in settings.items() if k in names[type(options)]})
    memory = replace(memory, **{k: v for k, v in settings.items() if k in names[type(memory)]})
    return options, memory
