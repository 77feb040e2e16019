"""The dry run of a model with Gated DeltaNet linear attention (Qwen3.5) against a real run of the same layout.

Qwen3.5 puts linear attention in three layers of four: its layers hold a recurrent state per head and a causal conv
instead of a KV cache, and their activations are the chunked delta rule's. The dry run measures them as it measures
any layer (the measured copies keep the stack's pattern: ``Workload.with_layers`` cuts ``layer_types``), so its
peak must be a real run's, moment by moment, as ``test_planner_dryrun.py`` checks for Llama.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_plugins import MemoryOptions, ParallelLayout, parallelize
from lightning_plugins.planner import rank_memory
from lightning_plugins.planner.dryrun import LINEAR_ATTENTION_NOTE, dry_run
from lightning_plugins.planner.workload import Workload
from lightning_plugins.testing.world import run_world

SEQ_LEN, ROWS, WORLD = 128, 2, 2
LAYOUTS = {
    "fsdp2": (ParallelLayout(dp_shard_size=2), MemoryOptions()),
    "fsdp2_ac_full": (ParallelLayout(dp_shard_size=2), MemoryOptions(activation_checkpointing="full")),
}


def _config() -> Any:
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        vocab_size=512,
        use_cache=False,
    )


def _measure(rank: int, world_size: int, out_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    from lightning_plugins.parallel import mesh_of
    from lightning_plugins.planner.measure import measure_step_memory

    results = {}
    for name, (layout, memory) in LAYOUTS.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_config(), dtype=torch.float32).train()
        model = parallelize(model, layout, memory=memory)
        gen = torch.Generator().manual_seed(1000 + mesh_of(model)["dp"].get_local_rank())
        ids = torch.randint(0, 512, (ROWS, SEQ_LEN), generator=gen)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        results[name] = measure_step_memory(model, optimizer, batch)["intervals"]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.mark.slow  # two gloo ranks and two dry runs of the torch reference kernels: about 2 minutes on 2 cores
def test_dry_run_of_linear_attention_predicts_a_real_run() -> None:
    with tempfile.TemporaryDirectory() as out_dir:
        run_world(_measure, WORLD, out_dir)
        real = json.loads(Path(out_dir, "rank0.json").read_text())
    for name, (layout, memory) in LAYOUTS.items():
        workload = Workload(
            _config(), layout.resolve(WORLD), memory=memory, dtype="fp32", seq_len=SEQ_LEN, micro_batch_size=ROWS
        )
        [predicted] = dry_run(workload)
        assert LINEAR_ATTENTION_NOTE in predicted.notes
        truths = [dict(interval) for interval in real[name]]
        for truth in truths:
            truth["other"] += truth.pop("buffers")
        assert len(predicted.intervals) == len(truths), f"{name}: {predicted.intervals} vs {truths}"
        for index, (guess, truth) in enumerate(zip(predicted.intervals, truths)):
            where = f"{name} interval {index}: predicted {guess}, measured {truth}"
            assert guess["total"] == pytest.approx(truth["total"], rel=0.10), where
            distance = sum(abs(guess[k] - truth[k]) for k in rank_memory.PEAK_CATEGORIES)
            assert distance <= 0.15 * truth["total"], where


@pytest.mark.slow  # forked fake-process-group dry runs of the torch reference kernels: about a minute on 2 cores
@pytest.mark.parametrize(
    "sizes,backend,key_heads",
    [({"cp_size": 2}, "ring", 2), ({"cp_size": 2, "tp_size": 2}, "ring", 2), ({"cp_size": 2, "tp_size": 2}, "ulysses", 4)],
    ids=["cp2-ring", "cp2xtp2-ring", "cp2xtp2-ulysses"],
)
def test_dry_run_of_linear_attention_under_context_parallelism(sizes: dict, backend: str, key_heads: int) -> None:
    """The linear attention's context-parallel paths run on fake tensors too (the documents of the rows are read only
    from real position ids; the dry run plans unpacked rows), alone and inside the tensor-parallel head split."""
    from lightning_plugins import ParallelOptions

    config = _config()
    config.linear_num_key_heads, config.linear_num_value_heads = key_heads, 2 * key_heads
    layout = ParallelLayout(**sizes).resolve(sizes["cp_size"] * sizes.get("tp_size", 1))
    workload = Workload(
        config, layout, ParallelOptions(cp_backend=backend), dtype="fp32", seq_len=SEQ_LEN, micro_batch_size=ROWS
    )
    [predicted] = dry_run(workload)
    assert LINEAR_ATTENTION_NOTE in predicted.notes and predicted.intervals[0]["total"] > 0
