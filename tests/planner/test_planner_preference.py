"""What the planner counts for a preference recipe: each pair as its two rows, and DPO's reference forward.

The memory side is measured, not modelled: the dry run runs the objective the real run runs (DPO's reference forward
under ``no_grad``, then the policy's), checked against a real DPO step on gloo in
``tests/planner/test_planner_dryrun.py`` (the ``dpo_lora_fsdp2`` layout of
``lightning_plugins.testing.memory_layouts``).
Here: the recipe's batch sizes, and the step-time model against hand arithmetic (a full step's FLOPs are three
forwards' worth, so one more forward adds a third).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import LlamaConfig

from lightning_plugins import MemoryOptions, ParallelLayout
from lightning_plugins.planner.hardware import cluster_from
from lightning_plugins.planner.report import step_time
from lightning_plugins.planner.workload import Workload
from lightning_plugins.preference.options import PreferenceOptions

ROOT = Path(__file__).parents[2]
CONFIG = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                     num_key_value_heads=8, vocab_size=32000)  # fmt: skip


def test_a_preference_recipe_plans_each_pair_as_two_rows() -> None:
    from lightning_plugins.recipe.schema import load_recipe

    recipe = load_recipe(ROOT / "recipes" / "tiny" / "dpo_lora_fsdp2.yaml")
    workload = Workload.from_recipe(recipe)
    assert workload.objective.method == "dpo" and workload.rows_per_sample == 2
    assert workload.micro_batch_size == 2 * recipe.train.micro_batch_size
    assert workload.global_batch_size == 2 * recipe.samples_per_step
    sft_recipe = load_recipe(ROOT / "recipes" / "tiny" / "full_tp2.yaml")
    sft = Workload.from_recipe(sft_recipe)
    assert sft.objective.method == "sft" and sft.micro_batch_size == sft_recipe.train.micro_batch_size


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
