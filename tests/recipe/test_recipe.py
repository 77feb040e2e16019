"""Recipes: every shipped one validates; every kind of mistake is one error naming file, key and fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lightning_plugins.cli import main
from lightning_plugins.recipe.schema import load_recipe
from lightning_plugins.errors import RecipeError
from lightning_plugins.recipe.build import lr_lambda

RECIPES = sorted((Path(__file__).parents[2] / "recipes").rglob("*.yaml"))
TINY = Path(__file__).parents[2] / "recipes" / "tiny"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_every_shipped_recipe_validates(path: Path) -> None:
    recipe = load_recipe(path)
    assert recipe.layout.world_size == recipe.hardware.world_size
    assert recipe.accumulation >= 1


def test_overrides_and_print_config(capsys: pytest.CaptureFixture) -> None:
    main(["finetune", str(TINY / "lora_tp2.yaml"), "--print-config", "--lora.r=32", "--train.max_steps", "7"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["lora"]["r"] == 32 and printed["train"]["max_steps"] == 7
    assert printed["lora"]["autocast_adapter_dtype"] is True  # peft's default
    assert printed["layout"]["dp_shard_size"] == 1  # resolved against hardware.devices
    assert Path(printed["data"]["train"]).is_absolute()


def test_lora_autocast_adapter_dtype_round_trips(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    main(["finetune", str(TINY / "lora_tp2.yaml"), "--print-config", "--lora.autocast_adapter_dtype=false"])
    printed = capsys.readouterr().out
    assert yaml.safe_load(printed)["lora"]["autocast_adapter_dtype"] is False
    (tmp_path / "printed.yaml").write_text(printed)  # the printed recipe loads as the same recipe
    assert load_recipe(tmp_path / "printed.yaml") == load_recipe(TINY / "lora_tp2.yaml", ["lora.autocast_adapter_dtype=false"])


def _recipe(tmp_path: Path, **changes: dict) -> Path:
    raw = yaml.safe_load((TINY / "full_tp2.yaml").read_text())
    raw["model"]["path"] = str(TINY / "model")
    raw["data"].update(train=str(TINY / "data" / "train.jsonl"), eval=str(TINY / "data" / "eval.jsonl"))
    for section, values in changes.items():
        raw.setdefault(section, {}).update(values)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"train": {"micro_batch_sise": 4}}, r"train\.micro_batch_sise: unknown key"),
        ({"bogus": {"x": 1}}, r"bogus: unknown key"),
        ({"layout": {"tp_size": "two"}}, r"layout\.tp_size: Input should be a valid integer"),
        ({"optim": {"lr": -1}}, r"optim\.lr: Input should be greater than 0"),
        ({"memory": {"activation_checkpointing": "some"}}, r"memory: activation_checkpointing='some' is not one of"),
        ({"data": {"train": "missing.jsonl"}}, r"data\.train: .*missing\.jsonl does not exist"),
        ({"model": {"path": "./no_such_model"}}, r"model\.path='\./no_such_model' is not a directory"),
        ({"layout": {"tp_size": 4}, "hardware": {"devices": 4}}, r"tp_size=4 does not divide num_attention_heads|num_key_value_heads=2"),
        ({"layout": {"tp_size": 3}}, r"hardware\.devices x hardware\.nodes = 2 processes: World size 2 is not divisible"),
        ({"layout": {"tp_size": 1, "pp_size": 4}, "hardware": {"devices": 4}}, r"pp_size=4 exceeds num_hidden_layers=2"),
        ({"train": {"micro_batch_size": 5}}, r"global_batch_size=16 is not a multiple of train\.micro_batch_size \(5\)"),
        ({"train": {"global_batch_tokens": 1024}}, r"give exactly one of global_batch_size .* and global_batch_tokens"),
        ({"train": {"epochs": 2}}, r"give exactly one of max_steps and epochs"),
        ({"layout": {"tp_size": 1, "pp_size": 2}, "parallel": {"pp_microbatches": 3}}, r"micro_batch_size=16 must divide into parallel\.pp_microbatches=3"),
        ({"train": {"merge_lora": True}}, r"train\.merge_lora is set but the recipe has no lora section"),
        ({"data": {"packing": True}, "model": {"attn_implementation": "paged|sdpa"}}, r"model\.attn_implementation with data\.packing"),
        ({"lora": {"r": 0}}, r"lora: lora r=0 must be a positive integer"),
        ({"lora": {"target_modules": ["qkv"]}}, r"lora: apply_lora: target_modules \['qkv'\] name no module of LlamaForCausalLM.*q_proj"),
        ({"lora": {"quantize": "nf4"}, "train": {"merge_lora": True}}, r"merge_lora with lora\.quantize: nf4"),
        ({"lora": {"quantize": "nf4"}, "parallel": {"compile": True, "float8": True}}, r"parallel\.float8 with lora\.quantize: nf4: .*Set parallel\.float8: false"),
        ({"train": {"preempt_signals": ["SIGTREM"]}}, r"train\.preempt_signals: unknown signal 'SIGTREM': did you mean SIGTERM\?"),
    ],
)
def test_recipe_errors_name_file_key_and_fix(tmp_path: Path, changes: dict, match: str) -> None:
    path = _recipe(tmp_path, **changes)
    with pytest.raises(RecipeError, match=match) as err:
        load_recipe(path)
    assert str(path) in str(err.value)


def test_bad_overrides(tmp_path: Path) -> None:
    path = _recipe(tmp_path)
    with pytest.raises(RecipeError, match=r"train\.bogus: unknown key"):
        load_recipe(path, ["train.bogus=1"])
    with pytest.raises(RecipeError, match=r"override 'lora' is not `section\.key=value`"):
        load_recipe(path, ["lora"])
    with pytest.raises(SystemExit):
        main(["finetune", str(path), "positional"])


def test_not_yaml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="no such recipe file"):
        load_recipe(tmp_path / "none.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(RecipeError, match="bad.yaml: not valid YAML"):
        load_recipe(bad)


def test_learning_rate_schedule() -> None:
    warm = [lr_lambda(s, 100, 10, "cosine", 0.1) for s in range(10)]
    assert warm == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert lr_lambda(10, 100, 10, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_lambda(100, 100, 10, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_lambda(55, 100, 10, "linear", 0.0) == pytest.approx(0.5)
    assert lr_lambda(99, 100, 0, "constant", 0.0) == 1.0


def test_version_is_the_installed_distributions(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"lightning-plugins {version('lightning_plugins')}"
