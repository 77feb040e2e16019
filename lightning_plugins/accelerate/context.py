"""What ``ParallelAccelerator.maybe_context_parallel`` does with the buffers a loop written for Accelerate gives it.

The prepared data loaders already hand each context-parallel rank its sequence shard of every batch, so the loader's
tensors are left as they are. One kind of buffer is made right: position ids the loop built from the shard's length.
Accelerate's ND-parallel example sets ``batch["position_ids"] = torch.arange(0, batch["input_ids"].size(1))`` and
passes them to the context, meaning the positions of the whole sequence (Accelerate's context shards them); built from
a shard, every rank's would start at 0. They are overwritten in place with the positions the loader gave this rank's
shard, which is what Accelerate's context would have made of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["position_whole_sequence"]


def position_whole_sequence(loaders: Iterable[Any], buffers: list[Tensor], seq_dims: list[int]) -> None:
    """Overwrite each buffer that is ``0 .. shard_len-1`` along its last dimension, and not a loader's own tensor, with
    the position ids the loader gave this rank's shard (for a ``[1, seq]`` buffer: when every row has the same).

    Args:
        loaders: The prepared data loaders; the one whose last batch holds one of ``buffers`` is the batch's.
        buffers: What the loop passed to ``maybe_context_parallel``.
        seq_dims: Their sequence dimensions.
    """
    shards = next((s for s in (getattr(ld, "last_shards", {}) for ld in loaders) if _holds(s, buffers)), {})
    positions = shards.get("position_ids")
    if positions is None:
        return
    for buffer, dim in zip(buffers, seq_dims):
        if _holds(shards, [buffer]) or not _counts_from_zero(buffer, dim, positions):
            continue
        if buffer.shape[0] == 1 and not torch.equal(positions, positions[:1].expand_as(positions)):
            continue  # rows positioned differently (packed): no single row stands for them
        buffer.copy_(positions[: buffer.shape[0]])


def _counts_from_zero(buffer: Tensor, dim: int, positions: Tensor) -> bool:
    """Whether ``buffer`` is integer ``0 .. n-1`` along its last dimension, shaped like ``positions`` or one row."""
    if buffer.dtype.is_floating_point or dim % buffer.ndim != buffer.ndim - 1:
        return False
    if buffer.shape[-1] != positions.shape[-1] or buffer.shape[0] not in (1, positions.shape[0]):
        return False
    return torch.equal(buffer, torch.arange(buffer.shape[-1], device=buffer.device).expand_as(buffer))


def _holds(batch: dict[str, Any], tensors: list[Tensor]) -> bool:
    """Whether one of ``tensors`` is (the very object of) a value of ``batch``."""
    return any(t is value for t in tensors for value in batch.values())
