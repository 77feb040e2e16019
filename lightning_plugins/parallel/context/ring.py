"""Ring attention (:func:`ring_attention`): exact attention over a sequence sharded across the cp ranks.

Each rank keeps its own queries and passes its key/value block around the ring of ``cp`` ranks; attention of
the local queries against each arriving block is merged with an online softmax (running log-sum-exp in fp32
or wider). The backward recomputes each block from the saved ``q, k, v, out, lse`` (FlashAttention-2 style)
while K/V and the dK/dV accumulators travel the ring again, so no rank ever holds more than two K/V blocks.

Each block is computed in pieces (:func:`~.tiles.block_pieces` says which path each takes):

* **fused** (:mod:`.fused`): fully visible boxes and causal squares (a sliding window's band: reversed and plain
  causal squares and boxes between them) go to an SDPA kernel that returns the
  log-sum-exp (on CPU ``aten._scaled_dot_product_flash_attention_for_cpu``, on CUDA the flash kernel), and backward
  through the kernel's own backward op, given the merged output and log-sum-exp; no scores are materialised;
* **masked fused** (where the kernel takes a mask, :func:`~.fused.takes_masks`: on CPU): what those do not express,
  short runs of a window's band rows (where the layout's chunks cut it) and short packed documents,
  goes to the same kernel with the additive mask of a tile of query rows (a tile takes many short documents);
* **tiles**, the pure-torch fallback (matmul + exp, a tile of query rows at a time, each with its own small mask):
  what no kernel here computes: soft-capped scores (``softcap * tanh`` is no mask; ``flex_attention`` has no CPU
  backward in torch 2.13), masked pieces where the kernel takes no mask (CUDA's flash op), or a device/dtype without
  a fused kernel (``fused=False`` forces it).

Sinks join the merged log-sum-exp after the last block, whichever path computed the blocks.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_plugins.parallel.context.checks import check_gqa, local_sinks
from lightning_plugins.parallel.context.sharding import sequence_positions
from lightning_plugins.parallel.context.fused import fused_kernel_for, takes_masks
from lightning_plugins.parallel.context.pieces import Saved, attend_pieces, attend_pieces_backward
from lightning_plugins.parallel.context.bands import BandCall
from lightning_plugins.parallel.context.tiles import ActiveBlock, FusedCall, Piece, active_block, block_pieces

# p2p tags keep the K/V ring and the dK/dV ring apart where a backend matches messages by tag (gloo);
# NCCL ignores tags and matches by posting order, which is the same on every rank.
_KV_TAG = 0
_GRAD_TAG = 1


def _ring_shift(tensor: Tensor, group: dist.ProcessGroup, tag: int) -> tuple[list[Any], Tensor]:
    """Start sending ``tensor`` to the next rank and receiving the previous rank's; returns (works, buffer)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    received = torch.empty_like(tensor)
    ops = [
        dist.P2POp(dist.isend, tensor, group=group, tag=tag, group_peer=(rank + 1) % size),
        dist.P2POp(dist.irecv, received, group=group, tag=tag, group_peer=(rank - 1) % size),
    ]
    return dist.batch_isend_irecv(ops), received


