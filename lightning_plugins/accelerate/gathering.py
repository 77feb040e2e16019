"""Gathering over the data-parallel ranks only: tensor, context and pipeline peers hold the same samples, so
Accelerate's gather over every process would repeat each sample once per peer."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from accelerate.utils import recursively_apply
from torch import Tensor

__all__ = ["all_tensors", "gather_objects", "gather_tensors"]

# torch 2.13 renamed all_gather_into_tensor (the old name warns).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_tensors(tensor: Any, group: dist.ProcessGroup) -> Any:
    """Every tensor in ``tensor`` (nested as Accelerate nests them) concatenated over the ranks of ``group``."""

    def gather_one(local: Tensor) -> Tensor:
        local = local.reshape(1) if local.ndim == 0 else local.contiguous()
        out = local.new_empty((dist.get_world_size(group) * local.shape[0], *local.shape[1:]))
        _all_gather_single(out, local, group=group)
        return out

    return recursively_apply(gather_one, tensor, error_on_other_type=True)


def all_tensors(data: Any) -> bool:
    """Whether ``data`` holds tensors only (nested as Accelerate nests them)."""
    try:
        recursively_apply(lambda x: x, data, error_on_other_type=True)
    except TypeError:
        return False
    return True


def gather_objects(data: Any, group: dist.ProcessGroup, gradient_state: Any) -> list[Any]:
    """The items of every rank's ``data`` in rank order; the last batch's duplicated samples dropped, as in
    Accelerate's ``gather_for_metrics``."""
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, data, group=group)
    items = [item for part in parts for item in part]
    state = gradient_state
    return items[: state.remainder] if state.end_of_dataloader and state.remainder > 0 else items
