"""Ulysses (:func:`ulysses_attention`, built from :func:`seq_to_head` / :func:`head_to_seq`).

An all-to-all turns sequence-sharded ``[b, h, s/cp, d]`` activations into head-sharded ``[b, h/cp, s, d]``
ones, any ordinary attention runs on the full sequence, and the inverse all-to-all brings the output back.
Its degree is limited by the number of heads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_plugins.parallel.context.checks import check_ulysses_heads, local_sinks
from lightning_plugins.parallel.context.fused import fused_kernel_for, takes_masks
from lightning_plugins.parallel.context.local import local_attention
from lightning_plugins.parallel.context.sharding import reorder_sequence_load_balanced, unshard_sequence_load_balanced

AttentionFn = Callable[..., Tensor]
"""``attn_fn(q, k, v, *, is_causal, scale, **variants) -> out`` on ``[b, heads, seq, head_dim]`` tensors in natural
sequence order; ``k``/``v`` may have fewer heads than ``q`` (grouped-query attention). ``variants`` holds only the
attention variants in use: ``window``, ``softcap``, ``sinks`` (see :func:`eager_attention`)."""


def eager_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    is_causal: bool,
    scale: Optional[float],
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Tensor] = None,
    dropout: float = 0.0,
) -> Tensor:
    """Attention as transformers' eager kernels compute it, on natural-order ``[b, h, S, d]`` tensors.

    Scores are scaled, soft-capped (``softcap * tanh(x / softcap)``, Gemma 2), masked causally and to the sliding
    window (query ``i`` sees keys ``j`` with ``i - window < j <= i``), and, with ``sinks`` (gpt-oss, one logit per
    query head), softmaxed together with the sink logit, which carries no value. Softmax in fp32 or wider.
    """
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if is_causal or window is not None:
        query, key = torch.arange(q.shape[2], device=q.device)[:, None], torch.arange(k.shape[2], device=q.device)
        allowed = key <= query
        if window is not None:
            allowed &= key > query - window
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    softmax_dtype = torch.promote_types(scores.dtype, torch.float32)
    if sinks is None:
        probs = F.softmax(scores, dim=-1, dtype=softmax_dtype)
    else:
        sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = F.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=softmax_dtype)[..., :-1]
    probs = F.dropout(probs.to(q.dtype), p=dropout, training=dropout > 0)
    return torch.matmul(probs, v)


def _all_to_all(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """All-to-all along dim 0, whose size is the group size: slice ``j`` goes to rank ``j``."""
    x = x.contiguous()  # the collective reads and writes raw memory: both buffers must be dense
    received = torch.empty_like(x)
    dist.all_to_all_single(received, x, group=group)
    return received


def _seq_to_head(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    size = dist.get_world_size(group)
    b, h, s, d = x.shape
    if h % size != 0:
        raise ValueError(f"seq_to_head splits {h} heads across cp_size={size}: heads must be divisible by cp_size.")
    # [cp, b, h/cp, s, d]: head slice j is sent to rank j, which receives every rank's sequence shard of it.
    received = _all_to_all(x.reshape(b, size, h // size, s, d).transpose(0, 1), group)
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * s, d)


def _head_to_seq(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    size = dist.get_world_size(group)
    b, h, s, d = x.shape
    if s % size != 0:
        raise ValueError(f"head_to_seq splits a sequence of {s} across cp_size={size}: it must be divisible.")
    # [cp, b, h/cp, s/cp, d]: sequence shard j is sent to rank j, which receives every rank's heads of it.
    received = _all_to_all(x.reshape(b, h, size, s // size, d).permute(2, 0, 1, 3, 4), group)
    return received.transpose(0, 1).reshape(b, size * h, s // size, d)


class _AllToAll(torch.autograd.Function):
    """:func:`_seq_to_head` (``to_heads``) or :func:`_head_to_seq`, differentiable: each one's backward is the other."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup, to_heads: bool) -> Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return (_seq_to_head if to_heads else _head_to_seq)(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        # The all-to-all is a permutation of data across ranks; its adjoint is the inverse permutation.
        return (_head_to_seq if ctx.to_heads else _seq_to_head)(grad, ctx.group), None, None


