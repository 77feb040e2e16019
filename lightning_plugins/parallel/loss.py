"""The causal-LM loss that stays exact under every layout.

Two things differ from transformers' ``ForCausalLMLoss``:

* **Loss parallel.** With vocab-sharded logits (a ``Shard(-1)`` DTensor) the cross entropy runs on the
  local shards with three small all-reduces (max, target logit, sum of exponentials); the full logits
  are never gathered, and no ``loss_parallel()`` context is needed around forward or backward.
* **Token-exact averaging across data ranks.** One process averages the loss over the valid (non
  ``-100``) tokens of the whole batch. Data-parallel ranks hold different numbers of valid tokens, so
  each rank divides its token-loss *sum* by the global count (one all-reduce over the data/context
  ranks). FSDP2 averages gradients over those ranks, so the differentiated loss is scaled by their
  number; the returned value is the exact global loss on every rank, which is what gets logged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

#: Label value ignored by ``torch.nn.CrossEntropyLoss`` (and HF models): padding, prompts, masked tokens.
IGNORE_INDEX = -100


def _loss_dtype(logits: Tensor) -> torch.dtype:
    """Cross entropy runs in fp32 at least (bf16 logits are upcast), and in the logits' own dtype above it."""
    return torch.promote_types(logits.dtype, torch.float32)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy of vocab-sharded logits; backward needs no communication."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, target: Tensor, vocab_start: int, group: dist.ProcessGroup) -> Tensor:
        logits = logits.to(_loss_dtype(logits))
        logits_max = logits.max(dim=-1).values
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)

        local_target = target - vocab_start
        owned = (local_target >= 0) & (local_target < logits.shape[-1])
        local_target = local_target.masked_fill(~owned, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)

        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        stats = torch.stack([target_logit, sum_exp])
        dist.all_reduce(stats, group=group)
        target_logit, sum_exp = stats[0], stats[1]

        valid = target != IGNORE_INDEX
        loss = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)
        exp.div_(sum_exp.unsqueeze(-1))  # now the local slice of the softmax
        ctx.save_for_backward(exp, local_target, owned & valid, valid)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor, None, None, None]:
        softmax, local_target, hit, valid = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad, None, None, None


def token_losses(logits: Tensor, targets: Tensor) -> Tensor:
    """Per-token cross entropy (0 where ``targets == -100``), for full or vocab-sharded logits.

    Args:
        logits: ``[..., vocab]`` plain tensor, or a DTensor sharded on its last dimension.
        targets: Matching integer targets ``[...]``.
    """
    if isinstance(logits, DTensor) and logits.placements[-1].is_shard():
        mesh = logits.device_mesh
        local = logits.to_local()
        return local_token_losses(local, targets, mesh.get_local_rank() * local.shape[-1], mesh.get_group())
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    return local_token_losses(logits, targets)


def local_token_losses(
    logits: Tensor, targets: Tensor, vocab_start: int = 0, group: dist.ProcessGroup | None = None
) -> Tensor:
    """Per-token cross entropy of plain logits: the whole vocabulary, or its slice from ``vocab_start`` over ``group``.

    Args:
        logits: ``[..., vocab or vocab slice]`` plain tensor (upcast to fp32 at least here).
        targets: Matching integer targets ``[...]`` (``-100``: ignored, loss 0).
        vocab_start: The first vocabulary row this rank's slice holds.
        group: The ranks holding the other slices (three small all-reduces); ``None``: the whole vocabulary.
    """
    flat_logits, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    if group is not None:
        return _VocabParallelCrossEntropy.apply(flat_logits, flat_targets, vocab_start, group).view(targets.shape)
    return F.cross_entropy(
        flat_logits.to(_loss_dtype(logits)), flat_targets, ignore_index=IGNORE_INDEX, reduction="none"
    ).view(targets.shape)


