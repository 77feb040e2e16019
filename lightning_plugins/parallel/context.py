"""Context parallelism: the sequence split across ranks inside attention, and its wiring into HF models.

Two mechanisms, both pure torch (matmul + exp) so they run on CPU/gloo as well as on GPUs:

* **Ring attention** (:func:`ring_attention`). Each rank keeps its own queries and passes its key/value
  block around the ring of ``cp`` ranks; attention of the local queries against each arriving block is
  merged with an online softmax (running log-sum-exp in fp32 or wider). The backward recomputes each
  block from the saved ``q, k, v, out, lse`` (FlashAttention-2 style) while K/V and the dK/dV
  accumulators travel the ring again, so no rank ever holds more than two K/V blocks or any attention
  probabilities beyond the tile of query rows being computed against one block.
* **Ulysses** (:func:`ulysses_attention`, built from :func:`seq_to_head` / :func:`head_to_seq`). An
  all-to-all turns sequence-sharded ``[b, h, s/cp, d]`` activations into head-sharded
  ``[b, h/cp, s, d]`` ones, any ordinary attention runs on the full sequence, and the inverse all-to-all
  brings the output back. Its degree is limited by the number of heads.

**Load-balanced layout.** With causal attention, a plain contiguous split gives the last rank ``cp``
times the work of the first. Instead the global sequence of length ``S`` is cut into ``2 * cp`` equal
chunks and rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``, concatenated: every rank then sees the
same number of unmasked query/key pairs. :func:`shard_sequence_load_balanced` and
:func:`load_balanced_indices` shard ``input_ids``, ``labels`` and ``position_ids`` consistently (the model
must get the *global* ``position_ids`` of its shard for RoPE). Concatenating the rank shards in rank
order, as an all-gather or the Ulysses all-to-all does, gives the *rank order* of the sequence;
:func:`unshard_sequence_load_balanced` turns it into natural order and
:func:`reorder_sequence_load_balanced` turns natural order back into rank order.

**Padding.** Both kernels need ``S`` divisible by ``2 * cp`` (``cp`` without load balancing);
:func:`pad_for_context_parallel` pads at the end, with ``-100`` labels. In causal attention trailing pads
are never attended by real tokens (every real position is smaller), so padding changes nothing for them;
non-causal attention must be told ``valid_len`` so that pad keys are masked out. Positions at or after
``valid_len`` neither attend nor are attended, and their attention output is zero.

**In a transformers model.** :func:`apply_context_parallel` (called by ``parallelize`` for
``cp_size > 1``) registers :func:`context_parallel_attention` in transformers' ``AttentionInterface``
and points the model at it; the attention modules keep their projections and RoPE, so q/k/v arrive
per rank and Ulysses runs the model's own attention implementation (SDPA, eager, flash) on the
full sequence in between its all-to-alls. The registered name has no mask function, so transformers
builds no (local-length, wrong) mask: causal masking comes from global positions. Batches are
sharded by :func:`shard_batch_for_context_parallel` / :func:`context_parallel_batch`: labels become
next-token ``shift_labels`` on the full sequence *before* sharding, the sequence is padded to a
multiple of ``2 * cp`` with ignored targets, and a right-padding ``attention_mask`` is checked and
dropped. The loss (``ParallelCausalLMLoss`` over ``dp_cp``) then equals the one-process loss exactly.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_plugins.options import CP_BACKENDS

AttentionFn = Callable[..., Tensor]
"""``attn_fn(q, k, v, *, is_causal, scale) -> out`` on ``[b, heads, seq, head_dim]`` tensors in natural
sequence order; ``k``/``v`` may have fewer heads than ``q`` (grouped-query attention)."""

# p2p tags keep the K/V ring and the dK/dV ring apart where a backend matches messages by tag (gloo);
# NCCL ignores tags and matches by posting order, which is the same on every rank.
_KV_TAG = 0
_GRAD_TAG = 1


# ----------------------------------------------------------------------------------------------------
# Load-balanced layout
# ----------------------------------------------------------------------------------------------------


def _check_divisible(seq_len: int, cp_size: int, num_chunks: int) -> None:
    if seq_len % num_chunks != 0:
        raise ValueError(
            f"Context parallelism with cp_size={cp_size} splits the sequence into {num_chunks} equal chunks, "
            f"but the sequence length {seq_len} is not divisible by {num_chunks}. Pad it first with "
            f"`pad_for_context_parallel` (to a multiple of {num_chunks})."
        )


def _rank_chunk_ids(cp_size: int) -> list[int]:
    """The ``2 * cp`` chunk ids in rank order: rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``."""
    return [chunk for rank in range(cp_size) for chunk in (rank, 2 * cp_size - 1 - rank)]


def load_balanced_indices(seq_len: int, cp_rank: int, cp_size: int) -> Tensor:
    """The global sequence positions that one rank holds in the load-balanced layout.

    Args:
        seq_len: Global sequence length ``S``; must be divisible by ``2 * cp_size``.
        cp_rank: The rank within the context-parallel group.
        cp_size: Size of the context-parallel group.

    Returns:
        A sorted ``LongTensor`` of ``S / cp_size`` positions: chunks ``cp_rank`` and
        ``2 * cp_size - 1 - cp_rank`` of the ``2 * cp_size`` equal chunks.
    """
    _check_divisible(seq_len, cp_size, 2 * cp_size)
    chunk = seq_len // (2 * cp_size)
    first, second = cp_rank, 2 * cp_size - 1 - cp_rank
    return torch.cat([
        torch.arange(first * chunk, (first + 1) * chunk),
        torch.arange(second * chunk, (second + 1) * chunk),
    ])


def _sequence_positions(seq_len: int, cp_rank: int, cp_size: int, load_balanced: bool) -> Tensor:
    """Global positions of one rank's shard, for either layout (sorted ascending in both).

    Real tensors also under a ``FakeTensorMode`` (the planner's dry run): they depend on nothing but the sizes, and
    :func:`_active_block` reads them.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        if load_balanced:
            return load_balanced_indices(seq_len, cp_rank, cp_size)
        _check_divisible(seq_len, cp_size, cp_size)
        local = seq_len // cp_size
        return torch.arange(cp_rank * local, (cp_rank + 1) * local)


def shard_sequence_load_balanced(x: Tensor, dim: int, cp_rank: int, cp_size: int) -> Tensor:
    """This rank's load-balanced shard of a full (natural order) sequence tensor.

    Differentiable; use it for ``input_ids``, ``labels``, ``position_ids`` and anything else indexed by
    sequence position, so that all of them are sharded the same way.

    Args:
        x: Tensor holding the whole sequence along ``dim``.
        dim: The sequence dimension.
        cp_rank: The rank within the context-parallel group.
        cp_size: Size of the context-parallel group.

    Returns:
        Chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` of ``x`` along ``dim``, concatenated.
    """
    _check_divisible(x.shape[dim], cp_size, 2 * cp_size)
    chunks = x.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=dim)


