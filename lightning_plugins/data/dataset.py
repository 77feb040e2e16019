"""The dataset a training run reads: :func:`build_dataset` (file, format, hold-out split, tokenization, packing)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Literal

from lightning_plugins.data.config import DataConfig, existing_path, hub_dataset
from lightning_plugins.errors import DataError
from lightning_plugins.data.encoding import ENCODERS, fit_to_length
from lightning_plugins.data.preference import (
    PAIR_KEYS, UNPAIRED_KEYS, encode_preference, encode_unpaired, fit_pair_to_length, fit_unpaired_to_length,
)
from lightning_plugins.data.loading import quiet_datasets, Source
from lightning_plugins.data.packing import write_packed
from lightning_plugins.data.prepared import DATA_FILE, cache_root, entry_name, file_identity, prepared

#: What each format's records hold, as TRL names the fields.
NEEDED = {"chat": {"messages"}, "prompt_completion": {"prompt", "completion"}, "preference": {"chosen", "rejected"},
          "unpaired": {"prompt", "completion", "label"}}  # fmt: skip
#: How each format's encoder and length fit, and the columns of its rows, are found by format.
_ROWS = {"preference": (encode_preference, fit_pair_to_length, PAIR_KEYS),
         "unpaired": (encode_unpaired, fit_unpaired_to_length, UNPAIRED_KEYS)}  # fmt: skip


def _kind(columns: set[str]) -> str:
    """What records with these columns are, in words (for errors)."""
    if {"chosen", "rejected"} <= columns:
        return "a chosen/rejected pair (TRL's paired preference format)"
    if NEEDED["unpaired"] <= columns:
        return "an unpaired prompt/completion/label record (TRL's KTO format)"
    return f"a record with fields {sorted(columns)}"


def _detect_format(config: DataConfig, source: Source) -> str:
    columns = set(source.dataset.column_names)
    if config.format == "image_text" or (config.format == "auto" and "images" in columns):
        raise DataError(
            f"data.{source.key}: {source.path} holds image-text records (an 'images' column): they are processed by"
            " the model's processor, through lightning_plugins.data.build_image_text_dataset (recipes do this)."
        )
    if config.format != "auto":
        needed = NEEDED[config.format]
        if not needed <= columns or (config.format == "unpaired" and {"chosen", "rejected"} & columns):
            raise DataError(
                f"data.{source.key}: {source.where(0)} is {_kind(columns)}, but data.format={config.format!r} needs"
                f" {sorted(needed)} in every record. Point data.{source.key} at records of that kind, or change"
                " data.format (and objective.method: dpo, simpo, orpo train on pairs, kto on unpaired records)."
            )
        return config.format
    if "messages" in columns:
        return "chat"
    if {"chosen", "rejected"} <= columns:
        return "preference"
    if NEEDED["unpaired"] <= columns:
        return "unpaired"
    if {"prompt", "completion"} <= columns:
        return "prompt_completion"
    raise DataError(
        f"data.{source.key}: {source.path} has columns {sorted(columns)}; expected 'messages' (chat), 'prompt' and"
        " 'completion', or 'chosen' and 'rejected' (preference pairs). Rename the fields, or set data.format."
    )


def build_dataset(config: DataConfig, tokenizer: Any, split: Literal["train", "eval"]) -> Any:
    """The ``train`` or ``eval`` split as a ``datasets.Dataset`` of token ids, ready for :func:`make_collator`.

    Rows are ``{"input_ids", "labels"}`` samples, or with ``config.packing`` packed rows that also carry
    ``position_ids``. Samples left without a supervised token by truncation are dropped.

    The rows are prepared once per node (:mod:`lightning_plugins.data.prepared`): the first process tokenizes (and
    packs) into an Arrow file in ``data.cache_dir``, the others wait for it, and every process gets the same file
    memory-mapped, not a copy of its own. A single process, a Lightning or an Accelerate run, under any launcher,
    calls it the same way, before or after its process group exists.

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
        raise DataError(
            f"There is no evaluation split of data.train ({config.train}): set data.eval (a file) or data.eval_fraction"
            " (e.g. 0.05)."
        )
    key = "eval" if split == "eval" and config.eval is not None else "train"
    value = getattr(config, key)
    hub = not Path(value).expanduser().exists() and hub_dataset(value) is not None
    if hub:  # loaded from datasets' own cache (or the hub): its fingerprint names the version read
        source = Source(value, key)
        identity = source.dataset._fingerprint
    else:
        path, source = existing_path(key, value), None
        identity = file_identity(path)
    name = entry_name(config, tokenizer, split, identity)

    def write(directory: Path) -> dict[str, Any]:
        return _tokenize(config, tokenizer, split, source or Source(path, key), directory, name)

    return prepared(cache_root(config), name, write, f"data.{key} ({value})")


