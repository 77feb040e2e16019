"""Fused attention kernels that return the log-sum-exp: what ring attention (:mod:`.ring`) computes its blocks with.

One block of ring attention is the attention of some local query rows to some keys of one K/V block, where every
pair attends (``causal=False``) or the box is square and causal (row ``i`` attends keys ``0..i``). Such a piece is one
call of a fused SDPA kernel that also returns each row's log-sum-exp, so the pieces merge by an online softmax, and
whose backward op takes the *merged* output and log-sum-exp (as torch's own ring attention,
``torch/distributed/tensor/experimental/_context_parallel/_attention.py``, drives them):

* CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward`` (every float dtype);
* CUDA: ``aten._scaled_dot_product_flash_attention`` and its ``_backward`` (fp16/bf16, head_dim a multiple of 8 and
  at most 256). Written as torch's ring drives it; not run on a GPU in this repository's tests.

Anything else (other devices or dtypes) has no fused kernel here: :func:`fused_kernel_for` says ``None`` and ring
attention computes every block with its pure-torch tiles. Grouped-query attention: a fully visible piece folds the
query heads that share a key head into its rows (one call, K/V not repeated); a causal piece repeats K/V to the
query heads (the causal triangle is per query head).

**Masked pieces** (a box whose rows attend part of its keys: the band of a sliding window, short packed documents)
take the kernel's additive ``attn_mask`` where the kernel has one with its backward (:func:`takes_masks`: the CPU
kernel; CUDA's flash op has none, so there such pieces stay on the tiles). A row the mask hides wholly (another
batch row's document) gets output 0 from the kernel and log-sum-exp 0, which :func:`fused_forward` sets to ``-inf``
so the merge gives it no weight. Soft-capping (``softcap * tanh``) is no mask: no kernel here computes it on CPU
(``flex_attention``'s ``score_mod`` would, but torch 2.13 refuses its backward on CPU), so soft-capped blocks stay on
the tiles.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

aten = torch.ops.aten

#: The kernel each device's fused path calls (see the module docstring).
CPU_KERNEL = "cpu_flash"
CUDA_KERNEL = "cuda_flash"


def fused_kernel_for(q: Tensor) -> Optional[str]:
    """The fused kernel ring attention uses for these queries (:data:`CPU_KERNEL`, :data:`CUDA_KERNEL`), or ``None``
    when there is none and the pure-torch tiles compute every block."""
    if q.device.type == "cpu" and q.dtype.is_floating_point:
        return CPU_KERNEL
    head_dim = q.shape[-1]
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= 256:
        return CUDA_KERNEL
    return None


def takes_masks(kernel: Optional[str]) -> bool:
    """Whether ``kernel`` computes masked pieces (an additive ``attn_mask``, forward and backward): the CPU kernel."""
    return kernel == CPU_KERNEL


def cpu_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, mask: Optional[Tensor] = None
) -> tuple[Tensor, Tensor, Any]:
    """The CPU kernel on ``[b, heads, rows, d]`` (an additive ``mask`` ``[.., rows, cols]``): output, log-sum-exp,
    and ``None`` (its backward needs nothing more)."""
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    return out, lse, None


def cpu_backward(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
    aux: Any,
    mask: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale
    )


def _cuda_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor, Any]:
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale
    )
    # The backward takes what the forward returned besides out and lse (no dropout: the rng state is unused).
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _cuda_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float, aux: Any
) -> tuple[Tensor, Tensor, Tensor]:
    cum_q, cum_k, max_q, max_k, seed, offset = aux
    return aten._scaled_dot_product_flash_attention_backward(
        grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale
    )


_FORWARD = {CPU_KERNEL: cpu_forward, CUDA_KERNEL: _cuda_forward}
_BACKWARD = {CPU_KERNEL: cpu_backward, CUDA_KERNEL: _cuda_backward}


def _repeat_heads(t: Tensor, group: int) -> Tensor:
    """``[b, kv_heads, n, d]`` -> ``[b, kv_heads * group, n, d]``: key head ``i`` serves query heads ``i*group..``."""
    b, hkv, n, d = t.shape
    return t.unsqueeze(2).expand(b, hkv, group, n, d).reshape(b, hkv * group, n, d)


def _as_kernel_heads(t: Tensor, per_head: bool) -> Tensor:
    """Grouped rows ``[b, kv_heads, group, n, ...]`` as the kernel's ``[b, heads, n, ...]``: query heads for a causal
    or masked piece (``per_head``), the group folded into the rows (one head per key head) for a fully visible one."""
    b, hkv, group, n = t.shape[:4]
    if per_head:
        return t.reshape(b, hkv * group, n, *t.shape[4:])
    return t.reshape(b, hkv, group * n, *t.shape[4:])


def _kernel_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A piece's boolean mask (``[rows, cols]``, or ``[batch, 1, 1, rows, cols]`` when batch rows differ) as the
    kernel's additive mask ``[batch or 1, 1, rows, cols]``, broadcast over the query heads."""
    zero, hidden = torch.zeros((), dtype=dtype), torch.full((), float("-inf"), dtype=dtype)
    return torch.where(mask.reshape(-1, 1, *mask.shape[-2:]), zero, hidden)