def unshard_sequence_load_balanced(x: Tensor, dim: int, cp_size: int) -> Tensor:
    """Natural sequence order from the rank-ordered concatenation of load-balanced shards.

    ``x`` is what an all-gather of the shards along ``dim`` (or the Ulysses all-to-all) produces: rank
    0's shard, then rank 1's, and so on. Differentiable; inverse of :func:`reorder_sequence_load_balanced`.

    Args:
        x: Tensor holding all ``cp_size`` shards, in rank order, along ``dim``.
        dim: The sequence dimension.
        cp_size: Size of the context-parallel group.

    Returns:
        ``x`` with its sequence in natural order.
    """
    _check_divisible(x.shape[dim], cp_size, 2 * cp_size)
    pieces = x.chunk(2 * cp_size, dim=dim)  # piece i holds chunk _rank_chunk_ids(cp_size)[i]
    position_of_chunk = {chunk: i for i, chunk in enumerate(_rank_chunk_ids(cp_size))}
    return torch.cat([pieces[position_of_chunk[chunk]] for chunk in range(2 * cp_size)], dim=dim)


def reorder_sequence_load_balanced(x: Tensor, dim: int, cp_size: int) -> Tensor:
    """Rank order from a natural-order sequence: the inverse of :func:`unshard_sequence_load_balanced`.

    Args:
        x: Tensor holding the whole sequence, in natural order, along ``dim``.
        dim: The sequence dimension.
        cp_size: Size of the context-parallel group.

    Returns:
        The ``cp_size`` load-balanced shards of ``x`` concatenated in rank order along ``dim``.
    """
    _check_divisible(x.shape[dim], cp_size, 2 * cp_size)
    chunks = x.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[chunk] for chunk in _rank_chunk_ids(cp_size)], dim=dim)


class ContextParallelBatch(NamedTuple):
    """A batch padded for context parallelism (see :func:`pad_for_context_parallel`)."""

    input_ids: Tensor
    labels: Optional[Tensor]
    position_ids: Tensor
    valid_len: int
    """Sequence length before padding: positions at or after it are padding."""


def pad_for_context_parallel(
    input_ids: Tensor,
    labels: Optional[Tensor],
    position_ids: Optional[Tensor],
    cp_size: int,
    pad_id: int,
    *,
    load_balanced: bool = True,
    ignore_index: int = -100,
) -> ContextParallelBatch:
    """Pad a batch at the end of its sequence so that context parallelism can split it evenly.

    The sequence (last dimension) is padded to a multiple of ``2 * cp_size`` (``cp_size`` without load
    balancing). Pad labels are ``ignore_index``, so the loss ignores them; pad positions continue the
    position ids, so RoPE stays well defined. In causal attention real tokens never attend to trailing
    pads; non-causal attention needs the returned ``valid_len`` passed to the kernel.

    Labels must already be the next-token targets (shifted by one) when the model is context parallel:
    a shift inside the loss would cross shard boundaries.

    Args:
        input_ids: Token ids, ``[..., seq]``.
        labels: Targets shaped like ``input_ids``, or ``None``.
        position_ids: Position ids ``[..., seq]``, or ``None`` for ``0 .. seq-1``.
        cp_size: Size of the context-parallel group.
        pad_id: Token id used for padding.
        load_balanced: Whether the sequence will be sharded with the load-balanced layout.
        ignore_index: Label value that the loss ignores.

    Returns:
        The padded ``input_ids``, ``labels`` and ``position_ids``, and the original length ``valid_len``.
    """
    seq_len = input_ids.shape[-1]
    multiple = 2 * cp_size if load_balanced else cp_size
    num_pad = -seq_len % multiple
    if position_ids is None:
        position_ids = torch.arange(seq_len, device=input_ids.device).expand_as(input_ids)
    if num_pad == 0:
        return ContextParallelBatch(input_ids, labels, position_ids, seq_len)
    input_ids = F.pad(input_ids, (0, num_pad), value=pad_id)
    if labels is not None:
        labels = F.pad(labels, (0, num_pad), value=ignore_index)
    steps = torch.arange(1, num_pad + 1, device=position_ids.device, dtype=position_ids.dtype)
    position_ids = torch.cat([position_ids, position_ids[..., -1:] + steps], dim=-1)
    return ContextParallelBatch(input_ids, labels, position_ids, seq_len)


