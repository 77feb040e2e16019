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


def _rows_back(t: Tensor, call: BandCall, group: int) -> Tensor:
    """The inverse of :func:`_rows_by_chunk`."""
    pb, hkv = t.shape[:2]
    tail = t.shape[3:]
    split = t.reshape(call.count, pb // call.count, hkv, group, call.chunk, *tail).movedim(0, 3)
    return split.reshape(pb // call.count, hkv, group, call.count * call.chunk, *tail)


def _keys_by_chunk(t: Tensor, call: BandCall) -> Tensor:
    """Keys ``[b, kv_heads, cols, d]`` (the call's ``cols``) as overlapping windows ``[count * b, kv_heads, chunk +
    width - 1, d]``."""
    b, hkv, _, d = t.shape
    windows = t.unfold(2, call.span, call.step)  # [b, hkv, count, d, span]
    return windows.permute(2, 0, 1, 4, 3).reshape(call.count * b, hkv, -1, d)


def _keys_back(grad: Tensor, call: BandCall, cols: int) -> Tensor:
    """The gradient of :func:`_keys_by_chunk`: each chunk's window summed into ``[b, kv_heads, cols, d]``."""
    span, stride = call.span, call.step
    pb, hkv, _, d = grad.shape
    b = pb // call.count
    windows = grad.reshape(call.count, b, hkv, span, d)
    # Window j starts j * step keys in: add its keys a step-wide slice at a time, every window at once.
    steps = -(-span // stride)
    acc = torch.promote_types(grad.dtype, torch.float32)  # overlapping windows add up: not in bf16
    total = torch.zeros(b, hkv, (call.count + steps) * stride, d, dtype=acc, device=grad.device)
    for step in range(steps):
        lo, hi = step * stride, min(span, (step + 1) * stride)
        target = total[:, :, lo : lo + call.count * stride].unflatten(2, (call.count, stride))
        target[..., : hi - lo, :] += windows[:, :, :, lo:hi].permute(1, 2, 0, 3, 4)
    return total[:, :, :cols]


def _kernel_mask(call: BandCall, group: int, dtype: torch.dtype) -> Optional[Tensor]:
    if call.width is None:
        return None
    mask = band_mask(call.chunk, call.width).repeat(group, 1)
    return torch.where(mask, torch.zeros((), dtype=dtype), torch.full((), float("-inf"), dtype=dtype))


def band_forward(q5: Tensor, k: Tensor, v: Tensor, call: BandCall, scale: float) -> tuple[Tensor, Tensor]:
    """The band's output ``[b, kv_heads, group, rows, d]`` (normalised over its keys) and log-sum-exp ``[b, kv_heads,
    group, rows]``; ``q5`` holds the call's rows, ``k``/``v`` ``[b, kv_heads, cols, d]`` its keys."""
    group = q5.shape[2]
    q = _rows_by_chunk(q5, call)
    mask = _kernel_mask(call, group, q.dtype)
    out, lse, _ = cpu_forward(q, _keys_by_chunk(k, call), _keys_by_chunk(v, call), False, scale, mask)
    return _rows_back(out, call, group), _rows_back(lse, call, group)


def band_backward(
    grad5: Tensor, q5: Tensor, k: Tensor, v: Tensor, out5: Tensor, lse5: Tensor, call: BandCall, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq like ``q5``, dk and dv like ``k``) of :func:`band_forward`, given the rows' *final* output and
    log-sum-exp (as :func:`~.fused.fused_backward`)."""
    group = q5.shape[2]
    q, grad, out = (_rows_by_chunk(t, call) for t in (q5, grad5, out5))
    lse = _rows_by_chunk(lse5, call).contiguous()
    kb, vb = _keys_by_chunk(k, call), _keys_by_chunk(v, call)
    mask = _kernel_mask(call, group, q.dtype)
    grad_q, grad_k, grad_v = cpu_backward(grad.contiguous(), q, kb, vb, out, lse, False, scale, None, mask)
    cols = k.shape[2]
    return _rows_back(grad_q, call, group), _keys_back(grad_k, call, cols), _keys_back(grad_v, call, cols)
