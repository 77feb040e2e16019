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
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_plugins.errors import OptionsError

__all__ = ["check_step_in_backward", "step_in_backward"]


def step_in_backward(optimizer: Optimizer, params: Iterable[torch.Tensor] | None = None) -> list[RemovableHandle]:
    """Make ``optimizer`` step each parameter during backward, as soon as its gradient is accumulated, and free it.

    Call it once the optimizer's parameter groups hold the parameters backward will produce gradients for (after
    FSDP2 sharding; after Accelerate's ``prepare``). Zero the gradients to ``None`` before backward (the default of
    ``zero_grad``): a parameter's hook steps every parameter that holds a gradient.

    Args:
        optimizer: Any optimizer that skips parameters without a gradient (``torch.optim.AdamW``, torchao's
            ``AdamW8bit``, :class:`~lightning_plugins.parallel.offload.HostOffloadOptimizer`).
        params: The parameters to hook; ``None``: every parameter of ``optimizer``'s groups.

    Returns:
        The hooks' handles (``handle.remove()`` restores the ordinary step).
    """
    if params is None:
        params = [p for group in optimizer.param_groups for p in group["params"]]

    def apply_and_free(param: torch.Tensor) -> None:
        optimizer.step()
        param.grad = None

    return [p.register_post_accumulate_grad_hook(apply_and_free) for p in params if p.requires_grad]


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