# ----------------------------------------------------------------------------------------------------
# Ring attention
# ----------------------------------------------------------------------------------------------------


class _Block(NamedTuple):
    """Where one query block meets one key block: rows ``[row_start, row_end)``, keys ``[0, col_end)``."""

    row_start: int
    row_end: int
    col_end: int
    mask: Optional[Tensor]  # [rows, cols] bool, True = attend; None when every pair in the box attends


def _active_block(q_pos: Tensor, k_pos: Tensor, causal: bool, valid_len: Optional[int]) -> Optional[_Block]:
    """The box of query rows x key columns that can attend, or ``None`` when the block is fully masked.

    Positions are sorted within a shard in both layouts, so the rows that attend anything form a
    contiguous range and the keys that are attended form a prefix: slicing to that box skips the
    masked work (this is where load balancing pays: off-diagonal causal blocks shrink to a half).

    The positions are real tensors (:func:`_sequence_positions`), read outside any ``FakeTensorMode``.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return _block_of(q_pos, k_pos, causal, valid_len)


def _block_of(q_pos: Tensor, k_pos: Tensor, causal: bool, valid_len: Optional[int]) -> Optional[_Block]:
    row_end = len(q_pos) if valid_len is None else int((q_pos < valid_len).sum())
    col_end = len(k_pos) if valid_len is None else int((k_pos < valid_len).sum())
    if row_end == 0 or col_end == 0:
        return None
    if not causal:
        return _Block(0, row_end, col_end, None)
    # Keys after the last attending query are never attended; queries before the first key attend none.
    col_end = min(col_end, int(torch.searchsorted(k_pos, q_pos[row_end - 1], right=True)))
    row_start = int(torch.searchsorted(q_pos, k_pos[0]))
    if col_end == 0 or row_start >= row_end:
        return None
    mask = q_pos[row_start:row_end, None] >= k_pos[None, :col_end]
    return _Block(row_start, row_end, col_end, None if bool(mask.all()) else mask)


def _block_scores(q: Tensor, k: Tensor, scale: float, mask: Optional[Tensor]) -> Tensor:
    """Scaled scores ``[b, kv_heads, group, rows, cols]`` of grouped queries against one key block.

    ``q`` is ``[b, kv_heads, group, rows, d]``; folding the group into the rows lets one matmul serve
    every query head that shares a key head, without repeating K.
    """
    b, hkv, group, rows, d = q.shape
    scores = torch.matmul(q.reshape(b, hkv, group * rows, d), k.transpose(-1, -2)) * scale
    scores = scores.view(b, hkv, group, rows, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask.to(scores.device), float("-inf"))
    return scores


def _ring_shift(tensor: Tensor, group: dist.ProcessGroup, tag: int) -> tuple[list[Any], Tensor]:
    """Start sending ``tensor`` to the next rank and receiving the previous rank's; returns (works, buffer)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    received = torch.empty_like(tensor)
    ops = [
        dist.P2POp(dist.isend, tensor, group=group, tag=tag, group_peer=(rank + 1) % size),
        dist.P2POp(dist.irecv, received, group=group, tag=tag, group_peer=(rank - 1) % size),
    ]
    return dist.batch_isend_irecv(ops), received


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    # Softmax statistics and partial outputs in fp32 at least: bf16/fp16 would lose the merge.
    return torch.promote_types(dtype, torch.float32)


def _attend_block(q: Tensor, k: Tensor, v: Tensor, scale: float, mask: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """Softmax attention of grouped queries to one key block: (normalised output, log-sum-exp per row)."""
    scores = _block_scores(q, k, scale, mask)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.unsqueeze(2)), lse