def seq_to_head(x: Tensor, group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """Sequence-sharded ``[b, heads, s/cp, d]`` to head-sharded ``[b, heads/cp, s, d]`` (differentiable).

    Rank ``j`` gets heads ``[j * heads/cp, (j+1) * heads/cp)``; the gathered sequence is the
    concatenation of the ranks' shards in rank order (see :func:`unshard_sequence_load_balanced`).

    Args:
        x: This rank's sequence shard.
        group: The context-parallel process group (default: the world).

    Returns:
        This rank's head shard over the whole sequence.
    """
    return _AllToAll.apply(x, group if group is not None else dist.group.WORLD, True)


def head_to_seq(x: Tensor, group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """Head-sharded ``[b, heads/cp, s, d]`` to sequence-sharded ``[b, heads, s/cp, d]``: inverse of :func:`seq_to_head`.

    Args:
        x: This rank's head shard over the whole sequence (in rank order).
        group: The context-parallel process group (default: the world).

    Returns:
        This rank's sequence shard with all heads.
    """
    return _AllToAll.apply(x, group if group is not None else dist.group.WORLD, False)


def _repeat_kv_for_cp(x: Tensor, cp_size: int) -> Tensor:
    """Repeat key/value heads (each in place, like ``repeat_kv``) until their number divides ``cp_size``.

    ``lcm(kv_heads, cp)`` heads are the fewest that split evenly; they still divide the query heads
    (which both ``kv_heads`` and ``cp`` divide), so query head ``i`` keeps its key head.
    """
    kv_heads = x.shape[1]
    repeats = cp_size // math.gcd(kv_heads, cp_size)
    return x if repeats == 1 else x.repeat_interleave(repeats, dim=1)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool, scale: Optional[float]) -> Tensor:
    grouped = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=grouped)


def _gather_document_starts(starts: Tensor, group: dist.ProcessGroup, load_balanced: bool, device: Any) -> Tensor:
    """Every rank's ``[batch, local_seq]`` document starts, as ``[batch, seq]`` in natural order, on the host."""
    size = dist.get_world_size(group)
    local = starts.to(device, torch.long).contiguous()
    shards = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shards, local, group=group)
    whole = torch.cat(shards, dim=-1)  # rank order
    return (unshard_sequence_load_balanced(whole, -1, size) if load_balanced and size > 1 else whole).cpu()


def _attend_documents(
    attn_fn: AttentionFn,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    starts: Tensor,
    fused: bool,
    *,
    is_causal: bool,
    scale: Optional[float],
    **variants: Any,
) -> Tensor:
    """Attention of packed rows (natural order): no query attends another document's keys.

    ``starts[b, i]`` is where token ``i``'s document begins. ``fused``: by :func:`~.local.local_attention` (a few fused
    calls for the whole row); else ``attn_fn`` on each document of each row, one call each.
    """
    seq_len = q.shape[2]
    if not bool(starts[:, :seq_len].any()):
        return attn_fn(q, k, v, is_causal=is_causal, scale=scale, **variants)
    if fused:
        return local_attention(q, k, v, document_starts=starts[:, :seq_len], scale=scale, **variants)
    bounds = [torch.unique_consecutive(row).tolist() + [seq_len] for row in starts[:, :seq_len]]
    rows = []
    for b in range(q.shape[0]):
        row_bounds = bounds[min(b, len(bounds) - 1)]
        pieces = [
            attn_fn(
                q[b : b + 1, :, lo:hi],
                k[b : b + 1, :, lo:hi],
                v[b : b + 1, :, lo:hi],
                is_causal=is_causal,
                scale=scale,
                **variants,
            )
            for lo, hi in zip(row_bounds[:-1], row_bounds[1:])
        ]
        rows.append(torch.cat(pieces, dim=2))
    return torch.cat(rows, dim=0)


def _variants(
    window: Optional[int], softcap: Optional[float], sinks: Optional[Tensor], heads: int, group: dist.ProcessGroup
) -> dict[str, Any]:
    """The attention variants in use, as ``attn_fn`` takes them on this rank's heads (its slice of the sinks)."""
    variants: dict[str, Any] = {"window": window, "softcap": softcap}
    if sinks is not None:
        local = heads // dist.get_world_size(group)
        variants["sinks"] = local_sinks(sinks, heads)[dist.get_rank(group) * local : (dist.get_rank(group) + 1) * local]
    return {name: value for name, value in variants.items() if value is not None}


