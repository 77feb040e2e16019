"""The engine: a transformers causal LM turned into its parallel form.

The entry point is :mod:`.api` (:func:`parallelize`); beside it the dimensions (:mod:`.tensor`, :mod:`.fsdp`,
:mod:`.context`, :mod:`.pipeline`, :mod:`.moe`), the memory levers (:mod:`.memory`), the optimizer's work
(:mod:`.optim`), and what they share: the layout (:mod:`.layout`), the options (:mod:`.options`), the checks
(:mod:`.checks`), the model families (:mod:`.families`) and the loss (:mod:`.loss`). The engine imports neither
``lightning`` nor ``accelerate``, nor the adapters (which import it).

One run resolves one :class:`~lightning_plugins.parallel.plan.ParallelPlan` (:func:`~lightning_plugins.parallel.plan.resolve`):
the layout, the options and the memory options, checked once against the model's config and the world, and the
meshes built for them. ``parallelize(model, plan)`` applies it: the pipeline cut when ``pp_size > 1``, one per-part
sequence (experts, TP, CP, activation checkpointing, compile), FSDP2 per root (the model, or each stage).

The walk of one setting, ``ep_size``: the recipe's ``layout: {ep_size: 2}`` is read by
:func:`~lightning_plugins.recipe.schema.load_recipe` into the typed section ``Recipe.layout``, a
:class:`~lightning_plugins.parallel.layout.ParallelLayout` (whose ``__post_init__`` refuses a non-positive size), and
checked before any process starts against the recipe's world (``hardware``) and the model's config. The door's runner
hands that layout whole to the door (``layout=recipe.layout``; in code, its sizes by name:
``ParallelAccelerator(ep_size=2)``, ``ParallelismStrategy(ep_size=2)``, merged by
:func:`~lightning_plugins.parallel.layout.layout_of`), which resolves its plan once
(:func:`~lightning_plugins.parallel.plan.resolve`): :meth:`ParallelLayout.resolve` against the world, where
``ep_size`` must divide ``dp_shard x cp``, then :func:`~lightning_plugins.parallel.checks.check_settings`, where compile
or the step in backward refuse it and, once the model's config is known, :meth:`ParallelLayout.validate` checks it
against the config's experts (a plan resolved before the model existed runs only that part,
:func:`~lightning_plugins.parallel.checks.check_model_fit`, from
:meth:`~lightning_plugins.parallel.plan.ParallelPlan.check_config`).
The plan builds the mesh (``ep_size`` adds no mesh dimension) and the door hands the plan to
``parallelize(model, plan)`` (a user's ``parallelize(model, door.device_mesh)`` finds it from the mesh).
``plan.experts`` unflattens ``dp_shard_cp`` into ``(dp_shard_mod_ep, ep)``
(:func:`~lightning_plugins.parallel.moe.experts.expert_meshes`),
:func:`~lightning_plugins.parallel.moe.experts.apply_expert_parallel` shards each experts module's weights
``Shard(0)`` over ``ep``, FSDP2 shards them over the rest, and in the forward the tokens travel to their experts by
all-to-all and meet them in one grouped GEMM (``torch._grouped_mm``).
"""

from lightning_plugins.parallel.api import check_parallelizable, check_same_settings, parallelize
from lightning_plugins.parallel.checks import check_settings
from lightning_plugins.parallel.context import context_parallel_batch
from lightning_plugins.parallel.grad import clip_grad_norm_, reduce_partial_state, total_grad_norm
from lightning_plugins.parallel.mesh import data_mesh, fsdp_mesh, mesh_of
from lightning_plugins.parallel.pipeline import pipeline_of

__all__ = [
    "parallelize",
    "mesh_of",
    "pipeline_of",
    "data_mesh",
    "fsdp_mesh",
    "clip_grad_norm_",
    "total_grad_norm",
    "reduce_partial_state",
    "check_same_settings",
    "check_parallelizable",
    "check_settings",
    "context_parallel_batch",
]
