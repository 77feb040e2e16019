"""``parallelize``: turn a transformers causal LM into its parallel form, in one canonical order.

Order: float8 linears -> tensor/sequence parallel -> context parallel -> activation checkpointing -> torch.compile
per layer -> FSDP2 (each later step wraps what the earlier ones produced; FSDP2 must see the final DTensors). Under
pipeline parallelism each stage runs the same order after the split, without float8 and compile (both refused with
``pp_size > 1`` by :func:`~lightning_plugins.parallel.compile.check_compile`).
"""

from __future__ import annotations

from functools import partial

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_plugins.parallel.layout import MESH_DIM_NAMES, ParallelLayout
from lightning_plugins.errors import LayoutError
from lightning_plugins.parallel.hf_model import hf_model_of
from lightning_plugins.parallel.options import MemoryOptions, ParallelOptions
from lightning_plugins.parallel.quantized import check_quantized
from lightning_plugins.parallel.families import ModelFamily, check_supported, decoder_layers, family_for, final_norm
from lightning_plugins.parallel.memory.activation import apply_activation_checkpointing
from lightning_plugins.parallel.moe.experts import apply_expert_parallel, expert_meshes
from lightning_plugins.parallel.moe.router_loss import check_router_loss, install_global_balance_loss
from lightning_plugins.parallel.checks import check_settings
from lightning_plugins.parallel.compile import apply_compile, apply_float8, check_device, enable_async_tp, simulated
from lightning_plugins.parallel.context import apply_context_parallel
from lightning_plugins.parallel.fsdp import apply_fsdp, mixed_precision_policy, offload_policy
from lightning_plugins.parallel.mesh import attach_mesh, data_mesh, fsdp_mesh, mesh_of
from lightning_plugins.parallel.memory.gated_mlp import use_efficient_mlps
from lightning_plugins.parallel.memory.norms import use_efficient_norms
from lightning_plugins.parallel.memory.tiled_mlp import use_tiled_mlps
from lightning_plugins.parallel.save_pretrained import install_save_pretrained
from lightning_plugins.parallel.loss import ParallelCausalLMLoss, gather_logits_without_labels
from lightning_plugins.parallel.memory.chunked_loss import install_chunked_head, install_chunked_loss
from lightning_plugins.parallel.pipeline import PipelineOptions, apply_pipeline_parallel, pipeline_of
from lightning_plugins.parallel.pipeline.anatomy import decoder_anatomy
from lightning_plugins.parallel.tensor import apply_tensor_parallel
from lightning_plugins.parallel.tensor_checks import check_tensor_parallel

__all__ = ["SETTINGS_ATTR", "check_parallelizable", "check_same_settings", "parallelize"]

#: The attribute of a parallelized model holding the ``(options, memory)`` it was parallelized with: a later entry
#: point (a second ``fit``, :func:`lightning_plugins.parallel.by_hand`) must ask for the same.
SETTINGS_ATTR = "_lightning_plugins_settings"


