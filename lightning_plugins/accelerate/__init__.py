"""The Accelerate door: :class:`ParallelAccelerator` and the recipe runner ``python -m lightning_plugins.accelerate``.

``accelerate launch --config_file accelerate_configs/<hardware>.yaml -m lightning_plugins.accelerate RECIPE.yaml``
trains a recipe; ``ParallelAccelerator(tp_size=2, ...)`` in place of ``Accelerator(...)`` runs a user's own loop
with any layout of the engine. Nothing here imports Lightning.
"""

from lightning_plugins.accelerate.accelerator import ParallelAccelerator

__all__ = ["ParallelAccelerator"]
