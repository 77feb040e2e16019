"""Cross entropy straight from the final hidden states, a chunk of tokens at a time: never the full logits.

A causal LM's forward builds ``[batch, seq, vocab]`` logits with ``lm_head`` and the loss upcasts them to fp32; at
2 x 2048 tokens and a 128K vocabulary that is 1.96 GiB a copy, and autograd keeps more than one until backward.
:class:`ChunkedHead` replaces what ``lm_head`` computes while a loss is armed: the token-loss sum over chunks of
``chunk_tokens`` tokens (head matmul, the model's logit transforms, cross entropy), keeping only the hidden states,
the weight and each token's log normaliser for backward, which recomputes the logits a tile at a time (a block of
vocabulary rows by a chunk of tokens) and turns each tile into its gradients at once (like torchtune's
``LinearCrossEntropyLoss`` and Cut Cross-Entropy). At most one tile's logits and their gradient live at a time, and
the weight's gradient is summed in fp32 one block of rows at a time; the cost is one more head matmul per step.

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

from lightning_plugins.parallel.compile import simulated
from lightning_plugins.parallel.loss import IGNORE_INDEX, causal_lm_targets, local_token_losses
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


def _gather_vocab(local: Tensor, group: dist.ProcessGroup) -> Tensor:
    """All-gather logits along the vocabulary (forward only: backward works on this rank's rows alone)."""
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _sharded_logsumexp(logits: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``logsumexp`` over vocab-sharded logits: the global max first, so no slice's exponentials overflow."""
    peak = logits.max(dim=-1).values
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    sums = (logits - peak.unsqueeze(-1)).exp_().sum(dim=-1)
    dist.all_reduce(sums, group=group)
    return peak + sums.log()


def _chunk_losses(
    hidden: Tensor, weight: Tensor, targets: Tensor, head: DecoderAnatomy, vocab: _VocabSlice | None,
    logit_sums: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """One chunk's token losses and each token's log normaliser (``logsumexp`` of its transformed logits, which
    backward turns the recomputed logits into the softmax with): the head matmul and logit transforms in the
    weight's dtype (as the model's forward), the loss math in fp32 at least (as :func:`local_token_losses`).
    ``logit_sums``: filled with each token's sum of logits over the whole vocabulary (a metric, no gradient)."""
    logits = F.linear(hidden, weight)
    if vocab is not None and vocab.gather:
        logits = _gather_vocab(logits, vocab.group)
    logits = head.logits(logits)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # once: the loss's upcast is then a no-op
    if logit_sums is not None:
        logit_sums.copy_(logits.sum(dim=-1))
        if vocab is not None and not vocab.gather:
            dist.all_reduce(logit_sums, group=vocab.group)
    if vocab is None or vocab.gather:
        return local_token_losses(logits, targets), logits.logsumexp(dim=-1)
    return local_token_losses(logits, targets, vocab.start, vocab.group), _sharded_logsumexp(logits, vocab.group)


def _logit_grad(logits: Tensor, lse: Tensor, rows: Tensor, scale: Tensor, head: DecoderAnatomy) -> Tensor:
    """The loss's gradient with respect to one tile of head output (a chunk of tokens x a block of vocab rows).

    Args:
        logits: ``[tokens, block]`` head output, in the weight's dtype.
        lse: Each token's log normaliser from forward.
        rows: Each token's target row within the block (outside ``[0, block)``: not in this block, or ignored).
        scale: Each token's loss gradient (0: an ignored token).
        head: The model's logit transforms.
    """
    logits.requires_grad_()  # backward runs without grad mode: the transforms are chained through by autograd
    with torch.enable_grad():
        transformed = head.logits(logits)
    # softmax - onehot(target), times the loss gradient: what F.cross_entropy's backward gives, in its fp32.
    grad = (transformed.detach().to(lse.dtype) - lse.unsqueeze(-1)).exp_()
    hit = (rows >= 0) & (rows < grad.shape[-1])
    grad.scatter_add_(-1, rows.clamp(0, grad.shape[-1] - 1).unsqueeze(-1), -hit.to(grad.dtype).unsqueeze(-1))
    grad = grad.mul_(scale.unsqueeze(-1)).to(transformed.dtype)  # as the loss's upcast hands it back
    if transformed is logits:  # no transform
        return grad
    (grad,) = torch.autograd.grad(transformed, logits, grad)
    return grad


#: Vocabulary row blocks of the backward pass. Each block's fp32 weight-gradient sum (and an fp32 product of the
#: block's size, or on a CPU the fp32 copy of its weight rows) is 1/8 of a whole fp32 head: 245 MiB at Llama 3's
#: 128K x 4096 head, against the 1.96 GiB of a whole fp32 sum; more blocks would shave little more and make each
#: tile's matmuls narrower.
_GRAD_BLOCKS = 8


def _add_product(out: Tensor, a: Tensor, b: Tensor) -> None:
    """``out += a @ b`` summed in ``out``'s dtype (fp32). On GPUs, and in the planner's dry run that simulates one,
    16-bit operands stay in their dtype (tensor cores) with an fp32 product (``mm``'s ``out_dtype``); CPUs have no
    such kernel, so there they are upcast first (CPU matmuls run faster in fp32 than in bf16 anyway)."""
    if a.dtype != out.dtype and (a.is_cuda or simulated()):
        out.add_(torch.mm(a, b, out_dtype=out.dtype))
    else:
        out.addmm_(a.to(out.dtype), b.to(out.dtype))


def _chunk_starts(tokens: int, chunk: int) -> range:
    """Where each chunk of ``chunk`` tokens starts. Every chunk's temporaries are freed before the next one's exist,
    so the planner's dry run, which only measures memory, keeps the first alone
    (:func:`lightning_plugins.planner.fake_step.one_loss_chunk_only`)."""
    return range(0, tokens, chunk)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Sum of token losses of ``hidden @ weight.T`` over chunks; backward recomputes the logits tile by tile."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        chunk: int,
        head: DecoderAnatomy,
        vocab: _VocabSlice | None,
        per_token: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        lse = hidden.new_empty(targets.shape, dtype=torch.promote_types(weight.dtype, torch.float32))
        # Per token (a preference loss sums them per sequence): each token's loss and its sum of logits (a metric).
        tokens = lse.new_empty(targets.shape) if per_token else None
        logit_sums = lse.new_empty(targets.shape) if per_token else None
        for start in _chunk_starts(targets.numel(), chunk):
            end = start + chunk
            sums = None if logit_sums is None else logit_sums[start:end]
            losses, lse[start:end] = _chunk_losses(hidden[start:end], weight, targets[start:end], head, vocab, sums)
            if tokens is None:
                total += losses.sum()
            else:
                tokens[start:end] = losses
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk, ctx.head, ctx.vocab = chunk, head, vocab
        if tokens is None:
            return total
        ctx.mark_non_differentiable(logit_sums)
        return tokens, logit_sums

    @staticmethod
    def backward(ctx: Any, grad_total: Tensor, *unused: Any) -> tuple[Tensor | None, ...]:
        # grad_total: a scalar (the sum), or one gradient per token (per_token; the logit sums have none).
        hidden, weight, targets, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        accumulate = lse.dtype
        # Per token: its target's row in this rank's rows (ignored: none) and its loss gradient (ignored: 0).
        valid = targets != IGNORE_INDEX
        rows = (targets - (0 if ctx.vocab is None else ctx.vocab.start)).masked_fill(~valid, -1)
        scale = valid.to(accumulate) * grad_total
        # Vocabulary blocks outside, token chunks inside: the weight's gradient is summed over the chunks in fp32 (bf16
        # sums of many chunks would drift) one block of rows at a time, then cast into its rows, so no fp32 sum of the
        # whole head ever exists. The hidden states' gradient sums each block's share in fp32 ([tokens, hidden]).
        grad_hidden = torch.zeros_like(hidden, dtype=accumulate) if need_hidden else None
        grad_weight = torch.empty_like(weight) if need_weight else None
        height = -(-weight.shape[0] // _GRAD_BLOCKS)
        for first in range(0, weight.shape[0], height):
            block = weight[first : first + height]
            grad_block = None
            if need_weight:  # an fp32 weight sums straight into its gradient's rows
                grad_block = grad_weight[first : first + height]
                direct = grad_block.dtype == accumulate
                grad_block = grad_block.zero_() if direct else torch.zeros_like(block, dtype=accumulate)
            for start in _chunk_starts(targets.numel(), ctx.chunk):
                end = start + ctx.chunk
                x = hidden[start:end]
                logits = F.linear(x, block)  # as forward, in the weight's dtype
                grad_logits = _logit_grad(logits, lse[start:end], rows[start:end] - first, scale[start:end], ctx.head)
                if grad_block is not None:
                    _add_product(grad_block, grad_logits.t(), x)
                if grad_hidden is not None:
                    _add_product(grad_hidden[start:end], grad_logits, block)
                del logits, grad_logits  # this tile's: freed before the next one is built
            if grad_block is not None and grad_block.dtype != weight.dtype:
                grad_weight[first : first + height].copy_(grad_block)
            del grad_block  # this block's fp32 sum: freed before the next block's exists
        if grad_hidden is not None:
            grad_hidden = grad_hidden.to(hidden.dtype)
            if ctx.vocab is not None:  # each vocabulary slice contributes a partial sum
                dist.all_reduce(grad_hidden, group=ctx.vocab.group)
        return grad_hidden, grad_weight, None, None, None, None, None


def chunked_token_loss_sum(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    head: DecoderAnatomy,
    chunk_tokens: int,
    gather_vocab: bool = False,
    per_token: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """The sum of next-token losses of ``head.logits(hidden @ weight.T)``, one chunk of tokens at a time.

    Args:
        hidden: ``[..., hidden]`` final hidden states (a replicated DTensor under tensor parallelism).
        weight: ``[vocab, hidden]`` head weight, or a DTensor sharded over the vocabulary rows.
        targets: ``[...]`` targets (``-100``: ignored).
        head: The model's logit transforms.
        chunk_tokens: Tokens per chunk.
        gather_vocab: With a vocab-sharded weight, gather each chunk's logits whole (the head's output is
            replicated: no loss parallel) instead of the vocab-parallel cross entropy (loss parallel).
        per_token: Instead of the sum, each token's loss (flat, differentiable: a preference loss sums them per
            sequence) and each token's sum of logits over the vocabulary (no gradient).
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
    return _ChunkedLinearCrossEntropy.apply(flat, weight, targets.reshape(-1), chunk_tokens, head, vocab, per_token)


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
        #: Set by a preference loss (:mod:`lightning_plugins.preference.logps`): every call with labels, training or
        #: not, with or without gradients (the reference's forward), computes each token's loss and logit sum instead.
        self.per_sequence = False
        self._tokens: tuple[Tensor, Tensor] | None = None
        self._logits = lm_head.forward
        lm_head.forward = self.forward  # type: ignore[method-assign]  # hooks (FSDP2, TP) still run around it

    def arm(self, targets: Tensor | None) -> None:
        """The next head call computes the loss of ``targets`` (``None``: the logits, as usual)."""
        self._targets, self._loss_sum = targets, None

    def take(self) -> Tensor | None:
        """The token-loss sum of the last armed call, once (``None`` when none was computed)."""
        loss_sum, self._loss_sum = self._loss_sum, None
        return loss_sum

    def take_tokens(self) -> tuple[Tensor, Tensor] | None:
        """Each token's loss and sum of logits (flat) from the last call in :attr:`per_sequence` mode, once."""
        tokens, self._tokens = self._tokens, None
        return tokens

    def forward(self, hidden: Tensor) -> Tensor:
        targets, self._targets = self._targets, None
        if targets is None or hidden.shape[:-1] != targets.shape:
            return self._logits(hidden)
        computed = chunked_token_loss_sum(
            hidden, self.lm_head.weight, targets, self.head, self.chunk_tokens, self.gather_vocab, self.per_sequence
        )
        if self.per_sequence:
            self._tokens = computed
        else:
            self._loss_sum = computed
        if not isinstance(hidden, DTensor):
            return hidden.new_empty(*hidden.shape[:-1], 0)
        # Tensor parallelism's output hook expects the head's DTensor: an empty one, vocab-sharded as the head's is.
        local = hidden.to_local()
        return DTensor.from_local(local.new_empty(*local.shape[:-1], 0), hidden.device_mesh, [Shard(-1)], run_check=False)

    def arm_from_call(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """Forward pre-hook of the causal LM: arm a training forward that has ``labels`` (and maybe ``shift_labels``,
        ``ignore_index``)."""
        # transformers' causal LMs compute a loss only when `labels` is given: with `shift_labels` alone the forward
        # returns the logits and no loss, so the head must compute them.
        labels = kwargs.get("labels")
        armed = labels is not None and (self.per_sequence or (module.training and torch.is_grad_enabled()))
        if not armed or kwargs.get("logits_to_keep", 0) != 0:
            self.arm(None)
            return
        # The targets the model's loss_function computes from the same arguments (a custom ignore_index included).
        self.arm(causal_lm_targets(labels, kwargs.get("shift_labels"), kwargs.get("ignore_index", IGNORE_INDEX)))


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
