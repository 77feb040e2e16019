"""The dataset a training run reads: :func:`build_dataset` (file, format, hold-out split, tokenization, packing)."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any, Literal

from lightning_plugins.data.config import DataConfig, existing_path, hub_dataset
from lightning_plugins.errors import DataError
from lightning_plugins.data.encoding import ENCODERS, fit_to_length
from lightning_plugins.data.loading import quiet_datasets, Source
from lightning_plugins.data.packing import packed_dataset

def _detect_format(config: DataConfig, source: Source) -> str:
    columns = set(source.dataset.column_names)
    if config.format != "auto":
        needed = {"chat": {"messages"}, "prompt_completion": {"prompt", "completion"}}[config.format]
        if not needed <= columns:
            raise DataError(
                f"data.{source.key}: {source.path} has columns {sorted(columns)}, but data.format={config.format!r}"
                f" needs {sorted(needed)}."
            )
        return config.format
    if "messages" in columns:
        return "chat"
    if {"prompt", "completion"} <= columns:
        return "prompt_completion"
    raise DataError(
        f"data.{source.key}: {source.path} has columns {sorted(columns)}; expected 'messages' (chat) or 'prompt' and"
        " 'completion'. Rename the fields, or set data.format."
    )


def build_dataset(config: DataConfig, tokenizer: Any, split: Literal["train", "eval"]) -> Any:
    """The ``train`` or ``eval`` split as a ``datasets.Dataset`` of token ids, ready for :func:`make_collator`.

    Rows are ``{"input_ids", "labels"}`` samples, or with ``config.packing`` packed rows that also carry
    ``position_ids``. Samples left without a supervised token by truncation are dropped.

    Args:
        config: The data section; paths should be resolved (:meth:`DataConfig.resolve`).
        tokenizer: The model's Hugging Face tokenizer (fast, for chat templates without generation markers).
        split: ``"train"``, or ``"eval"`` (the eval file or the held-out fraction of ``train``).

    Raises:
        DataError: for a missing file, an unreadable record (naming file and line), a record longer than
            ``max_seq_len`` with ``truncation="error"``, or ``split="eval"`` without an evaluation split.
    """
    if split not in ("train", "eval"):
        raise DataError(f"split must be 'train' or 'eval', got {split!r}.")
    if split == "eval" and not config.has_eval:
        raise DataError("There is no evaluation split: set data.eval (a file) or data.eval_fraction (e.g. 0.05).")
    key = "eval" if split == "eval" and config.eval is not None else "train"
    value = getattr(config, key)
    hub = not Path(value).expanduser().exists() and hub_dataset(value) is not None
    source = Source(value if hub else existing_path(key, value), key)
    fmt = _detect_format(config, source)
    dataset, indices = source.dataset, None
    if config.eval is None and config.eval_fraction > 0:
        indices = _held_out(dataset.num_rows, config)[split == "eval"]
        dataset = dataset.select(indices)
    encode = ENCODERS[fmt]
    seen = {"longest": 0, "tokens": 0}  # for the message when truncation leaves nothing

    def tokenize(batch: dict[str, list], rows: list[int]) -> dict[str, list]:
        out: dict[str, list] = {"input_ids": [], "labels": []}
        for j, row in enumerate(rows):
            try:
                encoded = encode({k: v[j] for k, v in batch.items()}, tokenizer)
                seen["longest"] = max(seen["longest"], len(encoded["input_ids"]))
                seen["tokens"] += len(encoded["input_ids"])
                example = fit_to_length(encoded, config)
            except DataError as err:
                raise DataError(f"{source.where(row if indices is None else indices[row])}: {err}") from None
            if example is not None:
                out["input_ids"].append(example["input_ids"])
                out["labels"].append(example["labels"])
        return out

    with quiet_datasets():
        dataset = dataset.map(
            tokenize,
            batched=True,
            with_indices=True,
            remove_columns=dataset.column_names,
            keep_in_memory=True,
            new_fingerprint=_fingerprint(dataset._fingerprint, config, tokenizer, split),
        )
    if dataset.num_rows == 0:
        raise DataError(
            f"data.{key}: truncation at data.max_seq_len={config.max_seq_len} left nothing to train on: all"
            f" {len(indices) if indices is not None else source.dataset.num_rows} {split} records of {source.path} were"
            f" dropped ({seen['tokens']} tokens), none has a trained (completion or assistant) token in its first"
            f" {config.max_seq_len}. Raise data.max_seq_len (the longest record has {seen['longest']} tokens), or"
            " shorten the prompts."
        )
    if config.packing:
        dataset = packed_dataset(dataset, config.max_seq_len)
    return dataset


def _held_out(n: int, config: DataConfig) -> tuple[list[int], list[int]]:
    """(train, eval) row indices: a seeded random ``eval_fraction`` held out, each part in file order."""
    k = max(1, round(n * config.eval_fraction))
    if k >= n:
        raise DataError(f"data.eval_fraction={config.eval_fraction} of {n} records leaves none to train on.")
    held = set(random.Random(config.split_seed).sample(range(n), k))
    return [i for i in range(n) if i not in held], sorted(held)


def _fingerprint(parent: str, config: DataConfig, tokenizer: Any, split: str) -> str:
    # Given explicitly: datasets would otherwise hash the closure (tokenizer included), slowly.
    parts = (parent, repr(config), split, tokenizer.name_or_path, len(tokenizer), str(tokenizer.chat_template))
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]
