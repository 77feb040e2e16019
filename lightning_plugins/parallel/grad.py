"""The true global gradient norm over DTensors on several meshes, and clipping by it.

``torch.nn.utils.clip_grad_norm_`` fails on a mix of plain tensors and DTensors ("got mixed
torch.Tensor and DTensor") and on DTensors of different meshes. Gradients are grouped by mesh and
placements; each group's norm is reduced by DTensor itself (``full_tensor``), and pipeline stages,
which hold disjoint parameters, are summed over the ``pp`` group.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def total_grad_norm(parameters: Iterable[Tensor], norm_type: float = 2.0, pp_mesh: DeviceMesh | None = None) -> Tensor:
    """The norm of all gradients of ``parameters`` as one vector, identical on every rank.

    Args:
        parameters: Parameters whose ``.grad`` count (plain tensors and DTensors, any meshes).
        norm_type: The p of the p-norm (``float("inf")`` for the max norm).
        pp_mesh: The pipeline mesh when each stage holds different parameters, else ``None``.
    """
    groups: dict[object, list[Tensor]] = defaultdict(list)
    for param in parameters:
        grad = param.grad
        if grad is not None:
            key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
            groups[key].append(grad)
    norms = []
    # A scalar partial over a 2-D mesh is reduced one dimension at a time; DTensor warns about that
    # on every call, but for one scalar per group the cost is nil.
    redistribute_log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = redistribute_log.level
    redistribute_log.setLevel(logging.ERROR)
    try:
        for grads in groups.values():
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, norm_type)), norm_type)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    finally:
        redistribute_log.setLevel(level)
    device = norms[0].device if norms else torch.device("cpu")
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type) if norms else torch.zeros((), device=device)
    if pp_mesh is not None and pp_mesh.size() > 1:
        if norm_type == float("inf"):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_mesh.get_group())
        else:
            total = total**norm_type
            dist.all_reduce(total, group=pp_mesh.get_group())
            total = total ** (1.0 / norm_type)
    return total


def clip_grad_norm_(
    parameters: Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    pp_mesh: DeviceMesh | None = None,
    *,
    pipeline: Any = None,
) -> Tensor:
    """Scale gradients in place so their global norm is at most ``max_norm``; return the norm before.

    Args:
        parameters: Parameters whose ``.grad`` count (plain tensors and DTensors, any meshes).
        max_norm: The largest global norm the gradients keep.
        norm_type: The p of the p-norm (``float("inf")`` for the max norm).
        pp_mesh: The pipeline mesh when each stage holds different parameters, else ``None``.
        pipeline: The model's :class:`~lightning_plugins.parallel.pipeline.runtime.Pipeline` under pipeline
            parallelism: it clips instead (over all stages, counting a tied embedding held by the first and the last
            stage once). Both doors dispatch their clipping here.
    """
    if pipeline is not None:
        return pipeline.clip_grad_norm_(parameters, max_norm, norm_type)
    parameters = list(parameters)
    total = total_grad_norm(parameters, norm_type, pp_mesh)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for param in parameters:
        if param.grad is not None:
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            grad.mul_(coef.to(grad.device))
    return total


def reduce_partial_state(state: Any) -> Any:
    """``state`` (e.g. an optimizer state dict, nested) with every pending-sum (``Partial``) DTensor reduced.

    Under sequence parallelism a replicated norm weight's gradient is a pending sum over the tensor-parallel ranks,
    and optimizers keep state derived from it in that form (SGD's momentum buffer): the step is right, since DTensor
    reduces the sum where it is needed. A distributed checkpoint cannot keep it so: torch 2.15's DCP refuses partial
    DTensors, and 2.13 stored each rank's part (a resharded resume would read parts as sums). Reduced, the saved state
    is what one process holds.
    """
    from torch.distributed.tensor import Replicate
    from torch.utils._pytree import tree_map_only

    def reduce(tensor: DTensor) -> DTensor:
        if not any(p.is_partial() for p in tensor.placements):
            return tensor
        return tensor.redistribute(placements=[Replicate() if p.is_partial() else p for p in tensor.placements])

    return tree_map_only(DTensor, reduce, state)
