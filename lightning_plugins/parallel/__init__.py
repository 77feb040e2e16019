"""``parallelize``: turn a transformers causal LM into its parallel form, in one canonical order.

Order: pipeline split -> tensor/sequence parallel -> context parallel -> activation checkpointing ->
FSDP2 (each later step wraps what the earlier ones produced; FSDP2 must see the final DTensors).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_plugins.layout import MESH_DIM_NAMES, LayoutError, ParallelLayout
from lightning_plugins.models import ModelFamily, check_supported, decoder_layers, family_for
from lightning_plugins.parallel.activation import apply_activation_checkpointing
from lightning_plugins.parallel.context import apply_context_parallel, check_context_parallel, context_parallel_batch
from lightning_plugins.parallel.data import apply_fsdp, mixed_precision_policy, offload_policy
from lightning_plugins.parallel.grad import clip_grad_norm_, total_grad_norm
from lightning_plugins.parallel.loss import ParallelCausalLMLoss
from lightning_plugins.parallel.pipeline import PipelineOptions, apply_pipeline_parallel, check_pipeline_layout, pipeline_of
from lightning_plugins.parallel.tensor import apply_tensor_parallel

__all__ = [
    "parallelize",
    "mesh_of",
    "pipeline_of",
    "data_mesh",
    "fsdp_mesh",
    "clip_grad_norm_",
    "total_grad_norm",
    "context_parallel_batch",
]

_MESH_ATTR = "_lightning_plugins_mesh"


def parallelize(
    model: nn.Module,
    layout: ParallelLayout | DeviceMesh,
    *,
    sequence_parallel: bool = True,
    loss_parallel: bool = True,
    activation_checkpointing: str = "none",
    every_n_layers: int | None = None,
    param_dtype: str | torch.dtype | None = None,
    reduce_dtype: str | torch.dtype | None = None,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
    context_parallel_backend: str = "ulysses",
    pp_schedule: str = "1f1b",
    pp_microbatches: int | None = None,
    pp_stages_per_rank: int | None = None,
) -> nn.Module:
    """Apply the layout to ``model`` in place and return it.

    Args:
        model: A transformers causal LM, materialised or on the meta device (then load weights with
            :func:`lightning_plugins.loading.load_sharded_safetensors`).
        layout: A :class:`ParallelLayout` (resolved against the world size here) or a mesh built by
            :meth:`ParallelLayout.build_mesh`.
        sequence_parallel: Shard norms and the residual stream along the sequence (TP only).
        loss_parallel: Compute the loss on vocab-sharded logits without gathering them (TP only).
        activation_checkpointing: ``"none"``, ``"full"`` or ``"selective"`` (see ``every_n_layers``).
        every_n_layers: With ``"selective"``, checkpoint every N-th layer fully instead of op-level.
        param_dtype: FSDP2 compute dtype (e.g. ``"bf16"``); ``None`` keeps the parameters' dtype.
        reduce_dtype: FSDP2 gradient-reduction dtype (e.g. ``"fp32"``).
        cpu_offload: Keep sharded parameters, gradients and optimizer state on the CPU (FSDP2).
        reshard_after_forward: FSDP2's ZeRO-3 (``True``) or keep-gathered-until-backward (``False``).
        context_parallel_backend: With ``cp_size > 1``: ``"ulysses"`` (all-to-all over heads) or ``"ring"``
            (K/V around the ring); shard batches with :func:`context_parallel_batch`.
        pp_schedule: Pipeline schedule (``pp_size > 1``): ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``,
            ``"looped_bfs"``, ``"interleaved_zero_bubble"``, ``"zbv_zero_bubble"`` or ``"dualpipev"``.
        pp_microbatches: Micro-batches per pipeline step; ``None`` takes the number of stages.
        pp_stages_per_rank: Stages per rank; ``None`` takes 1 (2 for interleaved and V-shaped schedules).

    Returns:
        The same model, now holding DTensor parameters; its ``loss_function`` averages over valid tokens
        across all data ranks exactly as one process would. With ``pp_size > 1`` the model keeps only this
        rank's stages and ``model(**batch)`` runs forward and backward of the whole batch through the
        pipeline (see :func:`pipeline_of` and :mod:`lightning_plugins.parallel.pipeline`).

    Raises:
        LayoutError: for any invalid combination, before any collective runs.
    """
    check_supported(model)
    resolved = _resolve(layout)
    resolved.validate(getattr(model, "config", None))
    family = family_for(model, tensor_parallel=resolved.tp_size > 1)
    pipeline_options = None
    if resolved.pp_size > 1:
        options = PipelineOptions(pp_schedule, pp_microbatches, pp_stages_per_rank)
        pipeline_options = check_pipeline_layout(resolved, getattr(model, "config", None), options)
    check_context_parallel(
        getattr(model, "config", None), resolved.cp_size, resolved.tp_size, context_parallel_backend,
        pp_size=resolved.pp_size,
    )
    if (cpu_offload or param_dtype is not None or reduce_dtype is not None) and resolved.fsdp_size == 1:
        raise LayoutError(
            "cpu_offload, param_dtype and reduce_dtype are FSDP2 options and need at least 2 data-parallel ranks"
            " (dp_shard_size, dp_replicate_size or cp_size > 1); with one data rank, use a precision plugin instead."
        )
    # Validation is done: from here on collectives run (building the mesh creates process groups).
    mesh = layout if isinstance(layout, DeviceMesh) else resolved.build_mesh(_device_type())

    if pipeline_options is not None:
        _parallelize_pipeline(model, family, mesh, pipeline_options, sequence_parallel, loss_parallel,
                              activation_checkpointing, every_n_layers, param_dtype, reduce_dtype, cpu_offload,
                              reshard_after_forward)
        setattr(model, _MESH_ATTR, mesh)
        return model

    if resolved.tp_size > 1:
        apply_tensor_parallel(
            model, family, mesh["tp"], sequence_parallel=sequence_parallel, loss_parallel=loss_parallel
        )
    layers = decoder_layers(model, family)
    if resolved.cp_size > 1:
        apply_context_parallel(model, layers, mesh["cp"], context_parallel_backend)
    apply_activation_checkpointing(layers, activation_checkpointing, every_n_layers)
    fsdp = fsdp_mesh(mesh)
    if fsdp is not None:
        apply_fsdp(
            model,
            layers,
            fsdp,
            mp_policy=mixed_precision_policy(param_dtype, reduce_dtype),
            offload=offload_policy(cpu_offload, mesh.device_type),
            reshard_after_forward=reshard_after_forward,
        )
    model.loss_function = ParallelCausalLMLoss(data_mesh(mesh))
    setattr(model, _MESH_ATTR, mesh)
    return model


def _parallelize_pipeline(
    model: nn.Module,
    family: ModelFamily,
    mesh: DeviceMesh,
    options: PipelineOptions,
    sequence_parallel: bool,
    loss_parallel: bool,
    activation_checkpointing: str,
    every_n_layers: int | None,
    param_dtype: str | torch.dtype | None,
    reduce_dtype: str | torch.dtype | None,
    cpu_offload: bool,
    reshard_after_forward: bool,
) -> None:
    """The same order per stage: split -> TP/SP -> AC -> FSDP2 (each stage module is its own root)."""
    tp = mesh["tp"]
    tensor_parallel = sequence_mesh = fully_shard_stage = None
    if tp.size() > 1:
        tensor_parallel = partial(
            apply_tensor_parallel, family=family, tp_mesh=tp, sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel,
        )
        sequence_mesh = tp if sequence_parallel and family.sequence_parallel else None
    policy = mixed_precision_policy(param_dtype, reduce_dtype)
    fsdp = fsdp_mesh(mesh)
    if fsdp is not None:
        fully_shard_stage = partial(
            apply_fsdp, mesh=fsdp, mp_policy=policy, offload=offload_policy(cpu_offload, mesh.device_type)
        )
    apply_pipeline_parallel(
        model,
        family,
        mesh,
        options,
        tensor_parallel=tensor_parallel,
        sequence_mesh=sequence_mesh,
        activation_checkpointing=partial(
            apply_activation_checkpointing, mode=activation_checkpointing, every_n_layers=every_n_layers
        ),
        fully_shard_stage=fully_shard_stage,
        reshard_after_forward=reshard_after_forward,
        param_dtype=policy.param_dtype,
    )


def mesh_of(model: nn.Module) -> DeviceMesh | None:
    """The mesh ``parallelize`` applied to ``model`` (``None`` if it was not parallelized)."""
    return getattr(model, _MESH_ATTR, None)


def data_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """Ranks that hold different tokens (data replicas, shards and context shards), or ``None``."""
    return mesh["dp_cp"] if mesh["dp_cp"].size() > 1 else None


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """FSDP2's mesh: 1-D ``dp_shard_cp``, 2-D ``(dp_replicate, dp_shard_cp)`` for HSDP, or ``None``."""
    if mesh["dp_cp"].size() == 1:
        return None
    if mesh["dp_replicate"].size() > 1:
        return mesh["dp_replicate", "dp_shard_cp"]
    return mesh["dp_shard_cp"]


def _resolve(layout: ParallelLayout | DeviceMesh) -> ParallelLayout:
    if isinstance(layout, DeviceMesh):
        if not set(MESH_DIM_NAMES) <= set(layout.mesh_dim_names or ()):
            raise LayoutError(
                f"parallelize needs a mesh with dimensions {MESH_DIM_NAMES} (got {layout.mesh_dim_names});"
                " build it with `ParallelLayout(...).build_mesh(device_type)`."
            )
        return ParallelLayout.from_mesh(layout)
    if not dist.is_initialized():
        raise LayoutError(
            "parallelize needs an initialized process group (torch.distributed.init_process_group, torchrun, or a"
            " Lightning strategy); for one process, use a world of size 1."
        )
    return layout.resolve(dist.get_world_size())


def _device_type() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"