def _merge_into(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Online softmax: both outputs are normalised by their own lse, so reweight each to the joint one."""
    new_lse = torch.logaddexp(lse, block_lse)
    out.copy_(out * torch.exp(lse - new_lse).unsqueeze(-1) + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1))
    lse.copy_(new_lse)


def _attend_block_backward(
    q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, lse: Tensor, delta: Tensor, scale: float, mask: Optional[Tensor]
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) of one block, recomputing its probabilities from the forward's final lse."""
    b, hkv, group, rows, d = q.shape
    probs = torch.exp(_block_scores(q, k, scale, mask) - lse.unsqueeze(-1))
    grad_probs = torch.matmul(grad_out, v.unsqueeze(2).transpose(-1, -2))
    grad_scores = probs * (grad_probs - delta.unsqueeze(-1)) * scale
    grad_q = torch.matmul(grad_scores, k.unsqueeze(2))
    # Fold the query group into the rows: one matmul then sums over the heads that share a key head.
    grad_scores_t = grad_scores.reshape(b, hkv, group * rows, -1).transpose(-1, -2)
    grad_k = torch.matmul(grad_scores_t, q.reshape(b, hkv, group * rows, d))
    probs_t = probs.reshape(b, hkv, group * rows, -1).transpose(-1, -2)
    grad_v = torch.matmul(probs_t, grad_out.reshape(b, hkv, group * rows, d))
    return grad_q, grad_k, grad_v


#: Elements of one score-sized temporary (``batch x heads x rows x keys``) that ring attention aims at.
_SCORE_ELEMENTS = 1 << 22


def _row_tiles(block: _Block, query_tile: Optional[int], batch_heads: int) -> Iterator[tuple[slice, Optional[Tensor]]]:
    """Query-row tiles of an active block, with their slice of its mask.

    Rows are independent in attention, so a block is computed a tile at a time: the probabilities of
    one tile against the block's keys are the largest temporaries, whatever the local length.
    """
    tile = query_tile or max(1, _SCORE_ELEMENTS // (batch_heads * block.col_end))
    for start in range(block.row_start, block.row_end, tile):
        stop = min(start + tile, block.row_end)
        mask = None if block.mask is None else block.mask[start - block.row_start : stop - block.row_start]
        yield slice(start, stop), mask


class _RingAttention(torch.autograd.Function):
    """Ring attention over grouped queries; see :func:`ring_attention`."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        group: dist.ProcessGroup,
        causal: bool,
        scale: float,
        load_balanced: bool,
        valid_len: Optional[int],
        query_tile: Optional[int],
    ) -> Tensor:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        b, hq, s, d = q.shape
        hkv = k.shape[1]
        acc = _accumulation_dtype(q.dtype)
        positions = functools.partial(_sequence_positions, s * size, cp_size=size, load_balanced=load_balanced)
        q_pos = positions(rank)

        q5 = q.to(acc).reshape(b, hkv, hq // hkv, s, d)
        out = torch.zeros_like(q5)
        lse = torch.full(q5.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        for step in range(size):
            # Start moving the next block before computing on this one, so communication overlaps compute.
            works, kv_next = _ring_shift(kv, group, _KV_TAG) if step < size - 1 else ([], kv)
            block = _active_block(q_pos, positions((rank - step) % size), causal, valid_len)
            if block is not None:
                cols = slice(0, block.col_end)
                k_blk, v_blk = kv[0, :, :, cols].to(acc), kv[1, :, :, cols].to(acc)
                for rows, mask in _row_tiles(block, query_tile, b * hq):
                    block_out, block_lse = _attend_block(q5[..., rows, :], k_blk, v_blk, scale, mask)
                    _merge_into(out[..., rows, :], lse[..., rows], block_out, block_lse)
            _wait(works)
            kv = kv_next

        out = out.to(q.dtype).reshape(b, hq, s, d)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        ctx.load_balanced, ctx.valid_len, ctx.query_tile = load_balanced, valid_len, query_tile
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Optional[Tensor], ...]:
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        b, hq, s, d = q.shape
        hkv = k.shape[1]
        acc = lse.dtype
        positions = functools.partial(_sequence_positions, s * size, cp_size=size, load_balanced=ctx.load_balanced)
        q_pos = positions(rank)

        q5 = q.to(acc).reshape(b, hkv, hq // hkv, s, d)
        grad_out5 = grad_out.to(acc).reshape(q5.shape)
        # FlashAttention-2's D = rowsum(dO * O): the softmax-Jacobian term, the same for every key block.
        delta = (grad_out5 * out.to(acc).reshape(q5.shape)).sum(dim=-1)
        grad_q = torch.zeros_like(q5)
        kv = torch.stack([k, v])
        grad_works: list[Any] = []
        grad_kv_in: Optional[Tensor] = None
        for step in range(size):
            works, kv_next = _ring_shift(kv, group, _KV_TAG) if step < size - 1 else ([], kv)
            grad_kv = torch.zeros((2, *k.shape), dtype=acc, device=k.device)
            block = _active_block(q_pos, positions((rank - step) % size), ctx.causal, ctx.valid_len)
            if block is not None:
                cols = slice(0, block.col_end)
                k_blk, v_blk = kv[0, :, :, cols].to(acc), kv[1, :, :, cols].to(acc)
                for rows, mask in _row_tiles(block, ctx.query_tile, b * hq):
                    grad_q_blk, grad_k_blk, grad_v_blk = _attend_block_backward(
                        q5[..., rows, :], k_blk, v_blk, grad_out5[..., rows, :], lse[..., rows], delta[..., rows],
                        ctx.scale, mask,
                    )
                    grad_q[..., rows, :] += grad_q_blk
                    grad_kv[0, :, :, cols] += grad_k_blk
                    grad_kv[1, :, :, cols] += grad_v_blk
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
        return grad_q, grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None, None, None, None, None, None


def _check_gqa(num_heads: int, num_kv_heads: int) -> None:
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"Grouped-query attention needs the query heads ({num_heads}) to be a multiple of the key/value "
            f"heads ({num_kv_heads})."
        )


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
) -> Tensor:
    """Exact attention over a sequence sharded across the context-parallel group.

    Every rank passes its K/V block around the ring and attends its queries to each block in turn,
    merging with an online softmax; backward recomputes the blocks and sends dK/dV home around the
    ring. Memory is the local shard, its fp32 output and log-sum-exp, two K/V blocks, and a few
    ``[local_seq, local_seq]`` score-sized buffers per head for the block being computed.

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
            and ``2 * cp - 1 - r``, see :func:`shard_sequence_load_balanced`) rather than contiguous slices.
        valid_len: Global length before padding; positions from it on are padding and neither attend
            nor are attended (their output is zero). Needed for non-causal attention over a padded
            sequence; with causal attention real tokens never see trailing pads anyway.
        query_tile: Query rows computed at once against a K/V block; bounds the score-sized temporaries
            to ``batch x heads x query_tile x local_seq``. Default: as many rows as keep each of them
            under 2**22 elements (16 MiB in fp32).

    Returns:
        This rank's attention output, shaped like ``q``.
    """
    group = group if group is not None else dist.group.WORLD
    if query_tile is not None and query_tile < 1:
        raise ValueError(f"query_tile must be a positive number of rows, got {query_tile}.")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        raise ValueError(
            f"ring_attention takes this rank's shard of q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} "
            "as [batch, heads, local_seq, head_dim], with equal batch, local_seq and head_dim."
        )
    _check_gqa(q.shape[1], k.shape[1])
    if load_balanced and q.shape[2] % 2 != 0:
        raise ValueError(
            f"The load-balanced layout holds two equal chunks per rank, but the local sequence length "
            f"{q.shape[2]} is odd. Pad the global sequence with `pad_for_context_parallel`."
        )
    if valid_len is not None and valid_len < 1:
        raise ValueError(f"valid_len must be at least 1, got {valid_len}.")
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _RingAttention.apply(q, k, v, group, causal, scale, load_balanced, valid_len, query_tile)


# ----------------------------------------------------------------------------------------------------
# Ulysses
# ----------------------------------------------------------------------------------------------------


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


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return _seq_to_head(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        # The all-to-all is a permutation of data across ranks; its adjoint is the inverse permutation.
        return _head_to_seq(grad, ctx.group), None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return _head_to_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _seq_to_head(grad, ctx.group), None


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
    return _SeqToHead.apply(x, group if group is not None else dist.group.WORLD)


def head_to_seq(x: Tensor, group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """Head-sharded ``[b, heads/cp, s, d]`` to sequence-sharded ``[b, heads, s/cp, d]``: inverse of :func:`seq_to_head`.

    Args:
        x: This rank's head shard over the whole sequence (in rank order).
        group: The context-parallel process group (default: the world).

    Returns:
        This rank's sequence shard with all heads.
    """
    return _HeadToSeq.apply(x, group if group is not None else dist.group.WORLD)


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(c for c in range(1, min(n, limit) + 1) if n % c == 0)


def check_ulysses_heads(num_heads: int, num_kv_heads: int, cp_size: int) -> None:
    """Fail early, before any collective, when Ulysses cannot split these heads over ``cp_size`` ranks.

    Args:
        num_heads: Query heads of the attention layer.
        num_kv_heads: Key/value heads of the attention layer.
        cp_size: Size of the context-parallel group.

    Raises:
        ValueError: When the query heads are not divisible by ``cp_size`` (key/value heads need not be:
            they are repeated until they are), or are not a multiple of the key/value heads.
    """
    _check_gqa(num_heads, num_kv_heads)
    if num_heads % cp_size != 0:
        raise ValueError(
            f"Ulysses context parallelism splits attention heads across the cp group, so the query heads "
            f"({num_heads}) must be divisible by cp_size ({cp_size}). Use cp_size="
            f"{_largest_divisor_at_most(num_heads, cp_size)} (or another divisor of {num_heads}), or ring attention."
        )


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

    Returns:
        This rank's attention output, shaped like ``q``.
    """
    group = group if group is not None else dist.group.WORLD
    size = dist.get_world_size(group)
    check_ulysses_heads(q.shape[1], k.shape[1], size)
    attn_fn = attn_fn if attn_fn is not None else _sdpa
    q, k, v = (seq_to_head(x, group) for x in (q, _repeat_kv_for_cp(k, size), _repeat_kv_for_cp(v, size)))

    seq_len = q.shape[2]
    # Rank order is the natural order for contiguous shards. Non-causal attention over unpadded data needs
    # no reordering either: permuting queries and keys together just permutes the output rows.
    reorder = load_balanced and size > 1 and (causal or valid_len is not None)
    if reorder:
        q, k, v = (unshard_sequence_load_balanced(x, 2, size) for x in (q, k, v))
    if valid_len is not None and valid_len < seq_len:
        q, k, v = (x[:, :, :valid_len] for x in (q, k, v))  # natural order here: the pads are trailing
    out = attn_fn(q, k, v, is_causal=causal, scale=scale)
    if out.shape[2] < seq_len:
        out = F.pad(out, (0, 0, 0, seq_len - out.shape[2]))
    if reorder:
        out = reorder_sequence_load_balanced(out, 2, size)
    return head_to_seq(out, group)


# ----------------------------------------------------------------------------------------------------
# Wiring into transformers models
# ----------------------------------------------------------------------------------------------------

#: The name under which the context-parallel attention is registered in transformers' ``AttentionInterface``.
#: It has no mask function on purpose: transformers then builds no mask (a mask for the local length
#: would be wrong), and causal masking is done here from global positions.
ATTENTION_IMPLEMENTATION = "lightning_plugins_context_parallel"
BACKENDS = CP_BACKENDS
_STATE_ATTR = "_lightning_plugins_context_parallel"
# Keys of a batch that hold one entry per sequence position and that sharding knows how to split.
_SEQUENCE_KEYS = ("input_ids", "labels", "shift_labels", "position_ids", "attention_mask")


class _AttentionState(NamedTuple):
    """What the registered attention function needs from one prepared attention module."""

    group: dist.ProcessGroup
    size: int
    backend: str
    inner: str  # the model's own attention implementation, run on the full sequence by Ulysses
    inner_config: Any  # a copy of the model config naming ``inner``, for transformers' kernels that read it


def check_context_parallel(
    config: Any, cp_size: int, tp_size: int = 1, backend: str = "ulysses", *, pp_size: int = 1
) -> None:
    """Fail before any collective when context parallelism cannot run this model config.

    Args:
        config: The transformers model config (``num_attention_heads``, ``num_key_value_heads``, ...).
        cp_size: Context-parallel ranks.
        tp_size: Tensor-parallel ranks (they already split the heads; Ulysses splits the local ones).
        backend: ``"ulysses"`` or ``"ring"``.
        pp_size: Pipeline stages (not composed with context parallelism yet).

    Raises:
        LayoutError: naming the violated constraint and a setting that works.
    """
    from lightning_plugins.layout import LayoutError

    if backend not in BACKENDS:
        raise LayoutError(f"Unknown context-parallel backend {backend!r}; use one of {BACKENDS}.")
    if cp_size == 1:
        return
    if pp_size > 1:
        raise LayoutError(
            f"cp_size={cp_size} with pp_size={pp_size}: context parallelism is not composed with pipeline"
            " parallelism yet. Use cp_size=1 with pipelines, or pp_size=1 (CP composes with TP and FSDP2)."
        )
    if config is None:
        return
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if backend == "ulysses" and heads is not None:
        local_heads, local_kv = heads // tp_size, max(kv_heads // tp_size, 1)
        try:
            check_ulysses_heads(local_heads, local_kv, cp_size)
        except ValueError as err:
            where = f" ({heads} heads / tp_size={tp_size})" if tp_size > 1 else ""
            good = [c for c in range(1, local_heads + 1) if local_heads % c == 0]
            raise LayoutError(
                f"Ulysses context parallelism splits each rank's {local_heads} attention heads{where} over"
                f" cp_size={cp_size} ranks, which needs them divisible by cp_size. Use cp_size in {good}, or"
                f" backend='ring' (no head constraint). ({err})"
            ) from None
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if backend == "ring" and dropout > 0:
        raise LayoutError(
            f"Ring attention has no attention dropout, but config.attention_dropout={dropout}. Set it to 0.0 or use"
            " backend='ulysses'."
        )


def apply_context_parallel(model: Any, layers: Any, cp_mesh: Any, backend: str = "ulysses") -> None:
    """Route every decoder layer's attention through context-parallel attention over ``cp_mesh``.

    The model's attention modules keep computing q/k/v (and RoPE, from the *global* ``position_ids`` of
    the local tokens); transformers' attention interface then calls :func:`context_parallel_attention`,
    which runs Ulysses or ring attention over the cp group. Batches must be sharded with
    :func:`shard_batch_for_context_parallel` (or :func:`context_parallel_batch`).

    Args:
        model: A transformers causal LM (after tensor parallelism, if any).
        layers: Its decoder layers, each with a ``self_attn`` module.
        cp_mesh: The 1-D context-parallel mesh.
        backend: ``"ulysses"`` (all-to-all over heads, then the model's own attention on the full
            sequence) or ``"ring"`` (K/V passed around the ring, online softmax).
    """
    from transformers import AttentionInterface

    from lightning_plugins.layout import LayoutError

    if backend not in BACKENDS:
        raise LayoutError(f"Unknown context-parallel backend {backend!r}; use one of {BACKENDS}.")
    inner = model.config._attn_implementation or "eager"
    if inner == ATTENTION_IMPLEMENTATION:
        raise LayoutError("This model is already context parallel: apply `parallelize` to a fresh model.")
    inner_config = copy.copy(model.config)
    inner_config._attn_implementation = inner
    state = _AttentionState(cp_mesh.get_group(), cp_mesh.size(), backend, inner, inner_config)
    for index, layer in enumerate(layers):
        attention = getattr(layer, "self_attn", None)
        if attention is None:
            raise LayoutError(
                f"Decoder layer {index} ({type(layer).__name__}) has no `self_attn` module, so context parallelism"
                " cannot hook its attention. Use cp_size=1 for this model."
            )
        setattr(attention, _STATE_ATTR, state)
    AttentionInterface.register(ATTENTION_IMPLEMENTATION, context_parallel_attention)
    model.set_attn_implementation(ATTENTION_IMPLEMENTATION)


def context_parallel_attention(
    module: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers attention-interface function: exact attention over the cp-sharded sequence.

    Args:
        module: The attention module (prepared by :func:`apply_context_parallel`).
        query: This rank's queries ``[batch, heads, local_seq, head_dim]`` (after RoPE).
        key: This rank's keys ``[batch, kv_heads, local_seq, head_dim]``.
        value: This rank's values, shaped like ``key``.
        attention_mask: Must be ``None``: masks are handled when the batch is sharded.
        dropout: Attention dropout probability (Ulysses only).
        scaling: Score scale.
        is_causal: Overrides ``module.is_causal``.
        **kwargs: transformers' extra attention arguments (``sliding_window`` is checked).

    Returns:
        The attention output ``[batch, local_seq, heads, head_dim]`` and ``None`` (no weights).
    """
    state: Optional[_AttentionState] = getattr(module, _STATE_ATTR, None)
    if state is None:
        raise RuntimeError(
            f"{type(module).__name__} runs with attn_implementation={ATTENTION_IMPLEMENTATION!r} but was not prepared"
            " by `apply_context_parallel`; build the model through `lightning_plugins.parallelize`."
        )
    if attention_mask is not None:
        raise ValueError(
            "Context parallelism builds its own causal mask from global positions and cannot apply a custom 4-D"
            " attention mask. Pass a 2-D right-padding `attention_mask` (or none) in the batch instead."
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    global_len = query.shape[2] * state.size
    window = kwargs.get("sliding_window")
    if window is not None and global_len > window:
        raise ValueError(
            f"Sliding-window attention (window {window}) is not supported with context parallelism, and this"
            f" sequence ({global_len} tokens after padding) is longer than the window. Use sequences of at most"
            f" {window} tokens, or cp_size=1."
        )
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"Attention `{name}` is not supported with context parallelism; use cp_size=1.")
    dropout = dropout if module.training else 0.0
    if state.backend == "ring":
        if dropout > 0:
            raise ValueError("Ring attention has no attention dropout; set config.attention_dropout=0 or use Ulysses.")
        out = ring_attention(query, key, value, state.group, causal=causal, scale=scaling)
    else:
        inner = functools.partial(_inner_attention, module, state, dropout)
        out = ulysses_attention(query, key, value, state.group, causal=causal, scale=scaling, attn_fn=inner)
    return out.transpose(1, 2).contiguous(), None


class _InnerModule:
    """The attention module as the model's own kernel must see it on the head-sharded full sequence.

    After the all-to-all the query/key head ratio can differ from the module's (kv heads repeated for
    cp), and kernels that dispatch on ``module.config._attn_implementation`` must see their own name.
    """

    def __init__(self, module: Any, config: Any, num_key_value_groups: int, is_causal: bool) -> None:
        self._module = module
        self.config = config
        self.num_key_value_groups = num_key_value_groups
        self.is_causal = is_causal

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _inner_attention(
    module: Any, state: _AttentionState, dropout: float, q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool,
    scale: Optional[float],
) -> Tensor:
    """The model's own attention implementation on natural-order ``[b, h, S, d]`` tensors (Ulysses)."""
    groups = q.shape[1] // k.shape[1]
    if state.inner == "eager":
        # transformers' eager kernels take the causal mask from the model; build it for the full sequence here.
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
        scores = torch.matmul(q, k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
        if is_causal:
            length = q.shape[2]
            future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        probs = F.dropout(probs, p=dropout, training=dropout > 0)
        return torch.matmul(probs, v)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    proxy = _InnerModule(module, state.inner_config, groups, is_causal)
    attention = ALL_ATTENTION_FUNCTIONS[state.inner]
    out, _ = attention(proxy, q, k, v, None, dropout=dropout, scaling=scale, is_causal=is_causal)
    return out.transpose(1, 2)  # transformers' kernels return [b, S, h, d]


# ----------------------------------------------------------------------------------------------------
# Sharding a batch along the sequence
# ----------------------------------------------------------------------------------------------------


def shard_batch_for_context_parallel(
    batch: Mapping[str, Any],
    cp_rank: int,
    cp_size: int,
    *,
    pad_to_multiple_of: Optional[int] = None,
    pad_token_id: int = 0,
    ignore_index: int = -100,
) -> dict[str, Any]:
    """This rank's load-balanced shard of a full-sequence causal-LM batch.

    Labels are turned into next-token targets on the *full* sequence first (a shift after sharding
    would cross shard boundaries) and returned as ``shift_labels``, which transformers forwards to the
    loss; the sequence is padded at the end to a multiple of ``2 * cp_size`` with ignored targets, and
    ``input_ids``, ``labels``, ``shift_labels`` and the global ``position_ids`` are sharded alike.

    A right-padding ``attention_mask`` (ones, then zeros) is checked and dropped: in causal attention
    real tokens never attend trailing pads, so only the pads' own targets must be ignored.

    Args:
        batch: ``input_ids [B, S]`` and optionally ``labels``, ``shift_labels``, ``attention_mask``,
            ``position_ids``; other keys pass through unchanged unless they look sequence-shaped.
        cp_rank: This rank's index in the cp group.
        cp_size: Context-parallel ranks.
        pad_to_multiple_of: Pad the sequence to a multiple of this (a multiple of ``2 * cp_size``;
            default ``2 * cp_size``).
        pad_token_id: Token id for padding (never attended by real tokens, never a target).
        ignore_index: The label value the loss ignores.

    Returns:
        A new dict with this rank's ``input_ids``, ``position_ids`` and, when labels were given,
        ``labels`` and ``shift_labels``.

    Raises:
        ValueError: for left padding or other non-trailing masks, labels on padded positions, custom
            ``position_ids`` (packed sequences), ``inputs_embeds``, or a sequence-shaped key it
            cannot shard.
    """
    multiple = pad_to_multiple_of or 2 * cp_size
    if multiple % (2 * cp_size):
        raise ValueError(f"pad_to_multiple_of={multiple} must be a multiple of 2 * cp_size = {2 * cp_size}.")
    if not isinstance(batch, Mapping):
        raise ValueError(
            f"Context parallelism shards dict-like batches with `input_ids` [batch, seq]; got {type(batch).__name__}."
        )
    if "inputs_embeds" in batch:
        raise ValueError("Context parallelism shards `input_ids`; pass token ids, not `inputs_embeds`.")
    input_ids = batch.get("input_ids")
    if not isinstance(input_ids, Tensor) or input_ids.ndim != 2:
        raise ValueError("Context parallelism needs `input_ids` of shape [batch, seq] in the batch.")
    rows, seq_len = input_ids.shape
    for name, value in batch.items():
        if name not in _SEQUENCE_KEYS and isinstance(value, Tensor) and value.shape[:2] == (rows, seq_len):
            raise ValueError(
                f"Batch key {name!r} has shape {tuple(value.shape)}, one entry per token, and context parallelism"
                f" does not know how to shard it. Supported per-token keys: {_SEQUENCE_KEYS}."
            )
    device = input_ids.device
    labels, shift_labels = batch.get("labels"), batch.get("shift_labels")
    positions = torch.arange(seq_len, device=device).expand(rows, seq_len)
    given_positions = batch.get("position_ids")
    if given_positions is not None and not torch.equal(given_positions.expand(rows, seq_len), positions):
        raise ValueError(
            "Context parallelism assigns global positions itself and supports only `position_ids` = 0 .. seq-1 in"
            " every row; packed sequences (positions restarting inside a row) are not supported yet. Train unpacked"
            " rows (recipes: data.packing: false); dropping `position_ids` from a packed batch would let attention"
            " cross its samples."
        )
    if shift_labels is None and labels is not None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    mask = batch.get("attention_mask")
    if mask is not None:
        _check_right_padding(mask, labels, shift_labels, rows, seq_len, ignore_index)

    num_pad = -seq_len % multiple
    out = {k: v for k, v in batch.items() if k not in _SEQUENCE_KEYS}

    def shard(x: Tensor, fill: int) -> Tensor:
        return shard_sequence_load_balanced(F.pad(x, (0, num_pad), value=fill), -1, cp_rank, cp_size)

    out["input_ids"] = shard(input_ids, pad_token_id)
    padded_positions = torch.arange(seq_len + num_pad, device=device).expand(rows, seq_len + num_pad)
    out["position_ids"] = shard_sequence_load_balanced(padded_positions, -1, cp_rank, cp_size)
    if shift_labels is not None:
        out["shift_labels"] = shard(shift_labels, ignore_index)
        out["labels"] = shard(labels if labels is not None else shift_labels, ignore_index)
    return out


def _check_right_padding(
    mask: Tensor, labels: Optional[Tensor], shift_labels: Optional[Tensor], rows: int, seq_len: int, ignore_index: int
) -> None:
    if mask.shape != (rows, seq_len):
        raise ValueError(
            f"Context parallelism takes a 2-D `attention_mask` [batch, seq] = {(rows, seq_len)}, got"
            f" {tuple(mask.shape)}; custom 4-D masks are not supported."
        )
    keep = mask.bool()
    if not bool((keep[:, 1:] <= keep[:, :-1]).all()):
        raise ValueError(
            "Context parallelism supports right padding only (each row's `attention_mask` is ones, then zeros):"
            " this mask has zeros before ones (left padding, or holes). Pad on the right (tokenizer.padding_side ="
            " 'right') and set the padded labels to -100."
        )
    # A padded position neither predicts (its own target) nor is predicted (the previous position's target).
    for name, targets, pad in (("labels", labels, ~keep), ("shift_labels", shift_labels, ~keep)):
        if targets is not None and bool((targets[pad] != ignore_index).any()):
            raise ValueError(
                f"`{name}` hold targets at padded positions (attention_mask == 0). One process would mask those"
                f" positions out of attention; context parallelism drops the mask, so their targets must be"
                f" {ignore_index} (e.g. `labels[attention_mask == 0] = {ignore_index}`)."
            )


def context_parallel_batch(batch: Mapping[str, Any], mesh: Any, *, pad_token_id: int = 0) -> dict[str, Any]:
    """:func:`shard_batch_for_context_parallel` for this rank of a mesh built by ``ParallelLayout.build_mesh``.

    Pads to a multiple of ``2 * cp * tp`` so that sequence parallelism can split each cp shard further.
    With ``cp_size == 1`` the batch is returned unchanged.
    """
    cp_mesh = mesh["cp"]
    cp_size = cp_mesh.size()
    if cp_size == 1:
        return dict(batch) if isinstance(batch, Mapping) else batch
    tp_size = mesh["tp"].size()
    return shard_batch_for_context_parallel(
        batch, cp_mesh.get_local_rank(), cp_size, pad_to_multiple_of=2 * cp_size * tp_size, pad_token_id=pad_token_id
    )
