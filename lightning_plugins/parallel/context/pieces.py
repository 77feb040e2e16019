"""How ring attention computes the pieces of one K/V block, forward (:func:`attend_pieces`) and backward
(:func:`attend_pieces_backward`), each merged into the rows' running output and log-sum-exp (online softmax).

A piece is what :func:`~.tiles.block_pieces` planned: a fused call (:mod:`.fused`) or a tile of the pure-torch
fallback (matmul + exp in the accumulation dtype, soft-capping included: :func:`_attend_block`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_plugins.parallel.context.fused import fused_backward, fused_forward
from lightning_plugins.parallel.context.bands import BandCall, band_backward, band_forward, chunked
from lightning_plugins.parallel.context.tiles import FusedCall, Piece


def _block_scores(
    q: Tensor, k: Tensor, scale: float, mask: Optional[Tensor], softcap: Optional[float]
) -> tuple[Tensor, Optional[Tensor]]:
    """Scaled scores ``[b, kv_heads, group, rows, cols]`` of grouped queries against one key block.

    ``q`` is ``[b, kv_heads, group, rows, d]``; folding the group into the rows lets one matmul serve
    every query head that shares a key head, without repeating K. With ``softcap`` (Gemma 2) each score
    becomes ``softcap * tanh(score / softcap)`` before the mask, as in transformers' eager kernels; the tanh
    is returned too (the backward's chain rule needs ``1 - tanh**2``), else ``None``.
    """
    b, hkv, group, rows, d = q.shape
    scores = torch.matmul(q.reshape(b, hkv, group * rows, d), k.transpose(-1, -2)) * scale
    scores = scores.view(b, hkv, group, rows, -1)
    tanh = None
    if softcap is not None:
        tanh = torch.tanh(scores / softcap)
        scores = tanh * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask.to(scores.device), float("-inf"))
    return scores, tanh


def _attend_block(
    q: Tensor, k: Tensor, v: Tensor, scale: float, mask: Optional[Tensor], softcap: Optional[float]
) -> tuple[Tensor, Tensor]:
    """Softmax attention of grouped queries to one key block: (normalised output, log-sum-exp per row)."""
    scores, _ = _block_scores(q, k, scale, mask, softcap)
    lse = torch.logsumexp(scores, dim=-1)
    # In packed rows a query can attend none of this block's keys: its lse is -inf and its output 0.
    finite = lse if mask is None else lse.masked_fill(lse == float("-inf"), 0.0)
    return torch.matmul(torch.exp(scores - finite.unsqueeze(-1)), v.unsqueeze(2)), lse


def _merge_into(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Online softmax: both outputs are normalised by their own lse, so reweight each to the joint one."""
    new_lse = torch.logaddexp(lse, block_lse)
    finite = new_lse.masked_fill(new_lse == float("-inf"), 0.0)  # nothing attended yet: both weights 0
    out.mul_(torch.exp(lse - finite).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - finite).unsqueeze(-1))
    lse.copy_(new_lse)


def _attend_block_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    grad_out: Tensor,
    lse: Tensor,
    delta: Tensor,
    scale: float,
    mask: Optional[Tensor],
    softcap: Optional[float],
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) of one block, recomputing its probabilities from the forward's final lse."""
    b, hkv, group, rows, d = q.shape
    scores, tanh = _block_scores(q, k, scale, mask, softcap)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    grad_probs = torch.matmul(grad_out, v.unsqueeze(2).transpose(-1, -2))
    grad_scores = probs * (grad_probs - delta.unsqueeze(-1)) * scale
    if tanh is not None:
        grad_scores = grad_scores * (1 - tanh * tanh)  # d/dx softcap * tanh(x / softcap)
    grad_q = torch.matmul(grad_scores, k.unsqueeze(2))
    # Fold the query group into the rows: one matmul then sums over the heads that share a key head.
    grad_scores_t = grad_scores.reshape(b, hkv, group * rows, -1).transpose(-1, -2)
    grad_k = torch.matmul(grad_scores_t, q.reshape(b, hkv, group * rows, d))
    probs_t = probs.reshape(b, hkv, group * rows, -1).transpose(-1, -2)
    grad_v = torch.matmul(probs_t, grad_out.reshape(b, hkv, group * rows, d))
    return grad_q, grad_k, grad_v


