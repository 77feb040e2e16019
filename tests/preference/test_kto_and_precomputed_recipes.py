"""KTO and a precomputed DPO reference through recipes: what a recipe refuses before any process starts, records of
the other kind refused naming file and line, what the planner counts, and (slow) both through
``lightning-plugins finetune``: the precomputed reference trains as the per-step one, KTO logs TRL's metrics."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import yaml
from _tiny_recipe import tiny_recipe
from transformers import AutoTokenizer

from lightning_plugins.data import DataError
from lightning_plugins.errors import RecipeError
from lightning_plugins.preference import PreferenceOptions
from lightning_plugins.preference.precomputed import code_identity
from lightning_plugins.recipe.build import build_loaders
from lightning_plugins.recipe.schema import load_recipe
from lightning_plugins.testing.world import run_command

TINY = Path(__file__).parents[2] / "recipes" / "tiny"
KTO_RECIPE, DPO_RECIPE = TINY / "kto_lora_fsdp2.yaml", TINY / "dpo_lora_fsdp2.yaml"
#: TRL's KTOTrainer's logged metrics (TRL 1.16: its ``*_sum`` / ``count/*`` accumulators divided at log time).
KTO_METRICS = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
               "logits/chosen", "logits/rejected")  # fmt: skip


def _recipe(tmp_path: Path, source: Path, drop: tuple[str, ...] = (), **changes: dict) -> Path:
    return tiny_recipe(tmp_path, source, drop, cache=True, **changes)


def test_the_shipped_kto_recipe_is_one_typed_object() -> None:
    recipe = load_recipe(KTO_RECIPE)
    assert recipe.objective == PreferenceOptions(method="kto", beta=0.1, desirable_weight=1.0, undesirable_weight=1.0)
    assert recipe.data.format == "unpaired"


def test_a_kto_recipe_under_pipeline_parallelism_is_taken(tmp_path: Path) -> None:
    """KTO under PP runs through the schedule (lightning_plugins/preference/pipeline.py,
    tests/preference/test_dpo_pipeline.py)."""
    recipe = load_recipe(_recipe(tmp_path, KTO_RECIPE, (), layout={"dp_shard_size": 1, "pp_size": 2}))
    assert recipe.layout.pp_size == 2 and recipe.objective.method == "kto"


@pytest.mark.parametrize(
    ("source", "drop", "changes", "match"),
    [
        (KTO_RECIPE, (), {"data": {"format": "preference"}},
         r"objective\.method=kto trains on unpaired prompt/completion/label records; set data\.format: unpaired"),
        (KTO_RECIPE, (), {"data": {"packing": True}}, r"objective\.method=kto: preference records are not packed yet"),
        (KTO_RECIPE, (), {"objective": {"reference": "precomputed"}},
         r"objective\.reference: precomputed is for dpo: objective\.method=kto's KL rows"),
        (KTO_RECIPE, (), {"objective": {"method": "sft"}}, r"data\.format: unpaired trains a preference method"),
        (DPO_RECIPE, (), {"data": {"format": "unpaired"}},
         r"objective\.method=dpo trains on chosen/rejected pairs; set data\.format: preference"),
        (DPO_RECIPE, ("lora",), {"objective": {"method": "simpo", "reference": "precomputed"}},
         r"objective\.reference: precomputed, but objective\.method=simpo has no reference model"),
        (DPO_RECIPE, (), {"objective": {"reference": "precomputed"}, "layout": {"dp_shard_size": 1, "pp_size": 2}},
         r"objective\.reference: precomputed does not run under pipeline parallelism yet"),
    ],
)
def test_what_a_kto_or_precomputed_recipe_refuses(
    tmp_path: Path, source: Path, drop: tuple, changes: dict, match: str
) -> None:
    path = _recipe(tmp_path, source, drop, **changes)
    with pytest.raises(RecipeError, match=match) as err:
        load_recipe(path)
    assert str(path) in str(err.value)


def _loaders(tmp_path: Path, source: Path, train: Path, **objective: str):
    path = _recipe(tmp_path, source, objective=objective) if objective else _recipe(tmp_path, source)
    raw = yaml.safe_load(path.read_text())
    raw["data"].update(train=str(train), eval=None, format="auto")
    path.write_text(yaml.safe_dump(raw))
    return build_loaders(load_recipe(path), AutoTokenizer.from_pretrained(TINY / "model"))


@pytest.mark.parametrize(
    ("source", "data", "match"),
    [
        (KTO_RECIPE, "preference_train.jsonl", r"preference_train\.jsonl:1 is a chosen/rejected pair .* but"
         r" data\.format='unpaired' needs \['completion', 'label', 'prompt'\]"),
        (DPO_RECIPE, "kto_train.jsonl", r"kto_train\.jsonl:1 is an unpaired prompt/completion/label record \(TRL's KTO"
         r" format\), but data\.format='preference' needs \['chosen', 'rejected'\]"),
    ],
)
def test_records_of_the_other_kind_are_refused_naming_file_and_line(
    tmp_path: Path, source: Path, data: str, match: str
) -> None:
    with pytest.raises(DataError, match=match):
        _loaders(tmp_path, source, TINY / "data" / data)


def test_unpaired_records_are_not_trained_as_sft_and_a_missing_label_names_its_line(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"holds unpaired prompt/completion/label \(KTO\) records, but"
                       r" objective\.method=sft trains on prompt/completion or chat records.*data\.format:"
                       r" prompt_completion"):  # fmt: skip
        _loaders(tmp_path, KTO_RECIPE, TINY / "data" / "kto_train.jsonl", method="sft")
    records = [json.loads(line) for line in (TINY / "data" / "kto_train.jsonl").read_text().splitlines()]
    records[2].pop("label")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(record) + "\n" for record in records))
    with pytest.raises(DataError, match=r"bad\.jsonl:3: field 'label' must be true \(a desirable completion\)"):
        _loaders(tmp_path, KTO_RECIPE, bad)


def test_kto_batches_hold_rows_kl_rows_and_labels(tmp_path: Path) -> None:
    train, held = _loaders(tmp_path, KTO_RECIPE, TINY / "data" / "kto_train.jsonl")
    batch = next(iter(train))
    assert {"input_ids", "labels", "kl_input_ids", "kl_labels", "label"} <= batch.keys()
    assert batch["label"].shape == (load_recipe(KTO_RECIPE).train.micro_batch_size,) and held is None


def test_a_precomputed_reference_is_planned_without_its_copy_or_forward(tmp_path: Path) -> None:
    """A full fine-tune's DPO with ``objective.reference: precomputed`` holds no frozen copy (its parameters once, the
    frozen copy's twice) and its step time counts no reference forward; with ``model`` it holds and counts both."""
    from lightning_plugins.planner.dryrun import resident_state
    from lightning_plugins.planner.workload import Workload

    plans = {}
    for name, objective in {"precomputed": {"reference": "precomputed"}, "model": {}}.items():
        recipe = load_recipe(_recipe(tmp_path, DPO_RECIPE, ("lora",), objective=objective))
        (_, _, state), *_ = resident_state(Workload.from_recipe(recipe))
        plans[name] = (state["parameters"], recipe.objective.reference_per_step)
    assert plans["model"] == (2 * plans["precomputed"][0], True) and plans["precomputed"][1] is False


