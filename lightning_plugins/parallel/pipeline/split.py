"""Splitting a causal LM into this rank's pipeline stages, and the group that keeps a tied embedding in step.

* **Split.** The layers are cut into ``pp_size x stages_per_rank`` contiguous stages. Each rank keeps
  only its stages' layers (under their original names, so ``model.layers.5`` stays ``model.layers.5``
  and checkpoints map across layouts), the embedding if it holds the first stage, the final norm and
  ``lm_head`` if it holds the last.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_plugins.parallel.families import ModelFamily, decoder_layers
from lightning_plugins.parallel.pipeline.anatomy import decoder_anatomy
from lightning_plugins.parallel.pipeline.options import PipelineOptions, layer_ranges, stages_of_rank
from lightning_plugins.parallel.pipeline.stage import StageModule


def _parent_and_name(root: nn.Module, target: nn.Module) -> tuple[nn.Module, str]:
    for name, module in root.named_modules():
        for child_name, child in module.named_children():
            if child is target:
                return module, child_name
    raise LookupError(f"{type(target).__name__} is not a submodule of {type(root).__name__}")


def split_into_stages(
    model: nn.Module,
    family: ModelFamily,
    mesh: DeviceMesh,
    options: PipelineOptions,
    *,
    split_weights: Callable[[nn.Module], None] | None = None,
    sequence_mesh: DeviceMesh | None = None,
    context_parallel: Callable[[nn.Module, nn.ModuleList], None] | None = None,
) -> dict[int, StageModule]:
    """Prune ``model`` in place to this rank's stages and return their :class:`StageModule` s by index.

    Args:
        model: A transformers causal LM (materialised or on the meta device).
        family: Its module names.
        mesh: The full mesh (``pp`` and ``tp`` are read from it).
        options: Resolved pipeline options.
        split_weights: Called as ``split_weights(model)`` after the layers are pruned and before the
            embedding, final norm and head are dropped: expert then tensor parallelism (which expects to find all
            three).
        sequence_mesh: The tensor-parallel mesh when sequence parallelism is on: stage boundaries then
            carry each rank's sequence shard.
        context_parallel: Called as ``context_parallel(model, kept_layers)`` after tensor parallelism: routes
            the kept layers' attention through context-parallel attention (stages then run on the cp shard
            of every micro-batch, with global ``position_ids``).

    Returns:
        This rank's stages, keyed by stage index.
    """
    pp_size, pp_rank = mesh["pp"].size(), mesh["pp"].get_local_rank()
    anatomy = decoder_anatomy(model, pp_size)  # before pruning: it reads the whole model
    local = stages_of_rank(pp_rank, pp_size, options)
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
    if split_weights is not None:
        split_weights(model)
    if context_parallel is not None:
        context_parallel(model, layers)

    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    # The base model's own pieces (decoder_anatomy checked they are there), whatever the family names.
    norm, rotary = model.base_model.norm, model.base_model.rotary_emb
    first, last = 0 in local, num_stages - 1 in local
    tied = lm_head is not None and lm_head.weight is embed.weight
    # A tied head keeps the embedding module as its weight's first name: checkpoints (HF's and ours) know
    # the weight as the embedding's, and the embedding's forward is never run on this rank.
    if not first and not (tied and last):
        parent, name = _parent_and_name(model, embed)
        setattr(parent, name, None)
    if not last:
        parent, name = _parent_and_name(model, norm)
        setattr(parent, name, None)
        parent, name = _parent_and_name(model, lm_head)
        setattr(parent, name, None)

    stages = {}
    for stage in local:
        stages[stage] = StageModule(
            model.config,
            {index: all_layers[str(index)] for index in ranges[stage]},
            rotary,
            anatomy=anatomy,
            embed=embed if stage == 0 else None,
            norm=norm if stage == num_stages - 1 else None,
            lm_head=lm_head if stage == num_stages - 1 else None,
            sequence_mesh=sequence_mesh,
        )
    return stages


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
