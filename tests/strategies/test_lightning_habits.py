"""A module written for Lightning's ``ModelParallelStrategy`` runs on this project's strategies with one changed name.

Lightning's TP guide (``parallelize_module(self.model, self.device_mesh["tensor_parallel"], plan)`` in
``configure_model``) under ``TensorParallelStrategy(tp_size=2)``, and ``ParallelismStrategy(data_parallel_size=1,
tensor_parallel_size=2)``: both train like one process (see tests/scripts/lightning_habits.py); the mesh has
Lightning's ``data_parallel`` / ``tensor_parallel`` next to the engine's names; a dimension the strategy cannot add to
a model parallelized by hand is refused by name.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _world import run_script

from lightning_plugins import LayoutError
from lightning_plugins.strategies import ParallelismStrategy, TensorParallelStrategy

SCRIPT = Path(__file__).parents[1] / "scripts" / "lightning_habits.py"
TOL = 1e-5


def test_model_parallel_strategy_modules_train_like_one_process(tmp_path: Path) -> None:
    results = run_script(SCRIPT, tmp_path, "--devices", "2")
    for name in ("tp guide", "lightning sizes"):
        case = results[name]
        assert case["steps"] == 3 and case["tp_size"] == 2, (name, case)
        assert case["loss_diff"] <= TOL and case["weight_diff"] <= TOL, (name, case)
        assert case["mesh"] == {"data_parallel": 1, "tensor_parallel": 2, "dp": 1, "tp": 2}, (name, case)
    assert results["tp guide"]["configure_model_saw"] == {"data_parallel": 1, "tensor_parallel": 2}
    refused = results["pp refused"]
    assert "parallelized its LlamaForCausalLM itself" in refused and "cannot add pp_size=2" in refused, refused


def test_lightning_size_names() -> None:
    assert ParallelismStrategy(data_parallel_size=2, tensor_parallel_size=4).layout.tp_size == 4
    assert ParallelismStrategy(data_parallel_size=2, tensor_parallel_size=4).layout.dp_shard_size == 2
    assert ParallelismStrategy(data_parallel_size="auto").layout.dp_shard_size == -1
    assert TensorParallelStrategy(tensor_parallel_size=2).layout.tp_size == 2
    with pytest.raises(LayoutError, match=r"tensor_parallel_size=2 \(Lightning's name\) and tp_size=4 disagree"):
        ParallelismStrategy(tp_size=4, tensor_parallel_size=2)