def _kernel_inputs(q5: Tensor, k: Tensor, v: Tensor, per_head: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Queries, keys and values as the kernel takes them (K/V repeated to the query heads for a ``per_head`` piece)."""
    group = q5.shape[2]
    if per_head and group > 1:
        k, v = _repeat_heads(k, group), _repeat_heads(v, group)
    return _as_kernel_heads(q5, per_head), k, v


def fused_forward(
    kernel: str,
    q5: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    scale: float,
    mask: Optional[Tensor] = None,
    reverse: bool = False,
) -> tuple[Tensor, Tensor, Any]:
    """One fused piece: grouped queries ``[b, kv_heads, group, rows, d]`` against keys/values ``[b, kv_heads, cols, d]``.

    ``mask`` (a masked piece, not causal; only where :func:`takes_masks`): which (row, key) pairs attend, boolean
    ``[rows, cols]`` or ``[batch, 1, 1, rows, cols]``. Returns the output ``[b, kv_heads, group, rows, d]``
    (normalised over this piece's keys), its log-sum-exp ``[b, kv_heads, group, rows]`` (``-inf`` for a row that
    attends none of them), and what the kernel's backward needs besides (``None`` on CPU). ``reverse`` (causal
    only): row ``i`` attends keys ``i..`` instead, computed as a causal square with its rows and keys reversed.
    """
    if reverse:
        out, lse, aux = fused_forward(kernel, q5.flip(-2), k.flip(-2), v.flip(-2), causal, scale)
        return out.flip(-2), lse.flip(-1), aux
    q, k, v = _kernel_inputs(q5, k, v, causal or mask is not None)
    if mask is None:
        out, lse, aux = _FORWARD[kernel](q, k, v, causal, scale)
        return out.reshape(q5.shape), lse.reshape(q5.shape[:-1]), aux
    out, lse, aux = cpu_forward(q, k, v, False, scale, _kernel_mask(mask, q.dtype))
    lse = lse.reshape(q5.shape[:-1])
    # The kernel returns log-sum-exp 0 for a row its mask hides wholly: -inf gives it no weight in the merge.
    lse = lse.masked_fill(~mask.reshape(-1, 1, 1, *mask.shape[-2:]).any(-1), float("-inf"))
    return out.reshape(q5.shape), lse, aux


def fused_backward(
    kernel: str,
    grad5: Tensor,
    q5: Tensor,
    k: Tensor,
    v: Tensor,
    out5: Tensor,
    lse5: Tensor,
    causal: bool,
    scale: float,
    aux: Any,
    mask: Optional[Tensor] = None,
    reverse: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq ``[b, kv_heads, group, rows, d]``, dk, dv ``[b, kv_heads, cols, d]``) of one fused piece
    (``mask``, ``reverse``: as in :func:`fused_forward`).

    ``out5`` and ``lse5`` are the *final* output and log-sum-exp of these rows (merged over every block, sinks
    included): the kernel recomputes the piece's probabilities as ``exp(score - lse)`` and the softmax Jacobian's
    ``rowsum(dO * O)`` from them, which is the piece's share of the whole softmax's gradient.
    """
    if reverse:
        flipped = (t.flip(-2) for t in (grad5, q5, k, v, out5))
        grads = fused_backward(kernel, *flipped, lse5.flip(-1), causal, scale, aux)
        return grads[0].flip(-2), grads[1].flip(-2), grads[2].flip(-2)
    b, hkv, group = q5.shape[:3]
    per_head = causal or mask is not None
    q, k, v = _kernel_inputs(q5, k, v, per_head)
    grad, out = (_as_kernel_heads(t, per_head) for t in (grad5, out5))
    lse = _as_kernel_heads(lse5, per_head).contiguous()
    if mask is None:
        grad_q, grad_k, grad_v = _BACKWARD[kernel](grad.contiguous(), q, k, v, out, lse, causal, scale, aux)
    else:
        additive = _kernel_mask(mask, q.dtype)
        grad_q, grad_k, grad_v = cpu_backward(grad.contiguous(), q, k, v, out, lse, False, scale, aux, additive)
    if per_head and group > 1:
        grad_k, grad_v = (t.reshape(b, hkv, group, *t.shape[2:]).sum(2) for t in (grad_k, grad_v))
    return grad_q.reshape(q5.shape), grad_k, grad_v
