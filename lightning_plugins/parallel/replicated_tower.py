"""Under tensor parallelism, an image-text model's vision tower and projector replicated over ``tp``, run on local
copies of their weights.

Every tensor-parallel rank encodes the same images: the tower's input (the pixels) is the same on each, and so is the
gradient that reaches its output (the language model's embeddings are whole on every rank, their gradient all-reduced
by the first layer's region). Each module of the image path holds its weights as DTensors replicated over ``tp`` (so
gradient clipping and FSDP2 see one mesh, as for every other weight) and runs its own forward on their local copies,
whose gradient is taken as replicated: no collective, and no op of the tower needs a DTensor rule (Gemma 3's
projector pools with ``avg_pool2d``, whose backward DTensor cannot shard). A module's weights are swapped for the
call of its own forward only, so FSDP2 units inside the tower (each vision block) gather theirs first.

A checkpointed vision block (activation checkpointing) recomputes its forward in the backward, after the tower's call
has put its DTensor weights back: its checkpointed function swaps in the block's local copies itself
(:func:`recompute_on_local_copies`), in the forward and in the recompute alike.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from lightning_plugins.parallel.image_text import ImageTextParts

__all__ = ["recompute_on_local_copies", "replicate_image_path"]


def replicate_image_path(model: nn.Module, parts: ImageTextParts, tp_mesh: DeviceMesh) -> None:
    """Hold the vision tower's and the projector's weights replicated over ``tp_mesh``; the tower, each vision block
    and each projector module run on local copies of the weights they hold (before the rest of the model is
    replicated as DTensor modules)."""
    tower = model.get_submodule(parts.vision_path)
    projector = [model.get_submodule(path) for path in parts.projector_paths]
    for root in (tower, *projector):
        for module in root.modules():
            for name, param in list(module._parameters.items()):
                if param is not None and not isinstance(param, DTensor):
                    replicated = distribute_tensor(param.data, tp_mesh, [Replicate()])
                    module.register_parameter(name, nn.Parameter(replicated, param.requires_grad))
    for root in dict.fromkeys((tower, *parts.vision_units(model))):  # the FSDP2 units gather theirs when called
        root.forward = _OnLocalCopies(root)  # type: ignore[method-assign]


def recompute_on_local_copies(blocks: nn.Module) -> None:
    """Make each checkpointed block among ``blocks`` (a transformers ``GradientCheckpointingLayer`` whose
    ``_gradient_checkpointing_func`` activation checkpointing set) run its checkpointed forward, and so its recompute,
    on the local copies of its replicated weights."""
    for block in blocks:
        if getattr(block, "gradient_checkpointing", False):
            block._gradient_checkpointing_func = _CheckpointOnLocalCopies(block, block._gradient_checkpointing_func)


class _CheckpointOnLocalCopies:
    """A block's checkpointing function whose checkpointed forward runs on its local weight copies."""

    def __init__(self, block: nn.Module, checkpoint: Any) -> None:
        self.block, self.checkpoint = block, checkpoint

    def __call__(self, forward: Any, *args: Any, **kwargs: Any) -> Any:
        return self.checkpoint(_OnLocalCopies(self.block, forward), *args, **kwargs)


class _OnLocalCopies:
    """A module's forward (an instance attribute) run on the local copies of the replicated weights it and its
    submodules hold (a module may read a submodule's weight itself: SigLIP's pooling head reads its attention's
    ``out_proj.weight``), put back even when the call does not return. Weights still sharded by FSDP2 over the data
    ranks (a 2-D mesh: a vision block's, before its own call gathers them) are left to that call."""

    def __init__(self, module: nn.Module, forward: Any = None) -> None:
        self.module, self.forward = module, forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        saved = []
        for sub in self.module.modules():
            for name, param in list(sub._parameters.items()):
                if isinstance(param, DTensor) and param.device_mesh.ndim == 1:
                    saved.append((sub, name, param))
                    # Each rank's gradient is the whole one: replicated, not summed.
                    sub._parameters[name] = param.to_local(grad_placements=param.placements)
        try:
            if self.forward is not None:
                return self.forward(*args, **kwargs)
            # The class's forward as it is at the call: FSDP2 subclasses the module's class later, and transformers
            # checkpoints a layer only in its outermost class's forward.
            return type(self.module).forward(self.module, *args, **kwargs)
        finally:
            for sub, name, param in saved:
                sub._parameters[name] = param
