"""Data: the tiny assets, every loading path, prompt and chat masking, bad inputs, packing (one process, fast)."""

from __future__ import annotations

import copy
import importlib.util
import json
import random
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import datasets
import pydantic
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_plugins.data import (
    IGNORE_INDEX,
    TINY_DIR,
    DataConfig,
    DataError,
    build_dataset,
    collate_causal_lm,
    collate_packed,
    encode_chat,
    exact_match,
    first_fit,
    load_prompt_completion,
    make_collator,
    pack_examples,
    read_jsonl,
    tiny_assets,
)

PROMPTS = [{"prompt": "abcd=", "completion": "dcba"}, {"prompt": "ij=", "completion": "ji"}]
CHATS = [
    {"messages": [{"role": "user", "content": "r abc"}, {"role": "assistant", "content": "cba"}]},
    {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "s cab"},
            {"role": "assistant", "content": "abc"},
            {"role": "user", "content": "r"},
            {"role": "assistant", "content": "cba"},
        ]
    },
]


def _load_make_tiny() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_tiny", TINY_DIR / "make_tiny.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def make_tiny() -> ModuleType:
    return _load_make_tiny()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(tiny_assets().model_dir, local_files_only=True)


@pytest.fixture(scope="module")
def model() -> Any:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_assets().model_dir, local_files_only=True)


def _write_jsonl(path: Path, records: list[Any], blank_after: int | None = None) -> Path:
    lines = [json.dumps(r) for r in records]
    if blank_after is not None:
        lines.insert(blank_after, "")
    path.write_text("\n".join(lines) + "\n")
    return path


def _rows(dataset: Any) -> list[tuple]:
    return [tuple(tuple(row[key]) for key in sorted(row)) for row in dataset]


# ----------------------------------------------------------------------------------------------------
# The tiny assets
# ----------------------------------------------------------------------------------------------------


def test_tiny_assets_exist() -> None:
    assets = tiny_assets()
    assert assets.root == TINY_DIR
    for path in (assets.model_dir, assets.train_file, assets.eval_file, assets.chat_train_file, assets.chat_eval_file):
        assert path.exists()
    size = sum(p.stat().st_size for p in assets.model_dir.iterdir())
    assert size < 2_000_000


def test_tiny_assets_missing_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="make_tiny.py"):
        tiny_assets(tmp_path)


def test_tokenizer_loads_offline(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    reloaded = AutoTokenizer.from_pretrained(str(tiny_assets().model_dir))
    assert reloaded("abc=")["input_ids"] == tokenizer("abc=")["input_ids"]
    assert reloaded.chat_template == tokenizer.chat_template and "{% generation %}" in tokenizer.chat_template
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    ids = tokenizer("abc=")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 5  # BOS + one token per character
    no_special = tokenizer("cba", add_special_tokens=False)["input_ids"]
    assert len(no_special) == 3
    assert tokenizer.decode(no_special + [tokenizer.eos_token_id], skip_special_tokens=True) == "cba"


def test_model_config_fits_parallel_layouts(model: Any, tokenizer: Any) -> None:
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert cfg.num_attention_heads % 2 == 0 and cfg.num_key_value_heads % 2 == 0
    assert cfg.intermediate_size % 4 == 0 and cfg.vocab_size % 8 == 0
    assert len(tokenizer) <= cfg.vocab_size
    assert not cfg.tie_word_embeddings
    assert next(model.parameters()).dtype == torch.float32
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id


def test_records_are_disjoint_and_well_formed() -> None:
    assets = tiny_assets()
    train, evals = read_jsonl(assets.train_file), read_jsonl(assets.eval_file)
    assert len(train) >= 1000 and 100 <= len(evals) <= 500
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evals}
    for r in train[:50] + evals[:50]:
        assert r["prompt"].endswith("=")
        assert r["completion"] == r["prompt"][:-1][::-1]


def _chat_strings(record: dict) -> set[str]:
    return {m["content"].split(" ")[1] for m in record["messages"] if m["role"] == "user" and " " in m["content"]}


