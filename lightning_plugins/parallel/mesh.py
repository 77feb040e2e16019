"""The device mesh a parallelized model carries, and the sub-meshes the engine's steps work on."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["attach_mesh", "data_mesh", "fsdp_mesh", "mesh_of"]

_MESH_ATTR = "_lightning_plugins_mesh"


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
