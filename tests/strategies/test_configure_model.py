"""Lightning's ``configure_model`` pattern trains the same model under every strategy, and through ``LightningCLI``.

One launched world of 2 ranks runs every case under TP, PP, CP and FSDP2 (see tests/scripts/configure_model.py):
each against the same module without ``configure_model``, which is itself checked against one process; a model the
layout cannot run is refused with the layout's error before anything is parallelized.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning_plugins.testing.world import run_script

SCRIPT = Path(__file__).parents[1] / "scripts" / "configure_model.py"
TOL = 1e-5  # the baseline against one process
SAME = 1e-6  # a configure_model pattern against the baseline: the same computation
#: bf16 against fp32 after 3 steps: two bf16 spacings at the norm weights' 1.0 (bf16 keeps 8 significant bits)
BF16_TOL = 2**-6
PATTERNS = (
    "built on meta in configure_model",
    "built in __init__",
    "parallelized by configure_model",
    "PeftModel built in configure_model",
    "LightningCLI",
)
#: The error each layout gives the model it cannot run (plain FSDP2 runs any).
REFUSALS = {
    "tp2": "tp_size=2 does not divide num_key_value_heads=1",
    "pp2": "pp_size=2 exceeds num_hidden_layers=1",
    "cp2": "Ulysses context parallelism splits each rank's 1 attention heads over cp_size=2",
}
#: Each strategy's class (given to LightningCLI as a class path) and the layout it applies.
STRATEGIES = {
    "tp2": ("TensorParallelStrategy", {"tp_size": 2}),
    "pp2": ("PipelineParallelStrategy", {"pp_size": 2}),
    "cp2": ("ContextParallelStrategy", {"cp_size": 2}),
    "fsdp2": ("ParallelismStrategy", {"dp_shard_size": 2}),
}


@pytest.mark.slow
def test_configure_model_under_every_strategy(tmp_path: Path) -> None:
    results = run_script(SCRIPT, tmp_path)
    assert sorted(results) == sorted(STRATEGIES)
    for strategy, cases in results.items():
        class_name, layout = STRATEGIES[strategy]
        baseline = cases["baseline"]
        assert baseline["loss_diff"] <= TOL and baseline["weight_diff"] <= TOL, (strategy, baseline)
        assert baseline["layout"] == layout, (strategy, baseline)
        for name in PATTERNS:
            case = cases[name]
            assert case["steps"] == 3 and case["layout"] == layout, (strategy, name, case)
            assert case["loss_diff"] <= SAME and case["weight_diff"] <= SAME, (strategy, name, case)
            assert case.get("configured", 1) == 1, (strategy, name, case)  # configure_model ran once per fit
        # One plan per run, its settings checked once: resolved with the model's config when the module holds the
        # model, else resolved before configure_model (without it), and what the config adds checked once the model
        # exists.
        built_early = cases["built in __init__"]
        assert built_early["settings_checks"] == [["check_settings", True]], (strategy, built_early)
        built_later = cases["built on meta in configure_model"]
        assert built_later["settings_checks"] == [["check_settings", False], ["check_model_fit", True]], built_later
        # A second entry point keeps the settings the module's configure_model chose (validation ran).
        assert cases["parallelized by configure_model"]["validate_diff"] <= TOL, (strategy, cases)
        assert cases["LightningCLI"]["strategy"] == class_name, (strategy, cases["LightningCLI"])
        # bf16 trains the same model: within bf16 rounding of fp32, while training moved the weights far more.
        assert baseline["moved"] > 4 * BF16_TOL, (strategy, baseline)
        for precision, dtype in (("bf16-mixed", "torch.float32"), ("bf16-true", "torch.bfloat16")):
            case = cases[precision]
            assert case["steps"] == 3 and case["finite"] and case["layout"] == layout, (strategy, precision, case)
            assert case["param_dtypes"] == [dtype], (strategy, precision, case)
            assert case["weight_diff"] <= BF16_TOL, (strategy, precision, case)
        if strategy in REFUSALS:  # the layout's own error, never a hang or a half-parallelized model
            for name in ("refused early", "refused after configure_model"):
                case = cases[name]
                assert REFUSALS[strategy] in case["error"] and not case["parallelized"], (strategy, name, case)
                # Early: before configure_model ran (the script ran it once itself); after: once, by the Trainer.
                assert case["configured"] == 1, (strategy, name, case)