def parallelize(
    model: nn.Module,
    layout: ParallelLayout | DeviceMesh,
    options: ParallelOptions | None = None,
    memory: MemoryOptions | None = None,
) -> nn.Module:
    """Apply the layout to ``model`` in place and return it.

    Args:
        model: A transformers causal LM, materialised or on the meta device (then load weights with
            :func:`lightning_plugins.checkpoint.load.load_sharded_safetensors`), or a peft ``PeftModel`` of one
            (LoRA adapters are placed with their base layers; see :mod:`lightning_plugins.adapters.lora`).
        layout: A :class:`ParallelLayout` (resolved against the world size here) or a mesh built by
            :meth:`ParallelLayout.build_mesh`.
        options: How each dimension is applied (sequence/loss parallel, CP backend, pipeline schedule
            and micro-batches); defaults when ``None``. Shard CP batches with :func:`context_parallel_batch`.
        memory: Activation checkpointing and offload, FSDP2 mixed precision, CPU offload, resharding; defaults when
            ``None`` (``optimizer_offload`` is the optimizer's: see :func:`lightning_plugins.recipe.build.make_optimizer`).

    Returns:
        The same model, now holding DTensor parameters; its ``loss_function`` averages over valid tokens
        across all data ranks exactly as one process would. With ``pp_size > 1`` the model keeps only this
        rank's stages and ``model(**batch)`` runs forward and backward of the whole batch through the
        pipeline (see :func:`pipeline_of` and :mod:`lightning_plugins.parallel.pipeline`). Its ``save_pretrained``
        (and that of the ``PeftModel`` given) is collective: called on every rank, it writes the trained weights
        whole (see :mod:`lightning_plugins.parallel.save_pretrained`).

    Raises:
        LayoutError: for any invalid combination, before any collective runs.
    """
    if (inner := hf_model_of(model)) is not model:  # a PeftModel: the transformers model inside holds the layers
        parallelize(inner, layout, options, memory)
        install_save_pretrained(model)
        return model
    options, memory = options or ParallelOptions(), memory or MemoryOptions()
    resolved = _resolve(layout)
    if mesh_of(model) is not None:  # a later entry point (fit, then test; a second Trainer) reuses it
        check_same_settings(model, resolved, options, memory)
        return model
    pipeline_options = check_parallelizable(model, resolved, options, memory)
    family = family_for(model, tensor_parallel=resolved.tp_size > 1)
    if not simulated():  # the planner's dry run simulates a GPU world on CPU (see lightning_plugins.parallel.compile)
        check_device(options, layout.device_type if isinstance(layout, DeviceMesh) else _device_type(), resolved.tp_size)
    if memory.efficient_norms:
        use_efficient_norms(model)
    if memory.efficient_mlp:
        use_efficient_mlps(model)
    if memory.mlp_chunk_tokens:  # after the efficient MLP, whose forward each tile then runs
        use_tiled_mlps(model, memory.mlp_chunk_tokens)
    # Validation is done: from here on collectives run (building the mesh creates process groups).
    mesh = layout if isinstance(layout, DeviceMesh) else resolved.build_mesh(_device_type())

    if pipeline_options is not None:
        _parallelize_pipeline(model, family, mesh, pipeline_options, options, memory)
        _refuse_generate(model, "pipeline parallelism (each rank holds only some decoder layers)")
        install_save_pretrained(model)
        attach_mesh(model, mesh)
        setattr(model, SETTINGS_ATTR, (options, memory))
        return model

    layers = decoder_layers(model, family)
    experts = expert_meshes(mesh, resolved.ep_size) if resolved.ep_size > 1 else None
    if options.float8:  # before TP and FSDP2, which then shard (and gather) the float8 layers
        apply_float8(model, fsdp=fsdp_mesh(mesh) is not None)
    apply_expert_parallel(layers, experts)  # before tensor parallelism, which replicates what is left over tp
    if resolved.tp_size > 1:
        apply_tensor_parallel(
            model,
            family,
            mesh["tp"],
            sequence_parallel=options.sequence_parallel,
            loss_parallel=options.loss_parallel,
            regather=memory.sp_regather,
        )
        if options.loss_parallel:
            model.register_forward_hook(gather_logits_without_labels, with_kwargs=True)
    if resolved.cp_size > 1:
        apply_context_parallel(model, layers, mesh["cp"], options.cp_backend)
        _refuse_generate(model, "context parallelism (each rank holds only a shard of the sequence)")
    apply_activation_checkpointing(
        layers, memory.activation_checkpointing, memory.every_n_layers, offload=memory.activation_offload
    )
    if options.compile and not simulated():  # after TP and AC, before FSDP2 (torchtitan's order)
        if options.async_tp:
            enable_async_tp(mesh["tp"])
        apply_compile(layers)
    fsdp = fsdp_mesh(mesh)
    if fsdp is not None:
        apply_fsdp(
            model,
            layers,
            fsdp,
            mp_policy=mixed_precision_policy(memory.param_dtype, memory.reduce_dtype),
            offload=offload_policy(memory.cpu_offload, mesh.device_type),
            reshard_after_forward=memory.reshard_after_forward,
            experts=experts,
            embedding=model.get_input_embeddings(),
            head=(final_norm(model, family), model.get_output_embeddings()),
        )
    model.loss_function = ParallelCausalLMLoss(
        data_mesh(mesh), install_chunked_loss(model, memory.loss_chunk_tokens, not options.loss_parallel)
    )
    if data_mesh(mesh) is not None:
        install_global_balance_loss(model, data_mesh(mesh))
    install_save_pretrained(model)
    attach_mesh(model, mesh)
    setattr(model, SETTINGS_ATTR, (options, memory))
    return model


def check_parallelizable(
    model: nn.Module, layout: ParallelLayout, options: ParallelOptions, memory: MemoryOptions
) -> PipelineOptions | None:
    """Check a resolved layout and its settings against ``model`` before anything is applied (no collective runs).

    :func:`parallelize` runs these checks first; a door that knows the model before it joins the process group runs
    them then, so a layout the model cannot run fails before any process group exists.

    Returns:
        The resolved pipeline options when ``layout.pp_size > 1``, else ``None``.

    Raises:
        LayoutError: for sizes that do not fit the model; OptionsError: for settings that do not
            (:func:`~lightning_plugins.parallel.checks.check_settings`); both name a setting that works.
    """
    check_supported(model)
    pipeline_options = check_settings(layout, options, memory, getattr(model, "config", None))
    if pipeline_options is not None:
        decoder_anatomy(model, layout.pp_size)  # a forward a stage cannot reproduce is refused here
    check_quantized(model, layout, float8=options.float8)
    if layout.tp_size > 1:  # a layer tensor parallelism would split only partly
        check_tensor_parallel(model, family_for(model), layout.tp_size)
    check_router_loss(getattr(model, "config", None), splits_tokens=max(layout.tp_size, layout.cp_size, layout.pp_size) > 1)
    return pipeline_options