def next_token_targets(labels: Tensor) -> Tensor:
    """Targets for next-token prediction: ``labels`` moved left by one, last position ignored."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def causal_lm_targets(labels: Tensor, shift_labels: Tensor | None = None, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """The targets transformers' ``ForCausalLMLoss`` trains on, with ``-100`` for every ignored one.

    ``shift_labels`` are the targets as given; ``labels`` are shifted once only when there are none; either ignores
    ``ignore_index``.
    """
    if shift_labels is None:
        if ignore_index != IGNORE_INDEX:
            labels = labels.masked_fill(labels == ignore_index, IGNORE_INDEX)
        return next_token_targets(labels)
    if ignore_index != IGNORE_INDEX:
        return shift_labels.masked_fill(shift_labels == ignore_index, IGNORE_INDEX)
    return shift_labels


def normalize_over_tokens(
    loss_sum: Tensor, count: Tensor, data_mesh: DeviceMesh | None, global_count: Tensor | int | None = None
) -> Tensor:
    """Turn this rank's token-loss sum into its share of the global token mean.

    Args:
        loss_sum: Sum of per-token losses on this rank (differentiable).
        count: This rank's number of valid tokens.
        data_mesh: The ranks that hold different tokens and whose gradients FSDP2 averages
            (``dp_cp``), or ``None`` for a single data rank.
        global_count: The number of valid tokens over all of ``data_mesh`` when the caller already
            knows it (transformers' ``num_items_in_batch``); counted here otherwise.

    Returns:
        A scalar whose value is the global mean token loss on every rank and whose gradient, once
        averaged over ``data_mesh``, is the gradient of that global mean.
    """
    ranks = 1 if data_mesh is None else data_mesh.size()
    totals = torch.stack([loss_sum.detach().float(), count.float()])
    if ranks > 1:
        dist.all_reduce(totals, group=data_mesh.get_group())
    total = totals[1] if global_count is None else torch.as_tensor(global_count, dtype=totals.dtype)
    total = total.clamp(min=1)
    scaled = loss_sum * (ranks / total)
    return scaled + (totals[0] / total - scaled).detach()


class ParallelCausalLMLoss:
    """Drop-in for transformers' ``model.loss_function`` under any layout.

    Args:
        data_mesh: Ranks holding different tokens (see :func:`normalize_over_tokens`), or ``None``.
        chunked: The model's ``ChunkedHead`` (:mod:`lightning_plugins.parallel.memory.chunked_loss`), or ``None``.
    """

    def __init__(self, data_mesh: DeviceMesh | None = None, chunked: Any = None) -> None:
        self.data_mesh = data_mesh
        #: The model's :class:`~lightning_plugins.parallel.memory.chunked_loss.ChunkedHead`, if any: when it computed the
        #: token-loss sum in place of the logits (a training forward with labels), that sum is used.
        self.chunked = chunked
        #: Set by a preference loss (:func:`lightning_plugins.preference.logps.sequence_logps`) around a forward: the
        #: call is handed to it (``sequences(logits, targets, chunked)``), which keeps each sequence's log-probability.
        self.sequences: Any = None

    def __call__(
        self,
        logits: Tensor,
        labels: Tensor,
        vocab_size: int | None = None,
        num_items_in_batch: Tensor | int | None = None,
        ignore_index: int = IGNORE_INDEX,
        shift_labels: Tensor | None = None,
        **kwargs: Any,
    ) -> Tensor:
        targets = causal_lm_targets(labels, shift_labels, ignore_index).to(logits.device)
        if self.sequences is not None:
            return self.sequences(logits, targets, self.chunked)
        loss_sum = None if self.chunked is None else self.chunked.take()
        if loss_sum is None:
            loss_sum = token_losses(logits, targets).sum()
        count = (targets != IGNORE_INDEX).sum()
        return normalize_over_tokens(loss_sum, count, self.data_mesh, num_items_in_batch)


def gather_logits_without_labels(module: Any, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
    """Forward hook: with no labels (inference, ``generate``), hand back full logits as a plain tensor.

    Under loss parallel the logits stay vocab-sharded for the loss; without a loss to compute, callers
    (``generate``, metrics) expect ordinary logits.
    """
    logits = getattr(output, "logits", None)
    if isinstance(logits, DTensor) and kwargs.get("labels") is None and kwargs.get("shift_labels") is None:
        output.logits = logits.full_tensor()
    return output
