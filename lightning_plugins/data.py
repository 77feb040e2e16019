"""Fine-tuning data: local files through ``datasets``, prompt masking, chat templates, padding and packing.

Framework-free (``datasets``, ``torch`` and a Hugging Face tokenizer; no Lightning / Accelerate import),
so every door and every recipe share it. The recipe's ``data:`` section is a :class:`DataConfig`; the
finetune runner calls::

    config = config.resolve(recipe_dir)                       # relative paths, missing files
    train = build_dataset(config, tokenizer, "train")         # a datasets.Dataset of token ids
    loader = DataLoader(train, batch_size=..., collate_fn=make_collator(config, pad_token_id))

Records (JSON lines, a JSON array, parquet, or a ``save_to_disk`` directory):

* ``{"prompt", "completion"}``: ``prompt`` (with the tokenizer's special tokens, e.g. BOS) +
  ``completion`` + EOS; the prompt is masked from the loss (labels ``-100``).
* ``{"messages": [{"role", "content"}, ...]}``: rendered with the tokenizer's own chat template; only
  assistant turns are trained. A template with ``{% generation %}`` markers gives the assistant tokens
  directly; for one without, each assistant turn's characters are found by rendering the conversation's
  prefixes (checked to be prefixes of the whole rendering, else a clear error) and mapped to tokens
  through the tokenizer's offsets.

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
training; and flash attention 2/3 read packed positions only in a batch of one row.

Also here: :data:`TINY_DIR` / :func:`tiny_assets` (the tiny model and datasets shipped in
``recipes/tiny``) and :func:`exact_match` (greedy generation scored by exact match).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import random
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final, Literal, Union

import torch
from torch import Tensor

__all__ = [
    "IGNORE_INDEX",
    "TINY_DIR",
    "DataConfig",
    "DataError",
    "TinyAssets",
    "build_dataset",
    "check_packing_attention",
    "collate_causal_lm",
    "collate_packed",
    "encode_chat",
    "encode_prompt_completion",
    "exact_match",
    "first_fit",
    "load_prompt_completion",
    "make_collator",
    "pack_examples",
    "prepare_model_for_packing",
    "read_jsonl",
    "tiny_assets",
]

IGNORE_INDEX: Final[int] = -100
"""Label value ignored by ``torch.nn.CrossEntropyLoss`` (and HF models)."""

TINY_DIR: Final[Path] = Path(__file__).resolve().parents[1] / "recipes" / "tiny"
"""Root of the embedded default assets (``model/`` and ``data/``)."""

PathLike = Union[str, Path]
Record = dict[str, Any]
Example = dict[str, list[int]]

_FORMATS = ("auto", "prompt_completion", "chat")
_TRUNCATIONS = ("truncate", "error")
_JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class DataError(ValueError):
    """A dataset input that cannot be used; the message names the file, line or key, and a fix."""


@dataclass(frozen=True)
class DataConfig:
    """The recipe's ``data:`` section.

    Args:
        train: Training records: a ``.jsonl`` / ``.json`` / ``.parquet`` file or a ``save_to_disk``
            directory. Relative paths are resolved by :meth:`resolve`.
        eval: Held-out records in the same forms; ``None`` to hold out ``eval_fraction`` of ``train``.
        eval_fraction: Fraction of ``train`` held out for evaluation when ``eval`` is ``None``
            (``0`` for no evaluation split).
        format: ``"prompt_completion"``, ``"chat"`` (``messages``), or ``"auto"`` (from the columns).
        max_seq_len: Longest sample in tokens; with packing, the length of every packed row.
        truncation: A longer sample is cut at ``max_seq_len`` (``"truncate"``) or is an error naming
            its file and line (``"error"``).
        packing: Concatenate samples into rows of ``max_seq_len`` tokens (see the module docstring).
        split_seed: Seed of the random hold-out split.
    """

    train: str
    eval: str | None = None
    eval_fraction: float = 0.0
    format: Literal["auto", "prompt_completion", "chat"] = "auto"
    max_seq_len: int = 2048
    truncation: Literal["truncate", "error"] = "truncate"
    packing: bool = False
    split_seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.max_seq_len, int) or self.max_seq_len < 2:
            raise DataError(f"data.max_seq_len must be an integer >= 2, got {self.max_seq_len!r}.")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise DataError(f"data.eval_fraction must be in [0, 1), got {self.eval_fraction!r}.")
        if self.eval is not None and self.eval_fraction > 0:
            raise DataError(
                f"data.eval={self.eval!r} and data.eval_fraction={self.eval_fraction} both define the evaluation"
                " split. Give one of them: an eval file, or a fraction of data.train to hold out."
            )
        if self.format not in _FORMATS:
            raise DataError(f"data.format={self.format!r} is not one of {_FORMATS}.")
        if self.truncation not in _TRUNCATIONS:
            raise DataError(f"data.truncation={self.truncation!r} is not one of {_TRUNCATIONS}.")

    @property
    def has_eval(self) -> bool:
        """Whether an evaluation split exists (an eval file or a held-out fraction)."""
        return self.eval is not None or self.eval_fraction > 0

    def resolve(self, base_dir: PathLike) -> DataConfig:
        """This config with ``train`` / ``eval`` made absolute against ``base_dir`` (the recipe's directory).

        Raises:
            DataError: if a file or directory does not exist, naming the key and both paths.
        """
        resolved = {key: str(_existing(key, getattr(self, key), Path(base_dir))) for key in self._path_keys()}
        return replace(self, **resolved)

    def _path_keys(self) -> tuple[str, ...]:
        return ("train",) if self.eval is None else ("train", "eval")


def _existing(key: str, value: str, base_dir: Path | None = None) -> Path:
    path = Path(value).expanduser()
    if base_dir is not None and not path.is_absolute():
        path = base_dir / path
    if not path.exists():
        against = f" (resolved against {base_dir})" if base_dir is not None and not Path(value).is_absolute() else ""
        raise DataError(
            f"data.{key}: {path} does not exist{against}. Point data.{key} at a .jsonl / .json / .parquet file or a"
            " datasets `save_to_disk` directory; relative paths are taken from the recipe's directory."
        )
    return path.resolve()


# ----------------------------------------------------------------------------------------------------
# Reading records
# ----------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """No progress bars and no error logs of ``datasets`` while we load: our own errors say it better."""
    from datasets.utils import logging as ds_logging

    bars, level = ds_logging.is_progress_bar_enabled(), ds_logging.get_verbosity()
    ds_logging.disable_progress_bar()
    ds_logging.set_verbosity(logging.CRITICAL)
    try:
        yield
    finally:
        ds_logging.set_verbosity(level)
        if bars:
            ds_logging.enable_progress_bar()


def _is_json_lines(path: Path) -> bool:
    """JSON lines start with an object; a JSON file holding an array starts with ``[``."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                return line.lstrip().startswith("{")
    return True


def _scan_json(path: Path) -> Iterator[tuple[int, Any]]:
    """``(line number, record)`` of every record; a record that is not valid JSON is an error at its line."""
    text = path.read_text(encoding="utf-8")
    if not _is_json_lines(path):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{err.lineno}: not valid JSON ({err.msg}, column {err.colno}).") from None
        if not isinstance(records, list):
            raise DataError(f"{path}: a JSON file must hold an array of records (or use JSON lines, one per line).")
        yield from ((0, record) for record in records)
        return
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield line_no, json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(
                f"{path}:{line_no}: not valid JSON ({err.msg}, column {err.colno}). Each line must be one JSON object."
            ) from None


def read_jsonl(path: PathLike) -> list[Record]:
    """Reads the records of a JSON-lines (or JSON array) file; a bad line is an error naming ``file:line``."""
    path = Path(path)
    records = []
    for line_no, record in _scan_json(path):
        if not isinstance(record, dict):
            raise DataError(f"{_where(path, line_no, len(records))}: expected a JSON object, got {type(record).__name__}.")
        records.append(record)
    return records


def _where(path: Path, line_no: int, index: int) -> str:
    return f"{path}:{line_no}" if line_no else f"{path} record {index + 1}"


class _Source:
    """A loaded file: its ``datasets.Dataset`` and where each record came from, for error messages."""

    def __init__(self, path: Path, key: str) -> None:
        self.path, self.key = path, key
        self._lines: list[int] | None = None
        self.dataset = self._load()

    def where(self, index: int) -> str:
        """``file:line`` for JSON lines, ``file record N`` otherwise (``index`` is 0-based)."""
        if self.path.suffix in _JSON_SUFFIXES and self.path.is_file():
            if self._lines is None:
                self._lines = [line_no for line_no, _ in _scan_json(self.path)]
            return _where(self.path, self._lines[index], index)
        return _where(self.path, 0, index)

    def _load(self) -> Any:
        import datasets

        path = self.path
        with _quiet_datasets():
            if path.is_dir():
                try:
                    loaded = datasets.load_from_disk(str(path))
                except FileNotFoundError as err:
                    raise DataError(
                        f"data.{self.key}: {path} is a directory but not one written by datasets' `save_to_disk`"
                        f" ({err}). Point data.{self.key} at a .jsonl / .json / .parquet file or a saved dataset."
                    ) from None
                if isinstance(loaded, datasets.DatasetDict):
                    if len(loaded) != 1:
                        raise DataError(
                            f"data.{self.key}: {path} is a DatasetDict with splits {sorted(loaded)}; point data.{self.key}"
                            " at one split (save it with `dataset_dict['train'].save_to_disk(dir)`)."
                        )
                    loaded = next(iter(loaded.values()))
            else:
                loaded = self._load_file()
        if loaded.num_rows == 0:
            raise DataError(f"data.{self.key}: {path} holds no records.")
        return loaded

    def _load_file(self) -> Any:
        import datasets

        path = self.path
        builder = "parquet" if path.suffix == ".parquet" else "json" if path.suffix in _JSON_SUFFIXES else None
        if builder is None:
            raise DataError(
                f"data.{self.key}: {path} has suffix {path.suffix!r}; use .jsonl / .json (JSON lines or an array"
                " of records), .parquet, or a datasets `save_to_disk` directory."
            )
        try:
            return datasets.load_dataset(builder, data_files=str(path), split="train")
        except Exception as err:
            if builder != "json":
                raise DataError(f"data.{self.key}: {path} could not be read: {err}") from err
            return self._load_checked_json(err)

    def _load_checked_json(self, err: Exception) -> Any:
        """Where arrow cannot read a JSON file (e.g. a column's type changes between records): read it in Python,
        name the first bad line or record, and keep only the fields a format reads."""
        import datasets

        records = read_jsonl(self.path)
        if not records:
            raise DataError(f"data.{self.key}: {self.path} holds no records.")
        for index, record in enumerate(records):
            try:
                _messages(record) if "messages" in record else (_text(record, "prompt"), _text(record, "completion"))
            except DataError as bad:
                raise DataError(f"{self.where(index)}: {bad}") from None
        fields = ("messages",) if "messages" in records[0] else ("prompt", "completion")
        try:
            return datasets.Dataset.from_list([{key: record[key] for key in fields} for record in records])
        except Exception:
            raise DataError(f"data.{self.key}: {self.path} could not be read: {err}") from err


# ----------------------------------------------------------------------------------------------------
# Records -> token ids and labels
# ----------------------------------------------------------------------------------------------------


def _text(record: Mapping[str, Any], key: str) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        got = "missing (or null)" if value is None else f"a {type(value).__name__}"
        raise DataError(f"field {key!r} must be a string, but it is {got}.")
    return value


def encode_prompt_completion(record: Mapping[str, Any], tokenizer: Any) -> Example:
    """``prompt`` (with special tokens) + ``completion`` + EOS; labels ``-100`` on the prompt.

    Raises:
        DataError: if ``prompt`` or ``completion`` is not a string.
    """
    prompt, completion = _text(record, "prompt"), _text(record, "completion")
    prompt_ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    completion_ids = list(tokenizer(completion, add_special_tokens=False)["input_ids"]) + [_eos(tokenizer)]
    return {"input_ids": prompt_ids + completion_ids, "labels": [IGNORE_INDEX] * len(prompt_ids) + completion_ids}


def _eos(tokenizer: Any) -> int:
    if tokenizer.eos_token_id is None:
        raise DataError(f"The tokenizer {tokenizer.name_or_path!r} has no eos_token_id; set one in its tokenizer_config.json.")
    return tokenizer.eos_token_id


def _messages(record: Mapping[str, Any]) -> list[dict[str, str]]:
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise DataError("field 'messages' must be a non-empty list of {'role', 'content'} objects.")
    clean = []
    for turn, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise DataError(f"messages[{turn}] must be an object with 'role' and 'content'.")
        for key in ("role", "content"):
            try:
                _text(message, key)
            except DataError as err:
                raise DataError(f"messages[{turn}]: {err}") from None
        clean.append({k: v for k, v in message.items() if v is not None})  # arrow fills absent keys with null
    if not any(m["role"] == "assistant" for m in clean):
        raise DataError("the conversation has no 'assistant' message, so nothing in it would be trained.")
    return clean


def encode_chat(record: Mapping[str, Any], tokenizer: Any) -> Example:
    """Renders ``messages`` with the tokenizer's chat template; labels only on assistant turns.

    Raises:
        DataError: for malformed messages, a tokenizer without chat template, or a template whose
            rendering of a conversation's prefix is not a prefix of its full rendering.
    """
    messages = _messages(record)
    template = tokenizer.chat_template
    if not template:
        raise DataError(
            f"The tokenizer {tokenizer.name_or_path!r} has no chat template, so chat records cannot be rendered. Add"
            " one to its tokenizer_config.json (or chat_template.jinja), or use prompt/completion records."
        )
    if isinstance(template, str) and _GENERATION_TAG.search(template):
        encoded = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = list(encoded["input_ids"]), list(encoded["assistant_masks"])
    else:
        ids, mask = _assistant_mask_from_prefixes(messages, tokenizer)
    return {"input_ids": ids, "labels": [i if m else IGNORE_INDEX for i, m in zip(ids, mask)]}


def _assistant_mask_from_prefixes(messages: list[dict[str, str]], tokenizer: Any) -> tuple[list[int], list[int]]:
    """Assistant tokens for a template without ``{% generation %}``: the characters each assistant turn adds."""

    def render(turns: list[dict[str, str]], prompt: bool) -> str:
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=prompt)

    text = render(messages, False)
    spans = []
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, upto = render(messages[:turn], True), render(messages[: turn + 1], False)
        if not (text.startswith(before) and text.startswith(upto) and len(before) <= len(upto)):
            raise DataError(
                f"the tokenizer's chat template renders the conversation up to messages[{turn}] differently"
                " from the start of the whole conversation (e.g. it rewrites earlier turns), so the assistant tokens"
                " cannot be located. Add {% generation %}...{% endgeneration %} around assistant content in the template."
            )
        spans.append((len(before), len(upto)))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(lo <= start < hi for lo, hi in spans)) for start, _ in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), mask


