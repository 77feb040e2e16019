"""`Trainer(strategy=PipelineParallelStrategy(...))` matches one process; DCP resume continues exactly.

Lightning re-launches a script per rank, so each world is one script run that checks several cases
(see tests/scripts/pipeline_trainer.py for the cases and the reference).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _launch import shared_script

SCRIPT = Path(__file__).parents[1] / "scripts" / "pipeline_trainer.py"
TOL = 1e-5


@pytest.mark.parametrize("devices", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_pipeline_trainer_matches_one_process_and_resumes(
    devices: int, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> None:
    results = shared_script(request, tmp_path_factory, SCRIPT.name, devices)  # 2 ranks: one world with the others
    resumes = {name: results.pop(name) for name in list(results) if name.startswith("resume")}
    validate = results.pop("validate")
    assert results, "no case ran"
    for name, case in results.items():
        assert case["steps"] == 5, name
        assert case["loss_diff"] <= TOL, (name, case)
        assert case["weight_diff"] <= TOL, (name, case)
        assert case["logged_diff"] == 0.0, (name, case)  # the logged loss is the global one on every rank
        assert case["optimizer_params"] < case["model_params"], (name, case)  # only the stage's parameters
    # Sanity check (2 batches, initial weights) and the validation after epoch 0 (3 batches).
    assert validate["n"] == validate["expected_n"] == 5 and validate["loss_diff"] <= TOL, validate
    assert resumes, "no resume case ran"
    for name, resume in resumes.items():
        assert resume["checkpoint_is_dir"] and resume["resumed_steps"] == 2, (name, resume)
        assert resume["loss_diff"] <= TOL and resume["weight_diff"] <= TOL, (name, resume)
