"""The parts of an image-text model found by structure, LoRA's default targets on it, and the layouts refused for it.

No process group: the parts and the refusals are read from the model (refusals come before any collective).
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model
from tiny_vlm import collate, image_sample, tiny_vlm, tiny_vlm_config
from torch import nn
from transformers import AutoModelForImageTextToText, Gemma3Config, Qwen3VLMoeConfig

from lightning_plugins import LayoutError, OptionsError, ParallelLayout, ParallelOptions
from lightning_plugins.adapters.lora import LoraOptions, apply_lora, lora_layers
from lightning_plugins.parallel.api import check_parallelizable
from lightning_plugins.parallel.context import shard_batch_for_context_parallel
from lightning_plugins.parallel.families import decoder_layers, family_for
from lightning_plugins.parallel.image_text import image_text_parts

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def _on_meta(config) -> nn.Module:
    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(config)


def test_qwen2_5_vl_parts_and_its_language_model_layers() -> None:
    model = tiny_vlm()
    parts = image_text_parts(model)
    assert (parts.vision_path, parts.blocks_path) == ("model.visual", "model.visual.blocks")
    assert (parts.projector_paths, parts.language_path) == (("model.visual.merger",), "model.language_model")
    units = [type(m).__name__ for m in parts.vision_units(model)]
    assert units == ["Qwen2_5_VLVisionBlock"] * 2 + ["Qwen2_5_VLPatchMerger"]
    # The decoder layers are the language model's, not the vision blocks (which transformers also lists as
    # _no_split_modules); its final norm is found too.
    family = family_for(model, tensor_parallel=False)
    assert decoder_layers(model, family) is model.model.language_model.layers
    assert family.final_norm == "model.language_model.norm"
    assert image_text_parts(tiny_model("llama")) is None


def test_parts_of_other_families_are_found_by_the_same_rules() -> None:
    gemma3 = image_text_parts(_on_meta(Gemma3Config()))
    assert gemma3.projector_paths == ("model.multi_modal_projector",)
    assert gemma3.blocks_path == "model.vision_tower.encoder.layers"
    config = Qwen3VLMoeConfig()
    config.vision_config.out_hidden_size = config.text_config.hidden_size  # the released checkpoints' widths agree
    qwen3_vl = image_text_parts(_on_meta(config))
    assert qwen3_vl.projector_paths[:2] == ("model.visual.merger", "model.visual.deepstack_merger_list.0")
    # Qwen3.5: a Qwen3-VL tower without deepstack mergers, a language model with Gated DeltaNet layers.
    qwen3_5 = image_text_parts(_on_meta(tiny_vlm_config("qwen3_5")))
    assert (qwen3_5.vision_path, qwen3_5.blocks_path) == ("model.visual", "model.visual.blocks")
    assert (qwen3_5.projector_paths, qwen3_5.language_path) == (("model.visual.merger",), "model.language_model")


def test_gemma4_and_llama4_parts_are_found_by_the_same_rules() -> None:
    gemma4 = image_text_parts(_on_meta(tiny_vlm_config("gemma4")))
    assert (gemma4.vision_path, gemma4.blocks_path) == ("model.vision_tower", "model.vision_tower.encoder.layers")
    assert (gemma4.projector_paths, gemma4.language_path) == (("model.embed_vision",), "model.language_model")
    llama4 = image_text_parts(_on_meta(tiny_vlm_config("llama4")))  # towers at the top, next to their projector
    assert (llama4.vision_path, llama4.blocks_path) == ("vision_model", "vision_model.model.layers")
    assert (llama4.projector_paths, llama4.language_path) == (("multi_modal_projector",), "language_model")


def test_families_that_cannot_run_are_refused_before_any_collective() -> None:
    """Llama 4's multimodal forward fails in this transformers (so the refusal's reason holds: this test fails once it
    runs): refused under every layout. Gemma 4 passes the checks (the parity test trains it under TP, FSDP2 and CP), but
    for pipeline stages, which do not carry the multimodal forward's inputs to its language model (its
    per_layer_inputs); with per-layer inputs it runs under FSDP2 (the parity test) and is refused under TP (its forward
    reads a row of the vocab-sharded embedding weight outside any forward) and CP (it computes the per-layer inputs
    from whole rows)."""
    llama4 = tiny_vlm("llama4")
    batch = collate([image_sample(20, seed, "llama4") for seed in range(2)])
    with pytest.raises(AttributeError, match="image_outputs"):
        llama4(**batch)
    for layout in (ParallelLayout(dp_shard_size=2), ParallelLayout(tp_size=2), ParallelLayout(pp_size=2)):
        with pytest.raises(LayoutError, match=r"Llama 4 \(model type 'llama4'\) cannot run: .* `image_outputs`"):
            check_parallelizable(llama4, layout.resolve(2))
    config = tiny_vlm_config("gemma4")
    for sizes in ({"dp_shard_size": 2}, {"tp_size": 2}, {"cp_size": 2}):
        check_parallelizable(_on_meta(config), ParallelLayout(**sizes).resolve(2))
    # Why refused: the stages do not carry the language model's per_layer_inputs (None without per-layer inputs).
    with pytest.raises(LayoutError, match=r"\(Gemma4TextModel\) takes \['logits_to_keep', 'per_layer_inputs'\]"):
        check_parallelizable(_on_meta(config), ParallelLayout(pp_size=2).resolve(2))
    per_layer = tiny_vlm_config("gemma4_ple")
    check_parallelizable(_on_meta(per_layer), ParallelLayout(dp_shard_size=2).resolve(2))
    # Why refused: the reasons the docstring gives, each named with the size that splits the model.
    for name, reason in (("tp_size", "tensor parallelism holds vocab-sharded"), ("cp_size", "its shard of each row")):
        refused = rf"Gemma 4 with per-layer inputs .*_input=8\) is not supported with {name}=2: .*{reason}"
        with pytest.raises(LayoutError, match=refused):
            check_parallelizable(_on_meta(per_layer), ParallelLayout(**{name: 2}).resolve(2))


def test_lora_defaults_to_the_language_model() -> None:
    model = tiny_vlm()
    # The vision tower holds linears of the same names (its MLP's gate/up/down_proj): they are not adapted.
    assert any(name.endswith("mlp.gate_proj") for name, _ in model.model.visual.named_modules())
    adapted = [name for name, _ in lora_layers(apply_lora(model, LoraOptions(r=4)))]
    assert len(adapted) == 7 * 2 and all(".language_model.layers." in name for name in adapted), adapted


def test_missing_part_is_named() -> None:
    model = tiny_vlm()
    del model.model.visual.merger
    with pytest.raises(LayoutError, match="Qwen2_5_VLForConditionalGeneration is an image-text model .* projector"):
        image_text_parts(model)


def test_pipeline_parallelism_is_refused_where_stages_cannot_carry_the_images() -> None:
    """Pipeline stages run Qwen2.5-VL, Gemma 3 and Qwen3-VL with its deepstack features (the parity test); refused: a
    language model that takes other inputs from the multimodal forward, deepstack features that its config does not
    count; with context parallelism, a model whose image tokens attend each other both ways, as without stages."""
    for family in ("qwen2_5_vl", "gemma3", "qwen3_vl", "qwen3_vl_moe"):
        check_parallelizable(tiny_vlm(family), ParallelLayout(pp_size=2).resolve(2))
    uncounted = tiny_vlm("qwen3_vl")
    # How many features there are (what a boundary carries) unknown: a config that does not say (validation bypassed).
    object.__setattr__(uncounted.config.vision_config, "deepstack_visual_indexes", None)
    with pytest.raises(LayoutError, match=r"pp_size=2: the language model .* \['deepstack_visual_embeds', 'visual_pos"):
        check_parallelizable(uncounted, ParallelLayout(pp_size=2).resolve(2))
    other = tiny_vlm("qwen3_vl")
    language = other.model.language_model
    language.forward = lambda inputs_embeds=None, deepstack_visual_embeds=None, visual_pos_masks=None, audio=None: None
    with pytest.raises(LayoutError, match=r"pp_size=2: the language model .* takes \['audio'\] from the multimodal"):
        check_parallelizable(other, ParallelLayout(pp_size=2).resolve(2))
    # Whether the head is tied is the whole config's (Qwen2.5-VL's text config does not say): a V-shaped schedule,
    # which would hold a tied weight in two FSDP2 stage modules of one rank, is refused for a tied one.
    config = tiny_vlm_config()
    config.tie_word_embeddings = True
    config.text_config.num_hidden_layers, config.text_config.layer_types = 4, ["full_attention"] * 4  # 2 stages a rank
    tied = AutoModelForImageTextToText.from_config(config)
    with pytest.raises(OptionsError, match="pp_schedule='zbv_zero_bubble' puts the first and the last stage on one"):
        check_parallelizable(tied, ParallelLayout(pp_size=2, dp_shard_size=2).resolve(4),
                             ParallelOptions(pp_schedule="zbv_zero_bubble"))  # fmt: skip
    # Stages compose with tensor and context parallelism (the parity test); Gemma 3's two-way image-token attention is
    # refused under context parallelism with stages as without.
    for sizes in ({"tp_size": 2}, {"cp_size": 2}):
        check_parallelizable(tiny_vlm(), ParallelLayout(pp_size=2, **sizes).resolve(4))
    with pytest.raises(LayoutError, match="Gemma3ForConditionalGeneration: its image tokens attend each other both"):
        check_parallelizable(tiny_vlm("gemma3"), ParallelLayout(pp_size=2, cp_size=2).resolve(4))


def test_context_parallelism_is_refused_where_image_tokens_attend_both_ways() -> None:
    check_parallelizable(tiny_vlm(), ParallelLayout(cp_size=2).resolve(2))
    with pytest.raises(LayoutError, match="Gemma3ForConditionalGeneration: its image tokens attend each other both"):
        check_parallelizable(tiny_vlm("gemma3"), ParallelLayout(cp_size=2).resolve(2))
    # Ulysses splits the language model's heads (4 here), whatever the vision tower's.
    with pytest.raises(LayoutError, match="Ulysses context parallelism splits each rank's 4 attention heads"):
        check_parallelizable(tiny_vlm(), ParallelLayout(cp_size=8).resolve(8))


def test_an_image_text_batch_keeps_its_tokens_whole_and_shards_its_targets() -> None:
    """Under context parallelism the model places the images into the whole row and shards it (see the parity
    test); the batch keeps the per-token inputs whole (left padding rolled to the end, padded to 2 * cp) and shards the
    targets as a text batch's."""
    samples = [image_sample(18, seed) for seed in (3, 4)]  # seed 3: left padding
    batch = collate(samples)
    sharded = shard_batch_for_context_parallel(batch, 1, 2, pad_to_multiple_of=8)
    text = shard_batch_for_context_parallel(
        {key: batch[key] for key in ("input_ids", "attention_mask", "labels")}, 1, 2, pad_to_multiple_of=8
    )
    assert torch.equal(sharded["shift_labels"], text["shift_labels"]) and torch.equal(sharded["labels"], text["labels"])
    assert (
        sharded["input_ids"].shape == sharded["mm_token_type_ids"].shape == sharded["attention_mask"].shape == (2, 24)
    )
    keep = batch["attention_mask"].bool()
    for key in ("input_ids", "mm_token_type_ids", "attention_mask"):
        for row in range(2):  # real tokens first, in order
            assert torch.equal(sharded[key][row, : int(keep[row].sum())], batch[key][row][keep[row]]), key
    assert sharded["pixel_values"] is batch["pixel_values"] and sharded["image_grid_thw"] is batch["image_grid_thw"]
    # A batch without images is a text batch (its token types, all text, are not read by the model without images).
    text_only = {key: value for key, value in batch.items() if key not in ("pixel_values", "image_grid_thw")}
    sharded = shard_batch_for_context_parallel(text_only, 1, 2, pad_to_multiple_of=8)
    assert set(sharded) == set(text) and all(torch.equal(sharded[key], text[key]) for key in text)
    for key, why in (("position_ids", "packed image-text rows"), ("token_type_ids", "attend each other both ways")):
        with pytest.raises(ValueError, match=f"cannot hold `{key}`: .*{why}"):
            shard_batch_for_context_parallel(batch | {key: batch["input_ids"]}, 0, 2)


def test_tensor_parallelism_is_checked_against_the_language_model() -> None:
    check_parallelizable(tiny_vlm(), ParallelLayout(tp_size=2).resolve(2))  # 4 heads, 2 kv heads: splits in 2
    with pytest.raises(LayoutError, match="tp_size"):
        check_parallelizable(tiny_vlm(), ParallelLayout(tp_size=4).resolve(4))  # 2 kv heads do not split in 4


def test_expert_parallelism_is_checked_against_the_language_model() -> None:
    config = tiny_vlm_config("qwen3_vl_moe")
    check_parallelizable(_on_meta(config), ParallelLayout(ep_size=2).resolve(2))  # 4 experts split over 2 ranks
    with pytest.raises(LayoutError, match="ep_size"):
        check_parallelizable(_on_meta(config), ParallelLayout(ep_size=8).resolve(8))
