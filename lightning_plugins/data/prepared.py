"""Tokenized data prepared once per node and memory-mapped by every rank: :func:`prepared`, :func:`entry_name`.

:func:`~lightning_plugins.data.build_dataset` does not tokenize on every rank. Every rank computes the same
entry name, a hash of everything that changes the rows (:func:`entry_name`: the data section, the split, the
source's bytes, the tokenizer's vocabulary, special tokens and chat template, the code of this package that
makes the rows, the transformers version). The first process to take the entry's lock on a node writes the
entry; the others wait on the lock, then memory-map the same Arrow file, so a node holds one copy of the data
in its page cache however many ranks read it. The first process is the launching rank under the Lightning door
(it builds the data before ``trainer.fit`` starts the other ranks), whichever local rank arrives first under
``torchrun`` / ``accelerate launch``. With the cache on a file system shared by the nodes (``flock`` locks
across them, as NFSv4 and Lustre mounted with ``flock`` do), one rank of the whole job writes.

Why a file lock and not a ``torch.distributed`` barrier: the Lightning door builds its data before its process
group exists; a barrier would fail every rank on the process group's timeout (NCCL's default: 10 minutes) while
one rank tokenizes a large set; and a writer that fails leaves the waiters of a barrier hanging, while a lock
just passes to the next rank, which then fails with the same error naming the same file. The kernel releases
the lock of a killed writer.

Where (:func:`cache_root`): ``data.cache_dir``, else ``lightning_plugins/prepared/`` in the ``datasets`` cache
(``HF_DATASETS_CACHE``, by default ``~/.cache/huggingface/datasets``). An entry is a directory ``<name>/``
holding ``data.arrow`` and ``meta.json`` (what it was made from, for people), locked through ``.locks/<name>``,
written as ``<name>.partial-<host>-<pid>/`` and renamed into place when complete: a killed writer leaves a
partial directory that nothing reads (the next writer on that host removes it). Entries are never reused for
different inputs, and may be deleted at any time no run is starting.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import socket
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

from lightning_plugins.data.config import DataConfig
from lightning_plugins.errors import DataError

log = logging.getLogger(__name__)

DATA_FILE = "data.arrow"
META_FILE = "meta.json"
#: Errors of ``flock`` on a file system that has no locks: the rename alone still keeps readers safe.
_NO_LOCKS = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL)


def cache_root(config: DataConfig) -> Path:
    """Where entries live: ``data.cache_dir``, else ``lightning_plugins/prepared/`` in the ``datasets`` cache."""
    if config.cache_dir is not None:
        return Path(config.cache_dir).expanduser()
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE) / "lightning_plugins" / "prepared"


def entry_name(config: DataConfig, tokenizer: Any, split: str, source: str) -> str:
    """The entry of this split: readable (source file name, split) and a hash of everything that changes its rows.

    Args:
        config: The data section (every field counts but ``cache_dir``).
        tokenizer: The tokenizer (:func:`tokenizer_identity`).
        split: ``"train"`` or ``"eval"``.
        source: The identity of the records read (:func:`file_identity`, or a hub dataset's fingerprint).
    """
    import transformers

    parts = (
        repr(replace(config, cache_dir=None)),  # format, max_seq_len, truncation, packing, eval_fraction, split_seed...
        split,
        source,
        tokenizer_identity(tokenizer),
        code_identity(),
        transformers.__version__,
    )
    digest = hashlib.sha256(repr(parts).encode()).hexdigest()[:24]
    value = config.eval if split == "eval" and config.eval is not None else config.train
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(str(value)).name)[:48]
    return f"{stem}-{split}-{digest}"


def tokenizer_identity(tokenizer: Any) -> str:
    """A hash of what makes the tokenizer's ids: its vocabulary and rules, special tokens and chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    rules = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    parts = (
        type(tokenizer).__qualname__,
        tokenizer.name_or_path,
        len(tokenizer),
        str(tokenizer.chat_template),
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        getattr(tokenizer, "add_bos_token", None),
        getattr(tokenizer, "add_eos_token", None),
        hashlib.sha256(rules.encode()).hexdigest(),
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def code_identity() -> str:
    """A hash of this package's data code: a change to how rows are made never reads rows made before it."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def file_identity(path: Path) -> str:
    """A hash of a local source: a file's bytes; a ``save_to_disk`` directory's metadata and files' sizes and times.

    A file is read through (in blocks; about a second per GB), so a rewrite within the file system's time
    resolution, or with its time set back, is still seen.
    """
    digest = hashlib.sha256(str(path).encode())
    if path.is_dir():
        for member in sorted(p for p in path.rglob("*") if p.is_file()):
            stat = member.stat()
            digest.update(f"{member.relative_to(path)}:{stat.st_size}:{stat.st_mtime_ns}".encode())
            if member.suffix == ".json":  # state.json holds the saved dataset's own fingerprint
                digest.update(member.read_bytes())
        return digest.hexdigest()
    buffer = bytearray(1 << 18)  # one buffer, read into: a new block per read would leave the allocator megabytes
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while size := handle.readinto(buffer):
            digest.update(view[:size])
    return digest.hexdigest()


def prepared(root: Path, name: str, write: Callable[[Path], dict[str, Any]], what: str) -> Any:
    """The entry ``root/name`` as a memory-mapped ``datasets.Dataset``, written first if no process has yet.

    Args:
        root: The cache directory (:func:`cache_root`).
        name: The entry (:func:`entry_name`).
        write: Writes ``data.arrow`` into the directory it is given and returns what ``meta.json`` records; it
            runs in one process per entry (per node, or per job on a shared file system), under the lock.
        what: The setting and its source (``data.train (/path/train.jsonl)``), for error messages.

    Raises:
        DataError: if the cache directory cannot be written, or an entry is damaged; whatever ``write`` raises.
    """
    final = root / name
    if not _complete(final):  # else a read-only cache, prepared before, is enough
        try:
            (root / ".locks").mkdir(parents=True, exist_ok=True)
            handle = open(root / ".locks" / name, "a")  # kept: removing a lock file others wait on would split the lock
        except OSError as err:
            raise DataError(
                f"{what}: cannot write the tokenized data to the cache directory {root} ({err}). Set data.cache_dir"
                " (or HF_DATASETS_CACHE) to a writable directory."
            ) from None
        with handle, _locked(handle) as locked:
            if not _complete(final):
                _publish(root, name, write, locked)
    return _load(final, what)


def _complete(entry: Path) -> bool:
    return (entry / META_FILE).is_file()


def _publish(root: Path, name: str, write: Callable[[Path], dict[str, Any]], locked: bool) -> None:
    """Writes the entry under a partial name and renames it into place, so no reader ever sees it half written."""
    host = socket.gethostname()
    if locked:  # no other writer of this entry is alive on this host: its leftovers are a killed writer's
        for stale in root.glob(f"{name}.partial-{host}-*"):
            if not _alive(stale.name.rpartition("-")[2]):
                shutil.rmtree(stale, ignore_errors=True)
    partial = root / f"{name}.partial-{host}-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        meta = write(partial)
        (partial / META_FILE).write_text(json.dumps({**meta, "writer": f"{host}:{os.getpid()}"}, indent=1))
        for member in partial.iterdir():
            _fsync(member)
        try:
            os.rename(partial, root / name)
        except OSError:
            if not _complete(root / name):  # else another node wrote it first (a file system without locks)
                raise
            shutil.rmtree(partial, ignore_errors=True)
        _fsync(root)
        log.info("prepared %s", root / name)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _load(entry: Path, what: str) -> Any:
    import datasets

    meta = json.loads((entry / META_FILE).read_text())
    try:
        dataset = datasets.Dataset.from_file(str(entry / DATA_FILE))  # memory-mapped, not read into memory
    except Exception as err:
        dataset, why = None, f"{type(err).__name__}: {err}"
    else:
        why = f"it holds {dataset.num_rows} rows, its {META_FILE} says {meta.get('rows')}"
    if dataset is None or dataset.num_rows != meta.get("rows"):
        raise DataError(f"{what}: the tokenized cache {entry} is damaged ({why}). Delete that directory and run again.")
    return dataset


@contextlib.contextmanager
def _locked(handle: IO[str]) -> Iterator[bool]:
    """An exclusive ``flock`` on the open file ``handle`` (``True``), or nothing (``False``) where there are none."""
    try:
        import fcntl
    except ImportError:  # not POSIX: two writers may both write, the rename keeps their readers safe
        yield False
        return
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
    except OSError as err:
        if err.errno not in _NO_LOCKS:
            raise
        yield False
        return
    try:
        yield True
    finally:
        fcntl.flock(handle, fcntl.LOCK_UN)


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (ValueError, PermissionError):
        return True  # not ours to judge: leave it
    return True


def _fsync(path: Path) -> None:
    """Flush ``path`` to disk, so a power loss cannot leave a renamed entry whose files are empty."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
