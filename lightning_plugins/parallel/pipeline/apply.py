"""A causal LM made into a pipeline: :func:`attach_pipeline`, and its ``forward`` driving the pipeline.

Composition (:func:`lightning_plugins.parallel.api.parallelize`): the per-part steps (experts, tensor, context
parallelism, activation checkpointing) run on the rank's part of the model, FSDP2 on each stage module (the stage is
the FSDP root, which is what ``PipelineStage`` expects); every micro-batch is the cp shard of its rows (see
:class:`~lightning_plugins.parallel.pipeline.runtime.Pipeline`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_plugins.parallel.loss import IGNORE_INDEX, next_token_targets
from lightning_plugins.parallel.pipeline.image_text import hand_batch_to_stages
from lightning_plugins.parallel.pipeline.options import PipelineOptions
from lightning_plugins.parallel.pipeline.runtime import Pipeline, TiedEmbedding
from lightning_plugins.parallel.pipeline.split import tied_pair_group
from lightning_plugins.parallel.pipeline.stage import StageModule

_PIPELINE_ATTR = "_lightning_plugins_pipeline"


def pipeline_of(model: nn.Module) -> Pipeline | None:
    """The :class:`Pipeline` ``parallelize`` attached to ``model`` (``None`` without pipeline parallelism)."""
    return getattr(model, _PIPELINE_ATTR, None)


def attach_pipeline(
    model: nn.Module,
    stages: dict[int, StageModule],
    options: PipelineOptions,
    mesh: DeviceMesh,
    *,
    tied: bool = False,
    param_dtype: torch.dtype | None = None,
    reshard_per_microbatch: bool = False,
) -> Pipeline:
    """Attach to ``model`` the :class:`Pipeline` driving this rank's ``stages`` (parallelized already, FSDP2 per
    stage), so that ``model(**batch)`` runs the whole batch through it.

    Args:
        model: The model the stages were built from (:func:`~lightning_plugins.parallel.pipeline.split.build_stages`).
        stages: This rank's stages by index.
        options: Resolved pipeline options.
        mesh: The full mesh.
        tied: Whether the head's weight is the embedding's: when the first and the last stage sit on two ranks,
            each keeps a copy, kept in step over the pair (:class:`TiedEmbedding`).
        param_dtype: FSDP2's parameter dtype, the dtype of what travels between stages.
        reshard_per_microbatch: Reshard and reduce-scatter each stage after every micro-batch's backward
            (:class:`~lightning_plugins.parallel.pipeline.stage.ReshardingStage`).
    """
    tie = None
    group = tied_pair_group(mesh, options) if tied else None
    if group is not None:
        num_stages = mesh["pp"].size() * (options.stages_per_rank or 1)
        if 0 in stages and num_stages - 1 not in stages:
            tie = TiedEmbedding(_param_name(model, model.get_input_embeddings().weight), group, counted=True)
        elif num_stages - 1 in stages and 0 not in stages:
            tie = TiedEmbedding(_param_name(model, model.get_output_embeddings().weight), group, counted=False)
    pipeline = Pipeline(
        model, stages, options, mesh, tie=tie, param_dtype=param_dtype, reshard_per_microbatch=reshard_per_microbatch
    )
    setattr(model, _PIPELINE_ATTR, pipeline)
    model.__class__ = _pipelined_class(type(model))
    return pipeline


def retie_embedding(model: nn.Module) -> None:
    """After FSDP2 gave a tied head a new (sharded) parameter, name the same one in the kept embedding module."""
    if model.get_input_embeddings() is not None and model.get_output_embeddings() is not None:
        model.get_input_embeddings().weight = model.get_output_embeddings().weight


def _param_name(model: nn.Module, param: Tensor) -> str:
    return next(name for name, p in model.named_parameters() if p is param)


class _PipelinedCausalLM:
    """Put in front of a parallelized model's class: ``forward`` drives the pipeline for the whole batch.

    In training mode with gradients enabled, a call runs forward *and* backward of every micro-batch
    (the schedule interleaves them) and returns the loss detached: do not call ``backward`` on it. In
    eval mode or under ``no_grad`` it runs forward only. Either way the loss is the global mean token
    loss of the batch, identical on every rank; logits are not returned. With ``pipeline_head=`` (a loss of whole
    rows, :meth:`Pipeline.run_sequences`) the head computes each micro-batch's loss and keeps what it needs; the
    output's loss is ``None``.
    """

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        labels: Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        unsupported = sorted(k for k in ("inputs_embeds", "past_key_values") if kwargs.get(k) is not None)
        if input_ids is None or unsupported or kwargs.get("use_cache"):
            raise ValueError(
                f"{type(self).__name__} runs a pipeline: pass `input_ids` (and `labels`); {unsupported or 'use_cache'}"
                " is not supported under pipeline parallelism."
            )
        shift_labels = kwargs.get("shift_labels")  # next-token targets of a context-parallel shard
        if labels is None:
            # transformers' causal LMs compute a loss only when `labels` is given (`shift_labels` alone: none, only
            # logits), and the pipeline returns nothing else: one process's result cannot be given here.
            given = "only `shift_labels`" if shift_labels is not None else "no `labels`"
            raise ValueError(
                f"{type(self).__name__} runs a pipeline and returns the loss only (the logits stay on the last stage,"
                f" one micro-batch at a time), but the batch has {given}, for which transformers computes no loss."
                " Pass `labels` (with `shift_labels` too, those are the targets, as in transformers' loss)."
            )
        ignore_index = kwargs.get("ignore_index", IGNORE_INDEX)
        if ignore_index != IGNORE_INDEX:  # as transformers' loss reads it: every ignored target becomes -100
            labels = labels.masked_fill(labels == ignore_index, IGNORE_INDEX)
            if shift_labels is not None:
                shift_labels = shift_labels.masked_fill(shift_labels == ignore_index, IGNORE_INDEX)
        pipeline = pipeline_of(self)  # type: ignore[arg-type]
        assert pipeline is not None
        preludes = [stage.prelude for stage in pipeline.stages.values() if stage.prelude is not None]
        if preludes:  # an image-text model: its images and per-row inputs go to the stages by rows (see .image_text)
            hand_batch_to_stages(preludes, input_ids, attention_mask, position_ids, kwargs)
            position_ids = None
        train = self.training and torch.is_grad_enabled()  # type: ignore[attr-defined]
        head = kwargs.get("pipeline_head")
        if head is not None:  # a loss of whole rows (a preference loss): see Pipeline.run_sequences
            targets = next_token_targets(labels) if shift_labels is None else shift_labels
            pipeline.run_sequences(head, input_ids, attention_mask, position_ids, targets, train=train)
            return CausalLMOutputWithPast(loss=None)
        if self.training and torch.is_grad_enabled():  # type: ignore[attr-defined]
            loss = pipeline.step(input_ids, attention_mask, position_ids, labels, shift_labels=shift_labels)
        else:
            loss = pipeline.evaluate(input_ids, attention_mask, position_ids, labels, shift_labels=shift_labels)
        return CausalLMOutputWithPast(loss=loss)


_PIPELINED_CLASSES: dict[type, type] = {}


def _pipelined_class(cls: type) -> type:
    if issubclass(cls, _PipelinedCausalLM):
        return cls
    if cls not in _PIPELINED_CLASSES:
        _PIPELINED_CLASSES[cls] = type(f"Pipelined{cls.__name__}", (_PipelinedCausalLM, cls), {})
    return _PIPELINED_CLASSES[cls]
