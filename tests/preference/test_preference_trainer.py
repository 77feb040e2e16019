"""DPO in the user's own LightningModule (``PreferenceObjective`` called in ``training_step``) under FSDP2, TP with
sequence and loss parallel, and ring context parallelism, and KTO (``KTOObjective``) under TP and CP, matches one
process in float64, every step clipping (tests/scripts/preference_trainer.py, one launched world of 2 ranks, shared
with the other Trainer scripts of that size)."""

from __future__ import annotations

import pytest
from _launch import shared_script

TOL = 1e-9  # float64 (preference_trainer.DTYPE: why)


def test_dpo_in_the_users_module_under_each_strategy(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> None:
    results = shared_script(request, tmp_path_factory, "preference_trainer.py", 2)
    assert sorted(results) == ["cp2 ring", "fsdp2", "kto cp2 ring", "kto tp2 sp+lp", "tp2 sp+lp"]
    for name, case in results.items():
        # 3 steps, each clipping (KTO's at a lower norm, preference_trainer.KTO_MAX_NORM: its gradients are smaller)
        assert case["steps"] == 3 and case["clipped"], (name, case)
        # metrics: preference_trainer.metrics_error
        assert case["loss_diff"] <= TOL and case["metrics_diff"] <= TOL, (name, case)
        assert case["adapter_diff"] <= TOL and case["logged_diff"] <= TOL, (name, case)
        assert case["metric_names_match"], (name, case)
        assert case["adapters_moved"] > 1e-2, (name, case)  # the adapters trained (0.09-0.24): parity means something
