"""Packing and collation: padded batches, and packed rows of whole samples.

Packing (``packing: true``) fills rows of exactly ``max_seq_len`` tokens with whole samples, greedy
first fit in dataset order, once when the dataset is built (so every batch has the same shape, which
pipeline schedules and compiled graphs want). ``position_ids`` restart at 0 for every sample and the
batch has no ``attention_mask``: transformers then finds the sample boundaries from the positions and
masks attention block-diagonally (``masking_utils.find_packed_sequence_indices``, for sdpa, eager and
flex attention). The first token of every sample is labelled ``-100`` so the previous sample's last
token does not predict it: a packed batch trains exactly the per-token loss of its samples unpadded.
Two ways transformers 5.23 silently attends across samples instead, which
:func:`prepare_model_for_packing` rules out (call it on the model before training packed): it skips the
detection when a KV cache exists, and a causal LM makes one whenever ``config.use_cache`` is true, even in
training; and flash attention 2/3 read packed positions only in a batch of one row (on CUDA they keep the samples
apart in any batch when it carries their lengths: ``make_collator(..., varlen=True)`` and
``prepare_model_for_packing(model, varlen=True)``, :func:`varlen_lengths`). A third way for Gated
DeltaNet linear attention (Qwen3.5, Qwen3-Next), whose torch kernels take no document boundaries and carry the
recurrent state and conv from one sample into the next: :func:`prepare_model_for_packing` makes those layers run
each sample on its own (:mod:`lightning_plugins.parallel.linear_documents`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_plugins.data.config import IGNORE_INDEX, DataConfig, Example
from lightning_plugins.data.preference import PAIR_KEYS, ROW_PAIRS, SIDES, UNPAIRED_KEYS, collate_unpaired
from lightning_plugins.errors import DataError
from lightning_plugins.parallel.context.batch import SEQUENCE_IDS
from lightning_plugins.parallel.varlen import VARLEN_ATTENTION, varlen_lengths

def first_fit(lengths: Sequence[int], max_seq_len: int) -> list[list[int]]:
    """Greedy first fit: each sample, in order, goes into the first row with room; samples are never split.

    A segment tree over the rows' free space finds that row in ``O(log n)``.

    Returns:
        Per row, the indices of its samples (in the order they were placed).

    Raises:
        ValueError: if a sample is longer than ``max_seq_len``.
    """
    size = 1
    while size < max(1, len(lengths)):
        size *= 2
    free = [0] * (2 * size)  # free[size + r]: row r's free space (0 until the row is opened); inner nodes: max
    rows: list[list[int]] = []
    for index, length in enumerate(lengths):
        if length > max_seq_len:
            raise ValueError(f"sample {index} has {length} tokens, more than max_seq_len={max_seq_len}.")
        if free[1] >= length:
            node = 1
            while node < size:
                node = 2 * node if free[2 * node] >= length else 2 * node + 1
            row = node - size
        else:
            row, node = len(rows), size + len(rows)
            rows.append([])
            free[node] = max_seq_len
        rows[row].append(index)
        free[node] -= length
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return rows


def pack_examples(examples: Sequence[Mapping[str, Sequence[int]]], max_seq_len: int) -> list[Example]:
    """Packs samples into rows of at most ``max_seq_len`` tokens (:func:`first_fit`) for :func:`collate_packed`.

    Each row concatenates its samples' ``input_ids`` and ``labels`` and carries ``position_ids`` that
    restart at 0 for every sample; each sample's first label becomes ``-100``, so the previous sample's
    last token does not learn to predict it.

    Raises:
        ValueError: if a sample is longer than ``max_seq_len``.
    """
    rows = first_fit([len(ex["input_ids"]) for ex in examples], max_seq_len)
    return [_packed_row([examples[i] for i in members]) for members in rows]


def _packed_row(samples: Sequence[Mapping[str, Sequence[int]]]) -> Example:
    row: Example = {"input_ids": [], "labels": [], "position_ids": []}
    for sample in samples:
        row["input_ids"] += sample["input_ids"]
        row["labels"] += [IGNORE_INDEX, *sample["labels"][1:]]
        row["position_ids"] += range(len(sample["input_ids"]))
    return row


def _packed_pairs_row(pairs: Sequence[Mapping[str, Sequence[int]]]) -> Example:
    """Whole preference pairs side by side, each sequence a document; ``sequence_ids``: ``2k`` on pair ``k``'s chosen
    tokens, ``2k + 1`` on its rejected ones (:func:`collate_packed_pairs` numbers them over the batch)."""
    row: Example = {"input_ids": [], "labels": [], "position_ids": [], SEQUENCE_IDS: []}
    for k, pair in enumerate(pairs):
        for s, side in enumerate(SIDES):
            ids = pair[f"{side}_input_ids"]
            row["input_ids"] += ids
            row["labels"] += [IGNORE_INDEX, *pair[f"{side}_labels"][1:]]
            row["position_ids"] += range(len(ids))
            row[SEQUENCE_IDS] += [2 * k + s] * len(ids)
    return row


def pack_pairs(pairs: Sequence[Mapping[str, Sequence[int]]], max_seq_len: int) -> list[Example]:
    """Packs whole preference pairs (:mod:`lightning_plugins.data.preference` rows) into rows of at most
    ``max_seq_len`` tokens (:func:`first_fit` on each pair's two lengths together), for :func:`collate_packed_pairs`:
    a pair is never split across rows, and each of its sequences is a document (positions restarting at 0, its first
    label ``-100``).

    Raises:
        ValueError: if a pair's two sequences together are longer than ``max_seq_len``.
    """
    rows = first_fit([sum(len(pair[f"{side}_input_ids"]) for side in SIDES) for pair in pairs], max_seq_len)
    return [_packed_pairs_row([pairs[i] for i in members]) for members in rows]


def write_packed(samples: Any, max_seq_len: int, path: Path, rows_per_batch: int = 1000) -> int:
    """Packs ``samples`` (a ``datasets.Dataset`` of tokenized samples; or of preference pairs, whole pairs per row as
    :func:`pack_pairs` packs them) as :func:`pack_examples` does, into the Arrow file ``path``, a batch of rows at a
    time: memory holds the samples' lengths and one batch, not the data.

    Returns:
        The number of packed rows.
    """
    import pyarrow.compute as pc
    from datasets import Features
    from datasets.arrow_writer import ArrowWriter

    table = samples.with_format("arrow")[:]  # the memory-mapped columns, not a copy
    pairs = PAIR_KEYS[0] in table.column_names  # preference pairs: whole pairs per row (pack_pairs)
    ids = [f"{side}_input_ids" for side in SIDES] if pairs else ["input_ids"]
    lengths = [sum(each) for each in zip(*(pc.list_value_length(table.column(key)).to_pylist() for key in ids))]
    rows = first_fit(lengths, max_seq_len)
    token = samples.features[ids[0]]
    columns = dict.fromkeys(("input_ids", "labels", SEQUENCE_IDS), token) if pairs else samples.features
    features = Features({**columns, "position_ids": token})
    pack = _packed_pairs_row if pairs else _packed_row
    with ArrowWriter(features=features, path=str(path)) as writer:
        for start in range(0, len(rows), rows_per_batch):
            batch = rows[start : start + rows_per_batch]
            taken = table.take([i for members in batch for i in members]).to_pylist()
            packed, used = [], 0
            for members in batch:
                packed.append(pack(taken[used : used + len(members)]))
                used += len(members)
            writer.write_batch({key: [row[key] for row in packed] for key in features})
        writer.finalize()
    return len(rows)


def _tensor_rows(examples: Sequence[Mapping[str, Sequence[int]]], key: str, length: int, fill: int) -> Tensor:
    out = torch.full((len(examples), length), fill, dtype=torch.long)
    for row, example in enumerate(examples):
        values = example[key]
        out[row, : len(values)] = torch.as_tensor(values, dtype=torch.long)
    return out


def _check_examples(examples: Sequence[Mapping[str, Sequence[int]]], keys: tuple[str, ...]) -> None:
    if not examples:
        raise ValueError("cannot collate an empty list of examples")
    for row, example in enumerate(examples):
        if any(len(example[key]) != len(example["input_ids"]) for key in keys):
            raise ValueError(f"example {row}: {' and '.join(keys)} lengths differ")


def _round_up(length: int, multiple: int | None) -> int:
    return -(-length // multiple) * multiple if multiple is not None and multiple > 1 else length


def collate_causal_lm(
    examples: Sequence[Mapping[str, Sequence[int]]],
    pad_token_id: int,
    pad_to_multiple_of: int | None = None,
) -> dict[str, Tensor]:
    """Right-pads samples into ``input_ids``, ``attention_mask`` (1 real, 0 pad) and ``labels`` (``-100`` on pads).

    Args:
        examples: Dicts with equally long ``input_ids`` and ``labels``.
        pad_token_id: Id written into padded ``input_ids`` positions.
        pad_to_multiple_of: Round the padded length up to a multiple of this (e.g. for sequence parallelism).

    Raises:
        ValueError: if ``examples`` is empty or an example's lengths differ.
    """
    _check_examples(examples, ("input_ids", "labels"))
    length = _round_up(max(len(ex["input_ids"]) for ex in examples), pad_to_multiple_of)
    input_ids = _tensor_rows(examples, "input_ids", length, pad_token_id)
    attention_mask = torch.zeros_like(input_ids)
    for row, example in enumerate(examples):
        attention_mask[row, : len(example["input_ids"])] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": _tensor_rows(examples, "labels", length, IGNORE_INDEX)}


def collate_packed(
    examples: Sequence[Mapping[str, Sequence[int]]],
    pad_token_id: int,
    max_seq_len: int,
    pad_to_multiple_of: int | None = None,
    varlen: bool = False,
) -> dict[str, Any]:
    """Stacks packed rows into ``input_ids``, ``position_ids`` and ``labels`` of ``max_seq_len`` columns.

    The tail of a row that is not full is padding with ``-100`` labels and its own positions
    ``0, 1, ...`` (a sample of its own, attending only to itself). There is no ``attention_mask``: with
    none, transformers builds the block-diagonal causal mask from ``position_ids``. With ``varlen`` the batch also
    carries each sample's length for flash attention's variable-length kernel (:func:`varlen_lengths`).

    Raises:
        ValueError: if ``examples`` is empty, a row's lengths differ, or a row is longer than ``max_seq_len``.
    """
    _check_examples(examples, ("input_ids", "labels", "position_ids"))
    length = _round_up(max_seq_len, pad_to_multiple_of)
    longest = max(len(ex["input_ids"]) for ex in examples)
    if longest > length:
        raise ValueError(f"a packed row has {longest} tokens, more than max_seq_len={max_seq_len}.")
    position_ids = torch.arange(length).repeat(len(examples), 1)
    for row, example in enumerate(examples):
        used = len(example["position_ids"])
        position_ids[row, :used] = torch.as_tensor(example["position_ids"], dtype=torch.long)
        position_ids[row, used:] = torch.arange(length - used)
    batch: dict[str, Any] = {
        "input_ids": _tensor_rows(examples, "input_ids", length, pad_token_id),
        "position_ids": position_ids,
        "labels": _tensor_rows(examples, "labels", length, IGNORE_INDEX),
    }
    return {**batch, **varlen_lengths(position_ids)} if varlen else batch


def collate_packed_pairs(
    examples: Sequence[Mapping[str, Sequence[int]]], pad_token_id: int, max_seq_len: int,
    pad_to_multiple_of: int | None = None, varlen: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Rows of packed preference pairs (:func:`pack_pairs`) as :func:`collate_packed` stacks packed rows, plus the
    batch's sequences numbered as an unpacked batch of the same pairs orders its rows (:func:`collate_pairs`): on
    each token ``sequence_ids`` holds the chosen sequence of the batch's pair ``j`` (counted row by row) as ``j`` and
    its rejected one as ``pairs + j`` (``-1`` on padding), and :data:`~lightning_plugins.data.preference.ROW_PAIRS`
    how many pairs each row holds. :func:`lightning_plugins.preference.sequence_logps` sums each sequence's
    log-probability from them.

    Raises:
        ValueError: as :func:`collate_packed`, or for a row whose ``sequence_ids`` do not come in pairs.
    """
    _check_examples(examples, ("input_ids", SEQUENCE_IDS))
    batch = collate_packed(examples, pad_token_id, max_seq_len, pad_to_multiple_of, varlen)
    local = _tensor_rows(examples, SEQUENCE_IDS, batch["input_ids"].shape[1], -1)
    counts = [(max(example[SEQUENCE_IDS], default=-1) + 1) for example in examples]
    if any(count % 2 for count in counts):
        raise ValueError("a packed row of preference pairs holds a chosen sequence without its rejected one.")
    row_pairs = torch.tensor(counts, dtype=torch.long) // 2
    first = (row_pairs.cumsum(0) - row_pairs).unsqueeze(1)  # the batch's number of each row's first pair
    numbered = first + local // 2 + (local % 2) * int(row_pairs.sum())
    batch[SEQUENCE_IDS] = numbered.masked_fill(local < 0, -1)
    batch[ROW_PAIRS] = row_pairs
    return batch


def pairs_in_rows(input_ids: Tensor) -> dict[str, Any]:
    """The batch :func:`collate_packed_pairs` makes of full packed rows holding one pair each: every row of
    ``input_ids`` cut in half, the first half its chosen sequence, the second its rejected one, each its own labels.
    A step on it costs what a step on packed pairs of that many rows and tokens costs (the planner's dry run and the
    real step it is checked against measure it)."""
    rows, length = input_ids.shape
    half = length // 2
    sides = [zip(SIDES, (row[:half], row[half:])) for row in input_ids.tolist()]
    pairs = [{f"{side}_{key}": part for side, part in row for key in ("input_ids", "labels")} for row in sides]
    return collate_packed_pairs(pack_pairs(pairs, length), pad_token_id=0, max_seq_len=length)


def collate_pairs(
    examples: Sequence[Mapping[str, Sequence[int]]], pad_token_id: int, pad_to_multiple_of: int | None = None
) -> dict[str, Tensor]:
    """Preference pairs (:mod:`lightning_plugins.data.preference`) to one padded batch: the chosen rows of every
    pair, then their rejected rows in the same order (what :class:`lightning_plugins.preference.PreferenceObjective`
    splits)."""
    rows = [
        {"input_ids": example[f"{side}_input_ids"], "labels": example[f"{side}_labels"]}
        for side in SIDES
        for example in examples
    ]
    return collate_causal_lm(rows, pad_token_id, pad_to_multiple_of)


def make_collator(
    config: DataConfig, pad_token_id: int, pad_to_multiple_of: int | None = None, varlen: bool = False
) -> Callable[[Sequence[Mapping[str, Sequence[int]]]], dict[str, Tensor]]:
    """The ``collate_fn`` for rows of :func:`build_dataset` with this config: padded or packed batches (with
    ``varlen``, packed batches carry their samples' lengths for flash attention, :func:`varlen_lengths`), and for
    preference pairs (:func:`collate_pairs`) the chosen rows then the rejected (packed: :func:`collate_packed_pairs`);
    for unpaired (KTO) examples their rows
    and KL rows (:func:`~lightning_plugins.data.preference.collate_unpaired`)."""
    def collate(examples: Sequence[Mapping[str, Sequence[int]]]) -> dict[str, Tensor]:
        if examples and PAIR_KEYS[0] in examples[0]:  # rows of preference pairs (data.format preference, or auto)
            return collate_pairs(examples, pad_token_id, pad_to_multiple_of)
        if examples and SEQUENCE_IDS in examples[0]:  # preference pairs packed (data.packing)
            return collate_packed_pairs(examples, pad_token_id, config.max_seq_len, pad_to_multiple_of, varlen)
        if examples and UNPAIRED_KEYS[0] in examples[0]:  # unpaired examples (data.format unpaired, or auto)
            return collate_unpaired(examples, pad_token_id, config.max_seq_len)
        if config.packing:
            return collate_packed(examples, pad_token_id, config.max_seq_len, pad_to_multiple_of, varlen)
        return collate_causal_lm(examples, pad_token_id, pad_to_multiple_of)

    return collate


#: Attention implementations whose masks transformers builds from packed ``position_ids`` in any batch.
_PACKING_ATTENTION = ("sdpa", "eager", "flex_attention")


def check_packing_attention(implementation: str | None, varlen: bool = False, device: str | None = None) -> None:
    """Refuses an attention implementation that does not keep the samples of packed rows apart.

    Call it while validating a recipe (``model.attn_implementation`` with ``data.packing``), before any
    process starts; :func:`prepare_model_for_packing` calls it on the loaded model.

    Args:
        implementation: The model's attention implementation.
        varlen: Whether the batches carry their samples' lengths (``make_collator(..., varlen=True)``): then flash
            attention 2/3 keep the samples apart through their variable-length kernel, on CUDA.
        device: The device type the model trains on, when known (flash attention runs on CUDA only; ``"meta"``: not
            known yet).

    Raises:
        DataError: for anything but sdpa, eager or flex attention, or flash attention 2/3 given ``varlen`` on
            CUDA. Without the lengths flash attention finds packed samples only in a batch of one row
            (``modeling_flash_attention_utils._is_packed_sequence``) and attends across them otherwise.
    """
    flash = isinstance(implementation, str) and implementation in VARLEN_ATTENTION
    if flash and varlen and device not in (None, "cuda", "meta"):
        raise DataError(
            f"data.packing with {implementation!r}: flash attention's variable-length kernel runs on CUDA only"
            f" (flash-attn), and the model is on {device!r}. On CPU load it with attn_implementation='sdpa' (or"
            " 'eager'): the same samples, kept apart by a block-diagonal mask."
        )
    if implementation in _PACKING_ATTENTION or (flash and varlen):
        return
    why = (
        " transformers' flash attention finds packed samples from position_ids only in a batch of one row and"
        " would attend across the samples of a packed batch; make_collator(..., varlen=True) gives it each"
        " sample's length (cu_seq_lens) and prepare_model_for_packing(model, varlen=True) accepts it on CUDA."
        if flash
        else ""
    )
    raise DataError(
        f"data.packing needs an attention implementation that keeps packed samples apart {_PACKING_ATTENTION}; the"
        f" model uses {implementation!r}.{why} Load it with attn_implementation='sdpa' (or 'flex_attention'), or"
        " set data.packing: false."
    )


def prepare_model_for_packing(model: Any, varlen: bool = False, device: str | None = None) -> None:
    """Makes a transformers causal LM attend within packed samples only; call it before training packed.

    Sets ``config.use_cache = False``: with a cache (which the model creates whenever ``use_cache`` is
    true, in training too), transformers does not look for packed sequences in ``position_ids`` and
    attention silently crosses samples. Gated DeltaNet linear-attention layers (Qwen3.5, Qwen3-Next) restart their
    recurrent state and conv at each sample (``parallel.linear_documents.prepare_linear_attention_for_packing``); call
    it before ``parallelize`` (context parallelism does the same for those layers itself). ``varlen``: the batches
    carry their samples' lengths (``make_collator(..., varlen=True)``), so flash attention 2/3 on CUDA keep the
    samples apart through their variable-length kernel. ``device``: the device type the model will train on, when its
    parameters are not there yet (built on meta, or loaded on the host to be moved); default: its parameters'.

    Raises:
        DataError: for an attention implementation that does not separate the samples of packed rows, or flash
            attention on a model that is not on CUDA (see :func:`check_packing_attention`).
    """
    from lightning_plugins.parallel.linear_documents import prepare_linear_attention_for_packing

    device = device or next((p.device.type for p in model.parameters()), None)
    check_packing_attention(getattr(model.config, "_attn_implementation", None), varlen, device)
    model.config.use_cache = False
    prepare_linear_attention_for_packing(model)