def ulysses_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: Optional[dist.ProcessGroup] = None,
    *,
    causal: bool = True,
    scale: Optional[float] = None,
    load_balanced: bool = True,
    valid_len: Optional[int] = None,
    attn_fn: Optional[AttentionFn] = None,
    document_starts: Optional[Tensor] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Tensor] = None,
    packed_kernel: bool = True,
) -> Tensor:
    """Exact attention over a sequence sharded across the context-parallel group, by all-to-all over heads.

    After :func:`seq_to_head` the sequence is in rank order; for causal attention (and to drop padding)
    it is put in natural order before ``attn_fn`` and back after, so ``attn_fn`` can be any ordinary
    attention (SDPA, flash, ...) with its plain causal mask. Padding (``valid_len``) is sliced off before
    ``attn_fn``, which therefore always sees equal query and key lengths: no causal-alignment ambiguity.

    Args:
        q: This rank's queries ``[batch, heads, local_seq, head_dim]``; ``heads`` must be divisible by the
            group size (see :func:`check_ulysses_heads`).
        k: This rank's keys ``[batch, kv_heads, local_seq, head_dim]``; repeated when ``kv_heads`` does
            not divide the group size.
        v: This rank's values, shaped like ``k``.
        group: The context-parallel process group (default: the world).
        causal: Whether query position ``i`` attends only key positions ``<= i``.
        scale: Score scale; default ``1 / sqrt(head_dim)``.
        load_balanced: Whether the shards follow the load-balanced layout.
        valid_len: Global length before padding; positions from it on neither attend nor are attended
            (their output is zero).
        attn_fn: ``attn_fn(q, k, v, *, is_causal, scale)`` on natural-order ``[b, h, S, d]`` tensors;
            default :func:`torch.nn.functional.scaled_dot_product_attention`.
        document_starts: Packed rows: ``[batch or 1, local_seq]``, the global position where each local
            token's document begins. Gathered over the group (every rank must pass them, or none); see
            ``packed_kernel``, else ``attn_fn`` runs on each document separately.
        window: Sliding window (query ``i`` sees keys ``i - window < j <= i``), passed to ``attn_fn``.
        softcap: Attention logit soft-capping (Gemma 2), passed to ``attn_fn``.
        sinks: Attention sinks ``[heads]`` (gpt-oss); ``attn_fn`` gets this rank's heads' slice.
        With any of the three, ``attn_fn`` defaults to :func:`eager_attention` (SDPA has none of them).
        packed_kernel: Whether causal packed rows go to :func:`~.local.local_attention` (fused calls, not
            ``attn_fn``) where the kernel takes a mask (CPU); ``False`` when ``attn_fn`` applies dropout.

    Returns:
        This rank's attention output, shaped like ``q``.
    """
    group = group if group is not None else dist.group.WORLD
    size = dist.get_world_size(group)
    check_ulysses_heads(q.shape[1], k.shape[1], size)
    variants = _variants(window, softcap, sinks, q.shape[1], group)
    attn_fn = attn_fn if attn_fn is not None else (eager_attention if variants else _sdpa)
    starts = None
    if document_starts is not None:
        starts = _gather_document_starts(document_starts, group, load_balanced, q.device)
    q, k, v = (seq_to_head(x, group) for x in (q, _repeat_kv_for_cp(k, size), _repeat_kv_for_cp(v, size)))

    seq_len = q.shape[2]
    # Rank order is the natural order for contiguous shards. Non-causal attention over unpadded data needs
    # no reordering either: permuting queries and keys together just permutes the output rows.
    reorder = load_balanced and size > 1 and (causal or valid_len is not None or starts is not None)
    if reorder:
        q, k, v = (unshard_sequence_load_balanced(x, 2, size) for x in (q, k, v))
    if valid_len is not None and valid_len < seq_len:
        q, k, v = (x[:, :, :valid_len] for x in (q, k, v))  # natural order here: the pads are trailing
    if starts is None:
        out = attn_fn(q, k, v, is_causal=causal, scale=scale, **variants)
    else:
        fused = causal and packed_kernel and takes_masks(fused_kernel_for(q))
        out = _attend_documents(attn_fn, q, k, v, starts, fused, is_causal=causal, scale=scale, **variants)
    if out.shape[2] < seq_len:
        out = F.pad(out, (0, 0, 0, seq_len - out.shape[2]))
    if reorder:
        out = reorder_sequence_load_balanced(out, 2, size)
    return head_to_seq(out, group)
