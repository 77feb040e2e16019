"""A module written for Lightning's ``ModelParallelStrategy`` runs on this project's strategies with one changed name.

Lightning's TP guide (``parallelize_module(self.model, self.device_mesh["tensor_parallel"], plan)`` in
``configure_model``) under ``TensorParallelStrategy(tp_size=2)``, and ``ParallelismStrategy(data_parallel_size=1,
tensor_parallel_size=2)``: both train like one process (see tests/scripts/lightning_habits.py); the mesh has
Lightning's ``data_parallel`` / ``tensor_parallel`` next to the engine's names; a dimension the strategy cannot add to
a model parallelized by hand is refused by name; FSDP2 over the data ranks and activation checkpointing are added to it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _launch import shared_script
from lightning_plugins.testing.world import run_script

from lightning_plugins import LayoutError
from lightning_plugins.strategies import ParallelismStrategy, TensorParallelStrategy

SCRIPT = Path(__file__).parents[1] / "scripts" / "lightning_habits.py"
TOL = 1e-5


def test_model_parallel_strategy_modules_train_like_one_process(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> None:
    results = shared_script(request, tmp_path_factory, SCRIPT.name, 2)  # one world with the other 2-rank scripts
    for name in ("tp guide", "lightning sizes"):
        case = results[name]
        assert case["steps"] == 3 and case["tp_size"] == 2, (name, case)
        assert case["loss_diff"] <= TOL and case["weight_diff"] <= TOL, (name, case)
        assert case["mesh"] == {"data_parallel": 1, "tensor_parallel": 2, "dp": 1, "tp": 2}, (name, case)
    assert results["tp guide"]["configure_model_saw"] == {"data_parallel": 1, "tensor_parallel": 2}
    added = results["fsdp2 added"]
    assert added["steps"] == 3 and added["loss_diff"] <= TOL and added["weight_diff"] <= TOL, added
    assert added["sharded"] and added["checkpointed"] and added["q_proj_mesh"] == ["dp_shard_cp", "tensor_parallel"]
    refused = results["pp refused"]
    assert "parallelized its LlamaForCausalLM itself" in refused and "cannot add pp_size=2" in refused, refused


def test_lightning_size_names() -> None:
    assert ParallelismStrategy(data_parallel_size=2, tensor_parallel_size=4).layout.tp_size == 4
    assert ParallelismStrategy(data_parallel_size=2, tensor_parallel_size=4).layout.dp_shard_size == 2
    assert ParallelismStrategy(data_parallel_size="auto").layout.dp_shard_size == -1
    assert TensorParallelStrategy(tensor_parallel_size=2).layout.tp_size == 2
    with pytest.raises(LayoutError, match=r"tensor_parallel_size=2 \(Lightning's name\) and tp_size=4 disagree"):
        ParallelismStrategy(tp_size=4, tensor_parallel_size=2)


@pytest.mark.slow  # 4 ranks on a busy 2-core machine: 50-100 s; 2 ranks (dp 2, tp 1) run in the test above
def test_data_parallelism_added_to_a_module_split_by_hand(tmp_path: Path) -> None:
    """Lightning's TP guide module (TP only) gets FSDP2 over the data ranks and activation checkpointing from the
    strategy; Lightning's FSDP2 + TP example module keeps its own sharding: both train like one process (dp 2 x tp 2)."""
    results = run_script(SCRIPT.with_name("lightning_tp_fsdp.py"), tmp_path, "--devices", "4")
    for name in ("tp guide + fsdp2 by the strategy", "tp + fsdp2 guide"):
        case = results[name]
        assert case["steps"] == 3 and case["loss_diff"] <= TOL and case["weight_diff"] <= TOL, (name, case)
        assert case["layers_sharded"] and case["root_sharded"], (name, case)
    added = results["tp guide + fsdp2 by the strategy"]
    assert added["q_proj_mesh"] == ["dp_shard_cp", "tensor_parallel"] and added["checkpointed"], added