def _tokenize(
    config: DataConfig, tokenizer: Any, split: str, source: Source, directory: Path, name: str
) -> dict[str, Any]:
    """Writes the split's rows to ``directory/data.arrow`` (tokenized, then packed); returns what they came from."""
    fmt = _detect_format(config, source)
    dataset, indices = source.dataset, None
    if config.eval is None and config.eval_fraction > 0:
        indices = held_out(dataset.num_rows, config, source)[split == "eval"]
        dataset = dataset.select(indices, keep_in_memory=True)  # the row numbers only: the records stay mapped
    if fmt == "unpaired" and config.packing:  # preference pairs pack whole pairs per row (write_packed)
        raise DataError(f"data.{source.key}: unpaired (KTO) records are not packed yet; set data.packing: false.")
    encode, fit, keys = _ROWS.get(fmt, (ENCODERS.get(fmt), fit_to_length, ("input_ids", "labels")))
    seen = {"longest": 0, "tokens": 0}  # for the message when truncation leaves nothing

    def tokenize(batch: dict[str, list], rows: list[int]) -> dict[str, list]:
        out: dict[str, list] = {key: [] for key in keys}
        for j, row in enumerate(rows):
            try:
                encoded = encode({k: v[j] for k, v in batch.items()}, tokenizer)
                lengths = [len(encoded[key]) for key in keys if key.endswith("input_ids")] or [
                    len(encoded["prompt_ids"]) + len(encoded["completion_ids"])]  # an unpaired example: one row
                seen["longest"] = max(seen["longest"], *lengths)
                seen["tokens"] += sum(lengths)
                example = fit(encoded, config)
            except DataError as err:
                raise DataError(f"{source.where(row if indices is None else indices[row])}: {err}") from None
            if example is not None:
                for key in keys:
                    out[key].append(example[key])
        return out

    samples_file = directory / ("samples.arrow" if config.packing else DATA_FILE)
    with quiet_datasets():
        samples = dataset.map(
            tokenize,
            batched=True,
            with_indices=True,
            remove_columns=dataset.column_names,
            cache_file_name=str(samples_file),  # written to a file as it goes, not held in memory
            load_from_cache_file=False,
            new_fingerprint=name,  # else datasets would hash the closure (tokenizer included), slowly
        )
    if samples.num_rows == 0:
        raise DataError(
            f"data.{source.key}: truncation at data.max_seq_len={config.max_seq_len} left nothing to train on: all"
            f" {len(indices) if indices is not None else source.dataset.num_rows} {split} records of {source.path} were"
            f" dropped ({seen['tokens']} tokens), none has a trained (completion or assistant) token in its first"
            f" {config.max_seq_len}. Raise data.max_seq_len (the longest record has {seen['longest']} tokens), or"
            " shorten the prompts."
        )
    rows = samples.num_rows
    if config.packing:
        rows = write_packed(samples, config.max_seq_len, directory / DATA_FILE)
        del samples
        samples_file.unlink()
    return {"source": str(source.path), "split": split, "format": fmt, "rows": rows, "tokens": seen["tokens"],
            "config": repr(config)}  # fmt: skip


def held_out(n: int, config: DataConfig, source: Source) -> tuple[list[int], list[int]]:
    """(train, eval) row indices: a seeded random ``eval_fraction`` held out, each part in file order."""
    k = max(1, round(n * config.eval_fraction))
    if k >= n:
        raise DataError(
            f"data.{source.key}: data.eval_fraction={config.eval_fraction} of the {n} records of {source.path} leaves"
            " none to train on. Lower data.eval_fraction, or give data.eval a file of its own."
        )
    held = set(random.Random(config.split_seed).sample(range(n), k))
    return [i for i in range(n) if i not in held], sorted(held)
