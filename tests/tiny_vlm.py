"""A tiny Qwen2.5-VL built from transformers' own config classes, and batches of generated images with their tokens.

The vision tower is 2 blocks of width 16 (patches of 2x2 pixels, merged 2x2 into one image token), the language
model 2 layers of width 32: an image of 8x8 pixels is 16 patches and 4 image tokens. Widths differ on purpose, so
the projector (merger) is the only module that maps one width to the other.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig

VOCAB = 96
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 92, 93, 94, 95
PATCH, MERGE = 2, 2


def tiny_vlm_config() -> Qwen2_5_VLConfig:
    """Qwen2.5-VL with a 2-block vision tower and a 2-layer language model (multimodal RoPE sections of 8 dims)."""
    return Qwen2_5_VLConfig(
        text_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB, max_position_embeddings=256, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
            bos_token_id=0, eos_token_id=1, pad_token_id=2,
        ),
        vision_config=dict(
            depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=PATCH,
            spatial_merge_size=MERGE, temporal_patch_size=1, window_size=8, fullatt_block_indexes=[1],
        ),
        image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, attn_implementation="sdpa",
    )  # fmt: skip


def tiny_vlm(seed: int = 0) -> torch.nn.Module:
    """The tiny Qwen2_5_VLForConditionalGeneration with seeded random weights (no cache: training only)."""
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(tiny_vlm_config())
    model.config.use_cache = False
    return model


#: Image sizes in patches (height, width), each a multiple of the merge size: 4, 6 and 6 image tokens.
GRIDS = ((4, 4), (4, 6), (6, 4))


def image_sample(seq: int, seed: int) -> dict[str, torch.Tensor]:
    """One row: a generated image (random pixels, as patches) and its tokens inside random text, padded on the right.

    Labels are ``-100`` on the vision tokens, on the first text tokens (the prompt) and on the padding; the row's
    length, its image's size and where the image sits depend on ``seed``.
    """
    gen = torch.Generator().manual_seed(seed)
    height, width = GRIDS[seed % len(GRIDS)]
    image_tokens = height * width // MERGE**2
    pixels = torch.randn(height * width, 3 * PATCH * PATCH, generator=gen)
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
    grid = torch.tensor([1, height, width])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "pixel_values": pixels, "image_grid_thw": grid}


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A batch as Qwen2.5-VL's processor gives it: rows stacked, every image's patches concatenated in row order."""
    batch = {key: torch.stack([s[key] for s in samples]) for key in ("input_ids", "attention_mask", "labels")}
    batch["pixel_values"] = torch.cat([s["pixel_values"] for s in samples])
    batch["image_grid_thw"] = torch.stack([s["image_grid_thw"] for s in samples])
    return batch
