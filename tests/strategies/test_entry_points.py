"""fit -> validate -> test -> predict -> fit again on one LightningModule, under every strategy.

One launched world of 2 ranks runs the whole sequence for TP, PP, CP and FSDP2 (see
tests/scripts/entry_points.py) and compares every result with one process doing the same: the world the other 2-rank
Trainer scripts share (``_launch.shared_script``), so its ranks start and import once for all of them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _launch import shared_script

SCRIPT = Path(__file__).parents[1] / "scripts" / "entry_points.py"
TOL = 1e-5


def test_every_entry_point_after_fit(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> None:
    results = shared_script(request, tmp_path_factory, SCRIPT.name, 2)
    assert sorted(results) == ["cp2", "fsdp2", "pp2", "tp2"]
    for name, case in results.items():
        for key in ("fit_loss", "fit_weights", "validate", "validate_logged", "test", "test_logged", "refit_loss", "refit_weights"):
            assert case[key] <= TOL, (name, key, case)
        assert case["refit_steps"] == 2, (name, case)
        if name in ("tp2", "fsdp2"):  # greedy generation gives the one-process tokens
            assert case["predict_mismatched_batches"] == 0 and case["predict_new_tokens"] == 4, (name, case)
        else:
            assert case["predict"] <= TOL, (name, case)
            assert "Export the trained model" in case["generate_refusal"], (name, case)
    other = results["tp2"]["other_layout_error"]
    assert "already parallelized with ParallelLayout(" in other and "tp_size=2" in other and "dp_shard_size=2" in other, other