def test_a_precomputed_steps_loss_runs_no_reference() -> None:
    """The planner's measured step (``step_loss``) under ``reference: precomputed`` takes the batch's reference values:
    the base with its adapters disabled is never run."""
    import torch

    from lightning_plugins.adapters.lora import LoraOptions, apply_lora
    from lightning_plugins.planner.objective_step import step_loss
    from transformers import AutoModelForCausalLM

    model = apply_lora(AutoModelForCausalLM.from_pretrained(TINY / "model"), LoraOptions(r=4, alpha=8))

    def reference_forward() -> None:
        raise AssertionError("the reference ran")

    model.disable_adapter = reference_forward
    ids = torch.randint(4, 50, (4, 6))
    loss = step_loss(PreferenceOptions(method="dpo", reference="precomputed"), model, {"input_ids": ids, "labels": ids})
    assert loss.isfinite()
    with pytest.raises(AssertionError, match="the reference ran"):
        step_loss(PreferenceOptions(method="dpo"), model, {"input_ids": ids, "labels": ids})


def test_precomputed_values_are_kept_next_to_the_data_keyed_and_read_back(tmp_path: Path) -> None:
    """One process: the pass's values are written to the data cache; a second run with the same model, data and
    settings reads them without running the reference (the base with its adapters disabled); the same weights from
    another checkpoint directory are another key, whose run computes them anew."""
    import shutil

    import torch

    from lightning_plugins.recipe.build import build_model, make_objective

    raw = yaml.safe_load(_recipe(tmp_path, DPO_RECIPE, objective={"reference": "precomputed"}).read_text())
    raw["layout"], raw["hardware"]["devices"] = {"dp_shard_size": 1}, 1
    (tmp_path / "one.yaml").write_text(yaml.safe_dump(raw))
    recipe = load_recipe(tmp_path / "one.yaml")
    model, tokenizer = build_model(recipe, on_meta=False)
    train, held = build_loaders(recipe, tokenizer)
    batch = next(iter(train))
    first = make_objective(recipe, train, held)
    want, _ = first(model, batch)
    assert len(list((tmp_path / "cache" / "reference_logps").glob("*.safetensors"))) == 1
    assert first.table.shape == (len(train.dataset) + len(held.dataset), 2)

    def reference_forward() -> None:
        raise AssertionError("the reference ran")

    model.disable_adapter = reference_forward
    second = make_objective(recipe, train, held)
    got, _ = second(model, batch)
    assert torch.equal(second.table, first.table) and torch.equal(got, want)
    shutil.copytree(TINY / "model", tmp_path / "model")
    model.config.name_or_path = str(tmp_path / "model")
    with pytest.raises(AssertionError, match="the reference ran"):
        make_objective(recipe, train, held)(model, batch)


