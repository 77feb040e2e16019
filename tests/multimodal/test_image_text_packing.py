"""Packed image-text rows (``data.packing``) train exactly as their samples do unpacked, for tiny Qwen2.5-VL, Qwen3-VL
(4 dense layers, 3 deepstack features) and Qwen3-VL-MoE; Gemma 3 and unverified families are refused with the reason.

Six samples (0, 1 or 2 images of three sizes, different lengths; one trained from its first token) packed into rows of
at most 32 tokens by first fit: rows [0, 2, 4], [1], [3, 5], so the images sit in the rows in an order other than the
samples'. In fp32 the packed batch's loss and every gradient equal those of the samples in a right-padded batch (the
model computing its own positions from the attention mask); the same rows with plain text positions in place of the
3-D ones, or with text positions that do not restart, give another loss (3-D positions computed over the whole row
give the same loss: they shift each sample's positions by a constant, which rotary embeddings do not see within a
sample). The packed batch itself: positions restart per sample and match the model's own positions of the padded batch,
labels, pixels and grids in row order, every sample whole in one row.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_vlm import IMAGE_TOKEN, MERGE, PATCH, VISION_END, VISION_START, tiny_vlm, tiny_vlm_config

from lightning_plugins.data import DataError
from lightning_plugins.data.image_dataset import collate_image_text
from lightning_plugins.data.image_packing import (
    RopeIndex,
    image_packing_collator,
    image_packing_refusal,
    pack_image_text,
    prepare_model_for_image_packing,
)

PAD, MAX_SEQ_LEN, TOL = 2, 32, 1e-6
#: Per sample: its length and its images' sizes in patches (4, 6 or 6 image tokens each).
SPECS = (
    (14, [(4, 4)]),
    (24, [(4, 6), (6, 4)]),
    (9, [(4, 4)]),
    (13, [(6, 4)]),
    (6, []),
    (18, [(4, 4), (4, 4)]),
)
ROWS = [[0, 2, 4], [1], [3, 5]]


def _sample(seed: int, length: int, grids: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
    """One unpadded sample as Qwen's processors give it: images in the prompt, the rest trained (a sample without
    images is trained from its first token)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, IMAGE_TOKEN, (length,), generator=gen)
    start, pixels = 1 if grids else 0, []
    for height, width in grids:
        tokens = height * width // MERGE**2
        ids[start], ids[start + 1 + tokens] = VISION_START, VISION_END
        ids[start + 1 : start + 1 + tokens] = IMAGE_TOKEN
        start += tokens + 3  # the image, its two markers and one text token
        pixels.append(torch.randn(height * width, 3 * PATCH * PATCH, generator=gen))
    labels = ids.clone()
    labels[:start] = -100
    sample = {"input_ids": ids, "attention_mask": torch.ones(length, dtype=torch.long), "labels": labels,
              "mm_token_type_ids": (ids == IMAGE_TOKEN).int()}  # fmt: skip
    if grids:
        sample["pixel_values"] = torch.cat(pixels)
        sample["image_grid_thw"] = torch.tensor([[1, h, w] for h, w in grids])
    return sample


def _samples() -> list[dict[str, torch.Tensor]]:
    return [_sample(seed, length, grids) for seed, (length, grids) in enumerate(SPECS)]


@pytest.fixture(scope="module")
def samples() -> list[dict[str, torch.Tensor]]:
    return _samples()


def _loss_and_grads(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _packed(samples: list, family: str) -> dict[str, torch.Tensor]:
    return pack_image_text(samples, MAX_SEQ_LEN, PAD, RopeIndex(tiny_vlm_config(family)))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def test_packed_rows_train_as_their_samples(samples, family: str) -> None:
    model = tiny_vlm(family)
    prepare_model_for_image_packing(model)
    loss, grads = _loss_and_grads(model, collate_image_text(samples, PAD))
    packed = _packed(samples, family)
    assert packed["input_ids"].shape == (3, 31) and "attention_mask" not in packed
    packed_loss, packed_grads = _loss_and_grads(model, packed)
    assert abs(packed_loss - loss) <= TOL * abs(loss)
    assert grads.keys() == packed_grads.keys()
    deepstack = any("deepstack" in name for name in grads)
    assert any("visual" in name for name in grads) and deepstack == (family != "qwen2_5_vl")
    for name, grad in grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=0, atol=TOL * max(1.0, grad.abs().max().item()),
                                   msg=lambda m, name=name: f"{name}: {m}")  # fmt: skip
    # The test can fail: plain text positions in place of the 3-D ones, or text positions that do not restart
    # (attention then crosses the samples).
    positions = packed["position_ids"]
    flat = dict(packed, position_ids=positions[:1].expand(4, -1, -1))
    unbroken = dict(packed, position_ids=torch.arange(31).expand(4, 3, 31))
    assert _deviation(model, flat, loss, grads) > 100 * TOL
    assert _deviation(model, unbroken, loss, grads) > 100 * TOL
    # 3-D positions computed over the whole row differ from the per-sample ones by one constant per sample, which
    # rotary embeddings cannot see inside a sample's block of the mask: the same loss and gradients.
    rows, _ = model.model.get_rope_index(packed["input_ids"], packed["mm_token_type_ids"], packed["image_grid_thw"])
    assert not torch.equal(rows, positions[1:])
    assert _deviation(model, dict(packed, position_ids=torch.cat([positions[:1], rows])), loss, grads) <= TOL


