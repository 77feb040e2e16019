"""The image-text dataset a training run reads (:func:`build_image_text_dataset`) and its collator
(:func:`collate_image_text`).

Records in TRL's vision format (:mod:`lightning_plugins.data.image_text`) from a local file or a hub dataset, the
hold-out split as for text, every record's structure and images checked when the dataset is built (a bad one named by
``file:line``), each sample processed by the model's processor when it is drawn. With ``data.packing`` the samples a
batch draws are packed into rows by the collator, for the models whose positions allow it
(:mod:`lightning_plugins.data.image_packing`); the dataset is the same.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from torch.utils.data import Dataset

from lightning_plugins.data.config import IGNORE_INDEX, DataConfig, existing_path, hub_dataset
from lightning_plugins.data.image_text import encode_image_text, open_image, record_images, vision_messages
from lightning_plugins.data.loading import Source
from lightning_plugins.errors import DataError

#: Inputs with one value per token: padded on the right (with these values); the others are per image: concatenated.
_PAD = {"input_ids": None, "attention_mask": 0, "labels": IGNORE_INDEX, "token_type_ids": 0, "mm_token_type_ids": 0}


class ImageTextDataset(Dataset):
    """Image-text records, each processed by ``processor`` when it is drawn (``dataset[i]``: the model's inputs of
    sample ``i``, unbatched)."""

    column_names: ClassVar[list[str]] = ["input_ids", "labels", "pixel_values"]  # what build_loaders' checks read

    def __init__(self, source: Source, rows: list[int], processor: Any, config: DataConfig) -> None:
        self.source, self.rows, self.processor, self.config = source, rows, processor, config
        self.base_dir = source.path.parent if isinstance(source.path, Path) else None

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.rows[index]
        try:
            sample = encode_image_text(self.source.dataset[row], self.processor, self.config, self.base_dir)
        except DataError as err:
            raise DataError(f"{self.source.where(row)}: {err}") from None
        if sample is None:
            raise DataError(
                f"{self.source.where(row)}: no trained (assistant) token is left in the first"
                f" data.max_seq_len={self.config.max_seq_len} tokens. Raise data.max_seq_len, or drop the record."
            )
        return sample

    def check(self) -> None:
        """Every record's conversation and images, checked before training starts (each image's file read once)."""
        for row in self.rows:
            record = self.source.dataset[row]
            try:
                for value in record_images(record, vision_messages(record)):
                    open_image(value, self.base_dir, verify=True)
            except DataError as err:
                raise DataError(f"{self.source.where(row)}: {err}") from None


def build_image_text_dataset(
    config: DataConfig, processor: Any, split: Literal["train", "eval"], check: bool = True
) -> ImageTextDataset:
    """The ``train`` or ``eval`` split of image-text records (paths resolved: :meth:`DataConfig.resolve`).

    Raises:
        DataError: for a missing file, a record without ``messages``, a bad record or image (``file:line``).
    """
    from lightning_plugins.data.dataset import held_out

    if split == "eval" and not config.has_eval:
        raise DataError(
            f"There is no evaluation split of data.train ({config.train}): set data.eval or data.eval_fraction."
        )
    key = "eval" if split == "eval" and config.eval is not None else "train"
    value = getattr(config, key)
    local = Path(value).expanduser().exists() or hub_dataset(value) is None
    source = Source(existing_path(key, value) if local else value, key)
    if "messages" not in source.dataset.column_names:
        raise DataError(
            f"data.{key}: {source.path} has columns {sorted(source.dataset.column_names)}; image-text records need"
            " 'messages' (whose contents hold image entries) and 'images'."
        )
    rows = list(range(source.dataset.num_rows))
    if config.eval is None and config.eval_fraction > 0:
        rows = held_out(len(rows), config, source)[split == "eval"]
    dataset = ImageTextDataset(source, rows, processor, config)
    if check:
        dataset.check()
    return dataset


def collate_image_text(samples: list[dict[str, torch.Tensor]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """A batch as the model's processor gives one: per-token inputs padded on the right, every image's inputs
    (``pixel_values``, ``image_grid_thw``, ...) concatenated in row order (rows without images add none)."""
    longest = max(sample["input_ids"].shape[0] for sample in samples)
    batch: dict[str, torch.Tensor] = {}
    for key in samples[0]:
        values = [sample[key] for sample in samples if key in sample]
        if key in _PAD:
            pad = pad_token_id if _PAD[key] is None else _PAD[key]
            rows = torch.full((len(samples), longest), pad, dtype=values[0].dtype)
            for i, value in enumerate(values):
                rows[i, : value.shape[0]] = value
            batch[key] = rows
        else:
            batch[key] = torch.cat(values)
    for key in {key for sample in samples for key in sample} - batch.keys():  # images only in later rows
        batch[key] = torch.cat([sample[key] for sample in samples if key in sample])
    return batch


def is_image_text_data(config: DataConfig) -> bool:
    """Whether the run's records are image-text ones: ``data.format: image_text``, or (``auto``) records with an
    ``images`` field (the first record of a local JSON file; the columns of any other source)."""
    if config.format != "auto":
        return config.format == "image_text"
    path = Path(config.train).expanduser()
    if path.is_file() and path.suffix in (".jsonl", ".json", ".ndjson"):
        from lightning_plugins.data.loading import read_first_record

        return "images" in read_first_record(path)
    if not path.exists() and hub_dataset(config.train) is None:
        return False
    return "images" in Source(path if path.exists() else config.train, "train").dataset.column_names


def image_text_collator(processor: Any) -> Any:
    """:func:`collate_image_text` with the pad id of ``processor``'s tokenizer (its EOS when it has no pad token)."""
    import functools

    tokenizer = getattr(processor, "tokenizer", processor)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return functools.partial(collate_image_text, pad_token_id=pad)
