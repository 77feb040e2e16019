"""Tiny image-text models built from transformers' own config classes, and batches of generated images with tokens.

Qwen2.5-VL: a vision tower of 2 blocks of width 16 (patches of 2x2 pixels, merged 2x2 into one image token) and a
language model of 2 layers of width 32: an image of 8x8 pixels is 16 patches and 4 image tokens; images come in three
sizes. Gemma 3: a SigLIP tower of 2 layers of width 16 on 8x8 images (patches of 2x2), pooled to 4 image tokens by the
projector, and a Gemma 3 language model of 2 layers (one sliding-window, one global). Widths differ on purpose, so the
projector is the only module that maps one width to the other. Qwen3-VL-MoE: a tower like Qwen2.5-VL's (learned position
embeddings, one deepstack merger after its first block, whose features are added after the first decoder layer) and a
language model of 2 mixture-of-experts layers (4 experts, top 2); Qwen3-VL: the same with 4 dense layers and a tower
of 3 blocks, each followed by a deepstack merger, whose features are added after the first 3 decoder layers (in two
pipeline stages the second stage adds the third feature, which the first computes, and its last layer reads it; a
feature added after the last layer would reach only image tokens' logits, which no target reads). Qwen rows carry
``mm_token_type_ids`` (1 on image tokens), as their processors give them, so the model computes its 3-D multimodal RoPE
positions. Gemma 4: a tower of 2 layers of width 16 on images of 4x4 patches (given flattened, with their (x, y)
positions, as its processor gives them), pooled 2x2 to 4 image tokens, and a language model of 2 layers (one
sliding-window, one global; no per-layer inputs; ``gemma4_ple``: 8 per layer, which some layouts refuse: see
``refused_image_text_split``), whose global layer's heads
are 8 wide like the sliding one's (transformers' default ``global_head_dim`` is 512: with Gemma 4's unscaled attention,
q and k RMS-normed to 1, a random model's scores over 512 dimensions have a spread of ~23, a near one-hot softmax, and
its float32 gradients are accurate to ~1e-5 only, one process's too: its pre-clip norm (~14) is 4e-4 from the float64
one after 3 steps, so no layout could be held to 1e-5 against it; in float64 every layout matches one process to
3e-13 with either width). Qwen3.5: a tower like
Qwen3-VL's without deepstack mergers and a language model of one Gated DeltaNet (linear-attention) layer then one
full-attention layer.
Llama 4: a config only (its parts are found; its multimodal forward fails in transformers 5.24, so it is refused).
"""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForImageTextToText,
    Gemma3Config,
    Gemma4Config,
    Llama4Config,
    Qwen2_5_VLConfig,
    Qwen3_5Config,
    Qwen3VLConfig,
    Qwen3VLMoeConfig,
)

VOCAB = 96
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 92, 93, 94, 95
PATCH, MERGE = 2, 2
#: The language models' sizes (Gemma 3 needs its head_dim given; its sliding window is shorter than the rows).
_TEXT = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=VOCAB, max_position_embeddings=256, bos_token_id=0, eos_token_id=1, pad_token_id=2,
)  # fmt: skip


