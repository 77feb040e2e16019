"""Checks that fail before any collective when context parallelism cannot run a model or a layout."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_plugins.errors import LayoutError, OptionsError
from lightning_plugins.parallel.options import CP_BACKENDS

BACKENDS = CP_BACKENDS


def check_gqa(num_heads: int, num_kv_heads: int) -> None:
    """A clear error unless the query heads split evenly over the key/value heads (grouped-query attention)."""
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"Grouped-query attention needs the query heads ({num_heads}) to be a multiple of the key/value "
            f"heads ({num_kv_heads})."
        )


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(c for c in range(1, min(n, limit) + 1) if n % c == 0)


def check_ulysses_heads(num_heads: int, num_kv_heads: int, cp_size: int) -> None:
    """Fail early, before any collective, when Ulysses cannot split these heads over ``cp_size`` ranks.

    Args:
        num_heads: Query heads of the attention layer.
        num_kv_heads: Key/value heads of the attention layer.
        cp_size: Size of the context-parallel group.

    Raises:
        ValueError: When the query heads are not divisible by ``cp_size`` (key/value heads need not be:
            they are repeated until they are), or are not a multiple of the key/value heads.
    """
    check_gqa(num_heads, num_kv_heads)
    if num_heads % cp_size != 0:
        raise ValueError(
            f"Ulysses context parallelism splits attention heads across the cp group, so the query heads "
            f"({num_heads}) must be divisible by cp_size ({cp_size}). Use cp_size="
            f"{_largest_divisor_at_most(num_heads, cp_size)} (or another divisor of {num_heads}), or ring attention."
        )


def check_context_parallel(config: Any, cp_size: int, tp_size: int = 1, backend: str = "ulysses") -> None:
    """Fail before any collective when context parallelism cannot run this model config.

    Args:
        config: The transformers model config (``num_attention_heads``, ``num_key_value_heads``, ...).
        cp_size: Context-parallel ranks.
        tp_size: Tensor-parallel ranks (they already split the heads; Ulysses splits the local ones).
        backend: ``"ulysses"`` or ``"ring"``.

    Raises:
        LayoutError: when Ulysses cannot split the heads (softmax or linear attention, per tensor-parallel rank) over
            ``cp_size`` ranks.
        OptionsError: for an unknown backend, or ring attention with attention dropout; both name a setting that works.
    """
    if backend not in BACKENDS:
        raise OptionsError(f"Unknown context-parallel backend {backend!r}; use one of {BACKENDS}.")
    if cp_size == 1:
        return
    if config is None:
        return
    _check_linear_attention(config, cp_size, tp_size, backend)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if backend == "ulysses" and heads is not None:
        local_heads, local_kv = heads // tp_size, max(kv_heads // tp_size, 1)
        try:
            check_ulysses_heads(local_heads, local_kv, cp_size)
        except ValueError as err:
            where = f" ({heads} heads / tp_size={tp_size})" if tp_size > 1 else ""
            good = [c for c in range(1, local_heads + 1) if local_heads % c == 0]
            raise LayoutError(
                f"Ulysses context parallelism splits each rank's {local_heads} attention heads{where} over"
                f" cp_size={cp_size} ranks, which needs them divisible by cp_size. Use cp_size in {good}, or"
                f" backend='ring' (no head constraint). ({err})"
            ) from None
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if backend == "ring" and dropout > 0:
        raise OptionsError(
            f"Ring attention has no attention dropout, but config.attention_dropout={dropout}. Set it to 0.0 or use"
            " backend='ulysses'."
        )


def _check_linear_attention(config: Any, cp_size: int, tp_size: int, backend: str) -> None:
    """Gated DeltaNet layers (``layer_types`` with ``linear_attention``: Qwen3.5, Qwen3-Next) under context parallelism:
    Ulysses splits their key and value heads over cp (those of each tensor-parallel rank), which must divide both."""
    text = getattr(config, "text_config", None) or config
    layer_types = list(getattr(text, "layer_types", None) or ())
    if "linear_attention" not in layer_types or backend != "ulysses":
        return
    index = layer_types.index("linear_attention")
    for name in ("linear_num_key_heads", "linear_num_value_heads"):
        heads = getattr(text, name, None)
        if heads is None or heads % tp_size:
            continue  # tensor parallelism's own check names it
        if (heads // tp_size) % cp_size:
            local = heads // tp_size
            good = [c for c in range(1, local + 1) if local % c == 0]
            where = f" ({heads} / tp_size={tp_size} per tensor-parallel rank)" if tp_size > 1 else ""
            raise LayoutError(
                f"Decoder layer {index} is Gated DeltaNet linear attention, whose heads Ulysses context parallelism"
                f" splits over cp_size={cp_size}, but {name}={local}{where} is not divisible by it. Use cp_size in"
                f" {good}, or cp_backend='ring' (the recurrent state passed along the cp ranks; no head constraint)."
            )


def local_sinks(sinks: Tensor, num_heads: int) -> Tensor:
    """This rank's attention sinks (gpt-oss ``s_aux``) as a plain ``[num_heads]`` tensor, checked.

    Under tensor parallelism the sinks are a DTensor sharded by head like the queries: its local shard holds them.
    """
    sinks = sinks.to_local() if hasattr(sinks, "to_local") else sinks
    if sinks.shape != (num_heads,):
        raise ValueError(
            f"Attention sinks hold one logit per query head: expected shape ({num_heads},), got {tuple(sinks.shape)}."
        )
    return sinks