def test_chat_records_are_disjoint_and_correct() -> None:
    assets = tiny_assets()
    train, evals = read_jsonl(assets.chat_train_file), read_jsonl(assets.chat_eval_file)
    assert len(train) >= 1000 and 100 <= len(evals) <= 500
    assert not set().union(*map(_chat_strings, train)) & set().union(*map(_chat_strings, evals))
    ops = {"r": lambda s: s[::-1], "s": lambda s: "".join(sorted(s))}
    turns = set()
    for record in train + evals:
        messages = record["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant"] * (len(messages) // 2)
        turns.add(len(messages) // 2)
        answer = ""
        for user, assistant in zip(messages[::2], messages[1::2]):
            op, _, argument = user["content"].partition(" ")
            answer = ops[op](argument or answer)
            assert assistant["content"] == answer
    assert turns == {1, 2, 3}


def test_chat_template_stays_in_the_vocabulary(tokenizer: Any) -> None:
    """Every character the template emits for the shipped chats is a token of its own (no <unk>)."""
    records = read_jsonl(tiny_assets().chat_train_file)[:300] + CHATS
    for record in records:
        text = tokenizer.apply_chat_template(record["messages"], tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids) == text
    prompt = tokenizer.apply_chat_template(CHATS[0]["messages"][:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<s>u:r abc|a:"
    with pytest.raises(Exception, match="unknown role"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


# ----------------------------------------------------------------------------------------------------
# Records -> token ids and labels
# ----------------------------------------------------------------------------------------------------


def test_labels_mask_the_prompt(tokenizer: Any) -> None:
    examples = load_prompt_completion(PROMPTS, tokenizer, max_length=32)
    assert len(examples) == 2
    first = examples[0]
    prompt_len = 1 + len("abcd=")  # BOS + characters
    assert len(first["input_ids"]) == len(first["labels"]) == prompt_len + 4 + 1
    assert first["labels"][:prompt_len] == [IGNORE_INDEX] * prompt_len
    assert first["labels"][prompt_len:] == first["input_ids"][prompt_len:]
    assert first["labels"][-1] == tokenizer.eos_token_id
    assert tokenizer.decode(first["labels"][prompt_len:], skip_special_tokens=True) == "dcba"


def test_load_truncates_and_drops_unsupervised(tokenizer: Any) -> None:
    records = PROMPTS[:1]
    assert load_prompt_completion(records, tokenizer, max_length=6) == []  # prompt alone fills it
    (example,) = load_prompt_completion(records, tokenizer, max_length=8)
    assert len(example["input_ids"]) == 8
    assert example["labels"][6:] == example["input_ids"][6:]
    with pytest.raises(ValueError, match="max_seq_len"):
        load_prompt_completion(records, tokenizer, max_length=0)


def test_load_from_file(tokenizer: Any) -> None:
    examples = load_prompt_completion(tiny_assets().eval_file, tokenizer, max_length=32)
    assert len(examples) == len(read_jsonl(tiny_assets().eval_file))
    assert max(len(ex["input_ids"]) for ex in examples) < 32


def test_chat_trains_only_assistant_turns(tokenizer: Any) -> None:
    example = encode_chat(CHATS[1], tokenizer)
    ids, labels = example["input_ids"], example["labels"]
    assert tokenizer.decode(ids) == "<s>s:be brief|u:s cab|a:abc</s>u:r|a:cba</s>"
    trained = [(i, label) for i, label in enumerate(labels) if label != IGNORE_INDEX]
    assert all(ids[i] == label for i, label in trained)
    # Exactly the assistant contents and their EOS, in two contiguous runs.
    assert tokenizer.decode([label for _, label in trained]) == "abc</s>cba</s>"
    positions = [i for i, _ in trained]
    assert positions == list(range(positions[0], positions[0] + 4)) + list(range(positions[4], positions[4] + 4))
    assert tokenizer.decode(ids[: positions[0]]).endswith("a:")


def test_chat_without_generation_markers_is_located_exactly(tokenizer: Any) -> None:
    """A template without {% generation %} (like most real checkpoints') gives the same labels."""
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = tokenizer.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    records = read_jsonl(tiny_assets().chat_eval_file)[:100] + CHATS
    for record in records:
        assert encode_chat(record, plain) == encode_chat(record, tokenizer)

    rewriting = copy.deepcopy(plain)  # a template that renders earlier assistant turns differently
    rewriting.chat_template = plain.chat_template.replace(
        "a:{{ message['content'] }}", "a:{{ message['content'] if loop.last else 'x' }}"
    )
    with pytest.raises(DataError, match="generation"):
        encode_chat(CHATS[1], rewriting)


def test_chat_needs_a_template(tokenizer: Any) -> None:
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(DataError, match="no chat template"):
        encode_chat(CHATS[0], bare)


# ----------------------------------------------------------------------------------------------------
# Loading paths and bad inputs
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("records", [PROMPTS, CHATS], ids=["prompt_completion", "chat"])
def test_every_loading_path_gives_the_same_rows(tmp_path: Path, tokenizer: Any, records: list[dict]) -> None:
    table = datasets.Dataset.from_list(records)
    paths = {
        "jsonl": _write_jsonl(tmp_path / "d.jsonl", records, blank_after=1),
        "json": tmp_path / "d.json",
        "parquet": tmp_path / "d.parquet",
        "saved": tmp_path / "saved",
        "saved_dict": tmp_path / "saved_dict",
    }
    paths["json"].write_text(json.dumps(records, indent=2))
    table.to_parquet(str(paths["parquet"]))
    table.save_to_disk(str(paths["saved"]))
    datasets.DatasetDict({"train": table}).save_to_disk(str(paths["saved_dict"]))
    encode = encode_chat if "messages" in records[0] else lambda r, t: load_prompt_completion([r], t, 64)[0]
    expected = [tuple(tuple(ex[k]) for k in ("input_ids", "labels")) for ex in (encode(r, tokenizer) for r in records)]
    for name, path in paths.items():
        rows = _rows(build_dataset(DataConfig(train=str(path), max_seq_len=64), tokenizer, "train"))
        assert rows == expected, name


def test_format_detection_and_mismatch(tmp_path: Path, tokenizer: Any) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", PROMPTS)
    named = build_dataset(DataConfig(train=str(path), format="prompt_completion"), tokenizer, "train")
    assert _rows(named) == _rows(build_dataset(DataConfig(train=str(path)), tokenizer, "train"))  # named = detected
    with pytest.raises(DataError, match=r"data.format='chat' needs \['messages'\]"):
        build_dataset(DataConfig(train=str(path), format="chat"), tokenizer, "train")
    other = _write_jsonl(tmp_path / "o.jsonl", [{"text": "abc"}])
    with pytest.raises(DataError, match=r"columns \['text'\]; expected 'messages'"):
        build_dataset(DataConfig(train=str(other)), tokenizer, "train")
    csv = tmp_path / "d.csv"
    csv.write_text("prompt,completion\n")
    with pytest.raises(DataError, match="suffix '.csv'"):
        build_dataset(DataConfig(train=str(csv)), tokenizer, "train")


def test_empty_or_unusable_inputs(tmp_path: Path, tokenizer: Any) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match=rf"data.train: {empty} holds no records"):
        build_dataset(DataConfig(train=str(empty)), tokenizer, "train")
    two = tmp_path / "two_splits"
    table = datasets.Dataset.from_list(PROMPTS)
    datasets.DatasetDict({"train": table, "test": table}).save_to_disk(str(two))
    with pytest.raises(DataError, match=r"DatasetDict with splits \['test', 'train'\]"):
        build_dataset(DataConfig(train=str(two)), tokenizer, "train")
    with pytest.raises(DataError, match="not one written by datasets' `save_to_disk`"):
        build_dataset(DataConfig(train=str(tmp_path)), tokenizer, "train")


def test_bad_json_names_file_and_line(tmp_path: Path, tokenizer: Any) -> None:
    lines = [json.dumps(PROMPTS[0]), "", json.dumps(PROMPTS[1]), '{"prompt": "ab=", "completion": ', json.dumps(PROMPTS[0])]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=rf"{path}:4: not valid JSON"):
        build_dataset(DataConfig(train=str(path)), tokenizer, "train")
    array = tmp_path / "bad.json"
    array.write_text('[\n{"prompt": "a=", "completion": "a"},\n{"prompt": "b=" "completion": "b"}\n]')
    with pytest.raises(DataError, match=rf"{array}:3: not valid JSON"):
        build_dataset(DataConfig(train=str(array)), tokenizer, "train")
    not_object = _write_jsonl(tmp_path / "list.jsonl", [PROMPTS[0], [1, 2]])
    with pytest.raises(DataError, match=rf"{not_object}:2: expected a JSON object"):
        build_dataset(DataConfig(train=str(not_object)), tokenizer, "train")


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"prompt": "ab="}, "field 'completion' must be a string, but it is missing"),
        ({"prompt": 5, "completion": "ab"}, "field 'prompt' must be a string, but it is a int"),
        ({"messages": []}, "field 'messages' must be a non-empty list"),
        ({"messages": [{"role": "user"}]}, r"messages\[0\]: field 'content' must be a string"),
        ({"messages": [{"role": "user", "content": "r ab"}]}, "the conversation has no 'assistant' message"),
    ],
    ids=["missing_key", "wrong_type", "empty_messages", "message_without_content", "no_assistant"],
)
def test_bad_record_names_file_and_line(tmp_path: Path, tokenizer: Any, bad: dict, message: str) -> None:
    good = PROMPTS if "prompt" in bad else CHATS
    path = _write_jsonl(tmp_path / "d.jsonl", [*good, bad], blank_after=1)  # line 4: a blank line before it
    with pytest.raises(DataError, match=rf"{path}:4: {message}"):
        build_dataset(DataConfig(train=str(path)), tokenizer, "train")


