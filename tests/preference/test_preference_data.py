"""Preference pairs: TRL's record formats to ids (prompt masked), pairs kept together in a batch, errors named."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from lightning_plugins.data import DataConfig, DataError, build_dataset, make_collator
from lightning_plugins.data.preference import encode_preference
from lightning_plugins.data.tiny import TINY_DIR


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_DIR / "model")


def _trained(ids, labels):
    return [i for i, label in zip(ids, labels) if label != -100]


def test_string_pairs_mask_the_prompt(tokenizer) -> None:
    row = encode_preference({"prompt": "abc=", "chosen": "cba", "rejected": "abc"}, tokenizer)
    eos = tokenizer.eos_token_id
    for side, text in (("chosen", "cba"), ("rejected", "abc")):
        ids, labels = row[f"{side}_input_ids"], row[f"{side}_labels"]
        assert _trained(ids, labels) == tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
        assert tokenizer.decode(ids[: len(ids) - 4], skip_special_tokens=True) == "abc="


def test_conversations_mask_the_prompt_explicit_and_implicit(tokenizer) -> None:
    prompt = [{"role": "user", "content": "r abc"}, {"role": "assistant", "content": "cba"}, {"role": "user", "content": "s"}]
    chosen, rejected = [{"role": "assistant", "content": "abc"}], [{"role": "assistant", "content": "bca"}]
    explicit = encode_preference({"prompt": prompt, "chosen": chosen, "rejected": rejected}, tokenizer)
    implicit = encode_preference({"chosen": prompt + chosen, "rejected": prompt + rejected}, tokenizer)
    assert explicit == implicit
    # Only the completion is trained: not the earlier assistant turn of the prompt.
    trained = tokenizer.decode(_trained(explicit["chosen_input_ids"], explicit["chosen_labels"]))
    assert trained.startswith("abc") and "cba" not in trained


def test_a_batch_holds_the_chosen_rows_then_their_rejected_rows(tokenizer, tmp_path) -> None:
    train = tmp_path / "pairs.jsonl"
    records = [{"prompt": f"{s}=", "chosen": s[::-1], "rejected": s} for s in ("abc", "defg", "hij")]
    train.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = DataConfig(train=str(train), max_seq_len=16, cache_dir=str(tmp_path / "cache"))
    rows = build_dataset(config, tokenizer, "train")
    batch = make_collator(config, tokenizer.pad_token_id)([rows[i] for i in range(3)])
    assert batch["input_ids"].shape[0] == 6
    for pair, record in enumerate(records):
        for offset, side in ((0, "chosen"), (3, "rejected")):
            labels = batch["labels"][pair + offset]
            got = tokenizer.decode(batch["input_ids"][pair + offset][labels != -100], skip_special_tokens=True)
            assert got == record[side]


def test_a_pair_truncation_empties_is_named(tokenizer, tmp_path) -> None:
    train = tmp_path / "pairs.jsonl"
    lines = [{"prompt": "ab=", "chosen": "ba", "rejected": "ab"}, {"prompt": "abcdefghij=", "chosen": "j", "rejected": "a"}]
    train.write_text("".join(json.dumps(r) + "\n" for r in lines))
    config = DataConfig(train=str(train), max_seq_len=8, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=rf"{train}:2: truncation at data.max_seq_len=8 leaves the chosen completion"):
        build_dataset(config, tokenizer, "train")


def test_the_shipped_pairs_load(tokenizer, tmp_path) -> None:
    config = DataConfig(train=str(TINY_DIR / "data/preference_train.jsonl"), max_seq_len=16, cache_dir=str(tmp_path))
    rows = build_dataset(config, tokenizer, "train")
    assert rows.num_rows == 48 and set(rows.column_names) == {"chosen_input_ids", "chosen_labels",
                                                              "rejected_input_ids", "rejected_labels"}  # fmt: skip
    batch = make_collator(config, tokenizer.pad_token_id)([rows[0], rows[1]])
    assert torch.equal(batch["input_ids"][0][:3], batch["input_ids"][2][:3])  # a pair shares its prompt
