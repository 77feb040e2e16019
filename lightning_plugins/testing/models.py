"""Tiny model configs for the benchmarks and the tests (a real family's code at a size a CPU trains in seconds)."""

from __future__ import annotations

from typing import Any


def tiny_llama(
    hidden: int, layers: int, heads: int, kv_heads: int, vocab: int, seq: int, intermediate: int, **extra: Any
) -> Any:
    """A Llama config of the given size with SDPA attention (``extra``: other ``LlamaConfig`` fields)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=seq, attn_implementation="sdpa",
        **extra,
    )  # fmt: skip
