"""Lightning doors: strategies that hand the LightningModule's HF model to the engine.

Importing this module registers the strategies in Lightning's registry, so
``Trainer(strategy="tensor_parallel")`` works once ``lightning_plugins.strategies`` is imported.
"""

import warnings

from lightning.pytorch.strategies import StrategyRegistry

from lightning_plugins.strategies.context_parallel import ContextParallelStrategy
from lightning_plugins.strategies.parallelism import ParallelismStrategy
from lightning_plugins.strategies.pipeline_parallel import PipelineParallelStrategy
from lightning_plugins.strategies.tensor_parallel import TensorParallelStrategy

__all__ = ["ContextParallelStrategy", "ParallelismStrategy", "PipelineParallelStrategy", "TensorParallelStrategy"]

for _name, _cls, _description in (
    ("parallelism", ParallelismStrategy, "FSDP2 + tensor/sequence/loss parallel for HF models (lightning_plugins)"),
    ("tensor_parallel", TensorParallelStrategy, "Tensor parallel over each node, FSDP2 across nodes (lightning_plugins)"),
    ("pipeline_parallel", PipelineParallelStrategy, "Pipeline stages (GPipe/1F1B/interleaved/zero bubble) (lightning_plugins)"),
    ("context_parallel", ContextParallelStrategy, "Context parallel (Ulysses) over each node, FSDP2 across (lightning_plugins)"),
):
    if _name not in StrategyRegistry:
        StrategyRegistry.register(_name, _cls, description=_description)

# Lightning 2.6 on torch 2.13 warns on every training step about its own use of a torch pytree API; nothing
# a user of these strategies can act on.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
