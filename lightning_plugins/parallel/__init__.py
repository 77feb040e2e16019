"""The engine: a transformers causal LM turned into its parallel form.

The entry point is :mod:`.api` (:func:`parallelize`); beside it the dimensions (:mod:`.tensor`, :mod:`.fsdp`,
:mod:`.context`, :mod:`.pipeline`, :mod:`.moe`), the memory levers (:mod:`.memory`), the optimizer's work
(:mod:`.optim`), and what they share: the layout (:mod:`.layout`), the options (:mod:`.options`), the checks
(:mod:`.checks`), the model families (:mod:`.families`) and the loss (:mod:`.loss`). The engine imports neither
``lightning`` nor ``accelerate``, nor the adapters (which import it).
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
