"""The one place this package unpickles anything: a checkpoint's files are read, never run.

A checkpoint directory is data someone else may have written (a shared output directory, a colleague's copy, a hub
download), and its checksums cannot vouch for it: whoever writes the files writes ``checksums.json`` too. Unpickling
runs whatever callable a pickle names, so every pickle a checkpoint holds is read here, admitting only what this
package's checkpoints hold:

* DCP's ``.metadata`` (torch's ``FileSystemReader`` reads it with a bare ``pickle.load``): :class:`SafeReader`, with
  an unpickler that admits DCP's own metadata classes and what they reference (:data:`DCP_METADATA`), nothing else.
* The non-tensor entries of DCP's data files (numbers, optimizer settings: torch's ``DefaultLoadPlanner`` reads them
  with ``torch.load(weights_only=False)``): :class:`SafeLoadPlanner`, weights-only. Every DCP load of the package
  goes through :func:`load_dcp` (both doors' resume, ``--resume``, resharding, export).
* The ``torch.save`` files (Lightning's ``meta.pt``, each rank's random states, the Accelerate door's state):
  :func:`load_torch_file`, ``weights_only=True`` with the exact extra types a file needs allowed by name
  (:data:`NUMPY_RANDOM_STATE` for the random states, nothing for the others).
* :func:`check_pickles` reads all of them once before anything is loaded
  (:func:`~lightning_plugins.checkpoint.integrity.verify_checkpoint`: auto-resume, ``--resume``, export, ``verify``).
  The tensor entries of the data files are left to the load: torch reads them weights-only, and a refusal there is
  named like the others.

A refused file is a :class:`~lightning_plugins.errors.CheckpointError` naming it and what it holds, never torch's
advice to load it without ``weights_only``. ``tests/test_structure.py`` keeps every unpickling reader in this module.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import pickle
import pickletools
import re
import warnings
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from fnmatch import fnmatch
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from lightning_plugins.errors import CheckpointError

__all__ = [
    "DCP_METADATA",
    "NUMPY_RANDOM_STATE",
    "SafeLoadPlanner",
    "SafeReader",
    "check_pickles",
    "load_dcp",
    "load_torch_file",
    "read_dcp_metadata",
    "refusal",
    "refusing",
]

#: Every global a DCP ``.metadata`` written by this package references (traced from the checkpoints of a tiny run
#: through both doors, with torch 2.13): DCP's metadata dataclasses and the filesystem storage record, the enum
#: that stands for a memory format, ``torch.Size``, the dtypes, the layout (pickled as a call of torch's own
#: ``_get_layout``, a table lookup) and the checkpoint path that ``StorageMeta`` records.
DCP_METADATA: frozenset[tuple[str, str]] = frozenset(
    [
        *(
            ("torch.distributed.checkpoint.metadata", name)
            for name in ("Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
                         "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")  # fmt: skip
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        *(("torch", name) for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)),
        ("pathlib", "PosixPath"),
    ]
)
#: The same classes under the module that other Pythons pickle them from (3.13 keeps the paths in ``pathlib._local``).
_ALIASES = {("pathlib._local", "PosixPath"): ("pathlib", "PosixPath")}

_MULTIARRAY = importlib.import_module(
    "numpy._core.multiarray" if np.lib.NumpyVersion(np.__version__) >= "2.0.0" else "numpy.core.multiarray"
)
#: What NumPy's random state (in each rank's ``rng_state_<rank>.pt``) needs beyond weights-only's tensors and
#: containers: the array it is, rebuilt by ``_reconstruct``, and its ``uint32`` dtype (the class of that dtype too:
#: torch's loader builds only instances of allowed classes).
NUMPY_RANDOM_STATE: tuple[Any, ...] = (np.ndarray, _MULTIARRAY._reconstruct, np.dtype, type(np.dtype(np.uint32)))
#: Extra types allowed by file name (a ``fnmatch`` pattern) for :func:`check_pickles`; any other file gets none.
_EXTRA_TYPES: dict[str, tuple[Any, ...]] = {"rng_state_*.pt": NUMPY_RANDOM_STATE}
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


# ------------------------------------------------------------------------------------------------ refusals


def _reason(error: BaseException) -> str:
    """What a refused pickle holds, in torch's words or ours, without torch's advice on loading it anyway."""
    names = list(dict.fromkeys(_GLOBAL.findall(str(error))))
    if names:
        return f"it holds objects a checkpoint never holds ({', '.join(names)}), and unpickling it could run code"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    said = next((line.split("error:", 1)[1].strip() for line in lines if "WeightsUnpickler error:" in line), None)
    said = said or next((line for line in lines if "weights_only" not in line and "Weights only" not in line), "")
    said = said or type(error).__name__
    return f"the safe reader refuses it ({said}): it is damaged, or holds what a checkpoint never holds"


def refusal(path: str | Path, error: BaseException) -> CheckpointError:
    """The error for the file ``path``, refused by a safe reader with ``error``: the file, what it holds, the fix."""
    path = Path(path)
    return CheckpointError(
        f"{path} was not loaded: {_reason(error)}. A checkpoint written by lightning_plugins holds only tensors,"
        " arrays, numbers, strings and DCP's metadata; this file was changed, or planted by whoever could write"
        f" {path.parent}. Move {path.parent.name} aside and resume from an earlier checkpoint, or from one you wrote."
    )


@contextmanager
def refusing(path: str | Path) -> Iterator[None]:
    """Turn a safe reader's refusal (an ``UnpicklingError``) while reading ``path`` into :func:`refusal`'s error."""
    try:
        yield
    except pickle.UnpicklingError as error:
        raise refusal(path, error) from None


# ---------------------------------------------------------------------------------------- torch.save files


def _globals_in(source: str | Path | BinaryIO) -> list[str]:
    """The globals the pickle of the ``torch.save`` file ``source`` names, found by reading its opcodes (nothing is
    run): torch's loader names the first refused one of a protocol-2 pickle only."""
    if not isinstance(source, (str, Path)):
        source.seek(0)
    if not zipfile.is_zipfile(source):
        return []
    with zipfile.ZipFile(source) as archive:
        data = next((archive.read(n) for n in archive.namelist() if n.endswith("data.pkl")), b"")
    found, stack, memo = [], [], {}
    try:
        for opcode, arg, _ in pickletools.genops(data):
            if opcode.name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
                stack.append(arg)
            elif opcode.name in ("BINGET", "LONG_BINGET", "GET"):
                stack.append(memo.get(arg))
            elif opcode.name in ("BINPUT", "LONG_BINPUT", "PUT", "MEMOIZE"):
                memo[len(memo) if arg is None else arg] = stack[-1] if stack else None
            elif opcode.name == "GLOBAL":
                found.append(arg.replace(" ", "."))
            elif opcode.name == "STACK_GLOBAL" and len(stack) >= 2:
                found.append(f"{stack[-2]}.{stack[-1]}")
            else:
                stack.append(None)
    except Exception:  # a damaged pickle: what was found before the damage
        pass
    allowed = getattr(getattr(torch, "_weights_only_unpickler", None), "_get_allowed_globals", dict)()
    return [name for name in dict.fromkeys(found) if name not in allowed]


