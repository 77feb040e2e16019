"""Preference pairs: TRL's ``prompt``/``chosen``/``rejected`` records to token ids, and batches that keep a pair together.

Records, as TRL reads them:

* strings: ``{"prompt": str, "chosen": str, "rejected": str}``: ``prompt`` (with the tokenizer's special tokens) +
  completion + EOS, for each completion;
* conversations: ``{"prompt": [messages], "chosen": [messages], "rejected": [messages]}`` rendered with the
  tokenizer's chat template; or without ``prompt`` (TRL's implicit prompt), ``chosen`` and ``rejected`` whole
  conversations whose shared leading messages are the prompt.

Only the completion is labelled: the prompt's tokens (and, in a conversation, every token the prompt rendered with its
generation prompt already holds) are ``-100``. Each record becomes one row with ``chosen_input_ids``,
``chosen_labels``, ``rejected_input_ids`` and ``rejected_labels``; :func:`~lightning_plugins.data.packing.collate_pairs` stacks a batch of them as
``[chosen of each pair..., rejected of each pair...]``, the layout :class:`lightning_plugins.preference.PreferenceObjective`
splits, so both halves of a pair are always in the same micro-batch on the same data rank. With ``data.packing``
whole pairs are packed into rows instead (:func:`~lightning_plugins.data.packing.write_packed`): a pair's chosen and
rejected sequences lie side by side in one row, each a document of its own (positions restarting at 0), and
:func:`~lightning_plugins.data.packing.collate_packed_pairs` numbers every document of the batch
(:data:`ROW_PAIRS`, ``sequence_ids``) so that the log-probabilities are summed per sequence.

Unpaired records (TRL's KTO format: ``prompt``, ``completion``, ``label``: ``true`` for a desirable completion; strings
or conversations) become their prompt and completion ids apart (:func:`encode_unpaired`), and
:func:`collate_unpaired` builds each example's row and its KL row (its prompt with the completion of the example
before it in the batch), what :class:`lightning_plugins.preference.KTOObjective` takes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_plugins.data.config import IGNORE_INDEX, DataConfig, Example
from lightning_plugins.data.encoding import encode_chat, require_eos_id, text_field
from lightning_plugins.errors import DataError

#: What a pair's row holds.
PAIR_KEYS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")
SIDES = ("chosen", "rejected")
#: A batch of packed pairs' key: how many whole pairs each row holds (``[rows]``); its per-token ``sequence_ids``
#: (:data:`~lightning_plugins.parallel.context.batch.SEQUENCE_IDS`) number the pairs' sequences as an unpacked batch
#: orders its rows: the chosen sequence of pair ``j`` of the batch is ``j``, its rejected ``pairs + j``.
ROW_PAIRS = "row_pairs"


def _conversation(record: Mapping[str, Any], key: str) -> list[dict[str, str]]:
    value = record.get(key)
    if not isinstance(value, list) or not value or not all(isinstance(m, Mapping) for m in value):
        raise DataError(f"field {key!r} must be a non-empty list of {{'role', 'content'}} messages.")
    return [{k: v for k, v in message.items() if v is not None} for message in value]


def _split_implicit(chosen: list[dict], rejected: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """TRL's implicit prompt: the messages both conversations start with."""
    shared = 0
    while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0:
        raise DataError("'chosen' and 'rejected' share no leading message, and there is no 'prompt' field.")
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _encode_conversation(prompt: list[dict], completion: list[dict], tokenizer: Any) -> Example:
    """``prompt + completion`` through the chat template; only the completion's assistant tokens labelled (and
    ``prompt_length``: how many leading tokens the prompt with its generation prompt renders)."""
    if not any(m.get("role") == "assistant" for m in completion):
        raise DataError("the completion has no 'assistant' message, so nothing in it would be trained.")
    whole = encode_chat({"messages": prompt + completion}, tokenizer)
    start = tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, return_dict=True)
    start = list(start["input_ids"])
    if whole["input_ids"][: len(start)] != start:
        raise DataError(
            "the chat template renders the prompt (with its generation prompt) differently from the start of the"
            " prompt followed by the completion, so the prompt's tokens cannot be masked. Use a template that renders"
            " earlier turns unchanged, or string records."
        )
    labels = [IGNORE_INDEX] * len(start) + whole["labels"][len(start) :]
    return {"input_ids": whole["input_ids"], "labels": labels, "prompt_length": len(start)}


