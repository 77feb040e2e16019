"""Context parallelism inside a transformers model: its attention routed through Ulysses or ring attention.

:func:`apply_context_parallel` (called by ``parallelize`` for ``cp_size > 1``) registers
:func:`context_parallel_attention` in transformers' ``AttentionInterface`` and points the model at it; the
attention modules keep their projections and RoPE, so q/k/v arrive per rank and Ulysses runs the model's own
attention implementation (SDPA, eager, flash) on the full sequence in between its all-to-alls. The registered
name has no mask function, so transformers builds no (local-length, wrong) mask: causal masking comes from
global positions. Batches are sharded by :mod:`lightning_plugins.parallel.context.batch`.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_plugins.parallel.context.checks import BACKENDS
from lightning_plugins.parallel.context.linear import (
    DocumentPositions,
    apply_linear_context_parallel,
    linear_attention_of,
)
from lightning_plugins.parallel.context.sharding import sequence_positions
from lightning_plugins.parallel.context.ring import ring_attention
from lightning_plugins.parallel.context.ulysses import eager_attention, ulysses_attention
from lightning_plugins.parallel.image_text import image_text_parts

#: The name under which the context-parallel attention is registered in transformers' ``AttentionInterface``.
#: It has no mask function on purpose: transformers then builds no mask (a mask for the local length
#: would be wrong), and causal masking is done here from global positions.
ATTENTION_IMPLEMENTATION = "lightning_plugins_context_parallel"
_STATE_ATTR = "_lightning_plugins_context_parallel"


class _AttentionState(NamedTuple):
    """What the registered attention function needs from one prepared attention module."""

    mesh: Any  # the 1-D cp mesh; its group is looked up at each call (see lightning_plugins.parallel.teardown)
    size: int
    backend: str
    inner: str  # the model's own attention implementation, run on the full sequence by Ulysses
    inner_config: Any  # a copy of the model config naming ``inner``, for transformers' kernels that read it

    @property
    def group(self) -> dist.ProcessGroup:
        """The context-parallel process group."""
        return self.mesh.get_group()


def apply_context_parallel(model: Any, layers: Any, cp_mesh: Any, backend: str = "ulysses") -> None:
    """Route every decoder layer's attention through context-parallel attention over ``cp_mesh``.

    The model's attention modules keep computing q/k/v (and RoPE, from the *global* ``position_ids`` of
    the local tokens); transformers' attention interface then calls :func:`context_parallel_attention`,
    which runs Ulysses or ring attention over the cp group. Batches must be sharded with
    :func:`shard_batch_for_context_parallel` (or :func:`context_parallel_batch`).

    Args:
        model: A transformers causal LM (after tensor parallelism, if any).
        layers: Its decoder layers, each with a ``self_attn`` module or a Gated DeltaNet ``linear_attn`` (see
            :mod:`lightning_plugins.parallel.context.linear`).
        cp_mesh: The 1-D context-parallel mesh.
        backend: ``"ulysses"`` (all-to-all over heads, then the model's own attention on the full
            sequence) or ``"ring"`` (K/V passed around the ring, online softmax).
    """
    from transformers import AttentionInterface

    from lightning_plugins.errors import LayoutError

    if backend not in BACKENDS:
        raise LayoutError(f"Unknown context-parallel backend {backend!r}; use one of {BACKENDS}.")
    inner = model.config._attn_implementation or "eager"
    if inner == ATTENTION_IMPLEMENTATION:
        raise LayoutError("This model is already context parallel: apply `parallelize` to a fresh model.")
    inner_config = copy.copy(model.config)
    inner_config._attn_implementation = inner
    state = _AttentionState(cp_mesh, cp_mesh.size(), backend, inner, inner_config)
    documents = DocumentPositions()  # Gated DeltaNet layers (Qwen3.5, Qwen3-Next): their own context parallelism
    for index, layer in enumerate(layers):
        attention = getattr(layer, "self_attn", None)
        if attention is None and linear_attention_of(layer) is not None:
            apply_linear_context_parallel(layer, index, cp_mesh, backend, documents)
            continue
        if attention is None:
            raise LayoutError(
                f"Decoder layer {index} ({type(layer).__name__}) has no `self_attn` module, so context parallelism"
                " cannot hook its attention. Use cp_size=1 for this model."
            )
        setattr(attention, _STATE_ATTR, state)
    AttentionInterface.register(ATTENTION_IMPLEMENTATION, context_parallel_attention)
    parts = image_text_parts(model)  # an image-text model's vision tower keeps its own attention on its own tokens
    (model if parts is None else model.get_submodule(parts.language_path)).set_attn_implementation(
        ATTENTION_IMPLEMENTATION
    )


def wrapped_attention(model: Any) -> Optional[str]:
    """The attention implementation that context parallelism runs inside ``model``'s (the one it had before
    :func:`apply_context_parallel`), or ``None`` when ``model`` is not context parallel."""
    for module in model.modules():
        state = getattr(module, _STATE_ATTR, None)
        if isinstance(state, _AttentionState):
            return state.inner
    return None


def context_parallel_attention(
    module: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers attention-interface function: exact attention over the cp-sharded sequence.

    Args:
        module: The attention module (prepared by :func:`apply_context_parallel`).
        query: This rank's queries ``[batch, heads, local_seq, head_dim]`` (after RoPE).
        key: This rank's keys ``[batch, kv_heads, local_seq, head_dim]``.
        value: This rank's values, shaped like ``key``.
        attention_mask: Must be ``None``: masks are handled when the batch is sharded.
        dropout: Attention dropout probability (Ulysses only).
        scaling: Score scale.
        is_causal: Overrides ``module.is_causal``.
        **kwargs: transformers' extra attention arguments: ``position_ids`` (packed rows: attention stays within
            each document), ``sliding_window``, ``softcap`` (Gemma 2) and ``s_aux`` (gpt-oss's sinks).

    Returns:
        The attention output ``[batch, local_seq, heads, head_dim]`` and ``None`` (no weights).
    """
    state: Optional[_AttentionState] = getattr(module, _STATE_ATTR, None)
    if state is None:
        raise RuntimeError(
            f"{type(module).__name__} runs with attn_implementation={ATTENTION_IMPLEMENTATION!r} but was not prepared"
            " by `apply_context_parallel`; build the model through `lightning_plugins.parallelize`."
        )
    if attention_mask is not None:
        raise ValueError(
            "Context parallelism builds its own causal mask from global positions and cannot apply a custom 4-D"
            " attention mask. Pass a 2-D right-padding `attention_mask` (or none) in the batch instead."
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # The model's attention variants, as its attention module passes them: the local layers' sliding window
    # (None on global layers), Gemma 2's logit soft-capping and gpt-oss's sinks.
    variants = {"window": kwargs.get("sliding_window"), "softcap": kwargs.get("softcap"), "sinks": kwargs.get("s_aux")}
    if variants["window"] is not None and not causal:
        raise ValueError(
            f"{type(module).__name__} has a sliding window ({variants['window']}) but is not causal; context"
            " parallelism applies windows to causal attention only. Use cp_size=1 for this model."
        )
    dropout = dropout if module.training else 0.0
    group = state.group
    starts = _document_starts(kwargs.get("position_ids"), group, query.shape[2])
    if state.backend == "ring":
        if dropout > 0:
            raise ValueError("Ring attention has no attention dropout; set config.attention_dropout=0 or use Ulysses.")
        out = ring_attention(
            query, key, value, group, causal=causal, scale=scaling, document_starts=starts, **variants
        )
    else:
        inner = functools.partial(_inner_attention, module, state, dropout)
        # Packed rows go to the fused kernel's document pieces, which apply no dropout: with dropout, attn_fn's.
        out = ulysses_attention(
            query, key, value, group, causal=causal, scale=scaling, attn_fn=inner, document_starts=starts,
            packed_kernel=dropout == 0.0, **variants
        )
    return out.transpose(1, 2).contiguous(), None


def _document_starts(position_ids: Optional[Tensor], group: dist.ProcessGroup, local_len: int) -> Optional[Tensor]:
    """Where each local token's document begins (global position, ``[batch, local_seq]``, on the host).

    The model's ``position_ids`` count up from 0 in each document of a packed row, so the token at global
    position ``i`` with position id ``p`` belongs to the document that begins at ``i - p``; a row's first
    document begins at 0 whatever its ids (rows turned from left padding keep their original ids). Rows
    of one document give zeros. ``None`` without position ids (the planner's dry run plans unpacked rows).
    """
    if position_ids is None:
        return None
    size = dist.get_world_size(group)
    index = sequence_positions(local_len * size, dist.get_rank(group), cp_size=size, load_balanced=True)
    positions = position_ids.detach().to("cpu", torch.long)
    return torch.minimum((index - positions).clamp(min=0), index)


class _InnerModule:
    """The attention module as the model's own kernel must see it on the head-sharded full sequence.

    After the all-to-all the query/key head ratio can differ from the module's (kv heads repeated for
    cp), and kernels that dispatch on ``module.config._attn_implementation`` must see their own name.
    """

    def __init__(self, module: Any, config: Any, num_key_value_groups: int, is_causal: bool) -> None:
        self._module = module
        self.config = config
        self.num_key_value_groups = num_key_value_groups
        self.is_causal = is_causal

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _inner_attention(
    module: Any,
    state: _AttentionState,
    dropout: float,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    is_causal: bool,
    scale: Optional[float],
    **variants: Any,
) -> Tensor:
    """The model's own attention implementation on natural-order ``[b, h, S, d]`` tensors (Ulysses).

    transformers' eager kernels, and every kernel for a window, soft-capping or sinks, take their mask from the
    model (which builds none here): those run as :func:`eager_attention` with the mask built for the full sequence.
    """
    groups = q.shape[1] // k.shape[1]
    if state.inner == "eager" or variants:
        return eager_attention(q, k, v, is_causal=is_causal, scale=scale, dropout=dropout, **variants)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    proxy = _InnerModule(module, state.inner_config, groups, is_causal)
    attention = ALL_ATTENTION_FUNCTIONS[state.inner]
    out, _ = attention(proxy, q, k, v, None, dropout=dropout, scaling=scale, is_causal=is_causal)
    return out.transpose(1, 2)  # transformers' kernels return [b, S, h, d]
