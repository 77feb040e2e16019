"""Activation memory of decoder layers: checkpointing (full, every N-th layer, or op-level selective) and offload.

transformers' decoder layers (``GradientCheckpointingLayer``) checkpoint their own ``forward`` when
``gradient_checkpointing`` is set, which keeps FSDP2's module hooks outside the recomputed region and
leaves parameter names untouched; we only choose which layers and what is saved.

Activation offload moves what a layer saves for backward to host memory during its forward and brings it
back when backward needs it (:class:`offload_saved_tensors`, entered by module hooks around each layer's
call, so around the checkpoint of a checkpointed layer). It composes with checkpointing: a fully
checkpointed layer saves only its inputs (through torch's checkpoint), which is then what moves; the
recomputation in backward runs outside the hooks and stays on the device. Op-level selective checkpointing
keeps its matmul and attention outputs in the checkpoint's own cache: those stay on the device too.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_plugins.parallel.optim import offload
from lightning_plugins.errors import LayoutError
from lightning_plugins.parallel.options import CHECKPOINTING_MODES


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


def apply_activation_checkpointing(
    layers: Iterable[nn.Module], mode: str = "full", every_n_layers: int | None = None, *, offload: bool = False
) -> None:
    """Checkpoint decoder layers.

    Args:
        layers: The decoder layers.
        mode: ``"none"``; ``"full"`` (every layer keeps only its input); ``"selective"`` (with
            ``every_n_layers``: every N-th layer is checkpointed fully; without: every layer saves its
            matmul and attention outputs and recomputes the rest).
        every_n_layers: For ``"selective"``: checkpoint layers ``0, N, 2N, ...``.
        offload: Also offload what each layer saves for backward to host memory (:func:`apply_activation_offload`).

    Raises:
        LayoutError: for an unknown mode, a bad N, or layers that cannot checkpoint themselves.
    """
    if mode not in CHECKPOINTING_MODES:
        raise LayoutError(f"activation_checkpointing={mode!r} is not one of {CHECKPOINTING_MODES}.")
    if every_n_layers is not None and (mode != "selective" or every_n_layers < 1):
        raise LayoutError(
            f"every_n_layers={every_n_layers!r} needs activation_checkpointing='selective' and a positive integer."
        )
    layers = list(layers)
    if offload:
        apply_activation_offload(layers)
    if mode == "none":
        return
    op_level = mode == "selective" and every_n_layers is None
    # No context_fn unless op-level: torch.compile traces checkpoint() only without one (or with a plain function).
    function = partial(checkpoint, use_reentrant=False, **({"context_fn": _selective_contexts} if op_level else {}))
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



class _Shared:
    """One host copy that several saved tensors share (a tensor saved by several ops, and reshaped views of it),
    brought back to its device once, by the first of them backward needs."""

    __slots__ = ("packed", "device")

    def __init__(self, packed: Any) -> None:
        self.packed, self.device = packed, None

    def unpack(self) -> torch.Tensor:
        if self.device is None:
            self.device = offload.from_host(self.packed)
        return self.device


class _View(NamedTuple):
    """A saved view of a tensor moved whole: its geometry over the shared copy."""

    shared: _Shared
    size: torch.Size
    stride: tuple[int, ...]
    offset: int  # storage offset relative to the viewed tensor's


def _unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, _Shared):
        return packed.unpack()
    if isinstance(packed, _View):
        whole = packed.shared.unpack()
        return whole.as_strided(packed.size, packed.stride, whole.storage_offset() + packed.offset)
    return packed


class offload_saved_tensors(saved_tensors_hooks):  # a context manager, named like torch's save_on_cpu
    """Tensors saved for backward go to host memory (:func:`lightning_plugins.parallel.optim.offload.to_host`) and come back to
    their device when backward unpacks them; parameters stay. A tensor saved by several ops, or as views that cover it
    whole (a linear saves its input reshaped to 2-D: q, k and v each their own view of the norm's output), is moved
    once each way."""

    def __init__(self) -> None:
        moved: dict[int, tuple[torch.Tensor, int, _Shared]] = {}  # id(tensor) -> (tensor, its version, its copy)

        def pack(tensor: torch.Tensor) -> Any:
            base = None if isinstance(tensor, DTensor) else tensor._base
            whole = base if base is not None and base.numel() == tensor.numel() else tensor
            seen = moved.get(id(whole))
            if seen is not None and seen[0] is whole and seen[1] == whole._version:
                shared = seen[2]
            else:
                packed = offload.to_host(whole)
                if packed is whole:  # stays where it is (a parameter, an expanded view)
                    return tensor
                shared = _Shared(packed)
                moved[id(whole)] = (whole, whole._version, shared)
            if whole is tensor:
                return shared
            return _View(shared, tensor.size(), tensor.stride(), tensor.storage_offset() - whole.storage_offset())

        super().__init__(pack, _unpack)
        self._moved = moved

    def __exit__(self, *args: object) -> None:
        self._moved.clear()  # the originals may be freed now: only the host copies stay referenced (by autograd)
        super().__exit__(*args)


_OFFLOAD_ATTR = "_lightning_plugins_offload"


def _enter_offload(layer: nn.Module, args: object) -> None:
    context = offload_saved_tensors()
    context.__enter__()
    getattr(layer, _OFFLOAD_ATTR).append(context)


def _exit_offload(layer: nn.Module, args: object, output: object) -> None:
    getattr(layer, _OFFLOAD_ATTR).pop().__exit__(None, None, None)


def apply_activation_offload(layers: Iterable[nn.Module]) -> None:
    """Offload each decoder layer's saved activations to host memory for the duration of its call.

    Module hooks open :class:`offload_saved_tensors` before the layer's ``forward`` (and so before the checkpoint
    of a checkpointed layer) and close it after, also when the forward fails. Under pipeline parallelism the
    hooks sit on each stage's own layers; what they save for every micro-batch in flight goes to the host.
    """
    for layer in layers:
        if hasattr(layer, _OFFLOAD_ATTR):
            continue
        setattr(layer, _OFFLOAD_ATTR, [])
        layer.register_forward_pre_hook(_enter_offload)
        layer.register_forward_hook(_exit_offload, always_call=True)
