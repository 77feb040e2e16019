"""A batch's padding under context parallelism: each row checked to be pads, real tokens, pads, and left padding rolled
to the end (the sharded batch drops the attention mask; in causal attention real tokens never attend trailing pads).
Used for text batches (:mod:`.batch`) and image-text batches (:mod:`lightning_plugins.parallel.image_text_context`).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["check_padding", "real_tokens_first"]


def check_padding(
    mask: Tensor,
    labels: Tensor | None,
    shift_labels: Tensor | None,
    rows: int,
    seq_len: int,
    ignore_index: int,
) -> Tensor:
    """The mask as booleans, after checking that each row is pads, real tokens, pads (either side may be empty)."""
    if mask.shape != (rows, seq_len):
        raise ValueError(
            f"Context parallelism takes a 2-D `attention_mask` [batch, seq] = {(rows, seq_len)}, got"
            f" {tuple(mask.shape)}; custom 4-D masks are not supported."
        )
    keep = mask.bool()
    index = torch.arange(seq_len, device=keep.device)
    lead = (keep.cumsum(1) == 0).sum(1, keepdim=True)
    if not torch.equal(keep, (index >= lead) & (index < lead + keep.sum(1, keepdim=True))):
        raise ValueError(
            "Context parallelism takes left or right padding (each row's `attention_mask` is zeros, ones, zeros):"
            " this mask has holes (zeros between ones). Put each row's real tokens together, or pack documents"
            " with `position_ids` that restart at 0 for each."
        )
    for name, targets in (("labels", labels), ("shift_labels", shift_labels)):
        if targets is not None and bool((targets[~keep] != ignore_index).any()):
            raise ValueError(
                f"`{name}` hold targets at padded positions (attention_mask == 0). One process would mask those"
                f" positions out of attention; context parallelism drops the mask, so their targets must be"
                f" {ignore_index} (e.g. `labels[attention_mask == 0] = {ignore_index}`)."
            )
    return keep


def real_tokens_first(keep: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """The gather order that rolls each row's leading pads to its end, and the positions in that order.

    Real tokens keep their position ids; the pads after them count on from the last real one.
    """
    seq_len = keep.shape[1]
    index = torch.arange(seq_len, device=keep.device)
    lead = (keep.cumsum(1) == 0).sum(1, keepdim=True)
    real = keep.sum(1, keepdim=True)
    order = (index + lead) % seq_len
    positions = positions.gather(1, order)
    last = torch.where(real > 0, positions.gather(1, (real - 1).clamp(min=0)), -1)
    return order, torch.where(index >= real, last + 1 + index - real, positions)
