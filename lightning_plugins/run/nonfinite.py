"""The non-finite guard: a step whose loss or gradient norm is NaN or infinite on any rank is stopped or skipped by all.

Each micro-batch's loss is noted on the rank that computed it (no collective: under pipeline parallelism every stage
holds the last stage's loss, under tensor parallelism every shard the replicated loss). Once per optimizer step, after
the gradients are reduced and clipped and before the optimizer steps, :meth:`NonFiniteGuard.check` runs one
``all_reduce`` of two flags per rank (loss, gradient norm), so every rank takes the same decision in the same step. The
gradient norm is the one clipping computes (:func:`~lightning_plugins.parallel.clip_grad_norm_`: the global norm over
every shard and stage, identical on every rank); with clipping off the doors compute it by the same function with no
limit.

``train.on_nonfinite``:

* ``stop`` (default) raises :class:`NonFiniteError` on every rank before the optimizer steps, naming the step, the
  quantity, the ranks that saw it and the last checkpoint written (which holds the weights from before this step).
* ``skip`` drops the step as AMP's grad scaler drops an overflowing one: the gradients are set to ``None``, so the
  optimizer's ``step()`` updates nothing (no moments, no step count, no weight decay), while the learning-rate schedule
  and the step counter go on (the skipped step counts as taken, as under ``torch.amp.GradScaler``). After
  ``train.max_skipped_steps`` consecutive skips the run stops as with ``stop``.

Since no update is ever applied from a non-finite loss or gradient, and every save and export of a step comes after
its check, a checkpoint or an export can hold a non-finite value only if finite updates overflowed the weights; the
doors check the weights and the optimizer's state (:func:`check_finite_weights`, one pass over each rank's shard and
one ``all_reduce``) before every save, and the weights before every export, and stop rather than write one. So
auto-resume, which takes the newest complete checkpoint, never meets one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_plugins.errors import LayoutError
from lightning_plugins.errors import NonFiniteError

#: What the guard does with a non-finite step (the recipe's ``train.on_nonfinite``).
Policy = Literal["stop", "skip"]


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _ranks(flags: Tensor) -> list[int]:
    return [int(r) for r in torch.nonzero(flags).flatten().tolist()]


class NonFiniteGuard:
    """Sees a non-finite loss or gradient norm on any rank, on every rank, in the same optimizer step.

    Args:
        policy: ``"stop"`` or ``"skip"`` (see the module's docstring).
        max_skipped_steps: With ``skip``: stop after this many consecutive skipped steps.
        last_checkpoint: Returns the newest complete checkpoint (named in the error), or ``None``.
        stepped_in_backward: The optimizer already stepped when the guard runs (Accelerate's DeepSpeed steps inside
            ``backward``, and so does ``memory.optimizer_in_backward``): ``skip`` is refused, and ``stop`` says that
            the weights took the step.

    Raises:
        LayoutError: ``skip`` where the optimizer steps inside backward.
    """

    def __init__(
        self,
        policy: Policy,
        max_skipped_steps: int,
        last_checkpoint: Callable[[], Path | None] = lambda: None,
        stepped_in_backward: bool = False,
    ) -> None:
        if policy not in ("stop", "skip"):
            raise ValueError(f"train.on_nonfinite={policy!r}: expected 'stop' or 'skip'")
        if policy == "skip" and stepped_in_backward:
            raise LayoutError(
                "train.on_nonfinite=skip: the optimizer steps inside backward (Accelerate's DeepSpeed, or"
                " memory.optimizer_in_backward), before the guard sees the step's loss and gradient norm, so no step"
                " can be skipped. Use train.on_nonfinite=stop (the default), or turn memory.optimizer_in_backward"
                " off, or use the engine's own sharding (layout.dp_shard_size) instead of the DeepSpeed config."
            )
        self.stepped_in_backward = stepped_in_backward
        self.policy = policy
        self.max_skipped_steps = max_skipped_steps
        self.last_checkpoint = last_checkpoint
        #: Consecutive skipped steps, and skipped steps in all.
        self.consecutive, self.skipped = 0, 0
        self._bad_loss: Tensor | None = None

    def observe_loss(self, loss: Tensor) -> None:
        """Note one micro-batch's loss on this rank (no collective, no device sync)."""
        bad = ~torch.isfinite(_local(loss.detach())).all()
        self._bad_loss = bad if self._bad_loss is None else self._bad_loss | bad

    def check(self, step: int, grad_norm: Tensor | None, optimizer: Any) -> bool:
        """Decide, on every rank alike, whether optimizer step ``step`` (1-based) may update the weights.

        Call it after the gradients are clipped and before ``optimizer.step()``.

        Args:
            step: The optimizer step about to be taken (1-based: the checkpoint after it is ``step=<step>``).
            grad_norm: The global gradient norm (identical on every rank; under ``memory.optimizer_in_backward``
                the one its hooks accumulated, ``StepInBackward.grad_norm()`` of
                :mod:`lightning_plugins.parallel.optim.optim_in_backward`); ``None`` where the door cannot have it
                (Accelerate's DeepSpeed clips inside its engine): the loss alone is checked.
            optimizer: Its gradients are set to ``None`` when the step is skipped.

        Returns:
            ``True`` to step; ``False`` when the step is skipped (the optimizer's ``step()`` then updates nothing).

        Raises:
            NonFiniteError: Under ``stop``, or after ``max_skipped_steps`` consecutive skips.
        """
        norm = None if grad_norm is None else _local(grad_norm.detach())
        device = norm.device if norm is not None else self._bad_loss.device if self._bad_loss is not None else "cpu"
        flags = torch.zeros(2, dist.get_world_size(), dtype=torch.float32, device=device)
        rank = dist.get_rank()
        if self._bad_loss is not None:
            flags[0, rank] = self._bad_loss.to(device=device, dtype=torch.float32)
        if norm is not None:
            flags[1, rank] = (~torch.isfinite(norm).all()).float()
        self._bad_loss = None
        dist.all_reduce(flags)
        if not bool(flags.any()):
            self.consecutive = 0
            return True
        seen = []
        if bool(flags[0].any()):
            seen.append(f"a non-finite loss on rank(s) {_ranks(flags[0])}")
        if bool(flags[1].any()):
            ranks = _ranks(flags[1])
            seen.append(f"a non-finite gradient norm ({float(norm)}; the global norm, seen by rank(s) {ranks})")
        what = f"optimizer step {step}: " + " and ".join(seen)
        if self.policy == "stop":
            raise NonFiniteError(f"{what}. {self._advice()}")
        self.consecutive += 1
        self.skipped += 1
        optimizer.zero_grad(set_to_none=True)
        if self.consecutive >= self.max_skipped_steps:
            raise NonFiniteError(
                f"{what}: {self.consecutive} consecutive steps skipped (train.max_skipped_steps="
                f"{self.max_skipped_steps}). {self._advice()}"
            )
        if rank == 0:
            print(
                f"{what}: step skipped (train.on_nonfinite=skip; {self.consecutive} consecutive of at most"
                f" {self.max_skipped_steps})",
                file=sys.stderr,
                flush=True,
            )
        return False

    def _advice(self) -> str:
        last = self.last_checkpoint()
        where = f"the last checkpoint, {last}, holds finite weights" if last else "no checkpoint was written yet"
        took = "before the weights took it"
        if self.stepped_in_backward:
            took = "after the optimizer had stepped inside backward"
        return (
            f"Training stopped {took} ({where}). Lower optim.lr or set optim.max_grad_norm, check"
            " the data, or set train.on_nonfinite=skip to skip such steps."
        )


def training_state(parameters: Iterable[Tensor], optimizers: Iterable[Any] = ()) -> Iterator[Tensor]:
    """The tensors training changes: the trainable ``parameters`` and every tensor of the optimizers' states
    (moments). Frozen weights (a LoRA base, NF4 among them) keep the finite values they were loaded with."""
    yield from (parameter for parameter in parameters if parameter.requires_grad)
    for optimizer in optimizers:
        for state in getattr(optimizer, "state", {}).values():
            yield from (value for value in state.values() if isinstance(value, Tensor))


def check_finite_weights(tensors: Iterable[Tensor], what: str, step: int | None = None) -> None:
    """Raise :class:`NonFiniteError` on every rank if any rank's part of ``tensors`` holds a NaN or an infinity.

    Every rank must call it (one ``all_reduce``).

    Args:
        tensors: This rank's parameters, and optimizer state (:func:`training_state`); plain tensors or DTensors:
            each rank checks its local shard.
        what: What is about to be written (``"checkpoint step=4.ckpt"``, ``"export to out/hf"``): named in the error.
        step: The optimizer steps taken, when known.
    """
    bad = torch.zeros((), dtype=torch.bool)
    device = None
    for tensor in tensors:
        local = _local(tensor.detach())
        if type(local) is not Tensor and hasattr(local, "dequantize"):  # torchao's 8-bit optimizer state
            local = local.dequantize()
        device = device or local.device
        if local.is_floating_point() and local.numel():
            bad = bad.to(local.device) | ~torch.isfinite(local).all()
    flags = torch.zeros(dist.get_world_size(), dtype=torch.float32, device=device or torch.device("cpu"))
    flags[dist.get_rank()] = bad.float().to(flags.device)
    dist.all_reduce(flags)
    if bool(flags.any()):
        after = f" after optimizer step {step}" if step is not None else ""
        raise NonFiniteError(
            f"refusing to write the {what}{after}: the weights or optimizer state on rank(s) {_ranks(flags)} hold"
            " NaN or infinite values (finite updates overflowed them). Lower optim.lr or set optim.max_grad_norm, and"
            " resume from the last checkpoint."
        )