_ENCODERS: dict[str, Callable[[Mapping[str, Any], Any], Example]] = {
    "prompt_completion": encode_prompt_completion,
    "chat": encode_chat,
}


def _detect_format(config: DataConfig, source: _Source) -> str:
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


def _fit(example: Example, config: DataConfig) -> Example | None:
    """Applies ``max_seq_len``: truncate (``None`` if nothing supervised is left) or a clear error."""
    n = len(example["input_ids"])
    if n > config.max_seq_len:
        if config.truncation == "error":
            raise DataError(
                f"{n} tokens, longer than data.max_seq_len={config.max_seq_len}. Raise data.max_seq_len,"
                " shorten or drop the record, or set data.truncation: truncate."
            )
        example = {key: values[: config.max_seq_len] for key, values in example.items()}
    if all(label == IGNORE_INDEX for label in example["labels"]):
        return None
    return example


# ----------------------------------------------------------------------------------------------------
# The dataset a training run reads
# ----------------------------------------------------------------------------------------------------


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
    source = _Source(_existing(key, getattr(config, key)), key)
    fmt = _detect_format(config, source)
    dataset, indices = source.dataset, None
    if config.eval is None and config.eval_fraction > 0:
        indices = _held_out(dataset.num_rows, config)[split == "eval"]
        dataset = dataset.select(indices)
    encode = _ENCODERS[fmt]

    def tokenize(batch: dict[str, list], rows: list[int]) -> dict[str, list]:
        out: dict[str, list] = {"input_ids": [], "labels": []}
        for j, row in enumerate(rows):
            try:
                example = _fit(encode({k: v[j] for k, v in batch.items()}, tokenizer), config)
            except DataError as err:
                raise DataError(f"{source.where(row if indices is None else indices[row])}: {err}") from None
            if example is not None:
                out["input_ids"].append(example["input_ids"])
                out["labels"].append(example["labels"])
        return out

    with _quiet_datasets():
        dataset = dataset.map(
            tokenize,
            batched=True,
            with_indices=True,
            remove_columns=dataset.column_names,
            keep_in_memory=True,
            new_fingerprint=_fingerprint(dataset._fingerprint, config, tokenizer, split),
        )
    if config.packing:
        dataset = _packed_dataset(dataset, config.max_seq_len)
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