def _weights_only(source: str | Path | BinaryIO, allow: Sequence[Any] = ()) -> Any:
    with torch.serialization.safe_globals(list(allow)), warnings.catch_warnings():
        # torch.save writes protocol 2; torch warns before refusing a file pickled otherwise, which the refusal says
        warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
        try:
            return torch.load(source, weights_only=True)
        except pickle.UnpicklingError as error:
            allowed = {f"{getattr(t, '__module__', '')}.{getattr(t, '__name__', '')}" for t in allow}
            names = [name for name in _globals_in(source) if name not in allowed]
            if not names:
                raise
            raise pickle.UnpicklingError(", ".join(f"GLOBAL {name}" for name in names)) from None


def load_torch_file(path: str | Path, allow: Sequence[Any] = ()) -> Any:
    """``torch.load(path, weights_only=True)`` with exactly the extra types ``allow`` (beyond tensors, numbers,
    strings and containers) allowed.

    Raises:
        CheckpointError: the file holds anything else (named; nothing of it is run).
    """
    with refusing(path):
        return _weights_only(path, allow)


# ------------------------------------------------------------------------------------------------ DCP


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only :data:`DCP_METADATA`: any other global is refused before it is imported."""

    def find_class(self, module: str, name: str) -> Any:
        module, name = _ALIASES.get((module, name), (module, name))
        if (module, name) not in DCP_METADATA:
            raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")
        return getattr(importlib.import_module(module), name)


def read_dcp_metadata(path: str | Path, stream: BinaryIO | None = None) -> Metadata:
    """The DCP ``Metadata`` in the file ``path`` (or in ``stream``, opened on it), read with the restricted unpickler.

    Raises:
        CheckpointError: it holds anything but DCP's metadata (named), or it cannot be read (corrupted, truncated).
    """
    try:
        with refusing(path):
            if stream is not None:
                metadata = _MetadataUnpickler(stream).load()
            else:
                with open(path, "rb") as opened:
                    metadata = _MetadataUnpickler(opened).load()
    except CheckpointError:
        raise
    except Exception as error:  # a damaged file: what DCP would have said, with the file
        raise CheckpointError(
            f"{path} cannot be read: it is corrupted or truncated ({type(error).__name__}: {error}). Move its"
            " checkpoint aside and resume from an earlier complete one."
        ) from None
    if not isinstance(metadata, Metadata):
        raise refusal(path, pickle.UnpicklingError(f"a {type(metadata).__name__} where DCP's Metadata belongs"))
    for info in (metadata.storage_data or {}).values():  # DCP names its data files; a load reads only those
        name = Path(str(getattr(info, "relative_path", "")))
        if name.is_absolute() or ".." in name.parts:
            raise refusal(path, pickle.UnpicklingError(f"a data file outside its checkpoint: {name}"))
    return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading the non-tensor entries weights-only (torch's reads them with
    ``weights_only=False``)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = _weights_only(value)  # refused: an UnpicklingError, which SafeReader.read_data names with its file
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class SafeReader(FileSystemReader):
    """DCP's ``FileSystemReader`` whose ``.metadata`` is read with the restricted unpickler (once per reader: export
    loads a few tensors at a time), and whose refusals name the file. Load with :func:`load_dcp`."""

    _metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if self._metadata is None or rank is not None:
            path = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
            with self.fs.create_stream(path, "rb") as stream:
                metadata = read_dcp_metadata(path, stream)
            if rank is not None:
                return metadata
            self._metadata = metadata
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if not isinstance(planner, SafeLoadPlanner) and any(i.type == LoadItemType.BYTE_IO for i in plan.items):
            raise TypeError(f"{type(self).__name__} reads non-tensor entries with a SafeLoadPlanner: use load_dcp.")
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():  # one file at a time: a refusal names its file
            with refusing(Path(self.path) / name):
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
        done: Future[None] = Future()
        done.set_result(None)
        return done


def load_dcp(state: dict[str, Any], checkpoint: str | Path | SafeReader, *, no_dist: bool = False) -> None:
    """``dcp.load(state, ...)`` of the checkpoint directory (or :class:`SafeReader`) ``checkpoint`` with the safe
    reader and planner (collective unless ``no_dist``).

    Raises:
        CheckpointError: a file of the checkpoint holds what a checkpoint never holds (named, on every rank).
    """
    reader = checkpoint if isinstance(checkpoint, SafeReader) else SafeReader(checkpoint)
    reader.read_metadata()  # here, not inside DCP: DCP turns a failed read into a logged warning and a vaguer error
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=no_dist)
    except CheckpointException as error:
        failures = [f[0] if isinstance(f, tuple) else f for f in error.failures.values()]
        refused = next((f for f in failures if isinstance(f, CheckpointError)), None)
        if refused is None:
            raise
        raise CheckpointError(str(refused)) from None


# ------------------------------------------------------------------------------------------- check them all


def _bytes_entries(directory: Path, metadata: Metadata) -> Iterator[tuple[Path, Callable[[], bytes]]]:
    """The non-tensor entries of the data files: (file, a reader of the entry's bytes)."""
    for index, info in metadata.storage_data.items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        if getattr(info, "transform_descriptors", None):  # written through a stream transform: the load checks it
            continue

        def read(info: Any = info) -> bytes:
            with open(directory / info.relative_path, "rb") as stream:
                stream.seek(info.offset)
                return stream.read(info.length)

        yield directory / info.relative_path, read


def check_pickles(directory: str | Path) -> None:
    """Read every pickle the checkpoint ``directory`` holds with the safe readers (nothing is kept): ``.metadata``,
    the non-tensor entries of the data files, each ``*.pt`` file.

    Raises:
        CheckpointError: the first file holding anything a checkpoint never holds, or that cannot be read, named.
    """
    directory = Path(directory)
    if (directory / ".metadata").is_file():
        metadata = read_dcp_metadata(directory / ".metadata")
        for path, read in _bytes_entries(directory, metadata):
            _check(path, lambda: _weights_only(io.BytesIO(read())))
    for path in sorted(directory.glob("*.pt")):
        extra = next((types for pattern, types in _EXTRA_TYPES.items() if fnmatch(path.name, pattern)), ())
        _check(path, lambda: _weights_only(path, extra))


def _check(path: Path, load: Callable[[], Any]) -> None:
    """Run ``load`` (a safe read of ``path``): a refusal, or a file torch cannot read, is a named CheckpointError."""
    try:
        with refusing(path):
            load()
    except CheckpointError:
        raise
    except Exception as error:  # not a pickle torch can read (checksums find such damage first, where recorded)
        first = str(error).splitlines()[0] if str(error) else ""
        raise CheckpointError(
            f"{path} cannot be read: it is corrupted or truncated ({type(error).__name__}: {first}). Move"
            f" {path.parent.name} aside and resume from an earlier complete checkpoint."
        ) from None
