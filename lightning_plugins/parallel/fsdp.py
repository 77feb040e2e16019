"""FSDP2 over the data dimensions: per-layer ``fully_shard``, HSDP, mixed precision and CPU offload."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from lightning_plugins.errors import LayoutError
from lightning_plugins.parallel.dtypes import MIXED_PRECISION_DTYPES


def mixed_precision_policy(param_dtype: str | torch.dtype | None, reduce_dtype: str | torch.dtype | None) -> MixedPrecisionPolicy:
    """FSDP2's policy from dtype names (``"bf16"``, ``"fp32"``) or dtypes; ``None`` keeps the parameters' dtype."""

    def as_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
        if value is None or isinstance(value, torch.dtype):
            return value
        if value not in MIXED_PRECISION_DTYPES:
            names = sorted(MIXED_PRECISION_DTYPES)
            raise LayoutError(f"Unknown dtype {value!r} for mixed precision; use one of {names}.")
        return MIXED_PRECISION_DTYPES[value]

    return MixedPrecisionPolicy(param_dtype=as_dtype(param_dtype), reduce_dtype=as_dtype(reduce_dtype))


def offload_policy(cpu_offload: bool, device_type: str) -> OffloadPolicy:
    """``CPUOffloadPolicy`` when asked; pinned memory needs an accelerator, so CPU runs skip pinning."""
    if not cpu_offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device_type != "cpu")


def apply_fsdp(
    model: nn.Module,
    layers: nn.ModuleList,
    mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload: OffloadPolicy | None = None,
    reshard_after_forward: bool = True,
) -> None:
    """Shard each decoder layer and then the root (embeddings, final norm, ``lm_head``).

    Args:
        model: The (possibly tensor-parallel) model.
        layers: Its decoder layers, each its own all-gather/reduce-scatter unit.
        mesh: 1-D (FSDP) or 2-D ``(dp_replicate, dp_shard_cp)`` (HSDP) data mesh.
        mp_policy: Mixed precision (``None``: compute and reduce in the parameters' dtype).
        offload: ``CPUOffloadPolicy`` to keep sharded parameters and optimizer state on the CPU.
        reshard_after_forward: Free gathered parameters after forward (ZeRO-3); ``False`` keeps
            them until backward (ZeRO-2-like, more memory, fewer all-gathers).
    """
    kwargs = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy(), "offload_policy": offload or OffloadPolicy()}
    last = len(layers) - 1
    for index, layer in enumerate(layers):
        # The last layer's parameters are needed again at once by backward: keep them gathered.
        fully_shard(layer, reshard_after_forward=reshard_after_forward and index < last, **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)