def encode_preference(record: Mapping[str, Any], tokenizer: Any) -> Example:
    """A preference record to one row of both completions' ids and labels (prompt masked).

    Raises:
        DataError: naming the field that is missing or of the wrong kind.
    """
    if isinstance(record.get("chosen"), str) or isinstance(record.get("prompt"), str):
        prompt = text_field(record, "prompt")
        prompt_ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
        row: Example = {}
        for side in SIDES:
            ids = list(tokenizer(text_field(record, side), add_special_tokens=False)["input_ids"])
            ids.append(require_eos_id(tokenizer))
            row[f"{side}_input_ids"] = prompt_ids + ids
            row[f"{side}_labels"] = [IGNORE_INDEX] * len(prompt_ids) + ids
        return row
    chosen, rejected = _conversation(record, "chosen"), _conversation(record, "rejected")
    if record.get("prompt") is None:
        prompt, chosen, rejected = _split_implicit(chosen, rejected)
    else:
        prompt = _conversation(record, "prompt")
    row = {}
    for side, completion in zip(SIDES, (chosen, rejected)):
        encoded = _encode_conversation(prompt, completion, tokenizer)
        row[f"{side}_input_ids"], row[f"{side}_labels"] = encoded["input_ids"], encoded["labels"]
    return row


def fit_pair_to_length(example: Example, config: DataConfig) -> Example:
    """Applies ``max_seq_len`` to both completions: truncate, or a clear error; a pair truncation leaves without a
    trained token on either side is an error (dropping it would silently change the data), naming the side. With
    ``packing`` a pair's two sequences share one packed row of ``max_seq_len`` tokens: when they do not fit together,
    each is cut to ``max_seq_len // 2`` (or the error names their sum)."""
    fitted, limit = dict(example), config.max_seq_len
    together = sum(len(example[f"{side}_input_ids"]) for side in SIDES)
    if config.packing and together > config.max_seq_len:  # packed, a pair fills one row at most
        if config.truncation == "error":
            raise DataError(
                f"the chosen and rejected sequences have {together} tokens together, more than"
                f" data.max_seq_len={config.max_seq_len}, the length of a packed row that holds both. Raise"
                " data.max_seq_len, shorten or drop the record, or set data.truncation: truncate (each side cut to"
                " data.max_seq_len // 2 tokens)."
            )
        limit = config.max_seq_len // 2
    for side in SIDES:
        ids, labels = example[f"{side}_input_ids"], example[f"{side}_labels"]
        if len(ids) > limit:
            if config.truncation == "error":
                raise DataError(
                    f"the {side} sequence has {len(ids)} tokens, longer than data.max_seq_len={config.max_seq_len}."
                    " Raise data.max_seq_len, shorten or drop the record, or set data.truncation: truncate."
                )
            ids, labels = ids[:limit], labels[:limit]
        if all(label == IGNORE_INDEX for label in labels):
            raise DataError(
                f"truncation at data.max_seq_len={config.max_seq_len} leaves the {side} completion no token (its"
                f" prompt and completion have {len(example[f'{side}_input_ids'])} tokens). Raise data.max_seq_len,"
                " shorten the prompt, or drop the record."
            )
        fitted[f"{side}_input_ids"], fitted[f"{side}_labels"] = ids, labels
    return fitted


#: What an unpaired (KTO) example's row holds: its prompt, its completion (ids and labels) and whether it is desirable.
UNPAIRED_KEYS = ("prompt_ids", "completion_ids", "completion_labels", "label")