def test_bad_record_in_parquet_names_the_record(tmp_path: Path, tokenizer: Any) -> None:
    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list([*PROMPTS, {"prompt": "ab=", "completion": None}]).to_parquet(str(path))
    with pytest.raises(DataError, match=rf"{path} record 3: field 'completion'"):
        build_dataset(DataConfig(train=str(path)), tokenizer, "train")


def test_too_long_errors_or_truncates(tmp_path: Path, tokenizer: Any) -> None:
    long = {"prompt": "abc=", "completion": "abcdefghij" * 3}
    path = _write_jsonl(tmp_path / "d.jsonl", [*PROMPTS, long])
    with pytest.raises(DataError, match=rf"{path}:3: 36 tokens, longer than data.max_seq_len=16.*truncation: truncate"):
        build_dataset(DataConfig(train=str(path), max_seq_len=16, truncation="error"), tokenizer, "train")
    rows = build_dataset(DataConfig(train=str(path), max_seq_len=16), tokenizer, "train")
    assert [len(r["input_ids"]) for r in rows] == [11, 7, 16]
    chat = {"messages": [{"role": "user", "content": "r abcde"}, {"role": "assistant", "content": "edcba"}] * 3}
    path = _write_jsonl(tmp_path / "c.jsonl", [*CHATS, chat])
    with pytest.raises(DataError, match=rf"{path}:3: 55 tokens, longer than data.max_seq_len=40"):
        build_dataset(DataConfig(train=str(path), max_seq_len=40, truncation="error"), tokenizer, "train")