def _deviation(model: torch.nn.Module, batch: dict, loss: torch.Tensor, grads: dict[str, torch.Tensor]) -> float:
    """The largest deviation of ``batch``'s loss and gradients from ``loss`` and ``grads``, each relative to its
    scale."""
    other_loss, other = _loss_and_grads(model, batch)
    scale = {name: max(1.0, grad.abs().max().item()) for name, grad in grads.items()}
    worst = max((other[name] - grad).abs().max().item() / scale[name] for name, grad in grads.items())
    return max(worst, abs(other_loss - loss).item() / abs(loss).item())


def test_the_packed_batch(samples) -> None:
    packed = _packed(samples, "qwen2_5_vl")
    padded = collate_image_text(samples, PAD)
    # The model's own positions of the padded batch (its get_rope_index over every row, padding masked).
    reference, _ = tiny_vlm("qwen2_5_vl").model.get_rope_index(
        padded["input_ids"], padded["mm_token_type_ids"], padded["image_grid_thw"],
        attention_mask=padded["attention_mask"],
    )  # fmt: skip
    positions, ids, labels = packed["position_ids"], packed["input_ids"], packed["labels"]
    for row, members in enumerate(ROWS):
        start = 0
        for i in members:
            n = samples[i]["input_ids"].shape[0]
            assert torch.equal(ids[row, start : start + n], samples[i]["input_ids"])  # whole, in one row
            assert torch.equal(positions[0, row, start : start + n], torch.arange(n))
            assert torch.equal(positions[1:, row, start : start + n], reference[:, i, :n])
            assert labels[row, start] == -100
            assert torch.equal(labels[row, start + 1 : start + n], samples[i]["labels"][1:])
            start += n
        tail = ids.shape[1] - start
        assert bool((ids[row, start:] == PAD).all()) and bool((labels[row, start:] == -100).all())
        assert torch.equal(positions[:, row, start:], torch.arange(tail).expand(4, tail))
    assert samples[4]["labels"][0] != -100  # trained from its first token unpacked; packed not from the row's previous
    order = [i for members in ROWS for i in members if "pixel_values" in samples[i]]
    assert order == [0, 2, 1, 3, 5]
    assert torch.equal(packed["pixel_values"], torch.cat([samples[i]["pixel_values"] for i in order]))
    assert torch.equal(packed["image_grid_thw"], torch.cat([samples[i]["image_grid_thw"] for i in order]))
    assert torch.equal(packed["mm_token_type_ids"], (ids == IMAGE_TOKEN).int())


def test_what_cannot_be_packed_is_refused(samples) -> None:
    with pytest.raises(DataError, match=r"data.packing: Gemma 3's image tokens attend to each other both ways"):
        image_packing_collator(None, tiny_vlm_config("gemma3"), MAX_SEQ_LEN)
    assert "llava" in image_packing_refusal("llava") and "not packed on trust" in image_packing_refusal("llava")
    assert "context parallelism" in image_packing_refusal("qwen2_5_vl", cp_size=2)
    assert "pipeline" in image_packing_refusal("qwen3_vl_moe", pp_size=2)
    assert image_packing_refusal("qwen3_vl") is None
    with pytest.raises(ValueError, match="sample 1 has 24 tokens, more than max_seq_len=20"):
        pack_image_text(samples, 20, PAD, RopeIndex(tiny_vlm_config("qwen2_5_vl")))
    padded = dict(samples[0], attention_mask=torch.ones(14, dtype=torch.long).index_fill(0, torch.tensor([13]), 0))
    with pytest.raises(ValueError, match="must be unpadded"):
        pack_image_text([padded], MAX_SEQ_LEN, PAD, RopeIndex(tiny_vlm_config("qwen2_5_vl")))


def test_recipes_pack_qwen_and_refuse_the_rest(tmp_path) -> None:
    from types import SimpleNamespace

    from lightning_plugins.errors import RecipeError
    from lightning_plugins.recipe.build import check_global_batch
    from lightning_plugins.recipe.image_text import image_text_collate
    from lightning_plugins.recipe.schema import load_recipe

    tiny = Path(__file__).resolve().parents[2] / "recipes" / "tiny" / "vlm_fsdp2.yaml"
    tiny_vlm_config("qwen2_5_vl").save_pretrained(tmp_path)
    packed = [f"model.path={tmp_path}", "data.packing=true"]
    recipe = load_recipe(tiny, packed)
    processor = SimpleNamespace(tokenizer=SimpleNamespace(pad_token_id=PAD))
    collate = image_text_collate(recipe, processor)
    expected = pack_image_text(_samples(), recipe.data.max_seq_len, PAD, RopeIndex(tiny_vlm_config("qwen2_5_vl")))
    torch.testing.assert_close(collate(_samples()), expected, rtol=0, atol=0)
    with pytest.raises(DataError, match=r"holds 3 training samples after tokenization, fewer than one global batch"):
        check_global_batch(recipe, 3)  # image-text samples pack per drawn batch: the dataset counts samples
    for overrides, why in (
        (["layout.cp_size=2", "layout.dp_shard_size=1"], "not split by context parallelism yet"),
        (["layout.pp_size=2", "layout.dp_shard_size=1"], "a pipeline's micro-batches need fixed shapes"),
        (["model.attn_implementation=flash_attention_2"], "carry no sample lengths for flash_attention_2"),
    ):
        with pytest.raises(RecipeError, match=f"vlm_fsdp2.yaml: data.packing: .*{why}"):
            load_recipe(tiny, [*packed, *overrides])
