"""Run by tests/strategies/test_configure_model.py: Lightning's ``configure_model`` pattern under every strategy.

Lightning's launcher re-runs this script once per rank, so one launch of 2 ranks runs every case under TP, PP, CP
and FSDP2 in turn. Each case trains the same model as the module without ``configure_model`` (the baseline, itself
checked against one process): the HF model built in ``configure_model`` on the meta device (each rank reads its
slices through ``load_from``) or plainly (through ``LightningCLI``, the strategy given as a class path); built in
``__init__`` with a ``configure_model`` that only builds when it is missing; a peft ``PeftModel`` built in
``configure_model``; and parallelized by ``configure_model`` itself, with its own settings (then validated: a second
entry point). ``bf16-mixed`` and ``bf16-true`` train the model built in ``configure_model`` in bf16. A layout the
model does not fit is refused with the layout's own error, before ``configure_model`` where the module holds its
model from the start, and before parallelizing where ``configure_model`` builds it. Rank 0 writes the results as
JSON.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import (  # noqa: E402
    ACCUM,
    MAX_NORM,
    TIMEOUT,
    FineTune,
    dataset,
    evaluate,
    full_weights,
    global_batches,
    make_trainer,
    max_diff,
    max_weight_diff,
    script_args,
    sgd_steps,
    step_losses,
    write_results,
)
from _counted import counted_settings_checks  # noqa: E402
from lora_trainer import LoraFineTune, lora_model  # noqa: E402
from tiny_models import CONFIGS, tiny_model  # noqa: E402

import lightning_plugins.strategies as strategies  # noqa: E402
from lightning_plugins import LayoutError, MemoryOptions, ParallelLayout, parallelize  # noqa: E402
from lightning_plugins.parallel.families import find_hf_model  # noqa: E402
from lightning_plugins.parallel import mesh_of  # noqa: E402

FAMILY, STEPS, LOCAL_BATCH = "llama_4l", 3, 2
#: The strategy class, its arguments, the data-parallel ranks, and a config change the layout cannot run.
CASES: dict[str, tuple[str, dict[str, Any], int, dict[str, Any] | None]] = {
    "tp2": ("TensorParallelStrategy", {"tp_size": 2}, 1, {"num_key_value_heads": 1}),
    "pp2": ("PipelineParallelStrategy", {"pp_size": 2, "pp_schedule": "1f1b"}, 1, {"num_hidden_layers": 1}),
    "cp2": ("ContextParallelStrategy", {"cp_size": 2, "cp_backend": "ulysses"}, 1, {"num_attention_heads": 1}),
    "fsdp2": ("ParallelismStrategy", {"dp_shard_size": 2}, 2, None),  # any HF model fits plain FSDP2
}


class Configured(LoraFineTune):
    """The pattern Lightning documents for large models: ``configure_model`` builds the model when the module does not
    hold one yet (``how``: ``"plain"``, ``"meta"``: on the meta device, or ``"lora"``: a peft ``PeftModel``) and does
    other work besides (counting its calls). Its optimizer takes the trainable parameters (all but a LoRA base)."""

    def __init__(self, model: torch.nn.Module | None = None, how: str = "plain", config: dict | None = None) -> None:
        super().__init__(model)
        self.how, self.config_change, self.configured = how, config or {}, 0

    def configure_model(self) -> None:
        self.configured += 1
        if self.model is not None:
            return
        if self.how == "lora":
            self.model = lora_model()
            return
        config = CONFIGS[FAMILY]()
        for key, value in self.config_change.items():
            setattr(config, key, value)
        with torch.device("meta" if self.how == "meta" else "cpu"):
            torch.manual_seed(0)  # what tiny_model draws
            self.model = AutoModelForCausalLM.from_config(config)  # bf16 under "bf16-true": Lightning's default dtype


class ParallelizesItself(FineTune):
    """The pattern documented before the strategies parallelized after ``configure_model``: it parallelizes the model
    itself, with its own settings (full activation checkpointing: the same math, other settings than the strategy's)."""

    def configure_model(self) -> None:
        parallelize(self.model, self.device_mesh, memory=MemoryOptions(activation_checkpointing="full"))


class CliFineTune(Configured):
    """A module ``LightningCLI`` builds from its arguments: the model comes from ``configure_model``, the data from
    ``train_dataloader``."""

    def __init__(self, dp: int = 1) -> None:
        super().__init__()
        self.dp = dp

    def train_dataloader(self) -> DataLoader:
        rows = dataset(LOCAL_BATCH * self.dp, CONFIGS[FAMILY]().vocab_size)
        return DataLoader(rows, batch_size=LOCAL_BATCH, shuffle=False)


def fit(module: FineTune, strategy: Any, data: list, **kwargs: Any) -> Any:
    trainer = make_trainer(strategy, 2, STEPS, enable_checkpointing=False, **kwargs)
    trainer.fit(module, DataLoader(data, batch_size=LOCAL_BATCH, shuffle=False))
    return trainer


def applied_layout(module: FineTune) -> dict[str, int]:
    """The sizes above 1 of the layout applied to the module's HF model (``{}`` when it was not parallelized: on
    identical batches, an unparallelized model matches one process too)."""
    mesh = mesh_of(find_hf_model(module, "test"))
    return {} if mesh is None else {k: v for k, v in asdict(ParallelLayout.from_mesh(mesh)).items() if v != 1}


def against(module: FineTune, baseline: FineTune, steps: int) -> dict:
    """Step losses and final weights of ``module`` against the ``baseline`` module's (largest over ranks)."""
    return {
        "loss_diff": max_diff(step_losses(module.micro_losses), step_losses(baseline.micro_losses)),
        "weight_diff": max_weight_diff(module.model, full_weights(baseline.model)),
        "steps": steps,
        "layout": applied_layout(module),
    }


def refusal(module: Configured, make_strategy: Any, data: list) -> dict:
    """The error a module whose model the layout cannot run gets, how often its ``configure_model`` ran by then, and
    whether its model was parallelized."""
    try:
        fit(module, make_strategy(), data)
        error = ""
    except LayoutError as err:
        error = str(err)
    return {
        "error": error,
        "configured": module.configured,
        "parallelized": module.model is not None and mesh_of(module.model) is not None,
    }


def cli_args(class_name: str, init_args: dict[str, Any], dp: int) -> list[str]:
    """``fit`` as a user types it: the strategy as a class path, its arguments as ``init_args``."""
    return [
        "fit",
        f"--trainer.strategy=lightning_plugins.strategies.{class_name}",
        *(f"--trainer.strategy.init_args.{key}={value}" for key, value in {**init_args, "timeout": TIMEOUT}.items()),
        "--trainer.accelerator=cpu",
        "--trainer.devices=2",
        f"--trainer.max_steps={STEPS}",
        f"--trainer.gradient_clip_val={MAX_NORM}",
        f"--trainer.accumulate_grad_batches={ACCUM}",
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        f"--model.dp={dp}",
    ]


def run_strategy(case: str, checkpoint: Path) -> dict[str, Any]:
    """Every pattern under one strategy, each against the same module without ``configure_model``."""
    class_name, init_args, dp, bad_config = CASES[case]
    strategy_class = getattr(strategies, class_name)

    def make_strategy(**extra: Any) -> Any:
        return strategy_class(**init_args, timeout=TIMEOUT, **extra)

    results: dict[str, Any] = {}
    data = dataset(LOCAL_BATCH * dp, CONFIGS[FAMILY]().vocab_size)
    reference = tiny_model(FAMILY)
    baseline = FineTune(copy.deepcopy(reference))
    fit(baseline, make_strategy(), data)
    trained = copy.deepcopy(reference)  # one process
    one_process = sgd_steps(trained, global_batches(data, dp, LOCAL_BATCH, epochs=1), STEPS)
    results["baseline"] = {
        "loss_diff": max_diff(step_losses(baseline.micro_losses), one_process),
        "weight_diff": max_weight_diff(baseline.model, full_weights(trained)),
        "moved": max_weight_diff(baseline.model, full_weights(reference)),
        "layout": applied_layout(baseline),
    }

    cases = {
        "built on meta in configure_model": (Configured(how="meta"), {"load_from": str(checkpoint)}),
        "built in __init__": (Configured(copy.deepcopy(reference)), {}),
    }
    for name, (module, extra) in cases.items():
        strategy = make_strategy(**extra)
        with counted_settings_checks() as checks:
            trainer = fit(module, strategy, data)
        results[name] = {**against(module, baseline, trainer.global_step), "configured": module.configured}
        results[name]["settings_checks"] = [[check, config is not None] for check, config in checks]  # with a config?

    itself = ParallelizesItself(copy.deepcopy(reference))
    trainer = fit(itself, make_strategy(), data)
    results["parallelized by configure_model"] = against(itself, baseline, trainer.global_step)
    val = dataset(LOCAL_BATCH * dp, CONFIGS[FAMILY]().vocab_size, batches=2, seed=100)
    expected = evaluate(trained.eval(), global_batches(val, dp, LOCAL_BATCH, epochs=1, shuffle=False))
    trainer.validate(itself, DataLoader(val, batch_size=LOCAL_BATCH, shuffle=False), verbose=False)
    results["parallelized by configure_model"]["validate_diff"] = max_diff(itself.val_losses, expected)

    if bad_config is not None:
        held = Configured(config=bad_config)
        held.configure_model()  # the module holds its model from the start: checked before configure_model runs
        results["refused early"] = refusal(held, make_strategy, data)
        results["refused after configure_model"] = refusal(Configured(config=bad_config), make_strategy, data)

    lora_baseline = LoraFineTune(lora_model())
    fit(lora_baseline, make_strategy(), data)
    lora = Configured(how="lora")
    trainer = fit(lora, make_strategy(), data)
    results["PeftModel built in configure_model"] = against(lora, lora_baseline, trainer.global_step)

    for precision in ("bf16-mixed", "bf16-true"):
        module = Configured()
        trainer = fit(module, make_strategy(), data, precision=precision)
        results[precision] = {
            "steps": trainer.global_step,
            "finite": bool(torch.isfinite(torch.tensor(module.micro_losses)).all()),
            "param_dtypes": sorted({str(p.dtype) for p in module.model.parameters()}),
            "weight_diff": max_weight_diff(module.model, full_weights(baseline.model)),
            "layout": applied_layout(module),
        }

    cli = LightningCLI(CliFineTune, args=cli_args(class_name, init_args, dp), save_config_kwargs={"overwrite": True})
    results["LightningCLI"] = {
        **against(cli.model, baseline, cli.trainer.global_step),
        "strategy": type(cli.trainer.strategy).__name__,
        "configured": cli.model.configured,
    }
    return results


def main() -> None:
    args = script_args(devices=False)
    checkpoint = args.out.parent / "checkpoint"  # what the meta-device case loads
    if not (checkpoint / "config.json").exists():  # written by the launching rank before it starts the others
        tiny_model(FAMILY).save_pretrained(checkpoint)
    write_results({case: run_strategy(case, checkpoint) for case in CASES}, args.out)


if __name__ == "__main__":
    main()