def test_missing_file_names_the_key(tmp_path: Path, tokenizer: Any) -> None:
    (tmp_path / "train.jsonl").write_text(json.dumps(PROMPTS[0]) + "\n")
    config = DataConfig(train="train.jsonl", eval="data/eval.jsonl")
    with pytest.raises(DataError, match=rf"data.eval: {tmp_path}/data/eval.jsonl does not exist \(resolved against"):
        config.resolve(tmp_path)
    resolved = DataConfig(train="train.jsonl").resolve(tmp_path)
    assert resolved.train == str(tmp_path / "train.jsonl")
    with pytest.raises(DataError, match="data.train: nowhere.jsonl does not exist"):
        build_dataset(DataConfig(train="nowhere.jsonl"), tokenizer, "train")


def test_config_checks_and_pydantic_nesting() -> None:
    for bad, message in [
        (dict(max_seq_len=1), "data.max_seq_len"),
        (dict(eval_fraction=1.0), "data.eval_fraction"),
        (dict(eval="e.jsonl", eval_fraction=0.1), "both define the evaluation split"),
        (dict(format="csv"), "data.format"),
        (dict(truncation="drop"), "data.truncation"),
    ]:
        with pytest.raises(DataError, match=message):
            DataConfig(train="t.jsonl", **bad)

    class Recipe(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        data: DataConfig

    assert Recipe.model_validate({"data": {"train": "t.jsonl", "packing": True}}).data.packing
    with pytest.raises(pydantic.ValidationError, match="data.pack"):
        Recipe.model_validate({"data": {"train": "t.jsonl", "pack": True}})
    with pytest.raises(pydantic.ValidationError, match="data.max_seq_len must be an integer"):
        Recipe.model_validate({"data": {"train": "t.jsonl", "max_seq_len": 0}})


def test_eval_splits(tmp_path: Path, tokenizer: Any) -> None:
    records = [{"prompt": f"{s}=", "completion": s[::-1]} for s in ("abc", "bcd", "cde", "def", "efg", "fgh", "ghi", "hij")]
    path = _write_jsonl(tmp_path / "d.jsonl", records)
    config = DataConfig(train=str(path), eval_fraction=0.25, max_seq_len=32)
    train, held = _rows(build_dataset(config, tokenizer, "train")), _rows(build_dataset(config, tokenizer, "eval"))
    everything = _rows(build_dataset(DataConfig(train=str(path), max_seq_len=32), tokenizer, "train"))
    assert len(held) == 2 and len(train) == 6 and sorted(train + held) == sorted(everything)
    assert held == _rows(build_dataset(config, tokenizer, "eval"))  # seeded: the same split every time
    assert held != _rows(build_dataset(DataConfig(train=str(path), eval_fraction=0.25, split_seed=1), tokenizer, "eval"))
    eval_file = _write_jsonl(tmp_path / "e.jsonl", PROMPTS)
    assert len(build_dataset(DataConfig(train=str(path), eval=str(eval_file)), tokenizer, "eval")) == 2
    with pytest.raises(DataError, match="no evaluation split"):
        build_dataset(DataConfig(train=str(path)), tokenizer, "eval")
    with pytest.raises(DataError, match="leaves none to train on"):
        build_dataset(DataConfig(train=str(_write_jsonl(tmp_path / "one.jsonl", PROMPTS[:1])), eval_fraction=0.5), tokenizer, "train")
    # A bad record is located by its line in the file, not its row in the split.
    # A bad record fails the split it falls in, located by its line in the file, not its row in the split.
    bad = _write_jsonl(tmp_path / "b.jsonl", [*records, {"prompt": 1, "completion": "x"}])
    errors = []
    for split in ("train", "eval"):
        try:
            build_dataset(DataConfig(train=str(bad), eval_fraction=0.5), tokenizer, split)
        except DataError as err:
            errors.append(str(err))
    assert len(errors) == 1 and errors[0].startswith(f"{bad}:9: field 'prompt'"), errors


# ----------------------------------------------------------------------------------------------------
# Collation and packing
# ----------------------------------------------------------------------------------------------------


def test_collate_right_pads() -> None:
    examples = [
        {"input_ids": [1, 5, 6, 7], "labels": [-100, -100, 6, 7]},
        {"input_ids": [1, 5], "labels": [-100, 5]},
    ]
    batch = collate_causal_lm(examples, pad_token_id=0)
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert all(t.dtype == torch.long and t.shape == (2, 4) for t in batch.values())
    assert batch["input_ids"].tolist() == [[1, 5, 6, 7], [1, 5, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, -100, 6, 7], [-100, 5, -100, -100]]

    padded = collate_causal_lm(examples, pad_token_id=0, pad_to_multiple_of=3)
    assert padded["input_ids"].shape == (2, 6)
    assert padded["attention_mask"][:, 4:].sum() == 0
    assert (padded["labels"][:, 4:] == IGNORE_INDEX).all()
    with pytest.raises(ValueError):
        collate_causal_lm([], pad_token_id=0)
    with pytest.raises(ValueError, match="lengths differ"):
        collate_causal_lm([{"input_ids": [1, 2], "labels": [1]}], pad_token_id=0)


def _naive_first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    rows: list[list[int]] = []
    free: list[int] = []
    for i, n in enumerate(lengths):
        row = next((r for r, room in enumerate(free) if room >= n), None)
        if row is None:
            rows.append([])
            free.append(capacity)
            row = len(rows) - 1
        rows[row].append(i)
        free[row] -= n
    return rows


def test_first_fit_matches_the_definition() -> None:
    rng = random.Random(0)
    for trial in range(30):
        capacity = rng.choice([8, 64, 1024])
        lengths = [rng.randint(1, capacity) for _ in range(rng.randint(1, 300))]
        assert first_fit(lengths, capacity) == _naive_first_fit(lengths, capacity), trial
    assert first_fit([], 8) == []
    with pytest.raises(ValueError, match="sample 1 has 9 tokens"):
        first_fit([3, 9], 8)


def test_pack_and_collate_packed() -> None:
    examples = [
        {"input_ids": [1, 2, 3], "labels": [1, 2, 3]},
        {"input_ids": [4, 5, 6, 7, 8], "labels": [-100, 5, 6, 7, 8]},
        {"input_ids": [9, 10], "labels": [9, 10]},
        {"input_ids": [11, 12, 13, 14], "labels": [11, 12, 13, 14]},
    ]
    rows = pack_examples(examples, max_seq_len=8)
    assert rows == [
        {"input_ids": [1, 2, 3, 4, 5, 6, 7, 8], "labels": [-100, 2, 3, -100, 5, 6, 7, 8], "position_ids": [0, 1, 2, 0, 1, 2, 3, 4]},
        {"input_ids": [9, 10, 11, 12, 13, 14], "labels": [-100, 10, -100, 12, 13, 14], "position_ids": [0, 1, 0, 1, 2, 3]},
    ]
    batch = collate_packed(rows, pad_token_id=0, max_seq_len=8)
    assert set(batch) == {"input_ids", "position_ids", "labels"}  # no attention_mask: positions carry the boundaries
    assert batch["input_ids"][1].tolist() == [9, 10, 11, 12, 13, 14, 0, 0]
    assert batch["labels"][1].tolist() == [-100, 10, -100, 12, 13, 14, -100, -100]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 0, 1, 2, 3, 0, 1]]
    wide = collate_packed(rows, pad_token_id=0, max_seq_len=8, pad_to_multiple_of=5)
    assert wide["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1]
    empty = collate_packed([{"input_ids": [], "labels": [], "position_ids": []}], pad_token_id=0, max_seq_len=4)
    assert empty["position_ids"].tolist() == [[0, 1, 2, 3]] and (empty["labels"] == IGNORE_INDEX).all()
    with pytest.raises(ValueError, match="more than max_seq_len"):
        collate_packed(rows, pad_token_id=0, max_seq_len=6)


def test_packed_dataset_keeps_every_sample(tmp_path: Path, tokenizer: Any) -> None:
    config = DataConfig(train=str(tiny_assets().chat_eval_file), max_seq_len=64)
    samples = build_dataset(config, tokenizer, "train")
    packed = build_dataset(replace(config, packing=True), tokenizer, "train")
    assert packed.column_names == ["input_ids", "labels", "position_ids"]
    lengths = [len(s["input_ids"]) for s in samples]
    assert len(packed) == len(first_fit(lengths, 64))
    assert all(len(row["input_ids"]) <= 64 for row in packed)
    assert sum(lengths) / (64 * len(packed)) > 0.85  # samples of 11-55 tokens fill rows of 64 to 89%
    tokens = sorted(tuple(s["input_ids"]) for s in samples)
    unpacked = []
    for row in packed:  # split rows back at the position restarts
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["position_ids"])]
        unpacked += [tuple(row["input_ids"][a:b]) for a, b in zip(starts, starts[1:])]
    assert sorted(unpacked) == tokens
    trained = sum(label != IGNORE_INDEX for s in samples for label in s["labels"])
    assert sum(label != IGNORE_INDEX for row in packed for label in row["labels"]) == trained
    batch = make_collator(replace(config, packing=True), tokenizer.pad_token_id)([packed[i] for i in range(4)])
    assert set(batch) == {"input_ids", "position_ids", "labels"} and batch["input_ids"].shape == (4, 64)
    assert set(make_collator(config, tokenizer.pad_token_id)([samples[0], samples[1]])) == {"input_ids", "attention_mask", "labels"}


