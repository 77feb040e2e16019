"""A causal-LM batch sharded along the sequence for context parallelism.

:func:`shard_batch_for_context_parallel` / :func:`context_parallel_batch`: labels become next-token
``shift_labels`` on the full sequence *before* sharding, the sequence is padded to a multiple of ``2 * cp``
with ignored targets, and an ``attention_mask`` is checked and dropped: left-padded rows are turned into
right-padded ones (their tokens keep their position ids), and in causal attention real tokens never attend
trailing pads. Packed rows (``position_ids`` restarting at 0 for each document) keep their position ids,
from which the attention masks by document. The loss (``ParallelCausalLMLoss`` over ``dp_cp``) then equals
the one-process loss exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_plugins.parallel.context.padding import check_padding, real_tokens_first
from lightning_plugins.parallel.context.sharding import shard_sequence_load_balanced
from lightning_plugins.parallel.image_text_context import holds_images, shard_image_text_batch, without_image_types
from lightning_plugins.parallel.loss import IGNORE_INDEX

#: A per-token key of packed rows whose sequences are scored one by one (preference pairs packed with
#: ``data.packing``): the index of the sequence each token belongs to, ``-1`` where none (padding). Sharded as the
#: tokens are, padded with ``-1``.
SEQUENCE_IDS = "sequence_ids"
# Keys of a batch that hold one entry per sequence position and that sharding knows how to split.
_SEQUENCE_KEYS = ("input_ids", "labels", "shift_labels", "position_ids", "attention_mask", SEQUENCE_IDS)
#: The prefix of a second set of rows that travels with the batch's own, each row with its own (KTO's KL rows:
#: ``kl_input_ids``, ``kl_attention_mask``, ``kl_labels``): sharded as a batch of their own, their keys kept prefixed.
COMPANION_PREFIX = "kl_"


def shard_batch_for_context_parallel(
    batch: Mapping[str, Any],
    cp_rank: int,
    cp_size: int,
    *,
    pad_to_multiple_of: Optional[int] = None,
    pad_token_id: int = 0,
    ignore_index: int = IGNORE_INDEX,
) -> dict[str, Any]:
    """This rank's load-balanced shard of a full-sequence causal-LM batch.

    Labels are turned into next-token targets on the *full* sequence first (a shift after sharding
    would cross shard boundaries) and returned as ``shift_labels``, which transformers forwards to the
    loss; the sequence is padded at the end to a multiple of ``2 * cp_size`` with ignored targets, and
    ``input_ids``, ``labels``, ``shift_labels`` and ``position_ids`` are sharded alike.

    Padding: an ``attention_mask`` (ones for real tokens, zeros for pads on either side) is checked and
    dropped. Left-padded rows are rolled so that their real tokens come first, each keeping its position
    id (so RoPE sees what one process sees), and a pad predicts nothing; in causal attention real tokens
    never attend trailing pads. The shards then hold a row's tokens in that rolled order: the loss, a mean
    over tokens, is unchanged, per-position outputs are not in the input's order.

    Packing: ``position_ids`` that restart at 0 in a row (one document after another, as
    ``data.packing`` and transformers' ``DataCollatorWithFlattening`` make them) are kept, and attention
    stays within each document. Without ``position_ids`` every row is one sequence at ``0 .. seq-1``.

    Args:
        batch: ``input_ids [B, S]`` and optionally ``labels``, ``shift_labels``, ``attention_mask``,
            ``position_ids``, ``sequence_ids`` (:data:`SEQUENCE_IDS`); other keys pass through unchanged unless
            they look sequence-shaped. Keys prefixed ``kl_`` (:data:`COMPANION_PREFIX`: KTO's KL rows) are a second
            batch, sharded alike on its own.
        cp_rank: This rank's index in the cp group.
        cp_size: Context-parallel ranks.
        pad_to_multiple_of: Pad the sequence to a multiple of this (a multiple of ``2 * cp_size``;
            default ``2 * cp_size``).
        pad_token_id: Token id for padding (never attended by real tokens, never a target).
        ignore_index: The label value the loss ignores.

    Returns:
        A new dict with this rank's ``input_ids``, ``position_ids``, ``shift_labels`` when ``labels`` or
        ``shift_labels`` were given, and ``labels`` when they were.

    Raises:
        ValueError: for masks with holes, labels on padded positions, ``position_ids`` whose documents do
            not count up from 0, ``inputs_embeds``, or a sequence-shaped key it cannot shard.
    """
    multiple = pad_to_multiple_of or 2 * cp_size
    if multiple % (2 * cp_size):
        raise ValueError(f"pad_to_multiple_of={multiple} must be a multiple of 2 * cp_size = {2 * cp_size}.")
    if isinstance(batch, Mapping) and any(str(key).startswith(COMPANION_PREFIX) for key in batch):
        return _with_companion(batch, cp_rank, cp_size, multiple, pad_token_id, ignore_index)
    if holds_images(batch):  # an image-text model shards it once its images are placed (image_text_context)
        return shard_image_text_batch(batch, cp_rank, cp_size, multiple, pad_token_id, ignore_index)
    batch = without_image_types(batch)  # an image-text model's batch without images: a text batch
    input_ids = _checked_input_ids(batch)
    rows, seq_len = input_ids.shape
    sequence_ids = batch.get(SEQUENCE_IDS)
    labels, shift_labels = batch.get("labels"), batch.get("shift_labels")
    positions = _positions(batch.get("position_ids"), rows, seq_len, input_ids.device)
    derived = shift_labels is None and labels is not None
    if derived:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    mask = batch.get("attention_mask")
    if mask is not None:
        keep = check_padding(mask, labels, None if derived else shift_labels, rows, seq_len, ignore_index)
        if derived:  # a pad predicts nothing (the last left pad would predict the first real token)
            shift_labels = shift_labels.masked_fill(~keep, ignore_index)
        order, positions = real_tokens_first(keep, positions)
        input_ids, labels, shift_labels, sequence_ids = (
            None if x is None else x.gather(1, order) for x in (input_ids, labels, shift_labels, sequence_ids)
        )
    if batch.get("position_ids") is not None:
        _check_documents(positions)
    out = {k: v for k, v in batch.items() if k not in _SEQUENCE_KEYS}
    shards = _padded_shards(
        input_ids, positions, labels, shift_labels, multiple, cp_rank, cp_size, pad_token_id, ignore_index
    )
    if sequence_ids is not None:
        shards[SEQUENCE_IDS] = _sequence_ids_shard(sequence_ids, multiple, cp_rank, cp_size)
    return out | shards


def _sequence_ids_shard(sequence_ids: Tensor, multiple: int, cp_rank: int, cp_size: int) -> Tensor:
    """This rank's load-balanced shard of packed rows' per-token sequence numbers (a pad belongs to no sequence:
    ``-1``)."""
    padded = F.pad(sequence_ids, (0, -sequence_ids.shape[1] % multiple), value=-1)
    return shard_sequence_load_balanced(padded, -1, cp_rank, cp_size)


def _with_companion(
    batch: Mapping[str, Any], cp_rank: int, cp_size: int, multiple: int, pad_token_id: int, ignore_index: int
) -> dict[str, Any]:
    """The batch's shards and its companion rows' (keys prefixed :data:`COMPANION_PREFIX`), each sharded on its own."""
    size = len(COMPANION_PREFIX)
    parts = (
        {key: value for key, value in batch.items() if not key.startswith(COMPANION_PREFIX)},
        {key[size:]: value for key, value in batch.items() if key.startswith(COMPANION_PREFIX)},
    )
    own, companion = (
        shard_batch_for_context_parallel(part, cp_rank, cp_size, pad_to_multiple_of=multiple,
                                         pad_token_id=pad_token_id, ignore_index=ignore_index)
        for part in parts
    )  # fmt: skip
    return own | {COMPANION_PREFIX + key: value for key, value in companion.items()}


def _checked_input_ids(batch: Mapping[str, Any]) -> Tensor:
    """The batch's ``input_ids [batch, seq]``, once it is a dict whose per-token keys context parallelism shards."""
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
    return input_ids


def _padded_shards(
    input_ids: Tensor,
    positions: Tensor,
    labels: Tensor | None,
    shift_labels: Tensor | None,
    multiple: int,
    cp_rank: int,
    cp_size: int,
    pad_token_id: int,
    ignore_index: int,
) -> dict[str, Tensor]:
    """The per-token tensors padded at the end to ``multiple`` (pads attend nothing real, predict nothing; their
    positions count on) and this rank's load-balanced shard of each."""
    num_pad = -input_ids.shape[1] % multiple

    def shard(x: Tensor, fill: int) -> Tensor:
        return shard_sequence_load_balanced(F.pad(x, (0, num_pad), value=fill), -1, cp_rank, cp_size)

    out = {"input_ids": shard(input_ids, pad_token_id)}
    steps = torch.arange(1, num_pad + 1, device=positions.device, dtype=positions.dtype)
    out["position_ids"] = shard_sequence_load_balanced(
        torch.cat([positions, positions[:, -1:] + steps], dim=-1), -1, cp_rank, cp_size
    )
    if shift_labels is not None:
        out["shift_labels"] = shard(shift_labels, ignore_index)
    if labels is not None:  # `shift_labels` alone stay alone: transformers computes no loss from them (one process)
        out["labels"] = shard(labels, ignore_index)
    return out


def _positions(given: Optional[Tensor], rows: int, seq_len: int, device: torch.device) -> Tensor:
    if given is None:
        return torch.arange(seq_len, device=device).expand(rows, seq_len)
    if (
        not isinstance(given, Tensor)
        or given.ndim != 2
        or given.shape[-1] != seq_len
        or given.shape[0] not in (1, rows)
    ):
        shape = tuple(given.shape) if isinstance(given, Tensor) else type(given).__name__
        raise ValueError(f"`position_ids` must be [batch, seq] or [1, seq] = [{rows}, {seq_len}], got {shape}.")
    return given.expand(rows, seq_len)


def _check_documents(positions: Tensor) -> None:
    """Packed rows: a document begins where the ids do not count on by one, and must begin at id 0."""
    if bool((positions < 0).any()):
        raise ValueError("`position_ids` must not be negative.")
    begins = positions[:, 1:] != positions[:, :-1] + 1
    bad = (begins & (positions[:, 1:] != 0)).nonzero()
    if len(bad):
        row, index = (int(x) for x in bad[0])
        raise ValueError(
            f"`position_ids` row {row} jumps from {int(positions[row, index])} to {int(positions[row, index + 1])} at"
            f" index {index + 1}. Context parallelism takes packed rows whose documents count up from 0"
            " (as data.packing and transformers' DataCollatorWithFlattening make them); only a row's first"
            " document may start elsewhere."
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
