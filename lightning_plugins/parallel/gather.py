"""Gathering a parallelized model's full state: each DTensor whole on its pipeline stage's leader, every stage on rank 0.

Shared by the collective ``save_pretrained`` (:mod:`lightning_plugins.parallel.save_pretrained`) and the export of a
live model (:func:`lightning_plugins.checkpoint.live_export.export_hf`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed._state_dict_utils import _gather_state_dict

from lightning_plugins.parallel.mesh import mesh_of

__all__ = ["collect_stages", "full_on_leader", "stage_leader"]


def stage_leader(model: nn.Module) -> int:
    """The global rank that collects this pipeline stage's full tensors (its first rank; rank 0 without PP)."""
    mesh = mesh_of(model)
    if mesh is None:
        return 0
    coordinate = mesh.get_coordinate()
    return int(mesh.mesh[(coordinate[0], *[0] * (mesh.ndim - 1))])


def full_on_leader(model: nn.Module, sharded: dict[str, Any]) -> dict[str, Any]:
    """The full (unsharded) CPU tensors of a (nested) state dict on the stage leader; ``{}`` elsewhere.

    Every rank gathers each DTensor with the ranks that share it (``full_tensor``); only the leader keeps it.
    """
    # DTensor logs a warning for every TP x FSDP2 weight it gathers in two steps; for an export that is fine.
    redistribute_log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = redistribute_log.level
    redistribute_log.setLevel(logging.ERROR)
    try:
        # torch's own full-state-dict gatherer (what get_model_state_dict uses), told which rank keeps the result.
        leader = (stage_leader(model),) if dist.is_initialized() else ()
        return _gather_state_dict(sharded, cpu_offload=True, ranks_only=leader)
    finally:
        redistribute_log.setLevel(level)


def collect_stages(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """Rank 0 receives every pipeline stage leader's part; without pipeline parallelism, nothing moves.

    Parts are merged key by key (one level down for per-adapter dictionaries).
    """
    mesh = mesh_of(model)
    if mesh is None or mesh["pp"].size() == 1:
        return state
    if dist.get_rank() != stage_leader(model):
        return {}
    # The leaders are the pipeline group of rank 0 (every other coordinate 0).
    parts: list[Any] | None = [None] * mesh["pp"].size() if dist.get_rank() == 0 else None
    dist.gather_object(state, parts, dst=0, group=mesh["pp"].get_group())
    merged: dict[str, Any] = {}
    for part in parts or []:
        for key, value in part.items():
            if isinstance(value, dict):
                merged.setdefault(key, {}).update(value)
            else:
                merged[key] = value
    return merged
