"""What autograd keeps for backward, measured (shared by the memory-lever tests)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def saved_bytes(fn: Callable[[], object]) -> int:
    """Bytes of the distinct storages autograd saves while ``fn`` runs (parameters excluded)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


class LargestTensor(TorchDispatchMode):
    """The bytes of the largest tensor any operation creates while it is on (views of existing ones aside), of
    ``dtype`` only when given."""

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.dtype, self.largest = dtype, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for tensor in () if func.is_view else tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and self.dtype in (None, tensor.dtype):
                self.largest = max(self.largest, tensor.numel() * tensor.element_size())
        return out