# ----------------------------------------------------------------------------------------------------
# Evaluation and the generator script
# ----------------------------------------------------------------------------------------------------


def test_collated_batch_gives_a_finite_loss(model: Any, tokenizer: Any) -> None:
    examples = load_prompt_completion(read_jsonl(tiny_assets().train_file)[:8], tokenizer, 32)
    batch = collate_causal_lm(examples, tokenizer.pad_token_id)
    with torch.no_grad():
        loss = model(**batch).loss
    assert torch.isfinite(loss)


def test_exact_match_on_real_model(model: Any, tokenizer: Any) -> None:
    model.train()
    score = exact_match(model, tokenizer, tiny_assets().eval_file, max_new_tokens=8, limit=5)
    assert isinstance(score, float) and 0.0 <= score <= 1.0
    assert model.training  # mode restored
    assert exact_match(model, tokenizer, [], max_new_tokens=8) == 0.0
    assert 0.0 <= exact_match(model, tokenizer, tiny_assets().chat_eval_file, max_new_tokens=8, limit=5) <= 1.0


class _OracleModel(torch.nn.Module):
    """Fake LM whose ``generate`` answers a reversal prompt or a tiny chat correctly (or with junk)."""

    def __init__(self, tokenizer: Any, wrong: set[str]) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.tokenizer = tokenizer
        self.wrong = wrong

    def _answer(self, text: str) -> str:
        if text.endswith("="):
            return text[:-1][::-1]
        assert text.startswith("u:") and text.endswith("|a:")  # a chat generation prompt
        op, _, argument = text.rsplit("u:", 1)[1][:-3].partition(" ")
        return argument[::-1] if op == "r" else "".join(sorted(argument))

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **_: Any) -> torch.Tensor:
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            assert mask[-1] == 1  # left padding
            text = self.tokenizer.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=True)
            answer = "zz" if any(w in text for w in self.wrong) else self._answer(text)
            new = self.tokenizer(answer, add_special_tokens=False)["input_ids"]
            rows.append(ids + new + [self.tokenizer.eos_token_id])
        width = max(len(r) for r in rows)
        return torch.tensor([r + [self.tokenizer.pad_token_id] * (width - len(r)) for r in rows])


