"""Run by tests/strategies/test_trainer_parity.py: `Trainer(strategy=...)` against a one-process reference.

Lightning's subprocess launcher re-runs this script once per rank, so one launch checks every case
(later Trainers reuse the launched ranks). Rank 0 writes the measured differences as JSON.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import (  # noqa: E402
    ACCUM,
    TIMEOUT,
    FineTune,
    check_resume,
    dataset,
    fit_results,
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
from tiny_models import tiny_model  # noqa: E402

from lightning_plugins.parallel.moe.experts_balance import ExpertBalance  # noqa: E402
from lightning_plugins.strategies import ParallelismStrategy, TensorParallelStrategy  # noqa: E402
from lightning_plugins.strategies.balance import ExpertBalanceCallback  # noqa: E402

STEPS, LOCAL_BATCH = 5, 2
SKIPPED = 2  # the optimizer step (0-based) whose loss turns NaN on rank 1 in the user's module


class NanOnRankOne(FineTune):
    """The user's module, whose loss turns NaN on rank 1 in one micro-batch of step ``SKIPPED``: the strategy's
    non-finite guard (``on_nonfinite="skip"``) skips that optimizer step on every rank."""

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if batch_idx == SKIPPED * ACCUM and self.global_rank == 1 else loss


def check_skip(reference_model: torch.nn.Module, data: list[dict], dp: int, devices: int) -> dict:
    """A skipped step trains as if its micro-batches had never come: the one-process reference leaves them out."""
    batches = global_batches(data, dp, LOCAL_BATCH, epochs=2)
    del batches[SKIPPED * ACCUM : (SKIPPED + 1) * ACCUM]
    model = copy.deepcopy(reference_model)
    ref_losses = sgd_steps(model, batches, STEPS - 1)
    module = NanOnRankOne(copy.deepcopy(reference_model))
    strategy = ParallelismStrategy(tp_size=2, timeout=TIMEOUT, on_nonfinite="skip", max_skipped_steps=2)
    trainer = make_trainer(strategy, devices, STEPS, enable_checkpointing=False)
    trainer.fit(module, DataLoader(data, batch_size=LOCAL_BATCH, shuffle=False))
    losses = step_losses(module.micro_losses)
    del losses[SKIPPED]  # that step's loss was computed (before the NaN), its update skipped
    return {
        "loss_diff": max_diff(losses, ref_losses),
        "weight_diff": max_weight_diff(module.model, full_weights(model)),
        "skipped": strategy.nonfinite.skipped,
        "steps": trainer.global_step,
    }


def balance_results(trainer: L.Trainer, balance: ExpertBalance) -> dict:
    """The ``moe/*`` figures the strategy logged for the whole run (one log window) against one process's."""
    # Lightning keeps a logged float as a float32 tensor: the one-process figure, rounded the same way.
    want = {key: torch.tensor(value, dtype=torch.float32).item() for key, value in balance.read(reduce=False).items()}
    (callback,) = [c for c in trainer.callbacks if isinstance(c, ExpertBalanceCallback)]
    logged = {key: trainer.callback_metrics[key].item() for key in want if key in trainer.callback_metrics}
    return {
        "moe_logged": sorted(logged),
        "moe_load_diff": abs(logged.get("moe/load_max_over_mean", -1.0) - want["moe/load_max_over_mean"]),
        "moe_entropy_diff": abs(logged.get("moe/router_entropy", -1.0) - want["moe/router_entropy"]),
        "moe_counts_equal": torch.equal(callback.balance.last_counts, balance.last_counts),
    }


def reference(model: torch.nn.Module, data: list[dict], dp: int) -> tuple[list[float], dict]:
    """One process, the whole global batch, Lightning's accumulation and clipping semantics."""
    losses = sgd_steps(model, global_batches(data, dp, LOCAL_BATCH, epochs=2), STEPS)
    return losses, full_weights(model)


CASES = {
    2: [
        ("llama tp2", "llama", {"tp_size": 2}),
        ("qwen2 tp2", "qwen2", {"tp_size": 2}),
        ("llama tp2 no-sp", "llama", {"tp_size": 2, "sequence_parallel": False, "loss_parallel": False}),
        ("llama fsdp2", "llama", {"dp_shard_size": 2}),
        ("mixtral ep2", "mixtral", {"ep_size": 2}),
        # Issue 27: Phi-3's fused qkv/gate_up projections, its sequence-parallel plan derived from structure.
        ("phi3 TensorParallelStrategy tp2", "phi3", {"tp_size": 2}),
    ],
    4: [
        ("llama tp2 x fsdp2", "llama", {"tp_size": 2, "dp_shard_size": 2}),
        ("qwen2 hsdp 2x2", "qwen2", {"dp_replicate_size": 2, "dp_shard_size": 2}),
    ],
}


#: Cases run through a narrower door than ``ParallelismStrategy`` (same options).
DOORS = {"phi3 TensorParallelStrategy tp2": TensorParallelStrategy}


def main() -> None:
    args = script_args()
    results = {}
    for name, family, options in CASES[args.devices]:
        reference_model = tiny_model(family)
        strategy = DOORS.get(name, ParallelismStrategy)(**options, timeout=TIMEOUT)
        dp = args.devices // options.get("tp_size", 1)
        data = dataset(LOCAL_BATCH * dp, reference_model.config.vocab_size)
        ref_model = copy.deepcopy(reference_model)
        balance = ExpertBalance.of(ref_model)  # a mixture of experts: its routing, as one process counts it
        ref_losses, ref_weights = reference(ref_model, data, dp)
        module = FineTune(copy.deepcopy(reference_model))
        trainer = make_trainer(strategy, args.devices, STEPS, enable_checkpointing=False, log_every_n_steps=STEPS)
        with counted_settings_checks() as checks:
            trainer.fit(module, DataLoader(data, batch_size=LOCAL_BATCH, shuffle=False))
        results[name] = fit_results(trainer, module, ref_losses, ref_weights)
        results[name]["settings_checks"] = len(checks)  # the run's plan, resolved once with the model's config
        if balance is not None:
            results[name].update(balance_results(trainer, balance))
        if name == CASES[args.devices][0][0]:
            results["resume"] = check_resume(
                lambda options=options: ParallelismStrategy(**options, timeout=TIMEOUT),
                reference_model,
                args.devices,
                data,
                args.out.parent,
                local_batch=LOCAL_BATCH,
                steps=STEPS,
            )
    if args.devices == 2:
        model = tiny_model("llama")
        results["skip"] = check_skip(model, dataset(LOCAL_BATCH, model.config.vocab_size), 1, args.devices)
    write_results(results, args.out)


if __name__ == "__main__":
    main()
