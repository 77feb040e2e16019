"""Tiny transformers configs of every supported family, built from configs (no downloads)."""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    Glm4Config,
    GemmaConfig,
    GptOssConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
)

_COMMON = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
    max_position_embeddings=64,
    attn_implementation="sdpa",
)

_QWEN3_5 = dict(
    {**_COMMON, "hidden_size": 64, "num_hidden_layers": 3},
    head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    layer_types=["linear_attention", "linear_attention", "full_attention"],
)

_QWEN3_5_4L = {
    **_QWEN3_5,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
}

CONFIGS = {
    "llama": lambda: LlamaConfig(**_COMMON),
    "llama_tied": lambda: LlamaConfig(**_COMMON, tie_word_embeddings=True),
    "mistral": lambda: MistralConfig(**_COMMON),
    "qwen2": lambda: Qwen2Config(**_COMMON),
    "qwen3": lambda: Qwen3Config(**_COMMON, head_dim=8),
    # Not a registered family: exercises the fallback to the config's `base_model_tp_plan`.
    "gemma": lambda: GemmaConfig(**_COMMON, head_dim=8),
    # Deeper variants for pipeline parallelism (up to 4 ranks x 2 interleaved stages).
    "llama_4l": lambda: LlamaConfig(**{**_COMMON, "num_hidden_layers": 4}),
    "llama_tied_4l": lambda: LlamaConfig(**{**_COMMON, "num_hidden_layers": 4}, tie_word_embeddings=True),
    "qwen3_4l": lambda: Qwen3Config(**{**_COMMON, "num_hidden_layers": 4}, head_dim=8),
    "llama_8l": lambda: LlamaConfig(**{**_COMMON, "num_hidden_layers": 8}),
    # Wide enough that every matrix holds >= 4096 values per rank under FSDP2=2 (torchao's 8-bit AdamW quantizes
    # only such tensors, in blocks of 256 that a dim-0 shard of these shapes keeps whole).
    "llama_8bit_state": lambda: LlamaConfig(**{**_COMMON, "hidden_size": 128, "intermediate_size": 256}),
    # Mixture of experts: 4 routed experts, top-2 (Qwen2-MoE adds a shared expert and a dense layer).
    "mixtral": lambda: MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2),
    # The router's load-balancing loss on (a large coefficient, so a wrong global reduction shows).
    "mixtral_aux": lambda: MixtralConfig(
        **_COMMON, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.5
    ),
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **_COMMON, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True
    ),
    "qwen2_moe": lambda: Qwen2MoeConfig(
        **_COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        mlp_only_layers=[1],
    ),
    # Attention sinks, alternating sliding windows, transposed experts with biases and a clamped SwiGLU.
    "gpt_oss": lambda: GptOssConfig(
        **{**_COMMON, "attn_implementation": "eager"}, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"],
    ),
    # Dense families beyond the registered four (issue 27), 4 layers for interleaved pipelines. Each sets the knobs
    # that make its forward differ from Llama's to values that bite on a tiny model: soft-capping well inside the
    # logits' range, sliding windows shorter than the test sequences, scalings far from 1.
    "mistral_sw": lambda: MistralConfig(**{**_COMMON, "num_hidden_layers": 4}, sliding_window=8),
    "gemma2": lambda: Gemma2Config(
        **{**_COMMON, "num_hidden_layers": 4, "attn_implementation": "eager"}, head_dim=8, sliding_window=8,
        attn_logit_softcapping=2.0, final_logit_softcapping=2.0, query_pre_attn_scalar=16,
    ),
    # Gemma 2 whose soft-caps bend without amplifying rounding: at init 0.1 the final logits reach ~2.4 (capped to ~1.7
    # by 2.0) and the attention scores ~1.2 (to ~0.8 by 1.0), as Gemma 2's 30 and 50 bend its own; one process's fp32
    # trajectory stays within 1e-6 of fp64's over 5 SGD steps at lr 1 (`gemma2` above: its scores, ~0.04, never
    # reach its caps, and its fp32 drifts 3e-6 from fp64).
    "gemma2_capped": lambda: Gemma2Config(
        **{**_COMMON, "num_hidden_layers": 4, "attn_implementation": "eager"}, head_dim=8, sliding_window=8,
        attn_logit_softcapping=1.0, final_logit_softcapping=2.0, query_pre_attn_scalar=16, initializer_range=0.1,
    ),
    "gemma3": lambda: Gemma3TextConfig(
        **{**_COMMON, "num_hidden_layers": 4}, head_dim=8, sliding_window=8, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
    "phi3": lambda: Phi3Config(**{**_COMMON, "num_hidden_layers": 4}, pad_token_id=0, eos_token_id=2, bos_token_id=1),
    # OLMo 2's q/k meet no norm before attention, then a norm over all heads: at the default 0.02 init they are so
    # small that fp32 rounding alone moves one process's own 5-step trajectory ~3e-4 from fp64's.
    "olmo2": lambda: Olmo2Config(
        **{**_COMMON, "num_hidden_layers": 4}, pad_token_id=1, eos_token_id=2, initializer_range=0.2
    ),
    "granite": lambda: GraniteConfig(
        **{**_COMMON, "num_hidden_layers": 4}, embedding_multiplier=3.0, residual_multiplier=0.5,
        attention_multiplier=0.4, logits_scaling=0.25,
    ),
    # GLM-4: norms after attention and after the MLP too (four per layer), a fused gate_up_proj, q/k/v biases and
    # rotary embeddings on half of each head.
    "glm4": lambda: Glm4Config(**{**_COMMON, "num_hidden_layers": 4}, head_dim=8, pad_token_id=0, eos_token_id=2),
    "gpt_oss_4l": lambda: GptOssConfig(
        **{**_COMMON, "num_hidden_layers": 4, "attn_implementation": "eager"}, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
    ),
    # Qwen3.5: Gated DeltaNet linear attention (fused q/k/v, grouped value heads: 2 key heads serve 4 value heads, a
    # depthwise causal conv, per-head decays, a gated norm) in two of three layers, gated softmax attention in the last.
    "qwen3_5": lambda: Qwen3_5TextConfig(**_QWEN3_5),
    "qwen3_5_moe": lambda: Qwen3_5MoeTextConfig(
        **_QWEN3_5, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
    ),
    # Qwen3-Next: the same layers, its Gated DeltaNet's q/k/v/z and b/a fused per key head; experts in every layer.
    "qwen3_next": lambda: Qwen3NextConfig(
        **_QWEN3_5, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
    ),
    # Four key heads serving eight value heads: Ulysses splits them over cp under tp=2 (cp x tp x linear attention).
    "qwen3_5_h4": lambda: Qwen3_5TextConfig(**{**_QWEN3_5, "linear_num_key_heads": 4, "linear_num_value_heads": 8}),
    # Four layers, Qwen3.5's own pattern (three linear-attention layers, then a full-attention one), for pipeline
    # stages: 2 stages hold [lin, lin] and [lin, full], 4 hold one layer each (three of them linear attention only).
    "qwen3_5_4l": lambda: Qwen3_5TextConfig(**_QWEN3_5_4L),
    "qwen3_5_moe_4l": lambda: Qwen3_5MoeTextConfig(
        **_QWEN3_5_4L, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
    ),
    "qwen3_next_4l": lambda: Qwen3NextConfig(
        **_QWEN3_5_4L, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
    ),
    "mixtral_4l": lambda: MixtralConfig(**{**_COMMON, "num_hidden_layers": 4}, num_local_experts=4, num_experts_per_tok=2),
}


def tiny_model(name: str, seed: int = 0) -> torch.nn.Module:
    """A freshly initialised tiny causal LM of family ``name`` (same weights for the same seed)."""
    torch.manual_seed(seed)
    config = CONFIGS[name]()
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def make_batch(batch: int, seq: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """Random tokens with right padding and ``-100`` labels on padding and on some prompt tokens.

    Rows get different lengths, so data-parallel ranks hold different numbers of valid tokens.
    """
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    labels = input_ids.clone()
    for row in range(batch):
        length = seq - (row * 3) % (seq // 2)
        attention_mask[row, length:] = 0
        labels[row, length:] = -100
        labels[row, : 1 + row % 3] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
