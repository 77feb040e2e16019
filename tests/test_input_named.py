"""Every bad input is named, early (issue 23): the file and line of a data error, what truncation left, a dataset
smaller than one global batch, the closest valid key of a typo, a GPU recipe without a GPU, a model path that is
neither a directory nor cached while offline, a damaged weight file, an output directory that cannot be written, TP on
a family without a plan. No launched world: the checks run where the doors run them, before any rank starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from lightning_plugins.data import DataConfig, DataError, build_dataset
from lightning_plugins.recipe import RecipeError, load_recipe

TINY = Path(__file__).parents[1] / "recipes" / "tiny"
RECIPE = TINY / "full_tp2.yaml"
GOOD = {"prompt": "abc=", "completion": "cba"}
CHAT = {"messages": [{"role": "user", "content": "r ab"}, {"role": "assistant", "content": "ba"}]}


@pytest.fixture(scope="module")
def tokenizer() -> object:
    return AutoTokenizer.from_pretrained(TINY / "model")


def _lines(path: Path, *lines: str | bytes) -> Path:
    path.write_bytes(b"".join((line if isinstance(line, bytes) else line.encode()) + b"\n" for line in lines))
    return path


@pytest.mark.parametrize(
    ("third", "fmt", "said"),
    [
        (b'{"prompt": "ab\xff=", "completion": "x"}', "auto", r"bad.jsonl:3: not valid UTF-8 \(byte 0xff at column 15\)"),
        ('{"prompt": "ab=", "completion": }', "auto", r"bad.jsonl:3: not valid JSON"),
        ('{"prompt": "ab="}', "auto", r"bad.jsonl:3: field 'completion' must be a string, but it is missing"),
        (
            json.dumps({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}),
            "chat",
            r"bad.jsonl:3: the tokenizer's chat template refused the conversation \(unknown role: robot\).*'robot'",
        ),
    ],
    ids=["not-utf8", "bad-json", "missing-field", "unknown-role"],
)
def test_data_errors_name_the_file_and_line(tmp_path: Path, tokenizer: object, third: str | bytes, fmt: str, said: str) -> None:
    good = json.dumps(CHAT if fmt == "chat" else GOOD)
    path = _lines(tmp_path / "bad.jsonl", good, good, third)
    with pytest.raises(DataError, match=said):
        build_dataset(DataConfig(train=str(path), format=fmt), tokenizer, "train")


def test_truncation_that_leaves_nothing_says_so(tmp_path: Path, tokenizer: object) -> None:
    path = _lines(tmp_path / "long.jsonl", *[json.dumps({"prompt": "abcdefgh=", "completion": "x"})] * 3)
    with pytest.raises(
        DataError,
        match=r"truncation at data.max_seq_len=4 left nothing to train on: all 3 train records of .*long.jsonl were"
        r" dropped \(\d+ tokens\).*Raise data.max_seq_len \(the longest record has \d+ tokens\)",
    ):
        build_dataset(DataConfig(train=str(path), max_seq_len=4), tokenizer, "train")


def test_a_dataset_smaller_than_one_global_batch_is_refused(tmp_path: Path, tokenizer: object) -> None:
    from lightning_plugins.training import build_loaders

    path = _lines(tmp_path / "few.jsonl", *[json.dumps(GOOD)] * 5)
    recipe = load_recipe(RECIPE, [f"data.train={path}", "data.eval=null", "layout.tp_size=1", "train.micro_batch_size=4",
                                  "train.global_batch_size=8"])  # fmt: skip
    with pytest.raises(
        DataError,
        match=r"holds 5 training samples.*fewer than one global batch of 8 \(train.micro_batch_size 4 x accumulation 1"
        r" x data-parallel ranks 2\).*Set train.micro_batch_size=2 and train.global_batch_size=4",
    ):
        build_loaders(recipe, tokenizer)


def test_a_typo_names_the_key_the_closest_valid_key_and_the_file(tmp_path: Path) -> None:
    from lightning_plugins.cli import main

    recipe = tmp_path / "typo.yaml"
    recipe.write_text(RECIPE.read_text().replace("  lr:", "  lrr:").replace("\ntrain:", "\ntrian:\n  max_steps: 3\ntrain:"))
    recipe.with_name("model").symlink_to(TINY / "model")
    recipe.with_name("data").symlink_to(TINY / "data")
    with pytest.raises(SystemExit) as stop:
        main(["finetune", str(recipe), "--train.max_stesp=3", "--layout.tp_sise=2", "--lora.rr=4"])
    said = str(stop.value.code)
    assert said.startswith(f"error: {recipe}: 5 problem(s)"), said
    for typo, meant in [("optim.lrr", "lr"), ("trian", "train"), ("train.max_stesp", "max_steps"),
                        ("layout.tp_sise", "tp_size"), ("lora.rr", "r")]:  # fmt: skip
        assert f"  {typo}: unknown key; did you mean `{meant}`?" in said, said