def _parallelize_pipeline(
    model: nn.Module,
    family: ModelFamily,
    mesh: DeviceMesh,
    pipeline_options: PipelineOptions,
    options: ParallelOptions,
    memory: MemoryOptions,
) -> None:
    """The same order per stage: split -> TP/SP -> CP -> AC -> FSDP2 (each stage module is its own root)."""
    tp = mesh["tp"]
    sequence_mesh = fully_shard_stage = None
    ep_size = ParallelLayout.from_mesh(mesh).ep_size
    experts = expert_meshes(mesh, ep_size) if ep_size > 1 else None

    def split_weights(kept: nn.Module) -> None:  # the rank's part of the model, once the other stages are dropped
        apply_expert_parallel(decoder_layers(kept, family), experts)
        if tp.size() > 1:
            apply_tensor_parallel(
                kept,
                family,
                tp,
                sequence_parallel=options.sequence_parallel,
                loss_parallel=options.loss_parallel,
                regather=memory.sp_regather,
            )

    if tp.size() > 1:
        sequence_mesh = tp if options.sequence_parallel and family.sequence_parallel else None
    policy = mixed_precision_policy(memory.param_dtype, memory.reduce_dtype)
    fsdp = fsdp_mesh(mesh)
    if fsdp is not None:
        fully_shard_stage = partial(
            apply_fsdp,
            mesh=fsdp,
            mp_policy=policy,
            offload=offload_policy(memory.cpu_offload, mesh.device_type),
            experts=experts,
        )
    apply_pipeline_parallel(
        model,
        family,
        mesh,
        pipeline_options,
        split_weights=split_weights,
        sequence_mesh=sequence_mesh,
        context_parallel=(
            partial(apply_context_parallel, cp_mesh=mesh["cp"], backend=options.cp_backend)
            if mesh["cp"].size() > 1
            else None
        ),
        activation_checkpointing=partial(
            apply_activation_checkpointing,
            mode=memory.activation_checkpointing,
            every_n_layers=memory.every_n_layers,
            offload=memory.activation_offload,
        ),
        fully_shard_stage=fully_shard_stage,
        reshard_after_forward=memory.reshard_after_forward,
        param_dtype=policy.param_dtype,
        reshard_per_microbatch=memory.pp_reshard_per_microbatch,
    )
    for stage in pipeline_of(model).stages.values():
        if stage.is_last:
            stage.chunked = install_chunked_head(
                model, stage.lm_head, memory.loss_chunk_tokens, not options.loss_parallel
            )


def _refuse_generate(model: nn.Module, reason: str) -> None:
    """Replace ``model.generate`` by a clear refusal: token-by-token decoding needs every layer and token."""

    def generate(*args: object, **kwargs: object) -> None:
        raise NotImplementedError(
            f"generate() is not available under {reason}. Export the trained model with"
            " `lightning_plugins.checkpoint.live_export.export_hf(model, out_dir)` and generate from it in one process (or"
            " under tensor parallelism / FSDP2); the loss (`model(**batch).loss`) works under every layout."
        )

    model.generate = generate  # type: ignore[method-assign]


def check_same_settings(
    model: nn.Module,
    layout: ParallelLayout,
    options: ParallelOptions | None = None,
    memory: MemoryOptions | None = None,
) -> None:
    """A model is parallelized once: asking again is fine with the same layout and settings.

    Args:
        model: A model :func:`parallelize` applied a layout to.
        layout: The layout asked for now.
        options: The options asked for now; ``None`` accepts those applied (only the layout is compared).
        memory: The memory options asked for now; ``None`` accepts those applied.

    Raises:
        LayoutError: naming both layouts and settings when they differ.
    """
    applied = ParallelLayout.from_mesh(mesh_of(model))
    applied_options, applied_memory = getattr(model, SETTINGS_ATTR)
    options, memory = options or applied_options, memory or applied_memory
    if (applied, applied_options, applied_memory) != (layout, options, memory):
        raise LayoutError(
            f"This model was already parallelized with {applied}, {applied_options}, {applied_memory}; now"
            f" {layout}, {options}, {memory} is asked for. A layout cannot be changed in place: build the model"
            " again (or reload it from a checkpoint) and parallelize the fresh one, or keep the first layout."
        )


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
