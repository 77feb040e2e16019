"""The device mesh a parallelized model carries, the sub-meshes the engine's steps work on, and what a mesh was
built for.

A mesh is torch's object: nothing of ours is set on it. What it was built for (the layout, with ``ep_size``, which
adds no mesh dimension; the :class:`~lightning_plugins.parallel.plan.ParallelPlan` that built it) is kept beside it,
in a :class:`MeshRegistry` keyed by the mesh object and forgotten with it.
"""

from __future__ import annotations

import weakref
from typing import Generic, TypeVar

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MeshRegistry", "attach_mesh", "data_mesh", "fsdp_mesh", "mesh_of"]

_MESH_ATTR = "_lightning_plugins_mesh"

T = TypeVar("T")


class MeshRegistry(Generic[T]):
    """What each mesh object was built for, kept as long as the mesh lives (keyed by identity, not by equality:
    two meshes over the same ranks may be built for different layouts)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, T]] = {}

    def record(self, mesh: DeviceMesh, value: T) -> None:
        """Remember ``value`` for ``mesh`` (replacing what was recorded for it)."""
        key = id(mesh)
        self._entries[key] = (weakref.ref(mesh, lambda _, key=key: self._entries.pop(key, None)), value)

    def get(self, mesh: DeviceMesh) -> T | None:
        """What was recorded for ``mesh``, or ``None``."""
        entry = self._entries.get(id(mesh))
        return entry[1] if entry is not None and entry[0]() is mesh else None


def attach_mesh(model: nn.Module, mesh: DeviceMesh) -> None:
    """Record on ``model`` the mesh ``parallelize`` applied to it (read back by :func:`mesh_of`)."""
    setattr(model, _MESH_ATTR, mesh)


def mesh_of(model: nn.Module) -> DeviceMesh | None:
    """The mesh ``parallelize`` applied to ``model`` (``None`` if it was not parallelized)."""
    return getattr(model, _MESH_ATTR, None)


def data_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """Ranks that hold different tokens (data replicas, shards and context shards), or ``None``."""
    return mesh["dp_cp"] if mesh["dp_cp"].size() > 1 else None


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """FSDP2's mesh: 1-D ``dp_shard_cp``, 2-D ``(dp_replicate, dp_shard_cp)`` for HSDP, or ``None``."""
    if mesh["dp_cp"].size() == 1:
        return None
    if mesh["dp_replicate"].size() > 1:
        return mesh["dp_replicate", "dp_shard_cp"]
    return mesh["dp_shard_cp"]
