"""The real models' config.json files shipped under recipes/configs: they load, build, count and lay out.

Offline and fast: configs are read from the repository, models are built on the meta device (no memory, no
weights), so even Llama-3.1-405B takes well under a second.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_plugins import LayoutError, ParallelLayout

CONFIGS = Path(__file__).resolve().parents[2] / "recipes" / "configs"

# name: (architecture, published parameter count, exact count Hugging Face reports for the checkpoint's
# safetensors, i.e. the weights actually shipped). The published counts are the model cards' / hub's rounded
# figures; see recipes/configs/README.md for where each comes from.
MODELS = {
    "Llama-3.1-8B": ("LlamaForCausalLM", 8.03e9, 8_030_261_248),
    "Llama-3.1-70B": ("LlamaForCausalLM", 70.6e9, 70_553_706_496),
    "Llama-3.1-405B": ("LlamaForCausalLM", 405.9e9, 405_853_388_800),
    "Mistral-7B-v0.3": ("MistralForCausalLM", 7.25e9, 7_248_023_552),
    "Qwen2.5-7B": ("Qwen2ForCausalLM", 7.62e9, 7_615_616_512),
    "Qwen2.5-14B": ("Qwen2ForCausalLM", 14.8e9, 14_770_033_664),
    "Qwen2.5-32B": ("Qwen2ForCausalLM", 32.8e9, 32_763_876_352),
    "Qwen2.5-72B": ("Qwen2ForCausalLM", 72.7e9, 72_706_203_648),
    "Qwen3-32B": ("Qwen3ForCausalLM", 32.8e9, 32_762_123_264),
    "Qwen3-30B-A3B": ("Qwen3MoeForCausalLM", 30.5e9, 30_532_122_624),
    "Qwen3-235B-A22B": ("Qwen3MoeForCausalLM", 235e9, 235_093_634_560),
    "Mixtral-8x22B-v0.1": ("MixtralForCausalLM", 141e9, 140_620_634_112),
    # The hub's safetensors hold the experts in MXFP4 (packed blocks and scales): the count here is the model
    # transformers builds (bf16 experts), the 116.83B of OpenAI's model card.
    "gpt-oss-120b": ("GptOssForCausalLM", 116.83e9, 116_829_156_672),
    # 14.7B on the hub; exact = embedding + untied lm_head (2 x 100352 x 5120) + 40 x (qkv_proj 7680 x 5120,
    # o_proj, gate_up_proj 35840 x 5120, down_proj, 2 norms) + the final norm, counted by hand from the shape.
    "phi-4": ("Phi3ForCausalLM", 14.7e9, 14_659_507_200),
    # The 2026 families (issue 47). Exact: what transformers builds from the config, which leaves out the multi-token
    # prediction layer the hub's files also hold (DeepSeek-V3's 685B on the hub = 671B + 14B MTP) and counts
    # gpt-oss-20b's experts dense (the hub holds them in MXFP4).
    "DeepSeek-V3": ("DeepseekV3ForCausalLM", 671e9, 671_026_404_352),
    "GLM-4.5-Air": ("Glm4MoeForCausalLM", 106.9e9, 106_852_245_504),  # the card's "106B", rounded down
    "gpt-oss-20b": ("GptOssForCausalLM", 20.9e9, 20_914_757_184),
}

# Multimodal checkpoints whose text decoder the recipes train: (architecture of the checkpoint, of the decoder,
# exact count of the whole checkpoint, of the decoder alone). Gemma 3 27B: 27.4B on the hub (the vision tower and
# projector are 423M of it); the decoder ties its embedding to lm_head (262208 x 5376 counted once).
MULTIMODAL = {
    "gemma-3-27b-pt": ("Gemma3ForConditionalGeneration", "Gemma3ForCausalLM", 27_432_406_640, 27_009_346_304),
    # Qwen3.5 (dense and MoE) ships image-text checkpoints only; "27B" and "35B" count the vision tower (0.46B).
    "Qwen3.5-27B": ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM", 27_356_728_560, 26_895_998_464),
    "Qwen3.5-35B-A3B": ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM", 35_107_181_936, 34_660_610_688),
    # The image-text recipes' checkpoints (issue 50): the hub's 8.29B, 31.1B and 27.4B. Qwen2.5-VL's and Qwen3-VL's
    # language models have no causal-LM class in transformers (None): the text count is the planner's (the language
    # model and its untied head), equal to Qwen2.5-7B's and Qwen3-30B-A3B's.
    "Qwen2.5-VL-7B-Instruct": ("Qwen2_5_VLForConditionalGeneration", None, 8_292_166_656, 7_615_616_512),
    "Qwen3-VL-30B-A3B-Instruct": ("Qwen3VLMoeForConditionalGeneration", None, 31_070_754_032, 30_532_122_624),
    "gemma-3-27b-it": ("Gemma3ForConditionalGeneration", "Gemma3ForCausalLM", 27_432_406_640, 27_009_346_304),
}

# The largest tensor parallelism of a multimodal checkpoint's decoder when it is below 8: Qwen3.5-27B has 4 kv heads,
# Qwen3.5-35B-A3B 2 (their linear-attention heads, 16 key and 48 / 32 value heads, would split 8 ways).
MULTIMODAL_TP = {"Qwen3.5-27B": 4, "Qwen3.5-35B-A3B": 2, "Qwen2.5-VL-7B-Instruct": 4, "Qwen3-VL-30B-A3B-Instruct": 4}

# Mixture-of-experts models: (routed experts, experts per token, published active parameters, whether the
# published figure counts the input embedding). OpenAI's card counts gpt-oss's active parameters without the
# embedding table (5.13B); Qwen's and Mistral's figures are the whole forward path of one token.
MOE = {
    "Qwen3-30B-A3B": (128, 8, 3.3e9, True),
    "Qwen3-235B-A22B": (128, 8, 22e9, True),
    "Mixtral-8x22B-v0.1": (8, 2, 39e9, True),
    "gpt-oss-120b": (128, 4, 5.1e9, False),
    "gpt-oss-20b": (32, 4, 3.6e9, False),
    "DeepSeek-V3": (256, 8, 37e9, True),
}

# Models whose sizes do not allow tensor parallelism over 8 ranks, the size that forbids it and the tp sizes the
# error offers instead. Qwen2.5-7B has 28 attention heads and 4 kv heads: TP=8 would split heads; 4 (or 2, 1) is
# its maximum. Qwen3's MoE models have 4 kv heads: TP <= 4. Phi-4 has 40 heads but 10 kv heads: TP <= 2.
NOT_TP8 = {
    "Qwen2.5-7B": ("num_attention_heads=28", "[1, 2, 4]"),
    "Qwen3-30B-A3B": ("num_key_value_heads=4", "[1, 2, 4]"),
    "Qwen3-235B-A22B": ("num_key_value_heads=4", "[1, 2, 4]"),
    "phi-4": ("num_key_value_heads=10", "[1, 2]"),
}


def test_every_shipped_config_is_covered() -> None:
    shipped = {p.parent.name for p in CONFIGS.glob("*/config.json")}
    assert shipped == set(MODELS) | set(MULTIMODAL)
    readme = (CONFIGS / "README.md").read_text()
    for name in shipped:
        assert f"`{name}`" in readme, f"{name} missing from recipes/configs/README.md"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_config_loads_builds_and_has_published_size(name: str) -> None:
    architecture, published, exact = MODELS[name]
    directory = CONFIGS / name
    raw = json.loads((directory / "config.json").read_text())
    assert raw["architectures"] == [architecture]
    assert raw["tie_word_embeddings"] is False

    config = AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == architecture
    count = sum(p.numel() for p in model.parameters())
    assert abs(count - published) / published < 0.005, f"{name}: {count:,} parameters, published {published:,.0f}"
    assert count == exact, f"{name}: {count:,} parameters, the checkpoint holds {exact:,}"


@pytest.mark.parametrize("name", sorted(MULTIMODAL))
def test_multimodal_config_builds_its_text_decoder(name: str) -> None:
    """A multimodal checkpoint's config builds the whole model, and the planner's config is its text decoder:
    the causal LM a text fine-tune trains (which TP=8 splits, and whose count the planner reports)."""
    from lightning_plugins.planner.model_stats import load_model_config, model_stats

    architecture, decoder, whole, text = MULTIMODAL[name]
    config = AutoConfig.from_pretrained(CONFIGS / name)
    decoder_config = load_model_config(name)
    with torch.device("meta"):
        model = getattr(transformers, architecture)(config)  # Qwen3.5's AutoModelForCausalLM is the text model
        text_model = AutoModelForCausalLM.from_config(decoder_config) if decoder else None
    assert type(model).__name__ == architecture
    assert sum(p.numel() for p in model.parameters()) == whole
    assert model_stats(decoder_config).total_params == text
    if text_model is not None:
        assert type(text_model).__name__ == decoder
        assert sum(p.numel() for p in text_model.parameters()) == text
    else:  # the whole model's language model and head hold the text count
        head = model.get_output_embeddings()
        assert sum(p.numel() for p in model.get_decoder().parameters()) + head.weight.numel() == text
    tp = MULTIMODAL_TP.get(name, 8)
    layout = ParallelLayout(tp_size=tp, dp_shard_size=-1).resolve(64)
    layout.validate(decoder_config)
    if tp < 8:
        with pytest.raises(LayoutError, match="tp_size=8 does not divide num_(key_value|attention)_heads"):
            ParallelLayout(tp_size=8, dp_shard_size=-1).resolve(64).validate(decoder_config)


def test_gemma3_27b_keeps_its_attention_pattern() -> None:
    """Gemma 3 27B's decoder: 5 sliding (1024) layers to 1 global, query scale 168, linear RoPE x8 on global."""
    from lightning_plugins.planner.model_stats import load_model_config

    config = load_model_config("google/gemma-3-27b-pt")
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (5376, 21504, 62)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 16, 128)
    assert (config.query_pre_attn_scalar, config.sliding_window, config.vocab_size) == (168, 1024, 262208)
    assert config.layer_types.count("full_attention") == 10 and config.layer_types[5] == "full_attention"
    assert config.rope_parameters["full_attention"]["rope_type"] == "linear"
    assert config.rope_parameters["full_attention"]["factor"] == 8.0


