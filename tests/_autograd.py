"""What autograd keeps for backward, measured (shared by the memory-lever tests)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


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
