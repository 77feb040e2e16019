"""What the planner counts for a preference recipe: each pair as its two rows (packed pairs: the packed rows), and
DPO's reference forward.

The memory side is measured, not modelled: the dry run runs the objective the real run runs (DPO's reference forward
under ``no_grad``, then the policy's), checked against a real DPO step on gloo in
``tests/planner/test_planner_dryrun.py`` (the ``dpo_lora_fsdp2`` layout of
``lightning_plugins.testing.memory_layouts``), and here against real steps of KTO (its four forwards), of DPO and KTO
under PP and of a full fine-tune's DPO (its frozen copy held) (``PREFERENCE_LAYOUTS``), interval by interval.
Here: the recipe's batch sizes, and the step-time model against hand arithmetic (a full step's FLOPs are three
forwards' worth, so one more forward adds a third).
"""

from __future__ import annotations

from pathlib import Path

from dataclasses import replace

import pytest
from transformers import LlamaConfig

from lightning_plugins import MemoryOptions, ParallelLayout
from lightning_plugins.planner import rank_memory
from lightning_plugins.planner.dryrun import dry_run
from lightning_plugins.planner.hardware import cluster_from
from lightning_plugins.planner.report import step_time
from lightning_plugins.planner.workload import Workload
from lightning_plugins.preference.options import PreferenceOptions

ROOT = Path(__file__).parents[2]
CONFIG = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                     num_key_value_heads=8, vocab_size=32000)  # fmt: skip


def test_a_preference_recipe_plans_each_pair_as_two_rows_or_packed_rows() -> None:
    from lightning_plugins.recipe.schema import load_recipe

    recipe = load_recipe(ROOT / "recipes" / "tiny" / "dpo_lora_fsdp2.yaml")
    workload = Workload.from_recipe(recipe)
    assert workload.objective.method == "dpo" and workload.rows_per_sample == 2
    assert workload.micro_batch_size == 2 * recipe.train.micro_batch_size
    assert workload.global_batch_size == 2 * recipe.samples_per_step
    sft_recipe = load_recipe(ROOT / "recipes" / "tiny" / "full_tp2.yaml")
    sft = Workload.from_recipe(sft_recipe)
    assert sft.objective.method == "sft" and sft.micro_batch_size == sft_recipe.train.micro_batch_size
    # Packed pairs (data.packing): the recipe's batch sizes count packed rows, each holding whole pairs.
    packed = Workload.from_recipe(recipe.model_copy(update={"data": replace(recipe.data, packing=True)}))
    assert packed.packed_pairs and packed.rows_per_sample == 1
    assert (packed.micro_batch_size, packed.global_batch_size) == (recipe.train.micro_batch_size,
                                                                   recipe.samples_per_step)  # fmt: skip


def _step(objective: str, memory: MemoryOptions = MemoryOptions()):
    workload = Workload(CONFIG, ParallelLayout().resolve(8), memory=memory, seq_len=2048, micro_batch_size=4,
                        global_batch_size=64, objective=PreferenceOptions(objective))  # fmt: skip
    return step_time(workload, cluster_from("H100", gpus=8, gpus_per_node=8))


def test_dpo_step_time_adds_the_reference_forward() -> None:
    """A full step runs forward and backward, 1 + 2 forwards' FLOPs; DPO's reference adds one forward: 4/3 of the
    compute. Recomputation is the policy's own (the reference keeps nothing to recompute). FSDP2 gathers every layer
    once more for the reference's forward, unless the parameters stay gathered after forward. SimPO runs no reference:
    the same step as SFT on the same rows."""
    sft, dpo, simpo = _step("sft"), _step("dpo"), _step("simpo")
    assert dpo.compute_s == pytest.approx(sft.compute_s * 4 / 3, rel=1e-9)
    assert simpo.compute_s == sft.compute_s and simpo.comm_s == sft.comm_s
    assert dpo.comm_s["fsdp"] > sft.comm_s["fsdp"]
    assert any("reference" in line for line in dpo.assumptions)
    assert not any("reference" in line for line in sft.assumptions)
    checkpointed = MemoryOptions(activation_checkpointing="full")
    assert _step("dpo", checkpointed).recompute_s == _step("sft", checkpointed).recompute_s > 0
    kept = MemoryOptions(reshard_after_forward=False)
    assert _step("dpo", kept).comm_s["fsdp"] == _step("sft", kept).comm_s["fsdp"]


