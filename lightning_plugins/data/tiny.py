"""The tiny default assets shipped in ``recipes/tiny`` (:data:`TINY_DIR`, :func:`tiny_assets`), and
:func:`exact_match` (greedy generation scored by exact match)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

from lightning_plugins.data.config import DataConfig, Example, PathLike, Record
from lightning_plugins.errors import DataError
from lightning_plugins.data.encoding import require_eos_id, fit_to_length, messages_field, text_field, encode_prompt_completion
from lightning_plugins.data.loading import read_jsonl
from lightning_plugins.resources import tiny_dir

TINY_DIR: Final[Path] = tiny_dir()
"""Root of the embedded default assets (``model/`` and ``data/``), in a clone or an installed wheel."""


@dataclass(frozen=True)
class TinyAssets:
    """Locations of the embedded tiny checkpoint and datasets.

    Attributes:
        root: The ``recipes/tiny`` directory.
        model_dir: Hugging Face checkpoint directory (model + tokenizer with a chat template).
        train_file: String-reversal training records (JSONL, ``prompt``/``completion``).
        eval_file: String-reversal evaluation records.
        chat_train_file: Multi-turn chat training records (JSONL, ``messages``).
        chat_eval_file: Multi-turn chat evaluation records.
    """

    root: Path
    model_dir: Path
    train_file: Path
    eval_file: Path
    chat_train_file: Path
    chat_eval_file: Path


def tiny_assets(root: PathLike = TINY_DIR) -> TinyAssets:
    """Returns the paths of the embedded tiny model and datasets.

    Raises:
        FileNotFoundError: If any asset is missing (e.g. a partial checkout).
    """
    root = Path(root)
    data = root / "data"
    assets = TinyAssets(
        root=root,
        model_dir=root / "model",
        train_file=data / "train.jsonl",
        eval_file=data / "eval.jsonl",
        chat_train_file=data / "chat_train.jsonl",
        chat_eval_file=data / "chat_eval.jsonl",
    )
    required = (
        assets.model_dir / "config.json",
        assets.model_dir / "model.safetensors",
        assets.model_dir / "tokenizer.json",
        assets.train_file,
        assets.eval_file,
        assets.chat_train_file,
        assets.chat_eval_file,
    )
    missing = [str(p) for p in required if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            "Tiny default assets are missing: "
            + ", ".join(missing)
            + ". Regenerate them with `python recipes/tiny/make_tiny.py` in a clone of the repository."
        )
    return assets


def _as_records(path_or_records: PathLike | Iterable[Record]) -> list[Record]:
    if isinstance(path_or_records, (str, Path)):
        return read_jsonl(path_or_records)
    return list(path_or_records)


def load_prompt_completion(path: PathLike | Iterable[Record], tokenizer: Any, max_length: int) -> list[Example]:
    """Tokenizes prompt/completion records (a JSONL file or records) into a list, as :func:`build_dataset` does.

    Examples longer than ``max_length`` are truncated; those left without a supervised token are dropped.
    """
    config = DataConfig(train=str(path) if isinstance(path, (str, Path)) else "<records>", max_seq_len=max_length)
    examples = []
    for i, record in enumerate(_as_records(path)):
        try:
            example = fit_to_length(encode_prompt_completion(record, tokenizer), config)
        except DataError as err:
            raise DataError(f"record {i + 1}: {err}") from None
        if example is not None:
            examples.append(example)
    return examples


def _prompt_and_reference(record: Mapping[str, Any], tokenizer: Any) -> tuple[list[int], str]:
    """Generation prompt ids and the reference answer: the completion, or a chat's last assistant turn."""
    if "messages" not in record:
        return list(tokenizer(text_field(record, "prompt"), add_special_tokens=True)["input_ids"]), text_field(record, "completion")
    messages = messages_field(record)
    if messages[-1]["role"] != "assistant":
        raise DataError("exact_match scores a chat record's last message, which must be the assistant's.")
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=True, add_generation_prompt=True, return_dict=True)
    return list(prompt["input_ids"]), messages[-1]["content"]


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

    A prompt/completion record is prompted with its ``prompt``; a chat record with every message but the
    last (an assistant turn, the reference), rendered with the chat template and its generation prompt.
    Prompts are left-padded into batches and completed with ``model.generate`` (greedy). A prediction
    counts if its decoded text (special tokens skipped, stripped) equals the stripped reference. The model's
    train/eval mode is restored afterwards.

    Returns:
        The fraction of records answered exactly, in ``[0, 1]`` (0.0 if there are no records).
    """
    records = _as_records(path_or_records)[:limit]
    if not records:
        return 0.0
    eos_id = require_eos_id(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    correct = 0
    try:
        for start in range(0, len(records), batch_size):
            prompts, references = zip(*(_prompt_and_reference(r, tokenizer) for r in records[start : start + batch_size]))
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
            correct += sum(text.strip() == ref.strip() for text, ref in zip(texts, references))
    finally:
        model.train(was_training)
    return correct / len(records)