def _history(out: Path) -> list[dict[str, float]]:
    rows = csv.DictReader((out / "metrics.csv").open())
    return [{key: float(value) for key, value in row.items() if value and ("/" in key)} for row in rows]


@pytest.mark.slow
def test_a_precomputed_reference_trains_as_the_per_step_one_and_kto_logs_trls_metrics(tmp_path: Path) -> None:
    """Through ``lightning-plugins finetune`` (FSDP2 on 2 processes, LoRA): DPO with ``objective.reference:
    precomputed`` logs the per-step reference's losses and metrics (every training and held-out column of 6 steps)
    to 1e-6, both when its pass runs and when the next run reads its values back from the data cache (one file: the
    same key in another launch); KTO trains on the shipped unpaired records and logs TRL's metric names, training and
    held out."""
    short = ["--train.max_steps=6", "--train.eval_every=3", "--train.log_every=1", f"--data.cache_dir={tmp_path}/cache"]
    precomputed = (DPO_RECIPE, ["--objective.reference=precomputed"])
    runs = {"per_step": (DPO_RECIPE, []), "precomputed": precomputed, "read_back": precomputed, "kto": (KTO_RECIPE, [])}
    code = set()
    for run, (recipe, extra) in runs.items():
        command = [sys.executable, "-m", "lightning_plugins", "finetune", str(recipe),
                   f"--train.output_dir={tmp_path / run}", *short, *extra]  # fmt: skip
        if run in ("precomputed", "read_back"):
            code.add(code_identity())
        result = run_command(command, cwd=tmp_path)
        assert "Warning" not in result.stdout + result.stderr
    # Another key only where the package's code changed between the two launches (a checkout being edited meanwhile).
    assert len(list((tmp_path / "cache" / "reference_logps").glob("*.safetensors"))) == len(code)
    want = _history(tmp_path / "per_step")
    math = ("train/loss", "train/rewards", "train/logps", "train/logits", "train/grad_norm", "val/")  # not the timings
    compared = [(i, key) for i, row in enumerate(want) for key in row if key.startswith(math)]
    assert any(key.startswith("val/rewards") for _, key in compared)
    assert sum(key == "train/loss" for _, key in compared) == 6
    for run in ("precomputed", "read_back"):
        got = _history(tmp_path / run)
        assert len(want) == len(got) and [row.keys() for row in want] == [row.keys() for row in got]
        assert max(abs(got[i][key] - want[i][key]) for i, key in compared) <= 1e-6, (run, got, want)
    assert any(row.get("train/rewards/margins", 0) != 0 for row in want)  # the policy moved away from the reference
    logged = {key for row in _history(tmp_path / "kto") for key in row}
    assert {f"{split}/{name}" for split in ("train", "val") for name in KTO_METRICS} <= logged, logged
    losses = [row["train/loss"] for row in _history(tmp_path / "kto") if "train/loss" in row]
    assert len(losses) == 6 and len(set(losses)) > 1