def tiny_vlm_config(family: str = "qwen2_5_vl") -> Qwen2_5_VLConfig | Gemma3Config | Qwen3VLConfig | Qwen3VLMoeConfig:
    """The tiny config of ``family`` (``qwen2_5_vl``, ``gemma3``, ``gemma4``, ``gemma4_ple``, ``qwen3_vl``,
    ``qwen3_vl_moe``, ``qwen3_5`` or ``llama4``)."""
    if family == "qwen3_5":
        return Qwen3_5Config(
            text_config=dict(
                _TEXT, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"],
                rope_parameters={  # every dimension of a head rotated (a checkpoint rotates a quarter of 256)
                    "rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True,
                    "partial_rotary_factor": 1.0,
                },
            ),
            vision_config=dict(
                depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=PATCH,
                spatial_merge_size=MERGE, temporal_patch_size=1, num_position_embeddings=16,
            ),
            image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
            vision_end_token_id=VISION_END, attn_implementation="sdpa",
        )  # fmt: skip
    if family in ("qwen3_vl", "qwen3_vl_moe"):
        moe = family == "qwen3_vl_moe"
        experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16) if moe else {}
        return (Qwen3VLMoeConfig if experts else Qwen3VLConfig)(
            text_config=dict(
                _TEXT, head_dim=8, **experts, **({} if moe else {"num_hidden_layers": 4}),
                rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True},
            ),
            vision_config=dict(
                depth=2 if moe else 3, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=1, num_position_embeddings=16,
                deepstack_visual_indexes=[0] if moe else [0, 1, 2],
            ),
            image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
            vision_end_token_id=VISION_END, attn_implementation="sdpa",
        )  # fmt: skip
    if family in ("gemma4", "gemma4_ple"):
        per_layer = 8 if family == "gemma4_ple" else 0
        return Gemma4Config(
            text_config=dict(
                _TEXT, head_dim=8, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                hidden_size_per_layer_input=per_layer, vocab_size_per_layer_input=VOCAB,
                global_head_dim=8,  # as narrow as the sliding layer's (module doc)
            ),
            vision_config=dict(
                hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                head_dim=8, patch_size=PATCH, pooling_kernel_size=2, position_embedding_size=16,
            ),
            image_token_id=IMAGE_TOKEN, boi_token_id=VISION_START, eoi_token_id=VISION_END, attn_implementation="sdpa",
        )  # fmt: skip
    if family == "llama4":  # its parts are found; its multimodal forward fails in transformers 5.24 (refused)
        return Llama4Config(
            text_config=dict(_TEXT, head_dim=8, intermediate_size_mlp=64, num_local_experts=4, attention_chunk_size=8),
            vision_config=dict(
                hidden_size=16, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=8,
                patch_size=PATCH, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32,
            ),
            image_token_index=IMAGE_TOKEN, boi_token_index=VISION_START, eoi_token_index=VISION_END,
            attn_implementation="sdpa",
        )  # fmt: skip
    if family == "gemma3":
        return Gemma3Config(
            text_config=dict(_TEXT, head_dim=8, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
            vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                               image_size=8, patch_size=PATCH),
            mm_tokens_per_image=4, image_token_index=IMAGE_TOKEN, boi_token_index=VISION_START,
            eoi_token_index=VISION_END, attn_implementation="sdpa",
        )  # fmt: skip
    return Qwen2_5_VLConfig(
        text_config=dict(_TEXT, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
        vision_config=dict(
            depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=PATCH,
            spatial_merge_size=MERGE, temporal_patch_size=1, window_size=8, fullatt_block_indexes=[1],
        ),
        image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, attn_implementation="sdpa",
    )  # fmt: skip


def tiny_vlm(family: str = "qwen2_5_vl", seed: int = 0) -> torch.nn.Module:
    """The tiny ``...ForConditionalGeneration`` of ``family`` with seeded random weights (no cache: training only)."""
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(tiny_vlm_config(family))
    model.config.use_cache = False
    if family == "gemma3":
        # transformers starts Gemma 3's projection at zero (a checkpoint's is trained): small random values, so the
        # images reach the language model and the projection's gradient is of the other weights' size.
        weight = model.model.multi_modal_projector.mm_input_projection_weight
        with torch.no_grad():
            weight.copy_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(seed + 1)) * 0.02)
    return model


#: Qwen2.5-VL's image sizes in patches (height, width), each a multiple of the merge size: 4, 6 and 6 image tokens.
GRIDS = ((4, 4), (4, 6), (6, 4))


def image_sample(seq: int, seed: int, family: str = "qwen2_5_vl") -> dict[str, torch.Tensor]:
    """One row: a generated image (random pixels) and its tokens inside random text, padded on the right (on the left
    for every fourth seed).

    Labels are ``-100`` on the vision tokens, on the first text tokens (the prompt) and on the padding; the row's
    length, where the image sits and (Qwen2.5-VL) its size depend on ``seed``.
    """
    gen = torch.Generator().manual_seed(seed)
    qwen = family.startswith("qwen")
    height, width = GRIDS[seed % len(GRIDS)] if qwen else (4, 4)
    image_tokens = height * width // MERGE**2
    if qwen:  # the processor's layout: one row of flattened pixels per patch
        image = {"pixel_values": torch.randn(height * width, 3 * PATCH * PATCH, generator=gen)}
        image["image_grid_thw"] = torch.tensor([1, height, width])
    elif family.startswith("gemma4"):  # its processor's layout: each image's patches flattened, with their positions
        image = {"pixel_values": torch.randn(1, height * width, 3 * PATCH * PATCH, generator=gen)}
        ys, xs = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
        image["image_position_ids"] = torch.stack([xs.flatten(), ys.flatten()], dim=-1)[None]
    else:
        image = {"pixel_values": torch.randn(1, 3, height * PATCH, width * PATCH, generator=gen)}
    ids = torch.randint(3, IMAGE_TOKEN, (seq,), generator=gen)
    start = 1 + seed % 3
    ids[start] = VISION_START
    ids[start + 1 : start + 1 + image_tokens] = IMAGE_TOKEN
    ids[start + 1 + image_tokens] = VISION_END
    length = seq - seed % 5
    mask = torch.ones(seq, dtype=torch.long)
    mask[length:] = 0
    ids[length:] = 2
    labels = ids.clone()
    labels[: start + 2 + image_tokens] = -100
    labels[length:] = -100
    sample = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if family == "gemma3":  # its image tokens attend to each other both ways
        sample["token_type_ids"] = (ids == IMAGE_TOKEN).long()
    elif family != "llama4":  # which tokens are an image's (Qwen: the 3-D positions of multimodal RoPE)
        sample["mm_token_type_ids"] = (ids == IMAGE_TOKEN).int()
    if seed % 4 == 3:  # padded on the left
        sample = {key: value.roll(seq - length) for key, value in sample.items()}
    return sample | image


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A batch as the models' processors give it: rows stacked, every image's pixels concatenated in row order."""
    stacked = ("input_ids", "attention_mask", "labels", "token_type_ids", "mm_token_type_ids", "image_grid_thw")
    batch = {key: torch.stack([s[key] for s in samples]) for key in stacked if key in samples[0]}
    for key in ("pixel_values", "image_position_ids"):
        if key in samples[0]:
            batch[key] = torch.cat([s[key] for s in samples])
    return batch
