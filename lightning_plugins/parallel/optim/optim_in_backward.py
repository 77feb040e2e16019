"""The optimizer step fused into backward (``memory.optimizer_in_backward``): each parameter's gradient is applied
and freed as soon as backward has produced it, so a step never holds a full set of gradients (torchtune's
``optimizer_in_bwd``, on torch's ``register_post_accumulate_grad_hook``).

Unlike torchtune's one-optimizer-per-parameter wrapper, the optimizer stays ONE ordinary optimizer over all the
trainable parameters: a parameter's hook calls its ``step()`` while that parameter is the only one holding a gradient
(the ones before it were freed, the ones after it are not produced yet, and AdamW skips parameters without one),
then frees the gradient. Its state dict, DCP checkpoints, the LR schedule (``LambdaLR`` over it, stepped once per
optimizer step as before) and ``memory.optimizer_offload`` work unchanged, and the door's own ``optimizer.step()``
after backward finds no gradient and does nothing. Under FSDP2 the hook fires on the sharded parameter after the
reduce-scatter (FSDP2 runs the post-accumulate-grad hooks of the sharded parameters), so each rank steps its shard.

What it changes: gradient clipping needs the global norm of all the gradients before any is applied, so it is
refused (``optim.max_grad_norm: null``); gradient accumulation would step on each micro-batch's partial gradient,
so more than one micro-batch per step is refused, and so are pipeline parallelism (its micro-batches accumulate),
tensor and context parallelism and expert parallelism (their gradients get a last reduction after backward). Checked
where the settings meet (:func:`lightning_plugins.parallel.checks.check_settings`; the recipe's validation calls
:func:`check_step_in_backward`).

The gradient norm is still known: after backward no gradient is left for a norm to see, so each hook adds its
gradient's sum of squares (this rank's shard, in fp32) before applying it, and :meth:`StepInBackward.grad_norm`
reduces the sums once after backward as :func:`~lightning_plugins.parallel.total_grad_norm` reduces a step's norms
(per mesh and placements; summed over the sharded mesh dimensions, not over the replicated ones). The doors log it as
``train/grad_norm`` and hand it to the non-finite guard, which under ``train.on_nonfinite: stop`` stops the run (the
weights already took that step).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_plugins.errors import LayoutError, OptionsError

__all__ = ["StepInBackward", "check_step_in_backward", "step_in_backward", "stepping_in_backward"]

#: The hooks installed on each optimizer (a later :func:`step_in_backward` on the same optimizer replaces them).
_INSTALLED: weakref.WeakKeyDictionary[Optimizer, StepInBackward] = weakref.WeakKeyDictionary()


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _group(tensor: Tensor) -> object:
    """What :func:`~lightning_plugins.parallel.total_grad_norm` groups a gradient by: its mesh and placements."""
    return (tensor.device_mesh, tensor.placements) if isinstance(tensor, DTensor) else None


class StepInBackward:
    """The hooks of :func:`step_in_backward` on one optimizer, and the gradient norm of what they applied.

    Args:
        optimizer: See :func:`step_in_backward`.
        params: The parameters to hook.
    """

    def __init__(self, optimizer: Optimizer, params: Iterable[Tensor]) -> None:
        self.optimizer = optimizer
        hooked = [p for p in params if p.requires_grad]
        # Every rank seeds the same groups in the same order, so `grad_norm` runs the same collectives everywhere.
        self._where: dict[object, torch.device] = {}
        for param in hooked:
            self._where.setdefault(_group(param), _local(param).device)
        self._sums: dict[object, Tensor] = {}
        self.handles: list[RemovableHandle] = [p.register_post_accumulate_grad_hook(self._apply) for p in hooked]

    def _apply(self, param: Tensor) -> None:
        grad = param.grad
        if grad is not None:  # its share of the step's norm, before the step consumes it
            key = _group(grad)
            local = _local(grad).detach()
            square = torch.linalg.vector_norm(local, dtype=torch.float32).square()
            self._sums[key] = square if key not in self._sums else self._sums[key] + square
            self._where.setdefault(key, local.device)
        self.optimizer.step()
        param.grad = None

    def grad_norm(self) -> Tensor:
        """The global 2-norm of the gradients applied since the last call (identical on every rank), in fp32.

        What a plain step's :func:`~lightning_plugins.parallel.clip_grad_norm_` returns before the optimizer steps.
        Call it once per optimizer step, after backward, on every rank (one ``all_reduce`` per sharded mesh
        dimension of each group); the sums start again from zero.

        Raises:
            LayoutError: For a gradient that is a pending sum (``Partial``): it is not final when its hook runs.
        """
        total: Tensor | None = None
        for key, device in self._where.items():
            square = self._sums.get(key)
            if square is None:  # no gradient of this group on this rank: its peers may have some
                square = torch.zeros((), dtype=torch.float32, device=device)
            if key is not None:
                mesh, placements = key  # type: ignore[misc]
                for dim, placement in enumerate(placements):
                    if placement.is_partial():
                        raise LayoutError(
                            f"optimizer_in_backward: a gradient on mesh {mesh.mesh_dim_names} is a pending sum"
                            f" ({placements}) when its optimizer step runs. Use FSDP2 (dp_shard_size,"
                            " dp_replicate_size) or one GPU, or turn optimizer_in_backward off."
                        )
                    if placement.is_shard():  # each rank holds a part: the parts' squares add up
                        dist.all_reduce(square, group=mesh.get_group(dim))
            total = square if total is None else total + square.to(total.device)
        self._sums = {}
        if total is None:
            return torch.zeros((), dtype=torch.float32)
        return total.sqrt()

    def remove(self) -> None:
        """Restore the ordinary step."""
        for handle in self.handles:
            handle.remove()
        if _INSTALLED.get(self.optimizer) is self:
            del _INSTALLED[self.optimizer]


def step_in_backward(optimizer: Optimizer, params: Iterable[Tensor] | None = None) -> StepInBackward:
    """Make ``optimizer`` step each parameter during backward, as soon as its gradient is accumulated, and free it.

    Call it once the optimizer's parameter groups hold the parameters backward will produce gradients for (after
    FSDP2 sharding; after Accelerate's ``prepare``); a second call on the same optimizer replaces the first one's
    hooks. Zero the gradients to ``None`` before backward (the default of ``zero_grad``): a parameter's hook steps
    every parameter that holds a gradient.

    Args:
        optimizer: Any optimizer that skips parameters without a gradient (``torch.optim.AdamW``, torchao's
            ``AdamW8bit``, :class:`~lightning_plugins.parallel.optim.offload.HostOffloadOptimizer`).
        params: The parameters to hook; ``None``: every parameter of ``optimizer``'s groups.

    Returns:
        The hooks (``remove()`` restores the ordinary step) and the step's gradient norm (``grad_norm()``).
    """
    if params is None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
    earlier = _INSTALLED.get(optimizer)
    if earlier is not None:
        earlier.remove()
    installed = _INSTALLED[optimizer] = StepInBackward(optimizer, params)
    return installed


def stepping_in_backward(optimizer: Optimizer) -> StepInBackward | None:
    """The hooks that step ``optimizer`` in backward (:func:`step_in_backward`), or ``None``: it steps as usual."""
    return _INSTALLED.get(optimizer)


def check_step_in_backward(max_grad_norm: float | None, accumulation: int, on_nonfinite: str) -> None:
    """Refuse what stepping in backward cannot do: clip by the global norm, accumulate micro-batches, skip a step.

    Raises:
        OptionsError: naming the setting to change (recipe keys ``optim.max_grad_norm``, ``train.micro_batch_size``,
            ``train.on_nonfinite``).
    """
    if max_grad_norm is not None:
        raise OptionsError(
            "each parameter steps before the others' gradients exist, so optim.max_grad_norm cannot clip by the"
            " global norm. Set optim.max_grad_norm: null (torchtune's optimizer_in_bwd does not clip either), or turn"
            " memory.optimizer_in_backward off."
        )
    if accumulation > 1:
        raise OptionsError(
            f"it would step on each micro-batch's gradient, but {accumulation} micro-batches are accumulated per"
            " step. Make train.micro_batch_size the whole step's rows per data rank, or turn"
            " memory.optimizer_in_backward off."
        )
    if on_nonfinite == "skip":
        raise OptionsError(
            "the gradients are applied before a non-finite one can be seen, so train.on_nonfinite: skip cannot skip"
            " the step. Use train.on_nonfinite: stop, or turn memory.optimizer_in_backward off."
        )
