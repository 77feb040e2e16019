"""The recipe's ``data:`` section (:class:`DataConfig`, with path resolution), the :class:`DataError` every
data module raises, and the label value and record types they share."""

from __future__ import annotations

import re
from lightning_plugins.errors import DataError
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, Union

from lightning_plugins.parallel.loss import IGNORE_INDEX

PathLike = Union[str, Path]
Record = dict[str, Any]
Example = dict[str, list[int]]

_FORMATS = ("auto", "prompt_completion", "chat", "preference", "unpaired", "image_text")
_TRUNCATIONS = ("truncate", "error")


@dataclass(frozen=True)
class DataConfig:
    """The recipe's ``data:`` section."""

    train: str
    """Training records: a ``.jsonl`` / ``.json`` / ``.parquet`` file or a ``save_to_disk`` directory (relative paths
    are resolved by :meth:`resolve`), or a Hugging Face Hub dataset id with an optional split (``trl-lib/tldr``,
    ``trl-lib/tldr:validation``; split ``train`` by default), read through ``datasets.load_dataset`` (its cache, or the
    hub) when the run starts."""
    eval: str | None = None
    """Held-out records in the same forms; ``None`` to hold out ``eval_fraction`` of ``train``."""
    eval_fraction: float = 0.0
    """Fraction of ``train`` held out for evaluation when ``eval`` is ``None`` (``0`` for no evaluation split)."""
    format: Literal["auto", "prompt_completion", "chat", "preference", "unpaired", "image_text"] = "auto"
    """``"prompt_completion"``, ``"chat"`` (``messages``), ``"preference"`` (TRL's ``prompt``/``chosen``/``rejected``
    pairs, strings or conversations, for ``objective.method`` dpo, simpo, orpo), ``"unpaired"`` (TRL's unpaired
    preference records ``prompt``/``completion``/``label``, for ``objective.method: kto``), ``"image_text"`` (TRL's
    vision format: ``messages`` whose contents hold image entries and ``images``, processed by the model's processor;
    see :mod:`lightning_plugins.data.image_text`), or ``"auto"`` (from the columns: ``images`` means image-text,
    ``label`` beside ``prompt``/``completion`` unpaired, as TRL reads them)."""
    max_seq_len: int = 2048
    """Longest sample in tokens; with packing, the length of every packed row."""
    truncation: Literal["truncate", "error"] = "truncate"
    """A longer sample is cut at ``max_seq_len`` (``"truncate"``) or is an error naming its file and line
    (``"error"``)."""
    packing: bool = False
    """Concatenate samples into rows of ``max_seq_len`` tokens (see :mod:`lightning_plugins.data.packing`)."""
    split_seed: int = 0
    """Seed of the random hold-out split."""
    cache_dir: str | None = None
    """Where the tokenized (and packed) data is prepared once per node and memory-mapped by every rank (see
    :mod:`lightning_plugins.data.prepared`); relative paths are resolved by :meth:`resolve`. ``None``:
    ``lightning_plugins/prepared/`` in the ``datasets`` cache (``HF_DATASETS_CACHE``, by default
    ``~/.cache/huggingface/datasets``), which works offline. A directory local to each node prepares once per node; one
    shared by the nodes (with ``flock`` locks), once per job."""

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
        resolved = {key: _resolved(key, getattr(self, key), Path(base_dir)) for key in self._path_keys()}
        if self.cache_dir is not None:  # need not exist yet: the first run creates it
            resolved["cache_dir"] = str((Path(base_dir) / Path(self.cache_dir).expanduser()).resolve())
        return replace(self, **resolved)

    def _path_keys(self) -> tuple[str, ...]:
        return ("train",) if self.eval is None else ("train", "eval")


#: A Hugging Face Hub dataset id and an optional split: ``owner/name`` or ``owner/name:split``.
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?::(?P<split>[\w.-]+))?$")
#: What a local data file ends with (``data/train.jsonl`` is a missing file, never a hub id).
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".csv", ".txt")


def hub_dataset(value: str) -> tuple[str, str] | None:
    """``(repository id, split)`` when ``value`` names a hub dataset (``trl-lib/tldr:validation``), else ``None``."""
    match = _HUB_ID.match(str(value))
    if match is None or match["repo"].endswith(_FILE_SUFFIXES):
        return None
    return match["repo"], match["split"] or "train"


def _resolved(key: str, value: str, base_dir: Path) -> str:
    """An existing local path made absolute, or a hub dataset id as it is (read when the run starts)."""
    local = Path(value).expanduser()
    if not (local if local.is_absolute() else base_dir / local).exists() and hub_dataset(value) is not None:
        return value
    return str(existing_path(key, value, base_dir))


def existing_path(key: str, value: str, base_dir: Path | None = None) -> Path:
    """The path ``value`` of setting ``key`` (relative to ``base_dir`` when given), which must exist: else a clear error."""
    path = Path(value).expanduser()
    if base_dir is not None and not path.is_absolute():
        path = base_dir / path
    if not path.exists():
        against = f" (resolved against {base_dir})" if base_dir is not None and not Path(value).is_absolute() else ""
        raise DataError(
            f"data.{key}: {path} does not exist{against}. Point data.{key} at a .jsonl / .json / .parquet file, a"
            " datasets `save_to_disk` directory (relative paths are taken from the recipe's directory) or a hub"
            " dataset id (`owner/name[:split]`)."
        )
    return path.resolve()
