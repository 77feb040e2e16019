"""``check_settings``: every check of a layout and its settings that needs neither weights nor a collective, once.

The recipe (at load), :func:`~lightning_plugins.parallelize`, the Lightning strategies (at construction and
before the process group exists), the Accelerate door and the planner all call this one function, so a setting
is refused by the same check, with the same message, whichever way it came in.
"""

from __future__ import annotations

from typing import Any

from lightning_plugins.errors import OptionsError
from lightning_plugins.parallel.compile import check_compile
from lightning_plugins.parallel.context.checks import check_context_parallel
from lightning_plugins.parallel.image_text import check_image_text_layout, language_config
from lightning_plugins.parallel.layout import ParallelLayout
from lightning_plugins.parallel.options import MemoryOptions, ParallelOptions
from lightning_plugins.parallel.pipeline.options import PipelineOptions, check_pipeline_layout, check_pp_reshard
from lightning_plugins.parallel.memory.tiled_mlp import check_tiled_mlp

__all__ = ["check_model_fit", "check_settings"]


def check_settings(
    layout: ParallelLayout, options: ParallelOptions, memory: MemoryOptions, config: Any | None = None
) -> PipelineOptions | None:
    """Check a layout with its parallel and memory options, against a model config when given.

    In order: the sizes against the config (:meth:`ParallelLayout.validate`), the pipeline schedule and
    micro-batches, context parallelism, and the memory levers that need FSDP2. Field-level checks ran when the
    objects were built (``ParallelLayout``, ``ParallelOptions`` and ``MemoryOptions`` refuse bad values themselves).

    Args:
        layout: The parallel sizes; before it is resolved (``dp_shard_size=-1``) only what does not depend on the
            world size is checked (a door at construction, before it knows the world).
        options: How each dimension is applied.
        memory: The memory levers.
        config: A ``transformers.PretrainedConfig`` (or an object with its attribute names); ``None`` checks what
            needs no model.

    Returns:
        The resolved pipeline options when ``layout.pp_size > 1``, else ``None``.

    Raises:
        LayoutError: for sizes that do not fit the model.
        OptionsError: for settings that do not fit the layout or the model; both name the fix.
    """
    pipeline = check_model_fit(layout, options, config)
    resolved = layout.dp_shard_size != -1
    if resolved and memory.uses_fsdp_policy and layout.fsdp_size == 1:
        raise OptionsError(
            "cpu_offload, param_dtype and reduce_dtype are FSDP2 options and need at least 2 data-parallel ranks"
            " (dp_shard_size, dp_replicate_size or cp_size > 1); with one data rank, use a precision plugin instead."
        )
    check_compile(layout, options, memory)
    check_tiled_mlp(memory.mlp_chunk_tokens, layout.tp_size, options.compile)
    if memory.pp_reshard_per_microbatch:
        check_pp_reshard(layout, pipeline, resolved)
    if memory.optimizer_in_backward:
        split = {name: getattr(layout, name) for name in ("pp_size", "tp_size", "cp_size", "ep_size")}
        split = {name: size for name, size in split.items() if size > 1}
        if split:
            raise OptionsError(
                f"optimizer_in_backward steps each parameter as soon as backward produced its gradient, which needs"
                f" gradients that are final then: {', '.join(f'{k}={v}' for k, v in split.items())} reduces or"
                " accumulates them later. Use FSDP2 (dp_shard_size, dp_replicate_size) or one GPU, or turn"
                " optimizer_in_backward off."
            )
    return pipeline


def check_model_fit(
    layout: ParallelLayout, options: ParallelOptions, config: Any | None = None
) -> PipelineOptions | None:
    """The part of :func:`check_settings` that reads the model's config: the sizes against it
    (:meth:`ParallelLayout.validate`), the pipeline's stages and schedule, and context parallelism's heads; without a
    config, what of these needs none.

    The memory levers and the rest of :func:`check_settings` do not depend on the model, so a plan checked before its
    model existed runs only this part once the config is known
    (:meth:`~lightning_plugins.parallel.plan.ParallelPlan.check_config`).

    Returns:
        The resolved pipeline options when ``layout.pp_size > 1``, else ``None``.

    Raises:
        LayoutError, OptionsError: as :func:`check_settings` does.
    """
    check_image_text_layout(layout, config)  # before the decoder's checks, which read its language model's config
    resolved = layout.dp_shard_size != -1
    if resolved:
        layout.validate(language_config(config))
    pipeline = None
    if layout.pp_size > 1:
        pipeline = PipelineOptions.of(options)
        if config is not None and resolved:
            tied = bool(getattr(config, "tie_word_embeddings", False))  # an image-text model's whole config says
            pipeline = check_pipeline_layout(layout, language_config(config), pipeline, tied)
        else:
            pipeline = pipeline.resolve(layout.pp_size)
    check_context_parallel(language_config(config), layout.cp_size, layout.tp_size, options.cp_backend)
    return pipeline