def test_kto_step_time_adds_three_forwards() -> None:
    """KTO runs three forwards without backward (the policy's of the KL rows, the reference's of the rows and of the
    KL rows) before the policy's forward and backward: 3 + 3 forwards' FLOPs, twice SFT's; FSDP2 gathers every layer
    three more times."""
    sft, dpo, kto = _step("sft"), _step("dpo"), _step("kto")
    assert kto.compute_s == pytest.approx(sft.compute_s * 2, rel=1e-9)
    assert kto.comm_s["fsdp"] > dpo.comm_s["fsdp"] > sft.comm_s["fsdp"]
    assert any(line.startswith("KTO:") for line in kto.assumptions)
    assert not any(line.startswith("KTO:") for line in dpo.assumptions)


def _planned_against_measured(names: list[str]) -> dict[str, list[float]]:
    """Each layout run for real on gloo and dry-run on a fake process group, compared interval by interval as
    ``test_dry_run_predicts_the_peak_of_real_runs`` compares them (total within 10%, categories' L1 distance within
    15%, the peak within 10%); returns each layout's planned and measured peak (MiB) and intervals.

    Under PP a real step after the first holds both schedules' receive buffers from its start (the runtime keeps the
    last training and evaluation schedules; a DPO step runs both), while the dry run's step allocates them as it goes
    (as activations): its early intervals read up to those buffers (2 MiB here) lower, so there only the peak is
    compared (total within 10%, parameters and optimizer within 1%), with ``other`` folded into ``activations``."""
    from lightning_plugins.testing.memory_layouts import CONFIG, PREFERENCE_LAYOUTS, SEQ_LEN, measure_all

    real, peaks = measure_all(names), {}
    for name in names:
        spec = PREFERENCE_LAYOUTS[name]
        workload = Workload(LlamaConfig(**CONFIG), spec.layout.resolve(spec.world_size), spec.options, spec.memory,
                            spec.lora, dtype="fp32", seq_len=SEQ_LEN, micro_batch_size=spec.rows,
                            objective=spec.objective, packed_pairs=spec.packed_pairs)  # fmt: skip
        for predicted in dry_run(workload):
            truths = [dict(interval) for interval in real[name][f"rank{predicted.rank}"]["intervals"]]
            guesses = [dict(interval) for interval in predicted.intervals]
            for truth in truths:
                truth["other"] += truth.pop("buffers")
            for interval in (guesses + truths) if spec.layout.pp_size > 1 else []:
                interval["activations"] += interval.pop("other")
                interval["other"] = 0
            assert len(predicted.intervals) == len(truths), f"{name}: {predicted.intervals} vs {truths}"
            for index, (guess, truth) in enumerate(zip(guesses, truths) if spec.layout.pp_size == 1 else ()):
                where = f"{name} {predicted.kind} interval {index}: predicted {guess}, measured {truth}"
                assert guess["total"] == pytest.approx(truth["total"], rel=0.10), where
                distance = sum(abs(guess[k] - truth[k]) for k in rank_memory.PEAK_CATEGORIES)
                assert distance <= 0.15 * truth["total"], where
            at_peak = max(range(len(truths)), key=lambda index: truths[index]["total"])
            assert predicted.total == pytest.approx(truths[at_peak]["total"], rel=0.10), (name, guesses, truths)
            for key in ("parameters", "optimizer"):
                assert predicted.intervals[at_peak][key] == pytest.approx(truths[at_peak][key], rel=0.01), name
            peaks[f"{name} rank {predicted.rank}"] = [predicted.total / 2**20, truths[at_peak]["total"] / 2**20,
                                                      len(truths)]  # fmt: skip
    return peaks


@pytest.mark.slow
def test_preference_dry_runs_predict_real_steps() -> None:
    """Real steps on gloo against their dry runs: KTO (LoRA, FSDP2, 4 rows a rank with their KL rows: its four
    forwards), DPO on packed pairs (LoRA, FSDP2, 2 packed rows a rank, one pair each: transformers' block-diagonal mask
    of the packed sequences, under which SDPA expands the grouped keys and values), DPO under PP 1F1B (its reference
    through the forward-only schedule, then the training schedule: each stage's peak), KTO under PP 1F1B (three forward-only passes: the policy's of the KL rows, the reference's of the
    rows and of the KL rows; then the training schedule) and a full fine-tune's DPO (its frozen copy held all along,
    counted as parameters) under FSDP2 and under PP 1F1B (the copy split into the same stages, its own forward-only
    schedule)."""
    peaks = _planned_against_measured(["kto_lora_fsdp2", "dpo_lora_fsdp2_packed", "dpo_lora_pp2_1f1b",
                                       "kto_lora_pp2_1f1b", "dpo_full_fsdp2", "dpo_full_pp2_1f1b"])  # fmt: skip
    print(peaks)
    assert len(peaks) == 9, peaks
