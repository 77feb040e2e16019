"""Safetensors files read and written one tensor at a time, without holding a file (or mapping it) in memory.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte offsets) and
the tensors' bytes back to back. Knowing every name, dtype and shape up front (from a DCP checkpoint's
metadata), a writer puts the header first and then streams each tensor's bytes as it arrives, so the
peak memory of writing is one tensor, whatever the size of the file. (torch's
``_consolidate_hf_safetensors`` does the same for files written by its HF storage writer.) The reader
``readinto``s one tensor from its offsets: no ``mmap``, so pages read do not stay resident in this process.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

import torch
from torch import Tensor

__all__ = [
    "LazySlice", "SafetensorsDirectory", "TensorSpec", "read_header", "read_slice", "read_tensor", "write_streaming",
]

#: Bytes read at a time when a slice keeps part of each row: its other dimensions are cut as each chunk arrives.
CHUNK_BYTES = 64 * 2**20

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_FROM_NAME = {name: dtype for dtype, name in _DTYPES.items()}

#: ``(shape, dtype)`` of a tensor to be written.
TensorSpec = tuple[tuple[int, ...], torch.dtype]


def nbytes(spec: TensorSpec) -> int:
    """Bytes of a tensor of this shape and dtype."""
    shape, dtype = spec
    return math.prod(shape) * dtype.itemsize


def write_streaming(path: str | Path, specs: dict[str, TensorSpec], tensors: Iterable[tuple[str, Tensor]]) -> None:
    """Write a safetensors file whose tensors are ``specs`` (in that order), taking their values from ``tensors``.

    ``tensors`` yields ``(name, tensor)`` in the order of ``specs``; each is written as it comes and may be
    dropped by the caller right after.

    Raises:
        ValueError: when a yielded tensor is not the next one of ``specs`` or has another shape or dtype.
    """
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (shape, dtype) in specs.items():
        if dtype not in _DTYPES:
            raise ValueError(f"{name}: dtype {dtype} cannot be written to safetensors.")
        end = offset + nbytes((shape, dtype))
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the tensors start 8-byte aligned, as safetensors writes them
    expected = iter(specs.items())
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for name, tensor in tensors:
            want, (shape, dtype) = next(expected, (None, ((), None)))
            if name != want or tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise ValueError(
                    f"{path}: got {name} {tuple(tensor.shape)} {tensor.dtype}, expected {want} {tuple(shape)} {dtype}."
                )
            _write_tensor(handle, tensor)
        missing = [name for name, _ in expected]
        if missing:
            raise ValueError(f"{path}: {len(missing)} tensors were never produced, e.g. {missing[:3]}.")


def _write_tensor(handle: IO[bytes], tensor: Tensor) -> None:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    if flat.numel():
        handle.write(flat.view(torch.uint8).numpy().data)  # the tensor's own bytes, no copy


def read_header(path: str | Path) -> tuple[dict[str, dict], int]:
    """A safetensors file's header (without ``__metadata__``) and the byte offset where its data starts."""
    with open(path, "rb") as handle:
        raw = handle.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than its 8-byte header length).")
        (length,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(handle.read(length))
        except ValueError as err:
            raise ValueError(f"{path} is not a safetensors file (its header is not JSON: {err}).") from None
    header.pop("__metadata__", None)
    return header, 8 + length


def read_tensor(path: str | Path, entry: dict, data_start: int) -> Tensor:
    """The tensor described by header ``entry`` of file ``path``, read into a fresh CPU tensor."""
    dtype = _FROM_NAME.get(entry["dtype"])
    if dtype is None:
        raise ValueError(f"{path}: dtype {entry['dtype']} is not supported here.")
    begin, end = entry["data_offsets"]
    tensor = torch.empty(entry["shape"], dtype=dtype)
    if end > begin:
        with open(path, "rb") as handle:
            handle.seek(data_start + begin)
            view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
            if handle.readinto(view) != end - begin:
                raise ValueError(f"{path} is truncated: {entry} lies past its end.")
    return tensor


def read_slice(
    path: str | Path, entry: dict, data_start: int, index: tuple[slice, ...], out: Tensor | None = None
) -> Tensor:
    """``tensor[index]`` of the tensor that header ``entry`` of file ``path`` describes, reading only its rows.

    A slice that keeps whole rows is read straight into the result; one that keeps part of each row (a column shard)
    is read :data:`CHUNK_BYTES` of rows at a time, each chunk cut as it arrives: the peak is the result plus one chunk.

    Args:
        index: One ``slice`` (step 1) per leading dimension; the dimensions it leaves out are kept whole.
        out: Where the slice goes (of its shape; another dtype is cast, another device copied to): read into
            directly when it is a contiguous CPU tensor of the file's dtype. A new tensor when ``None``.
    """
    dtype = _FROM_NAME.get(entry["dtype"])
    if dtype is None:
        raise ValueError(f"{path}: dtype {entry['dtype']} is not supported here.")
    shape = entry["shape"]
    if not shape:
        return read_tensor(path, entry, data_start)
    bounds = [part.indices(size)[:2] for part, size in zip((*index, *[slice(None)] * len(shape))[: len(shape)], shape)]
    (lo, hi), rest = bounds[0], bounds[1:]
    given = out
    if out is None or out.dtype != dtype or not out.is_contiguous() or out.device.type != "cpu":
        out = torch.empty([max(0, b - a) for a, b in bounds], dtype=dtype)
    row_bytes = math.prod(shape[1:]) * out.element_size()
    whole_rows = all(b - a == size for (a, b), size in zip(rest, shape[1:]))
    step = max(1, hi - lo) if whole_rows else max(1, CHUNK_BYTES // max(1, row_bytes))
    cut = (slice(None), *(slice(a, b) for a, b in rest))
    with open(path, "rb") as handle:
        for start in range(lo, hi, step):
            stop = min(hi, start + step)
            chunk = out[start - lo : stop - lo] if whole_rows else torch.empty((stop - start, *shape[1:]), dtype=dtype)
            handle.seek(data_start + entry["data_offsets"][0] + start * row_bytes)
            if chunk.numel() and handle.readinto(memoryview(chunk.reshape(-1).view(torch.uint8).numpy())) != (
                stop - start
            ) * row_bytes:
                raise ValueError(f"{path} is truncated: {entry} lies past its end.")
            if not whole_rows:
                out[start - lo : stop - lo] = chunk[cut]
    if given is not None and given is not out:
        given.copy_(out)
        return given
    return out


class LazySlice:
    """One tensor of a safetensors file, read only when sliced (safetensors' ``get_slice`` API, without ``mmap``:
    the pages read do not stay resident in this process)."""

    def __init__(self, path: str | Path, entry: dict, data_start: int) -> None:
        self.path, self.entry, self.data_start = path, entry, data_start

    def get_shape(self) -> list[int]:
        return list(self.entry["shape"])

    def __getitem__(self, index: slice | tuple[slice, ...]) -> Tensor:
        return self.read_into(index if isinstance(index, tuple) else (index,), None)

    def read_into(self, index: tuple[slice, ...], out: Tensor | None) -> Tensor:
        """``self[index]``, into ``out`` (see :func:`read_slice`)."""
        return read_slice(self.path, self.entry, self.data_start, index, out)


class SafetensorsDirectory:
    """The weights of an HF checkpoint directory (``model.safetensors`` or shards + ``model.safetensors.index.json``),
    read one tensor at a time."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        index = self.directory / "model.safetensors.index.json"
        single = self.directory / "model.safetensors"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif single.is_file():
            files = [single.name]
        else:
            raise FileNotFoundError(
                f"{self.directory} holds neither model.safetensors nor model.safetensors.index.json: pass an HF"
                " checkpoint directory with safetensors weights (e.g. `hf download <model> --local-dir DIR`)."
            )
        self._where: dict[str, tuple[Path, dict, int]] = {}
        for name in files:
            path = self.directory / name
            if not path.is_file():
                raise FileNotFoundError(f"{path} is listed in {index.name} but missing: the download is incomplete.")
            header, start = read_header(path)
            for key, entry in header.items():
                self._where[key] = (path, entry, start)

    def names(self) -> Iterator[str]:
        return iter(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def dtype(self, name: str) -> torch.dtype:
        return _FROM_NAME[self._where[name][1]["dtype"]]

    def read(self, name: str) -> Tensor:
        if name not in self._where:
            raise KeyError(f"{self.directory} has no weight {name!r}.")
        path, entry, start = self._where[name]
        return read_tensor(path, entry, start)
