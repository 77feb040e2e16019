"""Tests for the embedded tiny assets and the data helpers (single process, fast)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_plugins.datasets import (
    IGNORE_INDEX,
    TINY_DIR,
    collate_causal_lm,
    exact_match,
    load_prompt_completion,
    read_jsonl,
    tiny_assets,
)


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


def test_tiny_assets_exist() -> None:
    assets = tiny_assets()
    assert assets.root == TINY_DIR
    for path in (assets.model_dir, assets.train_file, assets.eval_file):
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


def test_labels_mask_the_prompt(tokenizer: Any) -> None:
    records = [{"prompt": "abcd=", "completion": "dcba"}, {"prompt": "ij=", "completion": "ji"}]
    examples = load_prompt_completion(records, tokenizer, max_length=32)
    assert len(examples) == 2
    first = examples[0]
    prompt_len = 1 + len("abcd=")  # BOS + characters
    assert len(first["input_ids"]) == len(first["labels"]) == prompt_len + 4 + 1
    assert first["labels"][:prompt_len] == [IGNORE_INDEX] * prompt_len
    assert first["labels"][prompt_len:] == first["input_ids"][prompt_len:]
    assert first["labels"][-1] == tokenizer.eos_token_id
    assert tokenizer.decode(first["labels"][prompt_len:], skip_special_tokens=True) == "dcba"


def test_load_truncates_and_drops_unsupervised(tokenizer: Any) -> None:
    records = [{"prompt": "abcd=", "completion": "dcba"}]
    assert load_prompt_completion(records, tokenizer, max_length=6) == []  # prompt alone fills it
    (example,) = load_prompt_completion(records, tokenizer, max_length=8)
    assert len(example["input_ids"]) == 8
    assert example["labels"][6:] == example["input_ids"][6:]
    with pytest.raises(ValueError):
        load_prompt_completion(records, tokenizer, max_length=0)


def test_load_from_file(tokenizer: Any) -> None:
    examples = load_prompt_completion(tiny_assets().eval_file, tokenizer, max_length=32)
    assert len(examples) == len(read_jsonl(tiny_assets().eval_file))
    assert max(len(ex["input_ids"]) for ex in examples) < 32


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


class _OracleModel(torch.nn.Module):
    """Fake LM whose ``generate`` appends the reversal of the prompt (or junk)."""

    def __init__(self, tokenizer: Any, wrong: set[str]) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.tokenizer = tokenizer
        self.wrong = wrong

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **_: Any) -> torch.Tensor:
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            assert mask[-1] == 1  # left padding
            text = self.tokenizer.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=True)
            answer = "zz" if text[:-1] in self.wrong else text[:-1][::-1]
            new = self.tokenizer(answer, add_special_tokens=False)["input_ids"]
            rows.append(ids + new + [self.tokenizer.eos_token_id])
        width = max(len(r) for r in rows)
        return torch.tensor([r + [self.tokenizer.pad_token_id] * (width - len(r)) for r in rows])


def test_exact_match_scores_completions(tokenizer: Any) -> None:
    records = [{"prompt": f"{s}=", "completion": s[::-1]} for s in ("abc", "defgh", "ij", "jihg")]
    oracle = _OracleModel(tokenizer, wrong={"defgh"})
    assert exact_match(oracle, tokenizer, records, batch_size=3) == pytest.approx(0.75)
    assert exact_match(oracle, tokenizer, records, limit=1) == 1.0


def test_make_tiny_data_is_deterministic(make_tiny: ModuleType, tmp_path: Path) -> None:
    make_tiny.main(["--data-only", "--out", str(tmp_path)])
    for name in ("train.jsonl", "eval.jsonl"):
        assert (tmp_path / "data" / name).read_bytes() == (TINY_DIR / "data" / name).read_bytes()


def test_make_tiny_model_is_deterministic(make_tiny: ModuleType, tmp_path: Path) -> None:
    first, second = make_tiny.build_model().state_dict(), make_tiny.build_model().state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)

    make_tiny.main(["--model-only", "--out", str(tmp_path)])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "model" / name).read_bytes() == (TINY_DIR / "model" / name).read_bytes()
    for name in ("config.json", "generation_config.json"):
        new_cfg = json.loads((tmp_path / "model" / name).read_text())
        old_cfg = json.loads((TINY_DIR / "model" / name).read_text())
        new_cfg.pop("transformers_version", None)
        old_cfg.pop("transformers_version", None)
        assert new_cfg == old_cfg, name
