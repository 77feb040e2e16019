"""The recipe's ``objective:`` section: what a preference method refuses before any process starts, and the shipped
tiny DPO recipe through ``lightning-plugins finetune``."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
import yaml

from _tiny_recipe import tiny_recipe

from lightning_plugins.errors import RecipeError
from lightning_plugins.preference import PreferenceOptions
from lightning_plugins.recipe.schema import load_recipe
from lightning_plugins.testing.world import run_command

TINY = Path(__file__).parents[2] / "recipes" / "tiny"
RECIPE = TINY / "dpo_lora_fsdp2.yaml"


def _recipe(tmp_path: Path, drop: tuple[str, ...] = (), **changes: dict) -> Path:
    return tiny_recipe(tmp_path, RECIPE, drop, **changes)


def test_the_shipped_recipe_is_one_typed_object() -> None:
    recipe = load_recipe(RECIPE)
    assert recipe.objective == PreferenceOptions(method="dpo", beta=0.1, loss_type="sigmoid")
    assert load_recipe(TINY / "lora_tp2.yaml").objective.method == "sft"  # SFT stays the default


@pytest.mark.parametrize(
    ("drop", "changes", "match"),
    [
        ((), {"objective": {"reference": "copy"}}, r"objective\.reference: .*'model'"),
        ((), {"data": {"packing": True}, "objective": {"reference": "precomputed"}},
         r"packed preference pairs do not train with objective\.reference: precomputed yet; set data\.packing: false"),
        ((), {"data": {"format": "chat"}}, r"objective\.method=dpo trains on chosen/rejected pairs; set data\.format"),
        ((), {"objective": {"method": "sft"}}, r"data\.format: preference trains a preference method"),
        ((), {"objective": {"beta": 0}}, r"objective: .*objective\.beta must be > 0"),
        ((), {"objective": {"loss_type": "robust", "label_smoothing": 0.5}}, r"label_smoothing must be in \[0, 0\.5\)"),
        ((), {"objective": {"metod": "dpo"}}, r"objective\.metod: unknown key; did you mean `method`\?"),
    ],
)
def test_what_a_preference_recipe_refuses(tmp_path: Path, drop: tuple, changes: dict, match: str) -> None:
    path = _recipe(tmp_path, drop, **changes)
    with pytest.raises(RecipeError, match=match) as err:
        load_recipe(path)
    assert str(path) in str(err.value)


def test_context_parallel_layouts_are_taken(tmp_path: Path) -> None:
    recipe = load_recipe(_recipe(tmp_path, layout={"dp_shard_size": 1, "cp_size": 2}, parallel={"cp_backend": "ring"}))
    assert recipe.layout.cp_size == 2 and recipe.objective.method == "dpo"


def test_packed_pairs_are_taken(tmp_path: Path) -> None:
    """data.packing with a paired method: whole pairs per packed row (tests/preference/test_packed_pairs.py)."""
    recipe = load_recipe(_recipe(tmp_path, data={"packing": True}, layout={"dp_shard_size": 1, "cp_size": 2}))
    assert recipe.data.packing and recipe.layout.cp_size == 2 and recipe.objective.method == "dpo"


def test_a_full_fine_tune_under_pipeline_parallelism_is_taken(tmp_path: Path) -> None:
    """DPO without LoRA under PP: its frozen reference copy is split into the policy's stages
    (tests/preference/test_dpo_pipeline.py)."""
    recipe = load_recipe(_recipe(tmp_path, ("lora",), layout={"dp_shard_size": 1, "pp_size": 2}))
    assert recipe.layout.pp_size == 2 and recipe.lora is None and recipe.objective.method == "dpo"


def test_reference_free_methods_need_no_adapters(tmp_path: Path) -> None:
    assert load_recipe(_recipe(tmp_path, ("lora",), objective={"method": "orpo"})).objective.method == "orpo"


def test_a_full_fine_tunes_frozen_reference_is_planned_as_the_parameters_again(tmp_path: Path) -> None:
    """DPO without ``lora:``: the reference is a frozen copy sharded like the model, so each rank holds its parameters
    twice (no second gradient or optimizer state); with LoRA the reference is the base itself (no copy)."""
    from lightning_plugins.planner.dryrun import resident_state
    from lightning_plugins.planner.workload import Workload

    full = load_recipe(_recipe(tmp_path, ("lora",)))
    sft = load_recipe(_recipe(tmp_path, ("lora",), objective={"method": "simpo"}))  # the same model, no reference
    assert full.objective.frozen_copy(full.lora) and not load_recipe(RECIPE).objective.frozen_copy(
        load_recipe(RECIPE).lora
    )
    (_, _, dpo_state), *_ = resident_state(Workload.from_recipe(full))
    (_, _, free_state), *_ = resident_state(Workload.from_recipe(sft))
    assert dpo_state["parameters"] == 2 * free_state["parameters"] > 0
    assert dpo_state["gradients"] == free_state["gradients"] and dpo_state["optimizer"] == free_state["optimizer"]


@pytest.mark.slow
def test_the_tiny_dpo_recipe_runs_through_finetune(tmp_path: Path) -> None:
    out = tmp_path / "out"
    command = [sys.executable, "-m", "lightning_plugins", "finetune", str(RECIPE), f"--train.output_dir={out}"]
    result = run_command(command, cwd=tmp_path)
    assert "Warning" not in result.stdout + result.stderr
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    logged = {key for row in rows for key, value in row.items() if value}
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected", "logits/chosen", "logits/rejected"):  # fmt: skip
        assert f"train/{name}" in logged and f"val/{name}" in logged
    assert (out / "adapter" / "adapter_config.json").exists()


def _validation(out: Path) -> list[dict[str, float]]:
    rows = csv.DictReader((out / "metrics.csv").open())
    return [{key: float(value) for key, value in row.items() if key.startswith("val/") and value} for row in rows
            if row.get("val/loss")]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("cp2", ["--layout.dp_shard_size=1", "--layout.cp_size=2", "--parallel.cp_backend=ring"]),
        ("pp2", ["--layout.dp_shard_size=1", "--layout.pp_size=2", "--parallel.pp_microbatches=2"]),
    ],
)
def test_dpo_under_context_or_pipeline_parallelism_evaluates_as_under_fsdp2(
    tmp_path: Path, name: str, overrides: list[str]
) -> None:
    """The tiny DPO recipe through ``lightning-plugins finetune`` under CP=2 (ring: every rank holds a shard of every
    row), under PP=2 (1F1B, each pair's two rows in one of 2 pipeline micro-batches, the loss on the last stage) and
    under FSDP2=2: the same held-out metrics after the same steps. FSDP2's micro-batches hold 2 pairs a rank, so each
    global micro-batch holds the 4 pairs CP's and PP's do (epoch means of per-batch means depend on the grouping)."""
    short = ["--train.max_steps=6", "--train.eval_every=3"]
    for run, extra in {"fsdp2": ["--train.micro_batch_size=2"], name: overrides}.items():
        command = [sys.executable, "-m", "lightning_plugins", "finetune", str(RECIPE),
                   f"--train.output_dir={tmp_path / run}", *short, *extra]  # fmt: skip
        result = run_command(command, cwd=tmp_path)
        assert "Warning" not in result.stdout + result.stderr
    want, got = _validation(tmp_path / "fsdp2"), _validation(tmp_path / name)
    assert len(want) == len(got) == 2 and all(row.keys() == want[0].keys() for row in want + got)
    assert max(abs(row[key] - other[key]) for row, other in zip(got, want) for key in row) <= 1e-5, (got, want)


def _moe_dpo_recipe(root: Path) -> Path:
    """The tiny DPO recipe on a tiny Qwen3-MoE (the tiny tokenizer, 4 experts, top-2, its router's balance loss on
    with a large coefficient), LoRA on attention and on the routed experts' fused weights."""
    import json
    import shutil

    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    base = json.loads((TINY / "model" / "config.json").read_text())
    shared = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")  # fmt: skip
    torch.manual_seed(0)
    config = Qwen3MoeConfig(**{key: base[key] for key in shared}, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32, output_router_logits=True, router_aux_loss_coef=0.5)  # fmt: skip
    Qwen3MoeForCausalLM(config).save_pretrained(root / "model", save_original_format=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(TINY / "model" / name, root / "model" / name)
    raw = yaml.safe_load(RECIPE.read_text())
    raw["model"]["path"] = str(root / "model")
    raw["data"].update(train=str(TINY / "data/preference_train.jsonl"), eval=str(TINY / "data/preference_eval.jsonl"))
    raw["lora"]["target_parameters"] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    (root / "moe_dpo.yaml").write_text(yaml.safe_dump(raw))
    return root / "moe_dpo.yaml"


@pytest.mark.slow
def test_dpo_under_expert_parallelism_evaluates_as_under_fsdp2(tmp_path: Path) -> None:
    """The DPO recipe on a tiny mixture of experts through ``lightning-plugins finetune``, its experts split over EP=2
    (the data ranks) and under FSDP2=2 alone: the same held-out metrics after the same steps, the router's balance
    loss in the loss and logged (``aux_loss``, as TRL logs it)."""
    recipe = _moe_dpo_recipe(tmp_path)
    for name, overrides in {"fsdp2": [], "ep2": ["--layout.ep_size=2"]}.items():
        command = [sys.executable, "-m", "lightning_plugins", "finetune", str(recipe),
                   f"--train.output_dir={tmp_path / name}", "--train.max_steps=6", "--train.eval_every=3",
                   *overrides]  # fmt: skip
        result = run_command(command, cwd=tmp_path)
        assert "Warning" not in result.stdout + result.stderr
    want, got = _validation(tmp_path / "fsdp2"), _validation(tmp_path / "ep2")
    assert len(want) == len(got) == 2 and all(row.keys() == want[0].keys() for row in want + got)
    assert "val/aux_loss" in want[0], want[0]
    assert max(abs(row[key] - other[key]) for row, other in zip(got, want) for key in row) <= 1e-5, (got, want)