@pytest.mark.parametrize("name", sorted(MOE))
def test_moe_config_has_published_active_size(name: str) -> None:
    """The planner's active parameters (what a token uses: top-k routed experts, router, attention, shared parts)
    match the published figures, and equal a count made on the meta-built model's own experts."""
    from lightning_plugins.parallel.moe.experts import expert_modules
    from lightning_plugins.planner.model_stats import model_stats

    experts, top_k, published, with_embedding = MOE[name]
    config = AutoConfig.from_pretrained(CONFIGS / name)
    stats = model_stats(config)
    assert (stats.num_experts, stats.experts_per_token) == (experts, top_k)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    routed = sum(p.numel() for _, module in expert_modules(model) for p in module.parameters())
    total = sum(p.numel() for p in model.parameters())
    assert stats.total_params == total
    assert stats.active_params == total - routed + routed * top_k // experts
    active = stats.active_params - (0 if with_embedding else stats.embedding_params)
    assert abs(active - published) / published < 0.02, f"{name}: {active:,} active parameters, published {published:,.0f}"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_tp8_layout_validates(name: str) -> None:
    config = AutoConfig.from_pretrained(CONFIGS / name)
    layout = ParallelLayout(tp_size=8, dp_shard_size=-1).resolve(64)
    if name in NOT_TP8:
        size, valid = NOT_TP8[name]
        with pytest.raises(LayoutError, match=rf"tp_size=8 does not divide {size}.*{re.escape(valid)}"):
            layout.validate(config)
    else:
        layout.validate(config)
        assert layout.dp_shard_size == 8


