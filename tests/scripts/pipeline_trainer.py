"""Run by tests/strategies/test_pipeline_trainer.py: `Trainer(strategy=PipelineParallelStrategy(...))` vs one process.

Lightning's subprocess launcher re-runs this script once per rank, so one launch checks every case.
The LightningModule is the user's, unchanged (`self.model(**batch).loss`); under the pipeline that call
runs forward and backward of the whole batch. Every rank holds different stages, so each difference is
the maximum over all ranks; rank 0 writes them as JSON.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import (  # noqa: E402
    FineTune,
    check_resume,
    dataset,
    evaluate,
    fit_results,
    full_weights,
    global_batches,
    make_trainer,
    max_over_ranks,
    script_args,
    sgd_steps,
    write_results,
)
from tiny_models import tiny_model  # noqa: E402

from lightning_plugins.strategies import ParallelismStrategy, PipelineParallelStrategy  # noqa: E402

STEPS, LOCAL_BATCH = 5, 4


def reference(model: torch.nn.Module, data: list[dict], dp: int, val: list[dict]) -> tuple[list, dict, list]:
    """One process: the losses per optimizer step, the final weights, and the validation losses
    Lightning computes (sanity check on the first 2 batches, then all batches after epoch 0's 3 steps)."""
    batches = global_batches(data, dp, LOCAL_BATCH, epochs=2)
    val_batches = global_batches(val, dp, LOCAL_BATCH, epochs=1, shuffle=False)
    val_losses = evaluate(model, val_batches[:2])

    def validate_after_epoch_0(step: int) -> None:
        if step == 3:
            val_losses.extend(evaluate(model, val_batches))

    losses = sgd_steps(model, batches, STEPS, before_step=validate_after_epoch_0)
    return losses, full_weights(model), val_losses


RING = {"cp_backend": "ring"}
CASES = {
    2: [
        ("llama 1f1b", "llama_4l", {"pp_schedule": "1f1b"}),
        ("llama gpipe m4", "llama_4l", {"pp_schedule": "gpipe", "pp_microbatches": 4}),
        ("qwen3 interleaved_1f1b", "qwen3_4l", {"pp_schedule": "interleaved_1f1b", "pp_microbatches": 2}),
        ("llama tied zbv", "llama_tied_4l", {"pp_schedule": "zbv_zero_bubble", "pp_microbatches": 2}),
        ("llama tied 1f1b", "llama_tied_4l", {"pp_schedule": "1f1b"}),
        # Issue 27: Gemma 3's scaled embedding (tied to the head), alternating local/global layers with their own
        # RoPE, q/k norms; the stages are read from the model's structure.
        ("gemma3 tied 1f1b", "gemma3", {"pp_schedule": "1f1b", "pp_microbatches": 2}),
    ],
    4: [
        ("llama pp2 x tp2 1f1b", "llama_4l", {"pp_schedule": "1f1b", "tp_size": 2}),
        ("llama pp2 x fsdp2 interleaved_1f1b", "llama_4l", {"pp_schedule": "interleaved_1f1b", "pp_microbatches": 2}),
        # Context-parallel stages through the general door (the batches are sharded along the sequence).
        ("ParallelismStrategy pp2 x cp2 ring 1f1b", "llama_4l", {"pp_schedule": "1f1b", "cp_size": 2, **RING}),
    ],
}

def make_strategy(options: dict) -> ParallelismStrategy:
    """``PipelineParallelStrategy(pp_size=2, ...)``; with ``cp_size``, ``ParallelismStrategy`` (same ``pp_*`` names)."""
    if "cp_size" not in options:
        return PipelineParallelStrategy(pp_size=2, **options)
    return ParallelismStrategy(pp_size=2, **options)


#: Cases that also stop at an epoch's end with a DCP checkpoint and resume (a tied embedding saves one
#: weight from two ranks).
RESUME_CASES = {"llama 1f1b", "llama tied 1f1b", "llama pp2 x tp2 1f1b"}


def main() -> None:
    args = script_args()
    results = {}
    for name, family, options in CASES[args.devices]:
        reference_model = tiny_model(family)
        dp = args.devices // (2 * options.get("tp_size", 1) * options.get("cp_size", 1))
        data = dataset(LOCAL_BATCH * dp, reference_model.config.vocab_size)
        val = dataset(LOCAL_BATCH * dp, reference_model.config.vocab_size, batches=3, seed=1000)
        ref_losses, ref_weights, ref_val = reference(copy.deepcopy(reference_model), data, dp, val)
        module = FineTune(copy.deepcopy(reference_model))
        strategy = make_strategy(options)
        trainer = make_trainer(strategy, args.devices, STEPS, enable_checkpointing=False)
        first = name == CASES[args.devices][0][0]
        val_loader = DataLoader(val, batch_size=LOCAL_BATCH, shuffle=False) if first else None
        trainer.fit(module, DataLoader(data, batch_size=LOCAL_BATCH, shuffle=False), val_loader)
        results[name] = {
            **fit_results(trainer, module, ref_losses, ref_weights),
            "optimizer_params": sum(p.numel() for g in trainer.optimizers[0].param_groups for p in g["params"]),
            "model_params": sum(p.numel() for p in reference_model.parameters()),
        }
        if name in RESUME_CASES:
            tmp = args.out.parent / name.replace(" ", "_")
            results[f"resume {name}"] = check_resume(
                lambda options=options: make_strategy(options),
                reference_model,
                args.devices,
                data,
                tmp,
                local_batch=LOCAL_BATCH,
                steps=STEPS,
            )
        if first:
            results["validate"] = {
                "n": len(module.val_losses),
                "loss_diff": max_over_ranks(max(abs(a - b) for a, b in zip(module.val_losses, ref_val))),
                "expected_n": len(ref_val),
            }
    write_results(results, args.out)


if __name__ == "__main__":
    main()
