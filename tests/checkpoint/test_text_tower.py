"""A multimodal Gemma 3 checkpoint trains as its text decoder: the loader reads the language model's tensors (in
either spelling transformers writes) into a ``Gemma3ForCausalLM`` built from the ``text_config``, skips the vision
tower, and gives the logits of the multimodal model's text-only forward; the recipe's model is that decoder.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Gemma3Config, Gemma3ForConditionalGeneration

from lightning_plugins.checkpoint.load import checkpoint_index, load_sharded_safetensors
from lightning_plugins.checkpoint.text_tower import is_multimodal, text_config
from lightning_plugins.planner.model_stats import load_model_config
from lightning_plugins.recipe.build import build_model
from lightning_plugins.recipe.schema import load_recipe

ROOT = Path(__file__).resolve().parents[2]

#: Gemma 3's knobs at tiny size: sliding windows shorter than the sequence, q/k norms, a query scale not head_dim.
TEXT = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, sliding_window=4, query_pre_attn_scalar=16,
    layer_types=["sliding_attention", "full_attention"],
)
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)


@pytest.fixture(scope="module")
def multimodal() -> Gemma3ForConditionalGeneration:
    torch.manual_seed(0)
    config = Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # norms away from their zero init, so that a norm read from the wrong tensor shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("original_format", [True, False], ids=["hub_names", "transformers_names"])
def test_text_decoder_loads_from_a_multimodal_checkpoint(
    multimodal: Gemma3ForConditionalGeneration, tmp_path: Path, original_format: bool
) -> None:
    multimodal.save_pretrained(tmp_path, save_original_format=original_format)
    index = checkpoint_index(tmp_path)
    prefix = "language_model.model." if original_format else "model.language_model."
    assert f"{prefix}embed_tokens.weight" in index and any("vision_tower" in name for name in index)

    config = AutoConfig.from_pretrained(tmp_path)
    assert is_multimodal(config) and not is_multimodal(text_config(config))
    assert type(load_model_config(tmp_path)).__name__ == "Gemma3TextConfig"  # the planner sizes the decoder
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(text_config(config), dtype=torch.float32)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning of ours
        load_sharded_safetensors(model, tmp_path)
    decoder = multimodal.model.language_model.state_dict()
    for name, tensor in model.model.state_dict().items():
        assert torch.equal(tensor, decoder[name]), name
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as in the checkpoint

    input_ids = torch.randint(0, TEXT["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = multimodal(input_ids=input_ids).logits
        got = model.eval()(input_ids=input_ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_recipe_model_is_the_text_decoder(multimodal: Gemma3ForConditionalGeneration, tmp_path: Path) -> None:
    """The recipe builds the decoder on the meta device, for a full fine-tune and under LoRA adapters alike; its
    loader then reads the decoder's tensors of the multimodal checkpoint."""
    multimodal.save_pretrained(tmp_path)
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(ROOT / "recipes" / "tiny" / "model" / file, tmp_path / file)
    overrides = [f"model.path={tmp_path}", "model.attn_implementation=eager"]
    full, _ = build_model(load_recipe(ROOT / "recipes" / "tiny" / "full_tp2.yaml", overrides))
    assert type(full).__name__ == "Gemma3ForCausalLM" and full.model.embed_tokens.weight.is_meta
    assert full.config.name_or_path == str(tmp_path)
    lora, _ = build_model(load_recipe(ROOT / "recipes" / "tiny" / "lora_fsdp2_chat.yaml", overrides))
    base = lora.get_base_model()
    assert type(base).__name__ == "Gemma3ForCausalLM" and base.model.norm.weight.is_meta
    load_sharded_safetensors(base, base.config.name_or_path)
    assert torch.equal(base.model.norm.weight, multimodal.model.language_model.norm.weight)
    assert torch.equal(base.model.embed_tokens.weight, multimodal.model.language_model.embed_tokens.weight)
