"""Cross entropy straight from the final hidden states, a chunk of tokens at a time: never the full logits.

A causal LM's forward builds ``[batch, seq, vocab]`` logits with ``lm_head`` and the loss upcasts them to fp32; at
2 x 2048 tokens and a 128K vocabulary that is 1.96 GiB a copy, and autograd keeps more than one until backward.
:class:`ChunkedHead` replaces what ``lm_head`` computes while a loss is armed: the token-loss sum over chunks of
``chunk_tokens`` tokens (head matmul, the model's logit transforms, cross entropy), keeping only the hidden states
and the weight for backward, which recomputes each chunk's logits and turns them into the chunk's gradients at once
(like torchtune's ``LinearCrossEntropyLoss`` and Cut Cross-Entropy). At most one chunk's logits and their gradient
live at a time; the cost is one more head matmul per step.

Recompute (rather than Liger's gradients computed during forward) because the weight's gradient then exists only
in backward, where FSDP2 expects it and reduce-scatters it at once; computed in forward it would be a full fp32
``[vocab, hidden]`` tensor held through the whole backward.

It runs inside ``lm_head``'s own call, so every layout's hooks act as for the plain head: FSDP2 has gathered the
weight, tensor parallelism has handed a replicated (under sequence parallelism: re-gathered) input and holds a
vocabulary slice of the weight: with loss parallel each chunk's logits stay sharded and go through the
vocab-parallel cross entropy of :mod:`lightning_plugins.parallel.loss`; without it each chunk's logits are gathered
whole, the same math as the head's gathered logits (only a chunk of them). The logit transforms are the model's, as :mod:`.pipeline.anatomy` reads them
(``logits_scaling``, ``logit_scale``, ``final_logit_softcapping``), applied to the chunk's logits, never to hidden
states. The model's forward then gets an empty ``[batch, seq, 0]`` tensor as its logits (transforms of an empty
tensor are no-ops) and its ``loss_function`` (:class:`~lightning_plugins.parallel.loss.ParallelCausalLMLoss`) takes
the armed sum instead. Only a training forward with ``labels`` (or ``shift_labels``) is armed: evaluation,
``generate`` and a call without labels get the full logits as before; so does a head this cannot reproduce exactly
(a bias, a LoRA adapter or quantized weight on ``lm_head``, a causal LM with a scalar the head transforms do not
cover).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

from lightning_plugins.parallel.loss import local_token_losses, next_token_targets
from lightning_plugins.parallel.pipeline.anatomy import DecoderAnatomy, head_transforms

__all__ = ["ChunkedHead", "chunked_token_loss_sum", "install_chunked_head", "install_chunked_loss"]


@dataclass(frozen=True)
class _VocabSlice:
    """This rank's rows of a vocab-sharded head: where they start, the ranks holding the others, and whether each
    chunk's logits are gathered whole (tensor parallelism without loss parallel: the same math as the full logits
    gathered by the head) or kept sharded for the vocab-parallel cross entropy (loss parallel)."""

    start: int
    group: dist.ProcessGroup
    gather: bool


class _GatherVocab(torch.autograd.Function):
    """All-gather logits along the vocabulary; backward keeps this rank's slice (every rank has the same loss)."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, group: dist.ProcessGroup) -> Tensor:
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        ctx.rank, ctx.width = dist.get_rank(group), local.shape[-1]
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad[..., ctx.rank * ctx.width : (ctx.rank + 1) * ctx.width].contiguous(), None


def _chunk_losses(
    hidden: Tensor, weight: Tensor, targets: Tensor, head: DecoderAnatomy, vocab: _VocabSlice | None
) -> Tensor:
    """One chunk: head matmul and logit transforms in the weight's dtype (as the model's forward), then the loss."""
    return _losses_of(F.linear(hidden, weight), targets, head, vocab)


def _losses_of(logits: Tensor, targets: Tensor, head: DecoderAnatomy, vocab: _VocabSlice | None) -> Tensor:
    """A chunk's token losses from its head output (the logit transforms, then the cross entropy)."""
    if vocab is None or vocab.gather:
        logits = logits if vocab is None else _GatherVocab.apply(logits, vocab.group)
        return local_token_losses(head.logits(logits), targets)
    return local_token_losses(head.logits(logits), targets, vocab.start, vocab.group)