def test_llama31_keeps_its_rope_scaling() -> None:
    """Llama 3.1's long-context RoPE (llama3 type, factor 8 over 8192) survives loading."""
    for name in ("Llama-3.1-8B", "Llama-3.1-70B", "Llama-3.1-405B"):
        raw = json.loads((CONFIGS / name / "config.json").read_text())
        assert raw["rope_scaling"] == {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        }
        assert raw["rope_theta"] == 500000.0 and raw["max_position_embeddings"] == 131072
        config = AutoConfig.from_pretrained(CONFIGS / name)
        rope = getattr(config, "rope_parameters", None) or config.rope_scaling
        assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0


# Stacks that mix kinds of layer (issue 47): Qwen3.5's Gated DeltaNet linear attention in three layers of four,
# DeepSeek-V3's three dense layers before 58 MoE ones, GLM-4.5-Air's one. name: (kinds, layers of each kind).
MIXED = {
    "Qwen3.5-27B": (2, [48, 16]),
    "Qwen3.5-35B-A3B": (2, [30, 10]),
    "DeepSeek-V3": (2, [3, 58]),
    "GLM-4.5-Air": (2, [1, 45]),
}


@pytest.mark.parametrize("name", sorted(MIXED))
def test_mixed_layer_stacks_are_counted_layer_by_layer(name: str) -> None:
    """The planner counts every kind of layer of a mixed stack (one layer times the depth miscounts Qwen3.5-27B by
    176M and counts DeepSeek-V3 as dense): totals, routed experts, LoRA adapters on names only some layers have,
    and a linear-attention layer's attention work as a chunk's, not the whole row's."""
    from lightning_plugins.parallel.moe.experts import expert_modules
    from lightning_plugins.planner.model_stats import LINEAR_ATTENTION_CHUNK, load_model_config, model_stats

    kinds, counts = MIXED[name]
    config = load_model_config(name)
    stats = model_stats(config)
    assert (len(stats.layer_kinds), [k.count for k in stats.layer_kinds]) == (kinds, counts)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    routed = sum(p.numel() for _, module in expert_modules(model) for p in module.parameters())
    assert stats.total_params == sum(p.numel() for p in model.parameters())
    if routed:
        assert stats.active_params == stats.total_params - routed + routed * stats.experts_per_token // stats.num_experts
    targets = ("q_proj", "o_proj", "in_proj_qkv", "out_proj", "q_a_proj", "kv_b_proj")
    present = tuple(t for t in targets if any(n.endswith(f".{t}") for n, _ in model.named_modules()))
    adapters = sum(16 * (m.in_features + m.out_features) for n, m in model.named_modules() if n.rpartition(".")[2] in present)  # fmt: skip
    assert stats.lora_params_per_layer(present, 16) * stats.num_layers == pytest.approx(adapters)
    linear = [kind == "linear_attention" for kind in getattr(config, "layer_types", None) or []]
    if any(linear):
        seq = 4096
        full = (len(linear) - sum(linear)) * seq + sum(linear) * LINEAR_ATTENTION_CHUNK
        assert stats.attention_flops_per_token(seq) == 4.0 * stats.num_heads * stats.head_dim * full
