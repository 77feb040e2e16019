"""A tiny VLM learns on CPU: trained as the shipped image-text recipe says (``vlm_fsdp2.yaml`` in one process: its
model, processor, data, frozen vision tower, AdamW and schedule from the recipe's own builders, in a plain loop), the
saved model names the colours and shapes of held-out images far better than chance.

Accuracy is greedy exact match of the answer on the 64 held-out records, read with plain transformers from the
export (``AutoProcessor`` and ``AutoModelForImageTextToText``). Chance is the best a model blind to the images can do:
the most common training answer to each question, scored on the held-out records. The shipped (random) model scores
below it; the trained one above it.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from lightning_plugins.recipe.build import build_loaders, build_model, make_optimizer
from lightning_plugins.recipe.schema import load_recipe

TINY = Path(__file__).parents[2] / "recipes" / "tiny"
STEPS = 250
ONE = ["hardware.devices=1", "layout.dp_shard_size=1", f"train.max_steps={STEPS}"]


def _records(name: str) -> list[dict]:
    return [json.loads(line) for line in (TINY / "data" / name).read_text().splitlines()]


def _question(record: dict) -> str:
    return record["messages"][0]["content"][-1]["text"]


def _answer(record: dict) -> str:
    return record["messages"][1]["content"][0]["text"]


def accuracy(model_dir: Path, records: list[dict]) -> float:
    """Greedy exact match of the answers, the model and its processor read from ``model_dir``."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from lightning_plugins.data.image_text import open_image

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    tokenizer = processor.tokenizer
    right = 0
    for record in records:
        images = [open_image(path, TINY / "data") for path in record["images"]]
        inputs = processor.apply_chat_template(
            record["messages"][:1], add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt",
            processor_kwargs={"images": images},
        )
        length = len(tokenizer(_answer(record), add_special_tokens=False)["input_ids"]) + 1  # and its EOS
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=length, do_sample=False)
        said = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :])
        right += said == _answer(record) + tokenizer.eos_token
    return right / len(records)


def blind_accuracy(train: list[dict], held_out: list[dict]) -> float:
    """The held-out accuracy of answering each question with its most common training answer."""
    common = {q: Counter(_answer(r) for r in train if _question(r) == q).most_common(1)[0][0] for q in
              {_question(r) for r in train}}  # fmt: skip
    return sum(common.get(_question(r)) == _answer(r) for r in held_out) / len(held_out)


def train(out: Path) -> None:
    """The recipe's run in one process: its global batch of 16 as 2 accumulated micro-batches of 8, clipped."""
    recipe = load_recipe(TINY / "vlm_fsdp2.yaml", ONE)
    torch.manual_seed(recipe.train.seed)
    model, processor = build_model(recipe, on_meta=False)
    loader, _ = build_loaders(recipe, processor)
    optimizer, schedule = make_optimizer(model, recipe, STEPS)
    batches, step = iter(loader), 0
    while step < STEPS:
        for _ in range(recipe.accumulation):
            batch = next(batches, None) or next(batches := iter(loader))
            (model(**batch).loss / recipe.accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.optim.max_grad_norm)
        optimizer.step(), schedule.step(), optimizer.zero_grad()
        step += 1
    model.save_pretrained(out)
    processor.save_pretrained(out)


@pytest.mark.slow
def test_held_out_accuracy_rises_above_chance(tmp_path: Path) -> None:
    train(tmp_path / "out" / "hf")
    held_out = _records("vlm_eval.jsonl")
    chance = blind_accuracy(_records("vlm_train.jsonl"), held_out)
    before, after = accuracy(TINY / "vlm_model", held_out), accuracy(tmp_path / "out" / "hf", held_out)
    assert before < chance < after, (before, chance, after)


def test_the_recipes_image_text_model_trains_without_a_kv_cache(tmp_path: Path, monkeypatch) -> None:
    """The language model of an image-text model reads ``use_cache`` from its own text config (on by default): the
    recipe turns it off there too, or every training forward would build a cache of each layer's keys and values."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    recipe = load_recipe(TINY / "vlm_fsdp2.yaml", [*ONE, f"data.cache_dir={tmp_path / 'cache'}"])
    model, processor = build_model(recipe, on_meta=False)
    loader, _ = build_loaders(recipe, processor)
    output = model(**next(iter(loader)))
    assert output.loss.requires_grad and getattr(output, "past_key_values", None) is None