#: Row blocks of the head's fp32 gradient sum (see :meth:`_ChunkedLinearCrossEntropy.backward`).
_GRAD_BLOCKS = 8


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Sum of token losses of ``hidden @ weight.T`` over chunks; backward recomputes each chunk's logits."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        chunk: int,
        head: DecoderAnatomy,
        vocab: _VocabSlice | None,
    ) -> Tensor:
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, targets.numel(), chunk):
            end = start + chunk
            total += _chunk_losses(hidden[start:end], weight, targets[start:end], head, vocab).sum()
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk, ctx.head, ctx.vocab = chunk, head, vocab
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, targets = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        # The weight's gradient is summed over chunks in fp32 at least (bf16 sums of many chunks would drift), in
        # blocks of rows: each chunk adds its share block by block (never a whole [vocab, hidden] gradient per chunk:
        # 2 GiB at Llama-3.1-70B's head in bf16), and at the end each block is cast to the weight's dtype and freed in
        # turn, so the fp32 sum and the result never both exist whole.
        accumulate = torch.promote_types(weight.dtype, torch.float32)
        rows = -(-weight.shape[0] // _GRAD_BLOCKS)
        blocks = [torch.zeros_like(part, dtype=accumulate) for part in weight.split(rows)] if need_weight else []
        for start in range(0, targets.numel(), ctx.chunk):
            end = start + ctx.chunk
            x = hidden[start:end]
            logits = F.linear(x, weight).requires_grad_()  # a leaf: backward runs without grad mode
            with torch.enable_grad():
                loss = _losses_of(logits, targets[start:end], ctx.head, ctx.vocab).sum()
                (grad_logits,) = torch.autograd.grad(loss * grad_total, [logits])
            del logits, loss  # this chunk's logits: freed before the next chunk's are built
            if need_hidden:  # as F.linear's backward: in the weight's dtype
                grad_hidden[start:end] = grad_logits @ weight
            if blocks:  # each block's rows of grad_logits.T @ x, added in fp32 (no [vocab, hidden] chunk gradient)
                x = x.to(accumulate)
                for block, part in zip(blocks, grad_logits.split(rows, dim=-1)):
                    block.addmm_(part.t().to(accumulate), x)
        if need_hidden and ctx.vocab is not None:  # each vocabulary slice contributes a partial sum
            dist.all_reduce(grad_hidden, group=ctx.vocab.group)
        grad_weight = None
        if blocks:
            grad_weight = torch.empty_like(weight)
            for index, part in enumerate(grad_weight.split(rows)):
                part.copy_(blocks[index])
                blocks[index] = None  # freed as soon as it is cast
        return grad_hidden, grad_weight, None, None, None, None


def chunked_token_loss_sum(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    head: DecoderAnatomy,
    chunk_tokens: int,
    gather_vocab: bool = False,
) -> Tensor:
    """The sum of next-token losses of ``head.logits(hidden @ weight.T)``, one chunk of tokens at a time.

    Args:
        hidden: ``[..., hidden]`` final hidden states (a replicated DTensor under tensor parallelism).
        weight: ``[vocab, hidden]`` head weight, or a DTensor sharded over the vocabulary rows.
        targets: ``[...]`` targets (``-100``: ignored).
        head: The model's logit transforms.
        chunk_tokens: Tokens per chunk.
        gather_vocab: With a vocab-sharded weight, gather each chunk's logits whole (the head's output is
            replicated: no loss parallel) instead of the vocab-parallel cross entropy (loss parallel).
    """
    vocab = None
    if isinstance(weight, DTensor):
        if weight.placements[-1].is_shard(0):
            mesh = weight.device_mesh
            local = weight.to_local()
            vocab = _VocabSlice(mesh.get_local_rank() * local.shape[0], mesh.get_group(), gather_vocab)
        else:
            local = weight.full_tensor()
        weight = local
    if isinstance(hidden, DTensor):
        hidden = hidden.to_local()
    flat = hidden.reshape(-1, hidden.shape[-1])
    return _ChunkedLinearCrossEntropy.apply(flat, weight, targets.reshape(-1), chunk_tokens, head, vocab)


class ChunkedHead:
    """Replaces ``lm_head``'s forward while armed with targets: the chunked token-loss sum instead of the logits.

    Args:
        lm_head: The model's head (``nn.Linear`` without bias; see :func:`install_chunked_head`).
        head: The model's logit transforms.
        chunk_tokens: Tokens per chunk.
        gather_vocab: Under tensor parallelism without loss parallel: see :func:`chunked_token_loss_sum`.
    """

    def __init__(self, lm_head: nn.Module, head: DecoderAnatomy, chunk_tokens: int, gather_vocab: bool = False) -> None:
        self.lm_head, self.head, self.chunk_tokens, self.gather_vocab = lm_head, head, chunk_tokens, gather_vocab
        self._targets: Tensor | None = None
        self._loss_sum: Tensor | None = None
        self._logits = lm_head.forward
        lm_head.forward = self.forward  # type: ignore[method-assign]  # hooks (FSDP2, TP) still run around it

    def arm(self, targets: Tensor | None) -> None:
        """The next head call computes the loss of ``targets`` (``None``: the logits, as usual)."""
        self._targets, self._loss_sum = targets, None

    def take(self) -> Tensor | None:
        """The token-loss sum of the last armed call, once (``None`` when none was computed)."""
        loss_sum, self._loss_sum = self._loss_sum, None
        return loss_sum

    def forward(self, hidden: Tensor) -> Tensor:
        targets, self._targets = self._targets, None
        if targets is None or hidden.shape[:-1] != targets.shape:
            return self._logits(hidden)
        self._loss_sum = chunked_token_loss_sum(
            hidden, self.lm_head.weight, targets, self.head, self.chunk_tokens, self.gather_vocab
        )
        if not isinstance(hidden, DTensor):
            return hidden.new_empty(*hidden.shape[:-1], 0)
        # Tensor parallelism's output hook expects the head's DTensor: an empty one, vocab-sharded as the head's is.
        local = hidden.to_local()
        return DTensor.from_local(local.new_empty(*local.shape[:-1], 0), hidden.device_mesh, [Shard(-1)], run_check=False)

    def arm_from_call(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """Forward pre-hook of the causal LM: arm a training forward that has labels and the default ignore index."""
        labels, shift_labels = kwargs.get("labels"), kwargs.get("shift_labels")
        armed = module.training and torch.is_grad_enabled() and "ignore_index" not in kwargs
        if not armed or (labels is None and shift_labels is None) or kwargs.get("logits_to_keep", 0) != 0:
            self.arm(None)
            return
        self.arm(next_token_targets(labels) if shift_labels is None else shift_labels)


def install_chunked_head(
    model: nn.Module, lm_head: nn.Module | None, chunk_tokens: int | None, gather_vocab: bool = False
) -> ChunkedHead | None:
    """Put a :class:`ChunkedHead` on ``lm_head`` when it is a plain linear head whose loss this reproduces exactly.

    Returns:
        The head, or ``None`` (chunking off, or a head kept as it is: a bias, an adapter, quantized weights, or a
        causal LM whose forward may apply a scalar the head transforms do not cover).
    """
    if not chunk_tokens or not isinstance(lm_head, nn.Linear) or lm_head.bias is not None:
        return None
    if not lm_head.weight.dtype.is_floating_point or hasattr(lm_head, "lora_A"):
        return None
    head = head_transforms(model)
    if head is None:
        return None
    return ChunkedHead(lm_head, head, chunk_tokens, gather_vocab)


def install_chunked_loss(model: nn.Module, chunk_tokens: int | None, gather_vocab: bool = False) -> ChunkedHead | None:
    """Chunk the loss of a transformers causal LM: its head (:func:`install_chunked_head`), armed by its forward.

    Its ``loss_function`` must be a :class:`~lightning_plugins.parallel.loss.ParallelCausalLMLoss` given the head.
    """
    chunked = install_chunked_head(model, model.get_output_embeddings(), chunk_tokens, gather_vocab)
    if chunked is not None:
        model.register_forward_pre_hook(chunked.arm_from_call, with_kwargs=True)
    return chunked
