"""Data helpers for prompt/completion fine-tuning of causal language models.

This module is deliberately framework-free (plain ``torch`` and a Hugging Face
tokenizer, no Lightning / Accelerate import) so that every strategy and every
recipe can share it:

* :func:`load_prompt_completion` turns a ``{"prompt", "completion"}`` JSONL
  file into token ids with the prompt masked out of the labels.
* :func:`collate_causal_lm` right-pads a list of such examples into a batch.
* :func:`exact_match` greedily generates completions and scores them.
* :data:`TINY_DIR` / :func:`tiny_assets` locate the tiny Llama checkpoint and
  dataset shipped in ``recipes/tiny`` (regenerate them with
  ``python recipes/tiny/make_tiny.py``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Union

import torch
from torch import Tensor

__all__ = [
    "IGNORE_INDEX",
    "TINY_DIR",
    "TinyAssets",
    "collate_causal_lm",
    "exact_match",
    "load_prompt_completion",
    "read_jsonl",
    "tiny_assets",
]

IGNORE_INDEX: Final[int] = -100
"""Label value ignored by ``torch.nn.CrossEntropyLoss`` (and HF models)."""

TINY_DIR: Final[Path] = Path(__file__).resolve().parents[1] / "recipes" / "tiny"
"""Root of the embedded default assets (``model/`` and ``data/``)."""

PathLike = Union[str, Path]
Record = dict[str, str]
Example = dict[str, list[int]]


@dataclass(frozen=True)
class TinyAssets:
    """Locations of the embedded tiny checkpoint and dataset.

    Attributes:
        root: The ``recipes/tiny`` directory.
        model_dir: Hugging Face checkpoint directory (model + tokenizer).
        train_file: Training records (JSONL, ``prompt``/``completion``).
        eval_file: Evaluation records (JSONL, ``prompt``/``completion``).
    """

    root: Path
    model_dir: Path
    train_file: Path
    eval_file: Path


def tiny_assets(root: PathLike = TINY_DIR) -> TinyAssets:
    """Returns the paths of the embedded tiny model and dataset.

    Args:
        root: Directory holding ``model/`` and ``data/``; defaults to
            :data:`TINY_DIR`.

    Returns:
        The resolved asset paths.

    Raises:
        FileNotFoundError: If any asset is missing (e.g. a partial checkout).
    """
    root = Path(root)
    assets = TinyAssets(
        root=root,
        model_dir=root / "model",
        train_file=root / "data" / "train.jsonl",
        eval_file=root / "data" / "eval.jsonl",
    )
    required = (
        assets.model_dir / "config.json",
        assets.model_dir / "model.safetensors",
        assets.model_dir / "tokenizer.json",
        assets.train_file,
        assets.eval_file,
    )
    missing = [str(p) for p in required if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            "Tiny default assets are missing: "
            + ", ".join(missing)
            + ". Regenerate them with `python recipes/tiny/make_tiny.py`."
        )
    return assets


def read_jsonl(path: PathLike) -> list[Record]:
    """Reads ``prompt``/``completion`` records from a JSON-lines file.

    Args:
        path: File with one JSON object per line; blank lines are skipped.

    Returns:
        The records, in file order.

    Raises:
        ValueError: If a record lacks a string ``prompt`` or ``completion``.
    """
    records: list[Record] = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not (
                isinstance(record.get("prompt"), str)
                and isinstance(record.get("completion"), str)
            ):
                raise ValueError(
                    f"{path}:{line_no}: expected string 'prompt' and 'completion' fields"
                )
            records.append({"prompt": record["prompt"], "completion": record["completion"]})
    return records


def _as_records(path_or_records: PathLike | Iterable[Record]) -> list[Record]:
    if isinstance(path_or_records, (str, Path)):
        return read_jsonl(path_or_records)
    return list(path_or_records)


def load_prompt_completion(
    path: PathLike | Iterable[Record], tokenizer: Any, max_length: int
) -> list[Example]:
    """Tokenizes prompt/completion records for causal-LM fine-tuning.

    Each example is ``prompt_ids + completion_ids + [eos]``, where the prompt
    is tokenized *with* the tokenizer's special tokens (e.g. BOS) and the
    completion *without*. Labels equal the input ids except on the prompt,
    which is set to :data:`IGNORE_INDEX` so only the completion and EOS are
    learned. (Labels are not shifted: HF causal-LM models shift internally.)

    Args:
        path: A JSONL file (or an iterable of already-loaded records).
        tokenizer: A Hugging Face tokenizer with an ``eos_token_id``.
        max_length: Examples longer than this are truncated from the right.
            Examples left without any supervised token are dropped.

    Returns:
        One ``{"input_ids": [...], "labels": [...]}`` dict per kept example.

    Raises:
        ValueError: If ``max_length`` is not positive or the tokenizer has no
            EOS token.
    """
    if max_length <= 0:
        raise ValueError(f"max_length must be positive, got {max_length}")
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise ValueError("tokenizer has no eos_token_id")
    examples: list[Example] = []
    for record in _as_records(path):
        prompt_ids = list(tokenizer(record["prompt"], add_special_tokens=True)["input_ids"])
        completion_ids = list(
            tokenizer(record["completion"], add_special_tokens=False)["input_ids"]
        )
        input_ids = (prompt_ids + completion_ids + [eos_id])[:max_length]
        labels = ([IGNORE_INDEX] * len(prompt_ids) + completion_ids + [eos_id])[:max_length]
        if all(label == IGNORE_INDEX for label in labels):
            continue
        examples.append({"input_ids": input_ids, "labels": labels})
    return examples


def collate_causal_lm(
    examples: Sequence[Example],
    pad_token_id: int,
    pad_to_multiple_of: int | None = None,
) -> dict[str, Tensor]:
    """Right-pads examples into a batch for a causal LM.

    Args:
        examples: Dicts with ``input_ids`` and ``labels`` (equal lengths), as
            returned by :func:`load_prompt_completion`.
        pad_token_id: Id written into padded ``input_ids`` positions.
        pad_to_multiple_of: If given, the padded length is rounded up to a
            multiple of this (useful for sequence-parallel splits).

    Returns:
        ``input_ids`` and ``labels`` (``torch.long``) plus ``attention_mask``
        (1 for real tokens, 0 for padding), each of shape ``(batch, length)``.
        Padded label positions are :data:`IGNORE_INDEX`.

    Raises:
        ValueError: If ``examples`` is empty or an example's lengths differ.
    """
    if not examples:
        raise ValueError("cannot collate an empty list of examples")
    length = max(len(ex["input_ids"]) for ex in examples)
    if pad_to_multiple_of is not None and pad_to_multiple_of > 1:
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    batch = len(examples)
    input_ids = torch.full((batch, length), pad_token_id, dtype=torch.long)
    labels = torch.full((batch, length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((batch, length), dtype=torch.long)
    for row, ex in enumerate(examples):
        n = len(ex["input_ids"])
        if len(ex["labels"]) != n:
            raise ValueError(f"example {row}: input_ids and labels lengths differ")
        input_ids[row, :n] = torch.tensor(ex["input_ids"], dtype=torch.long)
        labels[row, :n] = torch.tensor(ex["labels"], dtype=torch.long)
        attention_mask[row, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


@torch.no_grad()
def exact_match(
    model: Any,
    tokenizer: Any,
    path_or_records: PathLike | Iterable[Record],
    max_new_tokens: int = 16,
    limit: int | None = None,
    batch_size: int = 64,
) -> float:
    """Scores greedy completions by exact string match.

    Prompts are tokenized as in :func:`load_prompt_completion`, left-padded
    into batches and completed with plain ``model.generate`` (greedy). A
    prediction counts if its decoded text (special tokens skipped, stripped)
    equals the stripped reference completion. The model is put in eval mode
    for the call and its previous mode is restored afterwards.

    Args:
        model: A Hugging Face causal LM (anything with ``generate``).
        tokenizer: The matching tokenizer (needs ``eos_token_id``; the pad
            token falls back to EOS).
        path_or_records: A JSONL file or an iterable of records.
        max_new_tokens: Generation budget per prompt.
        limit: If given, only the first ``limit`` records are scored.
        batch_size: Prompts generated together.

    Returns:
        The fraction of records answered exactly, in ``[0, 1]`` (0.0 if there
        are no records).
    """
    records = _as_records(path_or_records)
    if limit is not None:
        records = records[:limit]
    if not records:
        return 0.0
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    correct = 0
    try:
        for start in range(0, len(records), batch_size):
            chunk = records[start : start + batch_size]
            prompts = [
                list(tokenizer(r["prompt"], add_special_tokens=True)["input_ids"]) for r in chunk
            ]
            width = max(len(p) for p in prompts)
            input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
            attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
            for row, ids in enumerate(prompts):
                input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
                attention_mask[row, width - len(ids) :] = 1
            output = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eos_id,
                pad_token_id=pad_id,
            )
            texts = tokenizer.batch_decode(output[:, width:], skip_special_tokens=True)
            correct += sum(
                text.strip() == r["completion"].strip() for text, r in zip(texts, chunk)
            )
    finally:
        model.train(was_training)
    return correct / len(records)
