"""`Trainer(strategy=ParallelismStrategy(...))` matches a one-process run; DCP resume continues exactly; a NaN loss in
the user's own module skips that step (``on_nonfinite="skip"``) as if its batches had never come.

Lightning re-launches a script per rank, so each world is one script run that checks several cases
(see tests/scripts/trainer_parity.py for the cases and the reference).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _launch import shared_script

SCRIPT = Path(__file__).parents[1] / "scripts" / "trainer_parity.py"
TOL = 1e-5


@pytest.mark.parametrize("devices", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_trainer_matches_one_process_and_resumes(
    devices: int, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> None:
    results = shared_script(request, tmp_path_factory, SCRIPT.name, devices)  # 2 ranks: one world with the others
    resume = results.pop("resume")
    skip = results.pop("skip", None)
    assert results, "no case ran"
    for name, case in results.items():
        assert case["steps"] == 5, name
        assert case["loss_diff"] <= TOL, (name, case)
        assert case["weight_diff"] <= TOL, (name, case)
        assert case["logged_diff"] == 0.0, (name, case)  # the logged loss is the global one on every rank
        assert case["settings_checks"] == 1, (name, case)  # one plan per run: its settings checked once
        if "moe_logged" in case:  # the routing balance over every rank equals one process's, token for token
            assert case["moe_logged"] == ["moe/load_max_over_mean", "moe/router_entropy"], (name, case)
            assert case["moe_counts_equal"] and case["moe_load_diff"] == 0.0, (name, case)
            assert case["moe_entropy_diff"] <= TOL, (name, case)
    assert resume["checkpoint_is_dir"] and not resume["partial_left"], resume
    assert resume["resumed_steps"] == 2, resume
    assert resume["loss_diff"] <= TOL and resume["weight_diff"] <= TOL, resume
    if devices == 2:  # the user's own module: the strategy's non-finite guard skips the step its NaN loss was in
        assert skip is not None and skip["skipped"] == 1 and skip["steps"] == 5, skip
        assert skip["loss_diff"] <= TOL and skip["weight_diff"] <= TOL, skip
