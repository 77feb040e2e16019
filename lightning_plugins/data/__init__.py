"""Fine-tuning data: local files through ``datasets``, prompt masking, chat templates, padding and packing.

Framework-free (``datasets``, ``torch`` and a Hugging Face tokenizer; no Lightning / Accelerate import),
so every door and every recipe share it. The recipe's ``data:`` section is a :class:`DataConfig`; the
finetune runner calls::

    config = config.resolve(recipe_dir)                       # relative paths, missing files
    train = build_dataset(config, tokenizer, "train")         # a datasets.Dataset of token ids
    loader = DataLoader(train, batch_size=..., collate_fn=make_collator(config, pad_token_id))

Modules:

* :mod:`~lightning_plugins.data.config`: :class:`DataConfig`, :class:`DataError`, path resolution.
* :mod:`~lightning_plugins.data.loading`: reading JSON lines, JSON arrays, parquet and ``save_to_disk``
  directories, with ``file:line`` errors.
* :mod:`~lightning_plugins.data.encoding`: prompt/completion and chat records to token ids and labels.
* :mod:`~lightning_plugins.data.dataset`: :func:`build_dataset`, the dataset a training run reads.
* :mod:`~lightning_plugins.data.prepared`: that dataset tokenized once per node into ``data.cache_dir`` and
  memory-mapped by every rank (a file lock, an atomic rename, a key of everything that changes the rows).
* :mod:`~lightning_plugins.data.packing`: first-fit packing, padded and packed collation, and the
  attention checks packing needs.
* :mod:`~lightning_plugins.data.tiny`: the tiny assets shipped in ``recipes/tiny`` and :func:`exact_match`.
"""

from lightning_plugins.data.config import IGNORE_INDEX, DataConfig
from lightning_plugins.errors import DataError
from lightning_plugins.data.dataset import build_dataset
from lightning_plugins.data.encoding import encode_chat, encode_prompt_completion
from lightning_plugins.data.loading import read_jsonl
from lightning_plugins.data.packing import (
    check_packing_attention,
    collate_causal_lm,
    collate_packed,
    first_fit,
    make_collator,
    pack_examples,
    prepare_model_for_packing,
    varlen_lengths,
)
from lightning_plugins.data.tiny import TINY_DIR, TinyAssets, exact_match, load_prompt_completion, tiny_assets

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
    "varlen_lengths",
]