# ----------------------------------------------------------------------------------------------------
# Packing and collation
# ----------------------------------------------------------------------------------------------------


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
    rows = []
    for members in first_fit([len(ex["input_ids"]) for ex in examples], max_seq_len):
        row: Example = {"input_ids": [], "labels": [], "position_ids": []}
        for i in members:
            row["input_ids"] += examples[i]["input_ids"]
            row["labels"] += [IGNORE_INDEX, *examples[i]["labels"][1:]]
            row["position_ids"] += range(len(examples[i]["input_ids"]))
        rows.append(row)
    return rows


def _packed_dataset(dataset: Any, max_seq_len: int) -> Any:
    import datasets

    samples = [{"input_ids": ids, "labels": labels} for ids, labels in zip(dataset["input_ids"], dataset["labels"])]
    rows = pack_examples(samples, max_seq_len)
    return datasets.Dataset.from_dict({key: [row[key] for row in rows] for key in ("input_ids", "labels", "position_ids")})


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
) -> dict[str, Tensor]:
    """Stacks packed rows into ``input_ids``, ``position_ids`` and ``labels`` of ``max_seq_len`` columns.

    The tail of a row that is not full is padding with ``-100`` labels and its own positions
    ``0, 1, ...`` (a sample of its own, attending only to itself). There is no ``attention_mask``: with
    none, transformers builds the block-diagonal causal mask from ``position_ids``.

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
    return {
        "input_ids": _tensor_rows(examples, "input_ids", length, pad_token_id),
        "position_ids": position_ids,
        "labels": _tensor_rows(examples, "labels", length, IGNORE_INDEX),
    }


def make_collator(
    config: DataConfig, pad_token_id: int, pad_to_multiple_of: int | None = None
) -> Callable[[Sequence[Mapping[str, Sequence[int]]]], dict[str, Tensor]]:
    """The ``collate_fn`` for rows of :func:`build_dataset` with this config: padded or packed batches."""
    if config.packing:
        return lambda examples: collate_packed(examples, pad_token_id, config.max_seq_len, pad_to_multiple_of)
    return lambda examples: collate_causal_lm(examples, pad_token_id, pad_to_multiple_of)


#: Attention implementations whose masks transformers builds from packed ``position_ids`` in any batch.
_PACKING_ATTENTION = ("sdpa", "eager", "flex_attention")


def check_packing_attention(implementation: str | None) -> None:
    """Refuses an attention implementation that does not keep the samples of packed rows apart.

    Call it while validating a recipe (``model.attn_implementation`` with ``data.packing``), before any
    process starts; :func:`prepare_model_for_packing` calls it on the loaded model.

    Raises:
        DataError: for anything but sdpa, eager or flex attention. Flash attention 2/3 find packed samples
            only in a batch of one row (``modeling_flash_attention_utils._is_packed_sequence``) and attend
            across them otherwise.
    """
    if implementation in _PACKING_ATTENTION:
        return
    why = (
        " transformers' flash attention finds packed samples from position_ids only in a batch of one row and"
        " would attend across the samples of a packed batch."
        if isinstance(implementation, str) and "flash" in implementation
        else ""
    )
    raise DataError(
        f"data.packing needs an attention implementation that keeps packed samples apart {_PACKING_ATTENTION}; the"
        f" model uses {implementation!r}.{why} Load it with attn_implementation='sdpa' (or 'flex_attention'), or"
        " set data.packing: false."
    )


def prepare_model_for_packing(model: Any) -> None:
    """Makes a transformers causal LM attend within packed samples only; call it before training packed.

    Sets ``config.use_cache = False``: with a cache (which the model creates whenever ``use_cache`` is
    true, in training too), transformers does not look for packed sequences in ``position_ids`` and
    attention silently crosses samples.

    Raises:
        DataError: for an attention implementation that does not separate the samples of packed rows
            (see :func:`check_packing_attention`).
    """
    check_packing_attention(getattr(model.config, "_attn_implementation", None))
    model.config.use_cache = False


# ----------------------------------------------------------------------------------------------------
# The tiny default assets and exact-match evaluation
# ----------------------------------------------------------------------------------------------------


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
            + ". Regenerate them with `python recipes/tiny/make_tiny.py`."
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
            example = _fit(encode_prompt_completion(record, tokenizer), config)
        except DataError as err:
            raise DataError(f"record {i + 1}: {err}") from None
        if example is not None:
            examples.append(example)
    return examples


def _prompt_and_reference(record: Mapping[str, Any], tokenizer: Any) -> tuple[list[int], str]:
    """Generation prompt ids and the reference answer: the completion, or a chat's last assistant turn."""
    if "messages" not in record:
        return list(tokenizer(_text(record, "prompt"), add_special_tokens=True)["input_ids"]), _text(record, "completion")
    messages = _messages(record)
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
    eos_id = _eos(tokenizer)
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
