"""A causal-LM batch sharded along the sequence for context parallelism.

:func:`shard_batch_for_context_parallel` / :func:`context_parallel_batch`: labels become next-token
``shift_labels`` on the full sequence *before* sharding, the sequence is padded to a multiple of ``2 * cp``
with ignored targets, and a right-padding ``attention_mask`` is checked and dropped. The loss
(``ParallelCausalLMLoss`` over ``dp_cp``) then equals the one-process loss exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_plugins.parallel.context.sharding import shard_sequence_load_balanced

# Keys of a batch that hold one entry per sequence position and that sharding knows how to split.
_SEQUENCE_KEYS = ("input_ids", "labels", "shift_labels", "position_ids", "attention_mask")


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