def test_exact_match_scores_completions(tokenizer: Any) -> None:
    records = [{"prompt": f"{s}=", "completion": s[::-1]} for s in ("abc", "defgh", "ij", "jihg")]
    oracle = _OracleModel(tokenizer, wrong={"defgh"})
    assert exact_match(oracle, tokenizer, records, batch_size=3) == pytest.approx(0.75)
    assert exact_match(oracle, tokenizer, records, limit=1) == 1.0
    chats = [
        {"messages": [{"role": "user", "content": "r abc"}, {"role": "assistant", "content": "cba"}]},
        {"messages": [{"role": "user", "content": "s cab"}, {"role": "assistant", "content": "abc"}]},
        {"messages": [{"role": "user", "content": "r defgh"}, {"role": "assistant", "content": "hgfed"}]},
    ]
    assert exact_match(oracle, tokenizer, chats) == pytest.approx(2 / 3)


def test_make_tiny_data_is_deterministic(make_tiny: ModuleType, tmp_path: Path) -> None:
    make_tiny.main(["--data-only", "--out", str(tmp_path)])
    for name in ("train.jsonl", "eval.jsonl", "chat_train.jsonl", "chat_eval.jsonl"):
        assert (tmp_path / "data" / name).read_bytes() == (TINY_DIR / "data" / name).read_bytes()


