"""Activation checkpointing of decoder layers: full, every N-th layer, or op-level selective.

transformers' decoder layers (``GradientCheckpointingLayer``) checkpoint their own ``forward`` when
``gradient_checkpointing`` is set, which keeps FSDP2's module hooks outside the recomputed region and
leaves parameter names untouched; we only choose which layers and what is saved.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts, noop_context_fn

from lightning_plugins.layout import LayoutError

MODES = ("none", "full", "selective")

# Outputs kept by op-level selective checkpointing: the matmuls and attention (the expensive ops);
# norms, activations and elementwise ops are recomputed.
_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def _save_matmuls(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> tuple:
    return create_selective_checkpoint_contexts(_save_matmuls)


def apply_activation_checkpointing(layers: Iterable[nn.Module], mode: str = "full", every_n_layers: int | None = None) -> None:
    """Checkpoint decoder layers.

    Args:
        layers: The decoder layers.
        mode: ``"none"``; ``"full"`` (every layer keeps only its input); ``"selective"`` (with
            ``every_n_layers``: every N-th layer is checkpointed fully; without: every layer saves its
            matmul and attention outputs and recomputes the rest).
        every_n_layers: For ``"selective"``: checkpoint layers ``0, N, 2N, ...``.

    Raises:
        LayoutError: for an unknown mode, a bad N, or layers that cannot checkpoint themselves.
    """
    if mode not in MODES:
        raise LayoutError(f"activation_checkpointing={mode!r} is not one of {MODES}.")
    if every_n_layers is not None and (mode != "selective" or every_n_layers < 1):
        raise LayoutError(
            f"every_n_layers={every_n_layers!r} needs activation_checkpointing='selective' and a positive integer."
        )
    if mode == "none":
        return
    op_level = mode == "selective" and every_n_layers is None
    function = partial(checkpoint, use_reentrant=False, context_fn=_selective_contexts if op_level else noop_context_fn)
    for index, layer in enumerate(layers):
        if every_n_layers is not None and index % every_n_layers:
            continue
        if not hasattr(type(layer), "gradient_checkpointing"):
            raise LayoutError(
                f"{type(layer).__name__} is not a transformers GradientCheckpointingLayer; activation checkpointing"
                " needs transformers >= 5 decoder layers."
            )
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = function