def attend_pieces(
    q5: Tensor,
    kv_blk: Tensor,
    pieces: list[tuple[slice, Piece]],
    out: Tensor,
    lse: Tensor,
    kernel: Optional[str],
    scale: float,
    softcap: Optional[float],
    aux: list[Any],
) -> None:
    """Attend the grouped queries to one K/V block ``kv_blk`` ``[2, b, kv_heads, cols, d]`` piece by piece, merging
    each piece into ``out``/``lse``: a :class:`FusedCall` or a band's :class:`BandCall` through the fused kernel, a
    tile through the pure-torch fallback (:func:`_attend_block`, in the accumulation dtype)."""
    for batch, piece in pieces:
        if isinstance(piece, BandCall):  # merged chunk by chunk into the rows' views: the kernel's out is not copied
            rows, cols = piece.rows, piece.cols
            k_blk, v_blk = kv_blk[0, batch, :, cols], kv_blk[1, batch, :, cols]
            block_out, block_lse = band_forward(q5[batch][..., rows, :], k_blk, v_blk, piece, scale)
            _merge_into(chunked(out[batch][..., rows, :], piece), chunked(lse[batch][..., rows], piece), block_out,
                        block_lse)  # fmt: skip
            continue
        if isinstance(piece, FusedCall):
            rows, cols = piece.rows, piece.cols
            k_blk, v_blk = kv_blk[0, batch, :, cols], kv_blk[1, batch, :, cols]
            assert kernel is not None
            block_out, block_lse, extra = fused_forward(
                kernel, q5[batch][..., rows, :], k_blk, v_blk, piece.causal, scale, piece.mask, piece.reverse
            )
            if extra is not None:
                aux.append(extra)
        else:
            rows, cols, mask = piece
            k_blk, v_blk = (kv_blk[i, batch, :, cols].to(out.dtype) for i in (0, 1))
            block_out, block_lse = _attend_block(
                q5[batch][..., rows, :].to(out.dtype), k_blk, v_blk, scale, mask, softcap
            )
        _merge_into(out[batch][..., rows, :], lse[batch][..., rows], block_out, block_lse)


class Saved:
    """The backward's per-row inputs, grouped like the queries: dO, the final O and lse, and the CUDA kernel's extras
    in the forward's call order; ``delta`` (FlashAttention-2's ``D = rowsum(dO * O)``) built once, when first needed."""

    def __init__(self, grad_out5: Tensor, out5: Tensor, lse: Tensor, aux: Any) -> None:
        self.grad_out5, self.out5, self.lse, self.aux = grad_out5, out5, lse, aux
        self._delta: Optional[Tensor] = None

    def delta(self) -> Tensor:
        if self._delta is None:
            acc = self.lse.dtype
            self._delta = (self.grad_out5.to(acc) * self.out5.to(acc)).sum(dim=-1)
        return self._delta


def _kernel_inputs(q5: Tensor, kv_blk: Tensor, saved: Saved, batch: slice, rows: slice, cols: slice) -> tuple:
    """``(grad_out, q, k, v, out, lse)`` of one kernel piece, in the order the kernels' backward takes them."""
    return (
        saved.grad_out5[batch][..., rows, :],
        q5[batch][..., rows, :],
        kv_blk[0, batch, :, cols],
        kv_blk[1, batch, :, cols],
        saved.out5[batch][..., rows, :],
        saved.lse[batch][..., rows],
    )

def attend_pieces_backward(
    ctx: Any,
    q5: Tensor,
    kv_blk: Tensor,
    pieces: list[tuple[slice, Piece]],
    saved: Saved,
    grad_q: Tensor,
    grad_kv_blk: Tensor,
) -> None:
    """Add one K/V block's gradients, piece by piece as the forward computed it, into ``grad_q`` and ``grad_kv_blk``."""
    acc = grad_q.dtype
    for batch, piece in pieces:
        if isinstance(piece, BandCall):  # added in place: the windows' dK/dV straight into the block's
            rows, cols = piece.rows, piece.cols
            into = (grad_q[batch][..., rows, :], grad_kv_blk[0, batch, :, cols], grad_kv_blk[1, batch, :, cols])
            band_backward(*_kernel_inputs(q5, kv_blk, saved, batch, rows, cols), piece, ctx.scale, into)
            continue
        if isinstance(piece, FusedCall):
            rows, cols = piece.rows, piece.cols
            grads = fused_backward(
                ctx.kernel,
                *_kernel_inputs(q5, kv_blk, saved, batch, rows, cols),
                piece.causal,
                ctx.scale,
                next(saved.aux, None),
                piece.mask,
                piece.reverse,
            )
        else:
            rows, cols, mask = piece
            grads = _attend_block_backward(
                q5[batch][..., rows, :].to(acc),
                kv_blk[0, batch, :, cols].to(acc),
                kv_blk[1, batch, :, cols].to(acc),
                saved.grad_out5[batch][..., rows, :].to(acc),
                saved.lse[batch][..., rows],
                saved.delta()[batch][..., rows],
                ctx.scale,
                mask,
                ctx.softcap,
            )
        grad_q[batch][..., rows, :] += grads[0]
        grad_kv_blk[0, batch, :, cols] += grads[1]
        grad_kv_blk[1, batch, :, cols] += grads[2]