def encode_unpaired(record: Mapping[str, Any], tokenizer: Any) -> Example:
    """TRL's unpaired record (``prompt``, ``completion``, ``label``: strings, or conversations rendered with the chat
    template) to its prompt and completion ids, apart: a KL row joins the prompt to another example's completion.

    Raises:
        DataError: naming the field that is missing or of the wrong kind.
    """
    label = record.get("label")
    if not isinstance(label, bool):
        raise DataError(f"field 'label' must be true (a desirable completion) or false, got {label!r}.")
    if isinstance(record.get("completion"), str) or isinstance(record.get("prompt"), str):
        prompt_ids = list(tokenizer(text_field(record, "prompt"), add_special_tokens=True)["input_ids"])
        ids = list(tokenizer(text_field(record, "completion"), add_special_tokens=False)["input_ids"])
        ids.append(require_eos_id(tokenizer))
        return {"prompt_ids": prompt_ids, "completion_ids": ids, "completion_labels": ids, "label": label}
    prompt = _conversation(record, "prompt")
    encoded = _encode_conversation(prompt, _conversation(record, "completion"), tokenizer)
    start = encoded["prompt_length"]
    return {"prompt_ids": encoded["input_ids"][:start], "completion_ids": encoded["input_ids"][start:],
            "completion_labels": encoded["labels"][start:], "label": label}  # fmt: skip


def fit_unpaired_to_length(example: Example, config: DataConfig) -> Example:
    """Applies ``max_seq_len`` to an unpaired example's prompt + completion: truncate the completion, or a clear error;
    an example truncation leaves without a trained token is an error (dropping it would silently change the data)."""
    prompt, ids, labels = example["prompt_ids"], example["completion_ids"], example["completion_labels"]
    room = config.max_seq_len - len(prompt)
    if len(prompt) + len(ids) > config.max_seq_len and config.truncation == "error":
        raise DataError(
            f"the example has {len(prompt) + len(ids)} tokens, longer than data.max_seq_len={config.max_seq_len}."
            " Raise data.max_seq_len, shorten or drop the record, or set data.truncation: truncate."
        )
    if room <= 0 or all(label == IGNORE_INDEX for label in labels[: max(room, 0)]):
        raise DataError(
            f"truncation at data.max_seq_len={config.max_seq_len} leaves the completion no token (its prompt has"
            f" {len(prompt)} tokens). Raise data.max_seq_len, shorten the prompt, or drop the record."
        )
    return {**example, "completion_ids": ids[:room], "completion_labels": labels[:room]}


def collate_unpaired(
    examples: Sequence[Mapping[str, Any]], pad_token_id: int, max_seq_len: int | None = None
) -> dict[str, Tensor]:
    """Unpaired (KTO) examples to one right-padded batch: each example's row (``input_ids``, ``attention_mask``,
    ``labels``: the prompt masked), its KL row (``kl_*``: its prompt with the completion of the example before it in
    this batch, the first taking the last's, as TRL rotates completions; cut at ``max_seq_len``) and ``label``."""
    rows, kl_rows = [], []
    for i, example in enumerate(examples):
        other = examples[i - 1]  # i = 0: the last example's completion
        for out, source in ((rows, example), (kl_rows, other)):
            prompt = list(example["prompt_ids"])
            ids = (prompt + list(source["completion_ids"]))[:max_seq_len]
            labels = ([IGNORE_INDEX] * len(prompt) + list(source["completion_labels"]))[:max_seq_len]
            out.append((ids, labels))
    batch = {**_padded(rows, pad_token_id), **{f"kl_{k}": v for k, v in _padded(kl_rows, pad_token_id).items()}}
    batch["label"] = torch.tensor([bool(example["label"]) for example in examples])
    return batch


def _padded(rows: list[tuple[list[int], list[int]]], pad_token_id: int) -> dict[str, Tensor]:
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, (ids, targets) in enumerate(rows):
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        labels[row, : len(targets)] = torch.tensor(targets, dtype=torch.long)
        mask[row, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
