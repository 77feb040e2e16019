"""Splitting a causal LM into this rank's pipeline stages, and the group that keeps a tied embedding in step.

* **Split.** The layers are cut into ``pp_size x stages_per_rank`` contiguous stages. Each rank keeps
  only its stages' layers (under their original names, so ``model.layers.5`` stays ``model.layers.5``
  and checkpoints map across layouts), the embedding if it holds the first stage, the final norm and
  ``lm_head`` if it holds the last. In two steps, around the per-part steps (tensor parallelism first) that expect
  the whole model's embedding and head: :func:`keep_stage_layers`, then :func:`build_stages`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_plugins.parallel.families import ModelFamily, decoder_layers
from lightning_plugins.parallel.image_text import PARTS_BEFORE_STAGING, image_text_parts, language_config
from lightning_plugins.parallel.image_text_context import context_sharding
from lightning_plugins.parallel.pipeline.anatomy import decoder_anatomy
from lightning_plugins.parallel.pipeline.image_text import ImageTextPrelude
from lightning_plugins.parallel.pipeline.options import PipelineOptions, layer_ranges, stages_of_rank
from lightning_plugins.parallel.pipeline.stage import StageModule


def _parent_and_name(root: nn.Module, target: nn.Module) -> tuple[nn.Module, str]:
    for name, module in root.named_modules():
        for child_name, child in module.named_children():
            if child is target:
                return module, child_name
    raise LookupError(f"{type(target).__name__} is not a submodule of {type(root).__name__}")


@dataclass(frozen=True)
class StageCut:
    """What :func:`keep_stage_layers` cut: this rank's stages and every layer by index (read before pruning).

    Attributes:
        local: This rank's stage indices.
        num_stages: Stages over all ranks.
        ranges: The layer indices of each stage.
        layers: Every decoder layer by index, as the model held them before the other stages' were dropped.
        anatomy: What a stage needs to reproduce the decoder's forward (:func:`decoder_anatomy`).
        tied: Whether the head's weight is the embedding's.
    """

    local: tuple[int, ...]
    num_stages: int
    ranges: list[range]
    layers: dict[str, nn.Module]
    anatomy: Any
    tied: bool


def keep_stage_layers(model: nn.Module, family: ModelFamily, pp: DeviceMesh, options: PipelineOptions) -> StageCut:
    """Prune ``model``'s decoder layers in place to this rank's stages' (the embedding, final norm and head stay:
    the per-part steps, tensor parallelism first, expect them; :func:`build_stages` drops them after).

    Args:
        model: A transformers causal LM (materialised or on the meta device).
        family: Its module names.
        pp: The pipeline dimension of the mesh.
        options: Resolved pipeline options.
    """
    pp_size, pp_rank = pp.size(), pp.get_local_rank()
    anatomy = decoder_anatomy(model, pp_size)  # before pruning: it reads the whole model
    local = tuple(stages_of_rank(pp_rank, pp_size, options))
    num_stages = pp_size * (options.stages_per_rank or 1)
    layers = decoder_layers(model, family)
    ranges = layer_ranges(len(layers), num_stages)
    kept = {index for stage in local for index in ranges[stage]}
    # Drop other stages' layers but keep the original keys (names): iteration, FSDP, activation
    # checkpointing and state dicts all go through `_modules`.
    all_layers = dict(layers._modules)
    for key in list(layers._modules):
        if int(key) not in kept:
            del layers._modules[key]
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = lm_head is not None and lm_head.weight is embed.weight
    return StageCut(local, num_stages, ranges, all_layers, anatomy, tied)


def build_stages(model: nn.Module, cut: StageCut, sequence_mesh: DeviceMesh | None = None) -> dict[int, StageModule]:
    """Drop the embedding, final norm and head this rank's stages do not hold, and return its :class:`StageModule` s
    by index.

    Args:
        model: The model :func:`keep_stage_layers` pruned (its per-part steps applied).
        cut: What it cut.
        sequence_mesh: The tensor-parallel mesh when sequence parallelism is on: stage boundaries then
            carry each rank's sequence shard.
    """
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    parts = image_text_parts(model)
    decoder = model.base_model if parts is None else model.get_submodule(parts.language_path)
    # The base model's own pieces (decoder_anatomy checked they are there), whatever the family names.
    norm, rotary = decoder.norm, decoder.rotary_emb
    last_stage = cut.num_stages - 1
    first, last = 0 in cut.local, last_stage in cut.local
    context = context_sharding(model)  # under context parallelism (image_text_context.py)
    preludes = {
        stage: ImageTextPrelude(model, parts, stage == 0, cut.ranges[stage], context)
        for stage in (cut.local if parts else ())
    }
    if parts is not None and not first:  # the vision tower and the projector live in the first stage
        model.__dict__[PARTS_BEFORE_STAGING] = parts  # the language model's path stays known (image_text_parts)
        for path in (parts.vision_path, *parts.projector_paths):
            parent, _, name = path.rpartition(".")
            try:
                holder = model.get_submodule(parent)
            except AttributeError:  # inside a part dropped already (Qwen's merger in its tower)
                continue
            setattr(holder, name, None)
    # A tied head keeps the embedding module as its weight's first name: checkpoints (HF's and ours) know
    # the weight as the embedding's, and the embedding's forward is never run on this rank.
    if not first and not (cut.tied and last):
        parent, name = _parent_and_name(model, embed)
        setattr(parent, name, None)
    if not last:
        parent, name = _parent_and_name(model, norm)
        setattr(parent, name, None)
        parent, name = _parent_and_name(model, lm_head)
        setattr(parent, name, None)
    return {
        stage: StageModule(
            language_config(model.config),
            {index: cut.layers[str(index)] for index in cut.ranges[stage]},
            rotary,
            anatomy=cut.anatomy,
            embed=embed if stage == 0 else None,
            norm=norm if stage == last_stage else None,
            lm_head=lm_head if stage == last_stage else None,
            sequence_mesh=sequence_mesh,
            prelude=preludes.get(stage),
        )
        for stage in cut.local
    }


def tied_pair_group(mesh: DeviceMesh, options: PipelineOptions) -> dist.ProcessGroup | None:
    """The group of the two ranks holding the first and the last stage (same data/tensor coordinates).

    Every rank creates every pair's group (``new_group`` is collective); ``None`` when one rank holds
    both stages (V-shaped schedules), where the weight stays tied.
    """
    if options.spec.v_shape:
        return None
    grid = mesh.mesh.reshape(mesh.mesh.shape[0], -1)  # [pp, everything else]
    mine = None
    for column in range(grid.shape[1]):
        ranks = [int(grid[0, column]), int(grid[-1, column])]
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine
