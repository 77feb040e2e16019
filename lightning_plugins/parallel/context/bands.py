"""A sliding window's band in one masked kernel call (:class:`BandCall`, where the kernel takes masks: on CPU).

In a band, row ``i`` of a run attends keys ``first + i .. first + i + width - 1``. Cut into chunks of ``chunk`` rows,
each chunk attends a box of ``chunk + width - 1`` keys under the same mask (row ``i`` of the chunk: box keys ``i ..
i + width - 1``), and chunk ``j``'s box starts ``j * chunk`` keys after the first's. So every chunk is one batch entry
of a single kernel call: the queries are the run's rows regrouped by chunk, the keys and values overlapping windows of
the block's (``unfold``: a view, nothing copied when the batch is one row), the mask one ``[chunk, chunk + width - 1]``
broadcast over them. Grouped-query heads fold into the rows (the mask repeated per query head), so K/V are never
repeated to the query heads.

Why not :func:`~.tiles._band_calls` (a reversed causal square, a box and a causal square per chunk, no mask) on CPU:
the CPU kernel's key blocks are 512 wide and it computes a causal square of up to 512 keys whole, so those three calls
compute about twice the band's pairs, in three small calls a chunk, each with its own flips and merge. Here a call
computes ``(chunk + width - 1) / width`` times the pairs (1.12 at a 512-key window) for the whole run. Measured in
RESULTS.md (issue 48).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from lightning_plugins.parallel.context.fused import cpu_backward, cpu_forward


class BandCall(NamedTuple):
    """Chunks of ``chunk`` rows in one kernel call: chunk ``j`` is rows ``rows.start + j * chunk ..`` against keys
    ``cols.start + j * step ..`` (``span`` of them; keys relative to the block's first key). A band (``width``): row
    ``i`` of a chunk attends its keys ``i .. i + width - 1`` (``step == chunk``, ``span == chunk + width - 1``); no
    ``width``: every pair of each chunk's box attends (a staircase of equal boxes)."""

    rows: slice
    cols: slice
    chunk: int
    step: int
    span: int
    width: Optional[int] = None

    @property
    def count(self) -> int:
        return (self.rows.stop - self.rows.start) // self.chunk

    def chunks(self) -> list[tuple[slice, slice, Tensor]]:
        """Each chunk as (rows, keys, mask ``[rows, keys]``): what the one call computes, chunk by chunk."""
        if self.width is None:
            mask = torch.ones(self.chunk, self.span, dtype=torch.bool)
        else:
            mask = band_mask(self.chunk, self.width)
        out = []
        for j in range(self.count):
            row, col = self.rows.start + j * self.chunk, self.cols.start + j * self.step
            out.append((slice(row, row + self.chunk), slice(col, col + self.span), mask))
        return out


def band_mask(rows: int, width: int) -> Tensor:
    """``[rows, rows + width - 1]`` booleans: row ``i`` attends keys ``i .. i + width - 1``."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # real, also in the planner's dry run
        keys = torch.arange(rows + width - 1)[None, :] - torch.arange(rows)[:, None]
        return (keys >= 0) & (keys < width)


def _rows_by_chunk(t: Tensor, call: BandCall) -> Tensor:
    """Grouped rows ``[b, kv_heads, group, count * chunk, ...]`` as the kernel's ``[count * b, kv_heads, group *
    chunk, ...]``: a batch entry per chunk, the query heads of a key head folded into its rows."""
    b, hkv, group, _ = t.shape[:4]
    tail = t.shape[4:]
    split = t.reshape(b, hkv, group, call.count, call.chunk, *tail).movedim(3, 0)
    return split.reshape(call.count * b, hkv, group * call.chunk, *tail)


def rows_back(t: Tensor, call: BandCall, group: int) -> Tensor:
    """The inverse of :func:`_rows_by_chunk` as a view ``[b, kv_heads, group, count, chunk, ...]`` (no copy): the
    rows' chunks, to merge or add into the rows unflattened alike (:func:`chunked`)."""
    pb, hkv = t.shape[:2]
    tail = t.shape[3:]
    return t.reshape(call.count, pb // call.count, hkv, group, call.chunk, *tail).movedim(0, 3)


def chunked(t: Tensor, call: BandCall) -> Tensor:
    """Grouped rows ``[b, kv_heads, group, count * chunk, ...]`` viewed as ``[..., count, chunk, ...]``."""
    return t.unflatten(3, (call.count, call.chunk))


def _keys_by_chunk(t: Tensor, call: BandCall) -> Tensor:
    """Keys ``[b, kv_heads, cols, d]`` (the call's ``cols``) as overlapping windows ``[count * b, kv_heads, chunk +
    width - 1, d]``."""
    b, hkv, _, d = t.shape
    windows = t.unfold(2, call.span, call.step)  # [b, hkv, count, d, span]
    return windows.permute(2, 0, 1, 4, 3).reshape(call.count * b, hkv, -1, d)


def add_keys_back(into: Tensor, grad: Tensor, call: BandCall) -> None:
    """Add the gradient of :func:`_keys_by_chunk` into ``into`` ``[b, kv_heads, cols, d]`` (the call's keys, in the
    accumulation dtype): each chunk's window summed where its keys are, in place."""
    span, stride = call.span, call.step
    pb, hkv, _, d = grad.shape
    windows = grad.reshape(call.count, pb // call.count, hkv, span, d)
    # Window j starts j * step keys in: add its keys a step-wide slice at a time, every window at once, through a
    # strided view of the destination (window j's slice at j * step: no two of one slice overlap).
    s_b, s_h, s_k, s_d = into.stride()
    for lo in range(0, span, stride):
        width = min(span, lo + stride) - lo
        target = into.as_strided((into.shape[0], hkv, call.count, width, d), (s_b, s_h, stride * s_k, s_k, s_d),
                                 into.storage_offset() + lo * s_k)  # fmt: skip
        target += windows[:, :, :, lo : lo + width].permute(1, 2, 0, 3, 4)


def _kernel_mask(call: BandCall, group: int, dtype: torch.dtype) -> Optional[Tensor]:
    return None if call.width is None else _additive_band_mask(call.chunk, call.width, group, dtype)


@functools.lru_cache(maxsize=64)
def _additive_band_mask(chunk: int, width: int, group: int, dtype: torch.dtype) -> Tensor:
    """The kernel's additive band mask ``[group * chunk, chunk + width - 1]`` (0 attended, -inf not), made once per
    shape (every layer's calls share it; a real tensor, also in the planner's dry run)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        mask = band_mask(chunk, width).repeat(group, 1)
        return torch.where(mask, torch.zeros((), dtype=dtype), torch.full((), float("-inf"), dtype=dtype))


def band_forward(q5: Tensor, k: Tensor, v: Tensor, call: BandCall, scale: float) -> tuple[Tensor, Tensor]:
    """The band's output ``[b, kv_heads, group, count, chunk, d]`` (normalised over its keys) and log-sum-exp ``[b,
    kv_heads, group, count, chunk]``, views of the kernel's (merge them into :func:`chunked` rows); ``q5`` holds the
    call's rows, ``k``/``v`` ``[b, kv_heads, cols, d]`` its keys."""
    group = q5.shape[2]
    q = _rows_by_chunk(q5, call)
    mask = _kernel_mask(call, group, q.dtype)
    out, lse, _ = cpu_forward(q, _keys_by_chunk(k, call), _keys_by_chunk(v, call), False, scale, mask)
    return rows_back(out, call, group), rows_back(lse, call, group)


def band_backward(
    grad5: Tensor, q5: Tensor, k: Tensor, v: Tensor, out5: Tensor, lse5: Tensor, call: BandCall, scale: float,
    into: tuple[Tensor, Tensor, Tensor],
) -> None:  # fmt: skip
    """Add the gradients of :func:`band_forward` into ``into`` (dq like ``q5``, dk and dv like ``k``, in the
    accumulation dtype), given the rows' *final* output and log-sum-exp (as :func:`~.fused.fused_backward`)."""
    group = q5.shape[2]
    q, grad, out = (_rows_by_chunk(t, call) for t in (q5, grad5, out5))
    lse = _rows_by_chunk(lse5, call).contiguous()
    kb, vb = _keys_by_chunk(k, call), _keys_by_chunk(v, call)
    mask = _kernel_mask(call, group, q.dtype)
    grad_q, grad_k, grad_v = cpu_backward(grad.contiguous(), q, kb, vb, out, lse, False, scale, None, mask)
    chunked(into[0], call).add_(rows_back(grad_q, call, group))
    add_keys_back(into[1], grad_k, call)
    add_keys_back(into[2], grad_v, call)
