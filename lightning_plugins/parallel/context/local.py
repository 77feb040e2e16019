"""Attention over a whole sequence on one rank, by ring attention's pieces (:func:`local_attention`).

Ulysses gathers the whole sequence of its heads on each rank; packed rows then need attention within each document.
One call of the model's kernel per document is a hundred launches a layer at real packing (84-token instruction
samples fill 8K tokens with ~100 documents). Ring attention's block planner (:func:`~.tiles.block_pieces`) already
computes such a row in a few fused calls: a long document's rows in one causal call, short documents together in
masked calls of the same kernel (on CPU, where the kernel takes a mask), windows and sinks included. Here that planner
runs on one rank with no ring: the sequence is one block.
"""

from __future__ import annotations

import math
from typing import Optional

from torch import Tensor

from lightning_plugins.parallel.context.checks import local_sinks
from lightning_plugins.parallel.context.ring import check_ring_inputs, host_document_starts, RingAttention


def local_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    document_starts: Tensor,
    scale: Optional[float] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """Exact causal attention of packed rows on one rank: query ``i`` attends keys from its document's start on.

    Args:
        q: Queries ``[batch, heads, seq, head_dim]`` in natural order (the whole sequence).
        k: Keys ``[batch, kv_heads, seq, head_dim]`` (``heads`` a multiple of ``kv_heads``).
        v: Values, shaped like ``k``.
        document_starts: ``[batch or 1, seq]``: the position where each token's document begins.
        scale: Score scale; default ``1 / sqrt(head_dim)``.
        window: Sliding window (query ``i`` sees keys ``i - window < j <= i``).
        softcap: Attention logit soft-capping (computed by ring attention's pure-torch tiles).
        sinks: Attention sinks ``[heads]``, one logit per query head.

    Returns:
        The attention output, shaped like ``q``.
    """
    check_ring_inputs(q, k, v, True, False, None, None, window, softcap)
    starts = host_document_starts(document_starts, q, True)
    if sinks is not None:
        sinks = local_sinks(sinks, q.shape[1])
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return RingAttention.apply(q, k, v, sinks, None, True, scale, False, None, None, starts, window, softcap, True)
