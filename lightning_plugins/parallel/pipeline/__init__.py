"""Pipeline parallelism: decoder layers split into stages, micro-batches streamed by a torch schedule.

The parts: :mod:`.options` (schedules, :class:`PipelineOptions`, which stages and layers a rank holds, the
layout check), :mod:`.stage` (:class:`StageModule`), :mod:`.split` (pruning a model to its stages),
:mod:`.runtime` (:class:`Pipeline`, the step over a whole batch) and :mod:`.apply`
(:func:`attach_pipeline`, the model whose ``forward`` drives the pipeline).

How a causal LM becomes a pipeline:

* **Split.** The layers are cut into ``pp_size x stages_per_rank`` contiguous stages. Each rank keeps
  only its stages' layers (under their original names, so ``model.layers.5`` stays ``model.layers.5``
  and checkpoints map across layouts), the embedding if it holds the first stage, the final norm and
  ``lm_head`` if it holds the last.
* **Stages and loss.** Each stage recomputes its masks and rotary embeddings locally, so only hidden states
  travel between ranks; the last stage returns its share of the global token mean (see :mod:`.stage`).
* **Shapes** are given to ``PipelineStage`` up front (static mode): no metadata-inference pass runs.
  A new (micro-batch, sequence) shape rebuilds the stages; padding to a fixed length avoids that.
* **Tied embeddings.** When the first and last stage live on different ranks, each keeps a copy of the
  tied weight. After every step the gradient increments of the two copies are summed over the pair of
  ranks, so both copies take identical updates; :meth:`Pipeline.clip_grad_norm_` counts the weight once.

Composition: tensor parallelism is applied to the rank's part of the model, FSDP2 to each stage module
(the stage is the FSDP root, which is what ``PipelineStage`` expects), activation checkpointing to the
kept layers. Context parallelism routes the kept layers' attention through Ulysses or ring attention: each
rank's batch is already the load-balanced cp shard of its rows (``context_parallel_batch``), so stages run on
the local sequence length with global ``position_ids``, and the loss counts valid tokens over ``dp_cp``.

Image-text models (:mod:`.image_text`): the vision tower and the projector live in the first stage, which runs the
model's own forward up to its language model on its micro-batch's rows and images; every stage gets the masks and
positions that forward gives the language model.
"""

from lightning_plugins.parallel.pipeline.apply import attach_pipeline, pipeline_of
from lightning_plugins.parallel.pipeline.options import (
    SCHEDULES,
    PipelineOptions,
    check_pipeline_layout,
    layer_ranges,
    stages_of_rank,
)
from lightning_plugins.parallel.pipeline.runtime import Pipeline
from lightning_plugins.parallel.pipeline.split import StageCut, build_stages, keep_stage_layers, tied_pair_group
from lightning_plugins.parallel.pipeline.stage import StageModule

__all__ = [
    "attach_pipeline",
    "build_stages",
    "check_pipeline_layout",
    "SCHEDULES",
    "Pipeline",
    "PipelineOptions",
    "StageModule",
    "layer_ranges",
    "pipeline_of",
    "keep_stage_layers",
    "StageCut",
    "stages_of_rank",
    "tied_pair_group",
]
