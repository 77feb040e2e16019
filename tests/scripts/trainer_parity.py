"""Run by tests/test_trainer_parity.py: `Trainer(strategy=...)` against a one-process reference.

Lightning's subprocess launcher re-runs this script once per rank, so one launch checks every case
(later Trainers reuse the launched ranks). Rank 0 writes the measured differences as JSON.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import (  # noqa: E402
    TIMEOUT,
    FineTune,
    check_resume,
    dataset,
    fit_results,
    full_weights,
    global_batches,
    make_trainer,
    script_args,
    sgd_steps,
    write_results,
)
from tiny_models import tiny_model  # noqa: E402

from lightning_plugins.strategies import ParallelismStrategy  # noqa: E402

STEPS, LOCAL_BATCH = 5, 2


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
    ],
    4: [
        ("llama tp2 x fsdp2", "llama", {"tp_size": 2, "dp_shard_size": 2}),
        ("qwen2 hsdp 2x2", "qwen2", {"dp_replicate_size": 2, "dp_shard_size": 2}),
    ],
}


def main() -> None:
    args = script_args()
    results = {}
    for name, family, options in CASES[args.devices]:
        reference_model = tiny_model(family)
        strategy = ParallelismStrategy(**options, timeout=TIMEOUT)
        dp = args.devices // options.get("tp_size", 1)
        data = dataset(LOCAL_BATCH * dp, reference_model.config.vocab_size)
        ref_losses, ref_weights = reference(copy.deepcopy(reference_model), data, dp)
        module = FineTune(copy.deepcopy(reference_model))
        trainer = make_trainer(strategy, args.devices, STEPS, enable_checkpointing=False)
        trainer.fit(module, DataLoader(data, batch_size=LOCAL_BATCH, shuffle=False))
        results[name] = fit_results(trainer, module, ref_losses, ref_weights)
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
    write_results(results, args.out)


if __name__ == "__main__":
    main()