def _rank_and_size(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    """This rank and the ring's size; no group: one rank alone (:func:`~.local.local_attention`), no communication."""
    return (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    # Softmax statistics and partial outputs in fp32 at least: bf16/fp16 would lose the merge.
    return torch.promote_types(dtype, torch.float32)


class RingAttention(torch.autograd.Function):
    """Ring attention over grouped queries; see :func:`ring_attention` (a ``None`` group: one rank, no ring)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        sinks: Optional[Tensor],
        group: dist.ProcessGroup,
        causal: bool,
        scale: float,
        load_balanced: bool,
        valid_len: Optional[int],
        query_tile: Optional[int],
        document_starts: Optional[Tensor],
        window: Optional[int],
        softcap: Optional[float],
        fused: bool,
    ) -> Tensor:
        rank, size = _rank_and_size(group)
        b, hq, s, d = q.shape
        hkv = k.shape[1]
        acc = _accumulation_dtype(q.dtype)
        positions = functools.partial(sequence_positions, s * size, cp_size=size, load_balanced=load_balanced)
        q_pos = positions(rank)
        starts = _first_keys(q_pos, document_starts, window)
        # Soft-capping changes every score before the softmax: no fused kernel computes it.
        kernel = fused_kernel_for(q) if fused and softcap is None else None

        q5 = q.reshape(b, hkv, hq // hkv, s, d)
        out = torch.zeros(q5.shape, dtype=acc, device=q.device)
        lse = torch.full(q5.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        aux: list[Any] = []  # what the CUDA kernel's backward needs of each fused call, in call order
        plans: list[Optional[tuple[ActiveBlock, Optional[list[tuple[slice, Piece]]]]]] = []  # per step, for backward
        for step in range(size):
            # Start moving the next block before computing on this one, so communication overlaps compute.
            works, kv_next = _ring_shift(kv, group, _KV_TAG) if step < size - 1 else ([], kv)
            block = active_block(q_pos, positions((rank - step) % size), causal, valid_len, starts)
            if block is not None:
                kv_blk = kv[:, :, :, block.col_start : block.col_end]
                pieces = _pieces(block, query_tile, b * hq, kernel)
                attend_pieces(q5, kv_blk, pieces, out, lse, kernel, scale, softcap, aux)
                plans.append((block, pieces if _unmasked(pieces) else None))
            else:
                plans.append(None)
            _wait(works)
            kv = kv_next

        if sinks is not None:
            # gpt-oss: one logit per head joins every row's softmax denominator and carries no value.
            with_sink = torch.logaddexp(lse, _sink_logits(sinks, q5, acc).expand_as(lse))
            out.mul_(torch.exp(lse - with_sink).unsqueeze(-1))
            lse = with_sink
        out = out.to(q.dtype).reshape(b, hq, s, d)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.group, ctx.scale, ctx.softcap, ctx.query_tile = group, scale, softcap, query_tile
        ctx.kernel, ctx.aux, ctx.plans = kernel, aux, plans
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Optional[Tensor], ...]:
        q, k, v, out, lse, sinks = ctx.saved_tensors
        group = ctx.group
        rank, size = _rank_and_size(group)
        b, hq, s, d = q.shape
        hkv = k.shape[1]
        acc = lse.dtype

        q5 = q.reshape(b, hkv, hq // hkv, s, d)
        saved = Saved(grad_out.reshape(q5.shape), out.reshape(q5.shape), lse, iter(ctx.aux))
        grad_q = torch.zeros(q5.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        grad_works: list[Any] = []
        grad_kv_in: Optional[Tensor] = None
        for step in range(size):
            works, kv_next = _ring_shift(kv, group, _KV_TAG) if step < size - 1 else ([], kv)
            grad_kv = torch.zeros((2, *k.shape), dtype=acc, device=k.device)
            plan = ctx.plans[step]  # the forward's blocks and pieces: the same calls, planned once
            if plan is not None:
                block, pieces = plan
                pieces = pieces if pieces is not None else _pieces(block, ctx.query_tile, b * hq, ctx.kernel)
                cols = slice(block.col_start, block.col_end)
                attend_pieces_backward(ctx, q5, kv[:, :, :, cols], pieces, saved, grad_q, grad_kv[:, :, :, cols])
            if grad_kv_in is not None:
                # This block's dK/dV so far (its owner's and every rank's since) arrives from the previous rank.
                _wait(grad_works)
                grad_kv += grad_kv_in
            if size > 1:
                # After the last step the sum lands on the block's owner: the next rank after the last adder.
                grad_works, grad_kv_in = _ring_shift(grad_kv, group, _GRAD_TAG)
            _wait(works)
            kv = kv_next

        if grad_kv_in is not None:
            _wait(grad_works)
            grad_kv = grad_kv_in
        grad_q = grad_q.reshape(b, hq, s, d).to(q.dtype)
        grad_sinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            # d out / d sink = -p_sink * out, so d loss / d sink = -p_sink * rowsum(dO * O) = -p_sink * delta.
            p_sink = torch.exp(_sink_logits(sinks, q5, acc) - lse)
            grad_sinks = -(p_sink * saved.delta()).sum(dim=(0, 3)).reshape(hq).to(sinks.dtype)
        return grad_q, grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), grad_sinks, *([None] * 10)


def _pieces(
    block: ActiveBlock, query_tile: Optional[int], batch_heads: int, kernel: Optional[str]
) -> list[tuple[slice, Piece]]:
    """How one active block is computed (:func:`~.tiles.block_pieces`); the forward and the backward plan alike, so
    they replay the same calls."""
    return block_pieces(block, query_tile, batch_heads, kernel is not None, takes_masks(kernel))


def _unmasked(pieces: list[tuple[slice, Piece]]) -> bool:
    """Whether no piece carries a mask: such a plan is kept from the forward for the backward (a few slices a block);
    masks (short packed documents' tiles) are planned again rather than held from every layer's forward to its
    backward."""
    def unmasked(piece: Piece) -> bool:
        if isinstance(piece, BandCall):  # its band mask is made at each call
            return True
        return (piece.mask if isinstance(piece, FusedCall) else piece[2]) is None

    return all(unmasked(piece) for _, piece in pieces)


def _sink_logits(sinks: Tensor, q5: Tensor, dtype: torch.dtype) -> Tensor:
    """Per-query-head sink logits ``[hq]`` shaped ``[1, kv_heads, group, 1]`` to broadcast over grouped rows."""
    return sinks.to(dtype).reshape(1, q5.shape[1], q5.shape[2], 1)


def _first_keys(q_pos: Tensor, document_starts: Optional[Tensor], window: Optional[int]) -> Optional[Tensor]:
    """The first global key position each local query attends, ``[batch or 1, local_seq]``; ``None``: key 0 for all.

    A sliding window of ``window`` keys (transformers' convention: query ``i`` sees keys ``j`` with
    ``i - window < j <= i``) starts at ``i - window + 1``; in packed rows at the later of that and the document's
    start. The tiles of :mod:`.tiles` then box and skip by these starts, so keys outside the window cost nothing.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if window is None:
        return document_starts
    with unset_fake_temporarily():  # positions are real tensors, also in the planner's dry run
        starts = (q_pos - window + 1).clamp(min=0).unsqueeze(0)
        if document_starts is not None:
            starts = torch.maximum(starts, document_starts)
        return starts if bool(starts.any()) else None


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: Optional[dist.ProcessGroup] = None,
    *,
    causal: bool = True,
    scale: Optional[float] = None,
    load_balanced: bool = True,
    valid_len: Optional[int] = None,
    query_tile: Optional[int] = None,
    document_starts: Optional[Tensor] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Tensor] = None,
    fused: bool = True,
) -> Tensor:
    """Exact attention over a sequence sharded across the context-parallel group.

    Every rank passes its K/V block around the ring and attends its queries to each block in turn,
    merging with an online softmax; backward recomputes the blocks and sends dK/dV home around the
    ring. Blocks are computed by a fused attention kernel where one expresses them, else by pure-torch
    tiles (see the module docstring). Memory is the local shard, its fp32 output and log-sum-exp, two K/V
    blocks, and the kernel's own buffers (the fallback tiles: a few score-sized buffers, see ``query_tile``).

    Args:
        q: This rank's queries ``[batch, heads, local_seq, head_dim]``.
        k: This rank's keys ``[batch, kv_heads, local_seq, head_dim]``; ``heads`` must be a multiple of
            ``kv_heads`` (grouped-query attention, query head ``i`` uses key head ``i // (heads // kv_heads)``
            as in transformers' ``repeat_kv``).
        v: This rank's values, shaped like ``k``.
        group: The context-parallel process group (default: the world).
        causal: Whether query position ``i`` attends only key positions ``<= i`` (global positions).
        scale: Score scale; default ``1 / sqrt(head_dim)``.
        load_balanced: Whether the shards follow the load-balanced layout (rank ``r`` holds chunks ``r``
            and ``2 * cp - 1 - r`` of every segment, see :func:`load_balanced_indices`) rather than contiguous
            slices.
        valid_len: Global length before padding; positions from it on are padding and neither attend
            nor are attended (their output is zero). Needed for non-causal attention over a padded
            sequence; with causal attention real tokens never see trailing pads anyway.
        query_tile: Query rows a pure-torch fallback tile computes at once against a K/V block; bounds its
            score-sized temporaries to ``batch x heads x query_tile x local_seq`` (the fused kernel tiles itself).
            Default: as many rows as keep each of them under 2**22 elements (16 MiB in fp32).
        document_starts: Packed rows: ``[batch or 1, local_seq]``, the global position where each local
            query's document begins (at most the query's own position). A query attends only keys from
            its document's start on; blocks and tiles holding none of its document's keys are skipped, so
            a packed row costs what its documents cost. Causal attention only. ``None``: one document a row.
        window: Sliding window (causal only): query ``i`` attends keys ``j`` with ``i - window < j <= i``
            (transformers' convention). Blocks and tiles wholly outside the window are skipped (not computed;
            every block still travels the ring). ``None``: full causal.
        softcap: Attention logit soft-capping (Gemma 2): each score ``x`` becomes ``softcap * tanh(x / softcap)``
            before the mask; applied per score, so the online softmax stays exact.
        sinks: Attention sinks (gpt-oss ``s_aux``), one logit per query head ``[heads]``: each joins every row's
            softmax denominator and carries no value. Gets its gradient.
        fused: Whether blocks go to a fused attention kernel where one applies (the default); ``False`` computes
            every block with the pure-torch tiles (the fallback: for comparisons and tests).

    Returns:
        This rank's attention output, shaped like ``q``.
    """
    group = group if group is not None else dist.group.WORLD
    check_ring_inputs(q, k, v, causal, load_balanced, valid_len, query_tile, window, softcap)
    document_starts = host_document_starts(document_starts, q, causal)
    if sinks is not None:
        sinks = local_sinks(sinks, q.shape[1])
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return RingAttention.apply(
        q, k, v, sinks, group, causal, scale, load_balanced, valid_len, query_tile, document_starts, window, softcap,
        fused,
    )


def check_ring_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    load_balanced: bool,
    valid_len: Optional[int],
    query_tile: Optional[int],
    window: Optional[int],
    softcap: Optional[float],
) -> None:
    """Refuse shapes and settings :func:`ring_attention` cannot compute exactly, naming the fix."""
    if query_tile is not None and query_tile < 1:
        raise ValueError(f"query_tile must be a positive number of rows, got {query_tile}.")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        raise ValueError(
            f"ring_attention takes this rank's shard of q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} "
            "as [batch, heads, local_seq, head_dim], with equal batch, local_seq and head_dim."
        )
    check_gqa(q.shape[1], k.shape[1])
    if load_balanced and q.shape[2] % 2 != 0:
        raise ValueError(
            f"The load-balanced layout holds two equal chunks per rank, but the local sequence length "
            f"{q.shape[2]} is odd. Pad the global sequence with `pad_for_context_parallel`."
        )
    if valid_len is not None and valid_len < 1:
        raise ValueError(f"valid_len must be at least 1, got {valid_len}.")
    if window is not None:
        if window < 1:
            raise ValueError(f"window must be a positive number of keys, got {window}.")
        if not causal:
            raise ValueError("ring_attention applies a sliding window in causal attention only.")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be positive, got {softcap}.")


def host_document_starts(document_starts: Optional[Tensor], q: Tensor, causal: bool) -> Optional[Tensor]:
    """Packed rows' document starts on the CPU as ``long`` (the tiles are chosen there), ``None`` for one document
    a row; checked against the local queries."""
    if document_starts is None:
        return None
    if document_starts.ndim != 2 or document_starts.shape[-1] != q.shape[2]:
        raise ValueError(
            f"document_starts must be [batch or 1, local_seq] = [{q.shape[0]}, {q.shape[2]}], got"
            f" {tuple(document_starts.shape)}."
        )
    document_starts = document_starts.detach().to("cpu", torch.long)
    if not bool(document_starts.any()):
        return None  # every query's document begins at 0: one document a row
    if not causal:
        raise ValueError("ring_attention masks packed documents (document_starts) in causal attention only.")
    return document_starts
