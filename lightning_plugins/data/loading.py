"""Reading records: JSON lines, a JSON array, parquet, or a ``save_to_disk`` directory, through ``datasets``.

A record that cannot be used is a :class:`~lightning_plugins.data.DataError` naming ``file:line`` (JSON lines)
or ``file record N``.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightning_plugins.data.config import PathLike, Record, hub_dataset
from lightning_plugins.errors import DataError
from lightning_plugins.data.encoding import messages_field, text_field

_JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
#: Fields a format reads beside its text ones, kept when a JSON file is read in Python.
OPTIONAL_FIELDS = ("images", "label")


@contextlib.contextmanager
def quiet_datasets() -> Iterator[None]:
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


def _check_utf8(path: Path) -> None:
    """A byte that is not UTF-8 is an error naming its line and column (read line by line: any file size)."""
    with open(path, "rb") as handle:
        for line_no, line in enumerate(handle, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(
                    f"{path}:{line_no}: not valid UTF-8 (byte 0x{line[err.start]:02x} at column {err.start + 1}). Data"
                    " files must be UTF-8: re-encode the file (e.g. `iconv -f latin1 -t utf-8`) or fix that line."
                ) from None


def _read_text(path: Path) -> str:
    """The file as UTF-8 text; a byte that is not UTF-8 is an error naming its line and column."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        _check_utf8(path)
        raise


def _is_json_lines(text: str) -> bool:
    """JSON lines start with an object; a JSON file holding an array starts with ``[``."""
    first = next((line for line in text.splitlines() if line.strip()), "{")
    return first.lstrip().startswith("{")


def _scan_json(path: Path) -> Iterator[tuple[int, Any]]:
    """``(line number, record)`` of every record; a record that is not valid JSON is an error at its line."""
    text = _read_text(path)
    if not _is_json_lines(text):
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


def read_first_record(path: PathLike) -> Record:
    """The first record of a JSON-lines (or JSON array) file, ``{}`` when it has none or it is not an object."""
    record = next((record for _, record in _scan_json(Path(path))), {})
    return record if isinstance(record, dict) else {}


def _where(path: Path, line_no: int, index: int) -> str:
    return f"{path}:{line_no}" if line_no else f"{path} record {index + 1}"


class Source:
    """A loaded file or hub dataset: its ``datasets.Dataset`` and where each record came from, for error messages.

    ``path`` is an existing local path, or a hub dataset id (``owner/name[:split]``, a ``str``)."""

    def __init__(self, path: Path | str, key: str) -> None:
        self.path, self.key = path, key
        self._lines: list[int] | None = None
        self.dataset = self._load()

    def where(self, index: int) -> str:
        """``file:line`` for JSON lines, ``file record N`` otherwise (``index`` is 0-based)."""
        if isinstance(self.path, str):
            return f"{self.path} record {index + 1}"
        if self.path.suffix in _JSON_SUFFIXES and self.path.is_file():
            if self._lines is None:
                self._lines = [line_no for line_no, _ in _scan_json(self.path)]
            return _where(self.path, self._lines[index], index)
        return _where(self.path, 0, index)

    def _load(self) -> Any:
        import datasets

        path = self.path
        with quiet_datasets():
            if isinstance(path, str):
                loaded = self._load_hub(path)
            elif path.is_dir():
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

    def _load_hub(self, value: str) -> Any:
        import datasets

        repo, split = hub_dataset(value)
        try:
            return datasets.load_dataset(repo, split=split)
        except Exception as err:
            raise DataError(
                f"data.{self.key}: {value!r} is no local file (none at that path) and hub dataset {repo!r} split"
                f" {split!r} could not be loaded ({type(err).__name__}: {err}). Point data.{self.key} at a local"
                " .jsonl / .json / .parquet file, or at a hub dataset in the local cache or reachable online."
            ) from None

    def _load_file(self) -> Any:
        import datasets

        path = self.path
        builder = "parquet" if path.suffix == ".parquet" else "json" if path.suffix in _JSON_SUFFIXES else None
        if builder is None:
            raise DataError(
                f"data.{self.key}: {path} has suffix {path.suffix!r}; use .jsonl / .json (JSON lines or an array"
                " of records), .parquet, or a datasets `save_to_disk` directory."
            )
        if builder == "json":
            _check_utf8(path)  # arrow takes bytes that are not UTF-8 and fails only when a record is read
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
        pairs = "chosen" in records[0]
        for index, record in enumerate(records):
            try:
                if "messages" in record:
                    messages_field(record)
                elif pairs:  # strings or conversations: their contents are checked when encoded
                    if record.get("chosen") is None or record.get("rejected") is None:
                        raise DataError("a preference record needs 'chosen' and 'rejected'.")
                else:
                    (text_field(record, "prompt"), text_field(record, "completion"))
            except DataError as bad:
                raise DataError(f"{self.where(index)}: {bad}") from None
        fields = ("messages",) if "messages" in records[0] else ("prompt", "chosen", "rejected") if pairs else ("prompt", "completion")
        fields += tuple(key for key in OPTIONAL_FIELDS if key in records[0])  # image-text's images, KTO's labels
        try:
            return datasets.Dataset.from_list([{key: record.get(key) for key in fields} for record in records])
        except Exception:
            raise DataError(f"data.{self.key}: {self.path} could not be read: {err}") from err