def test_make_tiny_model_is_deterministic(make_tiny: ModuleType, tmp_path: Path) -> None:
    first, second = make_tiny.build_model().state_dict(), make_tiny.build_model().state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)

    make_tiny.main(["--model-only", "--out", str(tmp_path)])
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "model.safetensors"):
        assert (tmp_path / "model" / name).read_bytes() == (TINY_DIR / "model" / name).read_bytes(), name
    for name in ("config.json", "generation_config.json"):
        new_cfg = json.loads((tmp_path / "model" / name).read_text())
        old_cfg = json.loads((TINY_DIR / "model" / name).read_text())
        new_cfg.pop("transformers_version", None)
        old_cfg.pop("transformers_version", None)
        assert new_cfg == old_cfg, name


def test_hub_dataset_ids(tmp_path: Path, tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """`owner/name[:split]` that is no local path is a hub dataset, read when the run starts; a local path wins."""
    from lightning_plugins.data.config import hub_dataset

    assert hub_dataset("trl-lib/tldr") == ("trl-lib/tldr", "train")
    assert hub_dataset("trl-lib/tldr:validation") == ("trl-lib/tldr", "validation")
    for local in ("data/train.jsonl", "train.jsonl", "/abs/path", "a/b/c", "./x/y"):
        assert hub_dataset(local) is None, local
    config = DataConfig(train="trl-lib/tldr", eval="trl-lib/tldr:validation").resolve(tmp_path)
    assert (config.train, config.eval) == ("trl-lib/tldr", "trl-lib/tldr:validation")
    (tmp_path / "trl-lib").mkdir()
    (tmp_path / "trl-lib" / "tldr").write_text(json.dumps(PROMPTS[0]) + "\n")  # a local file of that name wins
    assert DataConfig(train="trl-lib/tldr").resolve(tmp_path).train == str(tmp_path / "trl-lib" / "tldr")
    import datasets
    import huggingface_hub

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # read at import: the variables alone do not reach it
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    with pytest.raises(DataError, match=r"data.train: 'nobody-here/no-such-set' is no local file .* could not be loaded"):
        build_dataset(DataConfig(train="nobody-here/no-such-set"), tokenizer, "train")
