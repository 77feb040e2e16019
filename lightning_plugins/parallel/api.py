"""``parallelize(model, plan)``: turn a transformers causal LM into its parallel form, in one canonical order.

One sequence, written once, for the whole model or, under pipeline parallelism, for the rank's part of it:
module swaps (efficient norms and MLPs, tiled MLP) -> [pp: keep this rank's stages' layers] -> float8 linears ->
expert parallel -> tensor/sequence parallel -> context parallel -> activation checkpointing -> torch.compile per
layer -> [pp: the stage modules] -> FSDP2 of each root (the model, or each stage) -> the loss. Each later step wraps
what the earlier ones produced (FSDP2 must see the final DTensors); float8 and compile are refused with
``pp_size > 1`` by :func:`~lightning_plugins.parallel.compile.check_compile`.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_plugins.errors import LayoutError
from lightning_plugins.parallel.compile import apply_compile, apply_float8, check_device, enable_async_tp, simulated
from lightning_plugins.parallel.context import apply_context_parallel
from lightning_plugins.parallel.families import ModelFamily, check_supported, decoder_layers, family_for, final_norm
from lightning_plugins.parallel.fsdp import apply_fsdp, mixed_precision_policy, offload_policy
from lightning_plugins.parallel.hf_model import hf_model_of
from lightning_plugins.parallel.image_text import image_text_parts
from lightning_plugins.parallel.image_text_context import ShardAfterImages, check_image_text_context
from lightning_plugins.parallel.layout import ParallelLayout
from lightning_plugins.parallel.loss import ParallelCausalLMLoss, gather_logits_without_labels
from lightning_plugins.parallel.memory.activation import apply_activation_checkpointing
from lightning_plugins.parallel.memory.chunked_loss import install_chunked_head, install_chunked_loss
from lightning_plugins.parallel.memory.gated_mlp import use_efficient_mlps
from lightning_plugins.parallel.memory.norms import use_efficient_norms
from lightning_plugins.parallel.memory.tiled_mlp import use_tiled_mlps
from lightning_plugins.parallel.mesh import attach_mesh, mesh_of
from lightning_plugins.parallel.moe.experts import apply_expert_parallel
from lightning_plugins.parallel.moe.router_loss import check_router_loss, install_global_balance_loss
from lightning_plugins.parallel.options import MemoryOptions, ParallelOptions
from lightning_plugins.parallel.pipeline import PipelineOptions, pipeline_of
from lightning_plugins.parallel.pipeline.anatomy import decoder_anatomy
from lightning_plugins.parallel.pipeline.apply import attach_pipeline, retie_embedding
from lightning_plugins.parallel.pipeline.split import StageCut, build_stages, keep_stage_layers
from lightning_plugins.parallel.plan import ParallelPlan, layout_of_mesh, resolve
from lightning_plugins.parallel.quantized import check_quantized
from lightning_plugins.parallel.replicated_tower import recompute_on_local_copies, replicate_image_path
from lightning_plugins.parallel.save_pretrained import install_save_pretrained
from lightning_plugins.parallel.tensor import apply_tensor_parallel
from lightning_plugins.parallel.tensor_checks import check_tensor_parallel

__all__ = ["SETTINGS_ATTR", "check_parallelizable", "check_same_settings", "parallelize"]

#: The attribute of a parallelized model holding the ``(options, memory)`` it was parallelized with: a later entry
#: point (a second ``fit``, :func:`lightning_plugins.parallel.by_hand`) must ask for the same.
SETTINGS_ATTR = "_lightning_plugins_settings"


def parallelize(
    model: nn.Module,
    layout: ParallelPlan | ParallelLayout | DeviceMesh,
    options: ParallelOptions | None = None,
    memory: MemoryOptions | None = None,
) -> nn.Module:
    """Apply the plan to ``model`` in place and return it.

    Args:
        model: A transformers causal LM, materialised or on the meta device (then load weights with
            :func:`lightning_plugins.checkpoint.load.load_sharded_safetensors`), or a peft ``PeftModel`` of one
            (LoRA adapters are placed with their base layers; see :mod:`lightning_plugins.adapters.lora`).
        layout: A :class:`~lightning_plugins.parallel.plan.ParallelPlan` (:func:`~lightning_plugins.parallel.plan.resolve`),
            a :class:`ParallelLayout` (resolved against the world size here) or a mesh built by a plan or by
            :meth:`ParallelLayout.build_mesh` (its plan, or its layout, is found from it).
        options: How each dimension is applied (sequence/loss parallel, CP backend, pipeline schedule
            and micro-batches); defaults when ``None`` (a plan's own; with a plan, give none or the same).
            Shard CP batches with :func:`~lightning_plugins.parallel.context_parallel_batch`.
        memory: Activation checkpointing and offload, FSDP2 mixed precision, CPU offload, resharding; defaults when
            ``None`` (``optimizer_offload`` is the optimizer's: see :func:`lightning_plugins.recipe.build.make_optimizer`).

    Returns:
        The same model, now holding DTensor parameters; its ``loss_function`` averages over valid tokens
        across all data ranks exactly as one process would. With ``pp_size > 1`` the model keeps only this
        rank's stages and ``model(**batch)`` runs forward and backward of the whole batch through the
        pipeline (see :func:`~lightning_plugins.parallel.pipeline_of`). Its ``save_pretrained`` (and that of the
        ``PeftModel`` given) is collective: called on every rank, it writes the trained weights whole (see
        :mod:`lightning_plugins.parallel.save_pretrained`).

    Raises:
        LayoutError: for any invalid combination, before any collective runs.
    """
    if (inner := hf_model_of(model)) is not model:  # a PeftModel: the transformers model inside holds the layers
        parallelize(inner, layout, options, memory)
        install_save_pretrained(model)
        return model
    if mesh_of(model) is not None:  # a later entry point (fit, then test; a second Trainer) reuses it
        check_same_settings(model, _plan(layout, options, memory))
        return model
    check_supported(model)
    plan = _plan(layout, options, memory, getattr(model, "config", None))
    plan.check_config(getattr(model, "config", None))  # a plan resolved before the model existed: checked once here
    _check_model(model, plan)
    family = family_for(model, tensor_parallel=plan.tp_size > 1)
    if not simulated():  # the planner's dry run simulates a GPU world on CPU (see lightning_plugins.parallel.compile)
        check_device(plan.options, plan.device_type, plan.tp_size)
    _swap_modules(model, plan.memory)
    # Validation is done: from here on collectives run (building the mesh creates process groups).
    cut = keep_stage_layers(model, family, plan.mesh("pp"), plan.pipeline) if plan.pipeline is not None else None
    _parallelize_part(model, family, plan)
    if cut is None:
        _shard(model, decoder_layers(model, family), plan, family)
        _install_loss(model, plan)
    else:
        _finish_pipeline(model, family, plan, cut)
    install_save_pretrained(model)
    attach_mesh(model, plan.mesh())
    setattr(model, SETTINGS_ATTR, (plan.options, plan.memory))
    return model


def _plan(
    layout: ParallelPlan | ParallelLayout | DeviceMesh,
    options: ParallelOptions | None,
    memory: MemoryOptions | None,
    config: Any | None = None,
) -> ParallelPlan:
    """The plan to apply: the one given (whose settings are the only ones), else one resolved here (its checks run
    here, against ``config``, once), or the plan of the mesh given (checked against ``config`` when it was not)."""
    if not isinstance(layout, ParallelPlan):
        return resolve(layout, options, memory, config)
    if (options or layout.options, memory or layout.memory) != (layout.options, layout.memory):
        raise LayoutError(
            f"parallelize was given a ParallelPlan with {layout.options}, {layout.memory} and other settings"
            f" ({options}, {memory}): a plan holds its settings. Resolve the plan with the settings you want."
        )
    return layout


def _swap_modules(model: nn.Module, memory: MemoryOptions) -> None:
    """The memory levers that replace modules' forwards, before anything is split."""
    if memory.efficient_norms:
        use_efficient_norms(model)
    if memory.efficient_mlp:
        use_efficient_mlps(model)
    if memory.mlp_chunk_tokens:  # after the efficient MLP, whose forward each tile then runs
        use_tiled_mlps(model, memory.mlp_chunk_tokens)


def _parallelize_part(model: nn.Module, family: ModelFamily, plan: ParallelPlan) -> None:
    """The per-part sequence on the model, or on the rank's part of it (its kept layers, embedding and head):
    float8 -> experts -> TP/SP -> CP -> activation checkpointing -> compile. FSDP2 follows, per root (:func:`_shard`)."""
    options, memory = plan.options, plan.memory
    layers = decoder_layers(model, family)
    if options.float8:  # before TP and FSDP2, which then shard (and gather) the float8 layers
        apply_float8(model, fsdp=plan.fsdp is not None)
    apply_expert_parallel(layers, plan.experts)  # before tensor parallelism, which replicates what is left over tp
    if plan.tp_size > 1:
        if (parts := image_text_parts(model)) is not None:  # before the rest is replicated module by module
            replicate_image_path(model, parts, plan.mesh("tp"))
        apply_tensor_parallel(
            model,
            family,
            plan.mesh("tp"),
            sequence_parallel=options.sequence_parallel,
            loss_parallel=options.loss_parallel,
            regather=memory.sp_regather,
        )
        if options.loss_parallel and plan.pipeline is None:
            model.register_forward_hook(gather_logits_without_labels, with_kwargs=True)
    if plan.cp_size > 1:
        apply_context_parallel(model, layers, plan.mesh("cp"), options.cp_backend)
        if (parts := image_text_parts(model)) is not None:  # its images placed into the whole sequence first
            ShardAfterImages(plan.mesh("cp")).install(model, parts)
        _refuse_generate(model, "context parallelism (each rank holds only a shard of the sequence)")
    apply_activation_checkpointing(
        layers, memory.activation_checkpointing, memory.every_n_layers, offload=memory.activation_offload
    )
    # The vision blocks too, as gradient_checkpointing_enable does; under TP their recompute runs on local copies of
    # their replicated weights, as their forward does (replicated_tower.py).
    if (parts := image_text_parts(model)) is not None:
        blocks = model.get_submodule(parts.blocks_path)
        apply_activation_checkpointing(blocks, memory.activation_checkpointing, memory.every_n_layers)
        if plan.tp_size > 1:
            recompute_on_local_copies(blocks)
    if options.compile and not simulated():  # after TP and AC, before FSDP2 (torchtitan's order)
        if options.async_tp:
            enable_async_tp(plan.mesh("tp"))
        apply_compile(layers)


def _shard(
    root: nn.Module,
    layers: list[nn.Module] | nn.ModuleList,
    plan: ParallelPlan,
    family: ModelFamily | None = None,
    *,
    embedding: nn.Module | None = None,
    head: tuple[nn.Module | None, ...] = (),
    split_backward: bool = False,
    vision: list[nn.Module] | None = None,
) -> None:
    """FSDP2 over one root (the model, or a pipeline stage), when there are data ranks to shard over.

    For the whole model (``family`` given) the embedding and the final norm and head are found on it.
    """
    if plan.fsdp is None:
        return
    memory = plan.memory
    vision = vision or []
    if family is not None:
        embedding, head = root.get_input_embeddings(), (final_norm(root, family), root.get_output_embeddings())
        parts = image_text_parts(root)
        vision = parts.vision_units(root) if parts is not None else []
    apply_fsdp(
        root,
        layers,
        plan.fsdp,
        mp_policy=mixed_precision_policy(memory.param_dtype, memory.reduce_dtype),
        offload=offload_policy(memory.cpu_offload, plan.mesh().device_type),
        reshard_after_forward=memory.reshard_after_forward and not split_backward,
        experts=plan.experts,
        embedding=embedding,
        head=head,
        vision=vision,
    )


def _install_loss(model: nn.Module, plan: ParallelPlan) -> None:
    """The loss averaged over valid tokens across the data ranks (chunked when asked), and the router's balance
    loss over the global batch."""
    chunked = install_chunked_loss(model, plan.memory.loss_chunk_tokens, not plan.options.loss_parallel)
    model.loss_function = ParallelCausalLMLoss(plan.data, chunked)
    if plan.data is not None:
        install_global_balance_loss(model, plan.data)


def _finish_pipeline(model: nn.Module, family: ModelFamily, plan: ParallelPlan, cut: StageCut) -> None:
    """The rank's stage modules, FSDP2 over each (each stage is its own root), and the pipeline driving them."""
    assert plan.pipeline is not None
    tied = model.get_output_embeddings() is not None and (
        model.get_output_embeddings().weight is model.get_input_embeddings().weight
    )
    sequence_mesh = None
    if plan.tp_size > 1 and plan.options.sequence_parallel and family.sequence_parallel:
        sequence_mesh = plan.mesh("tp")
    stages = build_stages(model, cut, sequence_mesh)
    for stage in stages.values():
        # A tied weight stays in the stage root unit: its embedding and head may sit in two stages.
        _shard(
            stage,
            list(stage.layers.values()),
            plan,
            embedding=None if tied else stage.embed,
            head=() if tied else (stage.norm, stage.lm_head),
            split_backward=plan.pipeline.spec.split_backward,
            vision=stage.prelude.vision_units() if stage.prelude is not None else None,
        )
    if tied and plan.fsdp is not None:
        retie_embedding(model)
    memory = plan.memory
    attach_pipeline(
        model,
        stages,
        plan.pipeline,
        plan.mesh(),
        tied=tied,
        param_dtype=mixed_precision_policy(memory.param_dtype, memory.reduce_dtype).param_dtype,
        reshard_per_microbatch=memory.pp_reshard_per_microbatch,
    )
    for stage in pipeline_of(model).stages.values():
        if stage.is_last:
            stage.chunked = install_chunked_head(model, stage.lm_head, memory.loss_chunk_tokens, not plan.options.loss_parallel)
    _refuse_generate(model, "pipeline parallelism (each rank holds only some decoder layers)")


def check_parallelizable(
    model: nn.Module,
    plan: ParallelPlan | ParallelLayout,
    options: ParallelOptions | None = None,
    memory: MemoryOptions | None = None,
) -> PipelineOptions | None:
    """Check a plan (or a resolved layout and its settings) against ``model`` before anything is applied (no
    collective runs).

    :func:`parallelize` runs these checks first; a door that knows the model before it joins the process group runs
    them then, so a layout the model cannot run fails before any process group exists. The plan's settings are checked
    against the model's config once (:meth:`~lightning_plugins.parallel.plan.ParallelPlan.check_config`): a later
    ``parallelize`` with the same plan does not check them again.

    Returns:
        The resolved pipeline options when ``pp_size > 1``, else ``None``.

    Raises:
        LayoutError: for sizes that do not fit the model; OptionsError: for settings that do not
            (:func:`~lightning_plugins.parallel.checks.check_settings`); both name a setting that works.
    """
    check_supported(model)
    config = getattr(model, "config", None)
    if isinstance(plan, ParallelPlan):
        plan.check_config(config)
    else:
        plan = resolve(plan, options, memory, config, world_size=plan.world_size)
    _check_model(model, plan)
    return plan.pipeline


def _check_model(model: nn.Module, plan: ParallelPlan) -> None:
    """The checks that need the model itself, not only its config."""
    if image_text_parts(model) is not None and plan.cp_size > 1:  # parts found, or the one that is not is named
        check_image_text_context(model)
    if plan.pipeline is not None:
        decoder_anatomy(model, plan.pp_size)  # a forward a stage cannot reproduce is refused here
    check_quantized(model, plan.layout, float8=plan.options.float8)
    if plan.tp_size > 1:  # a layer tensor parallelism would split only partly
        check_tensor_parallel(model, family_for(model), plan.tp_size)
    splits_tokens = max(plan.tp_size, plan.cp_size, plan.pp_size) > 1
    check_router_loss(getattr(model, "config", None), splits_tokens=splits_tokens)


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
    layout: ParallelPlan | ParallelLayout,
    options: ParallelOptions | None = None,
    memory: MemoryOptions | None = None,
) -> None:
    """A model is parallelized once: asking again is fine with the same layout and settings.

    Args:
        model: A model :func:`parallelize` applied a layout to.
        layout: The plan asked for now (its layout and settings), or the layout (then only what ``options`` and
            ``memory`` give is compared besides).
        options: The options asked for now; ``None`` accepts those applied (only the layout is compared).
        memory: The memory options asked for now; ``None`` accepts those applied.

    Raises:
        LayoutError: naming both layouts and settings when they differ.
    """
    if isinstance(layout, ParallelPlan):
        layout, options, memory = layout.layout, layout.options, layout.memory
    applied = layout_of_mesh(mesh_of(model))
    applied_options, applied_memory = getattr(model, SETTINGS_ATTR)
    options, memory = options or applied_options, memory or applied_memory
    if (applied, applied_options, applied_memory) != (layout, options, memory):
        raise LayoutError(
            f"This model was already parallelized with {applied}, {applied_options}, {applied_memory}; now"
            f" {layout}, {options}, {memory} is asked for. A layout cannot be changed in place: build the model"
            " again (or reload it from a checkpoint) and parallelize the fresh one, or keep the first layout."
        )
