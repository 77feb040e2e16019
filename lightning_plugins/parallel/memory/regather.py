"""Sequence-parallel regions that all-gather their input again in backward instead of keeping it (Megatron's way).

Under sequence parallelism a region (attention, MLP) all-gathers its sequence-sharded input once; the
column-parallel projections then save that gathered input for their weight gradients, ``tp`` times the shard.
:class:`RegatherInBackward` keeps the shard instead: while the region runs forward, a ``saved_tensors_hooks`` pair
replaces every saved tensor that lives in the gathered input's storage by a reference to the shard, and in
backward the first projection that needs it all-gathers the shard once more; the projections after it (k/v after
q, up after gate) reuse that copy, which is dropped when the last of them has it. Cost: one more all-gather of the
region's input per region and step (``(tp - 1) / tp`` of it received per rank); saved: the gathered input less its
shard, per region.

The hooks are transparent to saved-tensor hooks already active around the region (a memory tracker such as
``benchmarks/sp_fallback_memory.py``'s): every other tensor goes through them, and so does the shard. Activation
checkpointing and offload decide themselves what a layer keeps; ``MemoryOptions`` refuses ``sp_regather`` with them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor, Replicate


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's own buffer behind a DTensor or a pending collective's output."""
    if isinstance(tensor, DTensor):
        tensor = tensor._local_tensor
    return tensor.elem if isinstance(tensor, AsyncCollectiveTensor) else tensor


class _Gathered:
    """One forward of a region: its input's shard, and the gathered copy backward rebuilds (once, shared)."""

    def __init__(self, shard: DTensor, gathered: DTensor) -> None:
        self.shard = shard.detach()
        local = _local(gathered)
        self.storage = local.untyped_storage()._cdata  # the StorageImpl: also on meta and fake tensors
        self.size, self.stride, self.offset = local.size(), local.stride(), local.storage_offset()
        self.pending = 0  # saved tensors not yet unpacked
        self.copy: torch.Tensor | None = None

    def rebuild(self) -> torch.Tensor:
        if self.copy is None:
            with torch.no_grad():
                local = self.shard.redistribute(placements=[Replicate()]).to_local()
            if isinstance(local, AsyncCollectiveTensor):
                local = local.wait()
            if local.stride() != self.stride or local.storage_offset() != self.offset:
                local = torch.empty_strided(self.size, self.stride, dtype=local.dtype, device=local.device).copy_(local)
            self.copy = local
        copy = self.copy
        self.pending -= 1
        if self.pending <= 0:
            self.copy = None
        return copy


class _Saved:
    """A saved tensor that was a view of the gathered input: how to cut it out of the rebuilt copy."""

    def __init__(self, tensor: torch.Tensor, gathered: _Gathered) -> None:
        local = _local(tensor)
        self.gathered = gathered
        self.view = (local.size(), local.stride(), local.storage_offset())
        self.spec = (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride()) if isinstance(tensor, DTensor) else None
        self.requires_grad = tensor.requires_grad
        gathered.pending += 1

    def unpack(self) -> torch.Tensor:
        local = self.gathered.rebuild().as_strided(*self.view)
        if self.spec is None:
            return local
        mesh, placements, shape, stride = self.spec
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


class RegatherInBackward:
    """Make ``region`` keep its gathered input's shard for backward, not the gathered input.

    :meth:`begin` is called by the region's input hook (``parallel/tensor.py``) with the shard and the gathered
    input; the hooks then stay on until the region's forward returns.
    """

    def __init__(self, region: nn.Module) -> None:
        self.current: _Gathered | None = None
        self.hooks: Any = None
        self.outer: tuple[Any, Any] | None = None
        region.register_forward_hook(self._end, always_call=True)

    def begin(self, shard: DTensor, gathered: DTensor) -> None:
        self.current = _Gathered(shard, gathered)
        if torch.is_grad_enabled():
            self.outer = torch._C._autograd._top_saved_tensors_default_hooks(True)
            self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self.hooks.__enter__()

    def _end(self, *_: Any) -> None:
        if self.hooks is not None:
            self.hooks.__exit__(None, None, None)
        self.hooks = self.current = None

    def _pack(self, tensor: torch.Tensor) -> Any:
        current = self.current
        outer = self.outer
        if current is not None and _local(tensor).untyped_storage()._cdata == current.storage:
            saved = _Saved(tensor, current)
            if outer is not None:  # the outer hooks see what is kept: the shard
                saved.shard = outer[0](current.shard)
            return saved
        return _Outer(outer[0](tensor), outer[1]) if outer is not None else tensor

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, _Saved):
            return packed.unpack()
        return packed.unpack() if isinstance(packed, _Outer) else packed


class _Outer:
    """A tensor packed by the saved-tensor hooks that were active around the region."""

    def __init__(self, packed: Any, unpack: Any) -> None:
        self.packed, self.unpack_fn = packed, unpack

    def unpack(self) -> torch.Tensor:
        return self.unpack_fn(self.packed)
