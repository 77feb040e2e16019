"""Image-text data on the shipped tiny task: TRL's vision records processed by the tiny Gemma 3's own processor.

What is checked: only the assistant's answer (and its EOS) carries labels, image tokens and the question are -100;
a batch collated from single samples equals the processor's own batched output (padding, pixels, token types); a
template without generation markers finds the same assistant tokens; per-image inputs such as Qwen's
``image_grid_thw`` pass through the collator as the models' processors give them; a missing or unreadable image is
named with its file and line; packing (Gemma 3) and a cut through an image's tokens are refused; a model trains on a
batch.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from tiny_vlm import collate, image_sample

from lightning_plugins.data import DataConfig, DataError
from lightning_plugins.data.image_dataset import (
    build_image_text_dataset,
    collate_image_text,
    image_text_collator,
    is_image_text_data,
)
from lightning_plugins.data.image_text import encode_image_text, open_image

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny"


@pytest.fixture(scope="module")
def processor():
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(TINY / "vlm_model")


def _config(**kwargs) -> DataConfig:
    defaults = {"train": "data/vlm_train.jsonl", "eval": "data/vlm_eval.jsonl", "max_seq_len": 96}
    return DataConfig(**{**defaults, **kwargs}).resolve(TINY)


def _records(name: str = "vlm_train.jsonl") -> list[dict]:
    return [json.loads(line) for line in (TINY / "data" / name).read_text().splitlines()]


def test_only_the_answer_is_trained(processor) -> None:
    dataset = build_image_text_dataset(_config(), processor, "train")
    tokenizer = processor.tokenizer
    image_id = tokenizer.convert_tokens_to_ids(tokenizer.image_token)
    records = _records()
    assert len(dataset) == len(records)
    for index in (0, 1, next(i for i, r in enumerate(records) if len(r["images"]) == 2)):
        sample = dataset[index]
        answer = records[index]["messages"][1]["content"][0]["text"]
        trained = sample["labels"][sample["labels"] != -100]
        assert tokenizer.decode(trained) == answer + tokenizer.eos_token
        assert bool((sample["labels"][sample["input_ids"] == image_id] == -100).all())
        images = len(records[index]["images"])
        assert sample["pixel_values"].shape[0] == images
        assert int((sample["input_ids"] == image_id).sum()) == images * 16  # mm_tokens_per_image
        assert torch.equal(sample["token_type_ids"], (sample["input_ids"] == image_id).long())


def test_collated_batch_is_the_processors_own(processor) -> None:
    dataset = build_image_text_dataset(_config(), processor, "train")
    records = _records()
    rows = [0, next(i for i, r in enumerate(records) if len(r["images"]) == 2), 2]
    batch = image_text_collator(processor)([dataset[i] for i in rows])
    texts = [processor.apply_chat_template(records[i]["messages"]) for i in rows]
    images = [[open_image(path, TINY / "data") for path in records[i]["images"]] for i in rows]
    own = processor(text=texts, images=images, padding=True, add_special_tokens=False, return_tensors="pt")
    tokenizer = processor.tokenizer
    assert tokenizer.padding_side == "right"
    for key in ("input_ids", "attention_mask", "token_type_ids", "pixel_values"):
        assert torch.equal(batch[key], own[key]), key
    assert bool((batch["labels"][own["attention_mask"] == 0] == -100).all())


def test_template_without_generation_markers_finds_the_same_tokens(processor) -> None:
    import copy

    plain = copy.deepcopy(processor)
    plain.chat_template = re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", processor.chat_template)
    config = _config()
    for record in _records()[:6]:
        marked = encode_image_text(record, processor, config, TINY / "data")
        found = encode_image_text(record, plain, config, TINY / "data")
        assert torch.equal(marked["labels"], found["labels"])


def test_per_image_inputs_pass_through_the_collator() -> None:
    """Qwen2.5-VL's rows (``image_grid_thw``, patches of different counts) as tests/tiny_vlm.py collates them."""
    samples = [image_sample(20, seed) for seed in range(3)]
    for sample in samples:
        sample["image_grid_thw"] = sample["image_grid_thw"][None]  # the processor's [images, 3]
    batch = collate_image_text(samples, pad_token_id=2)
    reference = collate([{**s, "image_grid_thw": s["image_grid_thw"][0]} for s in samples])
    for key, value in reference.items():
        assert torch.equal(batch[key], value), key


def test_recipe_data_is_recognised(processor) -> None:
    assert is_image_text_data(_config(format="auto"))
    assert not is_image_text_data(DataConfig(train="data/chat_train.jsonl").resolve(TINY))


def _copy_with(tmp_path: Path, edit) -> Path:
    """The shipped training records and images in ``tmp_path``, the records passed through ``edit``."""
    shutil.copytree(TINY / "data" / "vlm_images", tmp_path / "vlm_images")
    records = edit(_records()[:12])
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return tmp_path / "train.jsonl"


def test_a_missing_image_is_named_with_its_line(tmp_path: Path, processor) -> None:
    def drop(records):
        records[4]["images"] = ["vlm_images/nowhere.png"]
        return records

    path = _copy_with(tmp_path, drop)
    with pytest.raises(DataError, match=rf"{re.escape(str(path))}:5: image 'vlm_images/nowhere.png'.*does not exist"):
        build_image_text_dataset(DataConfig(train=str(path)), processor, "train")


def test_an_unreadable_image_is_named_with_its_line(tmp_path: Path, processor) -> None:
    path = _copy_with(tmp_path, lambda records: records)
    broken = tmp_path / _records()[7]["images"][0]
    broken.write_bytes(broken.read_bytes()[:40])  # a truncated PNG
    with pytest.raises(DataError, match=rf"{re.escape(str(path))}:8: image .* cannot be read"):
        build_image_text_dataset(DataConfig(train=str(path)), processor, "train")


def test_image_count_must_match_the_entries(tmp_path: Path, processor) -> None:
    def extra(records):
        records[2]["images"] = records[2]["images"] * 2
        return records

    path = _copy_with(tmp_path, extra)
    with pytest.raises(DataError, match=r":3: the conversation holds 1 image entries but 'images' has 2"):
        build_image_text_dataset(DataConfig(train=str(path)), processor, "train")


def test_packing_and_cut_images_are_refused(processor) -> None:
    from transformers import AutoConfig

    from lightning_plugins.data.image_packing import image_packing_collator

    with pytest.raises(DataError, match="data.packing: Gemma 3's image tokens attend to each other both ways"):
        image_packing_collator(processor, AutoConfig.from_pretrained(TINY / "vlm_model"), 96)
    dataset = build_image_text_dataset(_config(max_seq_len=12), processor, "train")
    with pytest.raises(DataError, match=r"vlm_train.jsonl:1: .*would split an image's tokens"):
        dataset[0]


def test_the_model_trains_on_a_batch(processor) -> None:
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(TINY / "vlm_model")
    dataset = build_image_text_dataset(_config(), processor, "train")
    batch = image_text_collator(processor)([dataset[i] for i in range(8)])
    loss = model(**batch).loss
    loss.backward()
    projector = model.model.multi_modal_projector.mm_input_projection_weight
    assert torch.isfinite(loss) and projector.grad is not None and bool(projector.grad.abs().sum() > 0)


def test_a_json_file_arrow_cannot_read_keeps_its_images(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where arrow fails on a JSON file, the records are read in Python and keep the fields a format reads: the image
    paths of image-text records too (they were dropped, leaving the images' tokens without pixels)."""
    import datasets

    from lightning_plugins.data.loading import Source

    records = [
        {"messages": [{"role": "user", "content": "colour?"}, {"role": "assistant", "content": "red"}], "images": ["a.png"]},
        {"messages": [{"role": "user", "content": "shape?"}, {"role": "assistant", "content": "disc"}], "images": []},
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(record) for record in records) + "\n")

    def arrow_fails(*args, **kwargs):
        raise ValueError("arrow cannot read this file")

    monkeypatch.setattr(datasets, "load_dataset", arrow_fails)
    dataset = Source(path, "train").dataset
    assert dataset["images"] == [["a.png"], []]
    assert [row["messages"][1]["content"] for row in dataset] == ["red", "disc"]


def test_a_hub_dataset_of_pil_images_gives_the_samples_of_its_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, processor
) -> None:
    """A hub dataset as it arrives, its images a ``datasets`` ``Image()`` column of PNG bytes (PIL images when read):
    parquet files (``load_dataset("parquet")``) and a ``save_to_disk`` directory. Every sample equals the one of the
    same record in the shipped JSONL, whose images are paths to the same files."""
    from datasets import Dataset, Features, Image, Sequence, Value
    from PIL import Image as PILImage

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    records = _records()[:8]
    assert any(len(record["images"]) == 2 for record in records)
    part = {"type": Value("string"), "text": Value("string")}
    features = Features({"messages": [{"role": Value("string"), "content": [part]}], "images": Sequence(Image())})
    images = [[PILImage.open(TINY / "data" / path).copy() for path in r["images"]] for r in records]  # no file name
    hub = Dataset.from_dict({"messages": [r["messages"] for r in records], "images": images}, features=features)
    hub.to_parquet(tmp_path / "train.parquet")
    hub.save_to_disk(tmp_path / "saved")
    assert _holds_image_bytes(tmp_path / "train.parquet")
    files = build_image_text_dataset(_config(), processor, "train")
    for source in (tmp_path / "train.parquet", tmp_path / "saved"):
        config = DataConfig(train=str(source), eval=str(source), format="image_text", max_seq_len=96)
        dataset = build_image_text_dataset(config, processor, "train")
        assert len(dataset) == len(records)
        assert isinstance(dataset.source.dataset[0]["images"][0], PILImage.Image), source
        for index in range(len(records)):
            got, want = dataset[index], files[index]
            assert got.keys() == want.keys(), source
            assert all(torch.equal(got[key], want[key]) for key in want), (source, index)


def _holds_image_bytes(path: Path) -> bool:
    """Whether the parquet file holds the images' bytes (not paths to files)."""
    import pyarrow.parquet as pq

    images = pq.read_table(path).column("images").to_pylist()
    return all(image["bytes"] and not image["path"] for row in images for image in row)
