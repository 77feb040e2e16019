"""Run by tests/strategies/test_lora_trainer.py: a peft-wrapped model in the user's LightningModule, every strategy.

The module is the user's (`get_peft_model` in its constructor, `self.model(**batch).loss`, an optimizer
over the trainable parameters); each strategy finds the PeftModel and trains its adapters exactly as one
process does, leaving the frozen base untouched. Rank 0 writes the largest differences as JSON.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import (  # noqa: E402
    LR,
    TIMEOUT,
    FineTune,
    dataset,
    full_weights,
    make_trainer,
    max_diff,
    max_over_ranks,
    max_weight_diff,
    reference_fit,
    script_args,
    step_losses,
    write_results,
)
from tiny_models import tiny_model  # noqa: E402

from lightning_plugins.strategies import (  # noqa: E402
    ContextParallelStrategy,
    ParallelismStrategy,
    PipelineParallelStrategy,
    TensorParallelStrategy,
)

STEPS, LOCAL_BATCH = 3, 4  # one epoch: 6 batches, 2 accumulated per step
CASES = {  # name: (strategy factory, data-parallel ranks)
    2: {
        "tp2": (lambda: TensorParallelStrategy(tp_size=2, timeout=TIMEOUT), 1),
        "tp2 no-sp": (
            lambda: TensorParallelStrategy(tp_size=2, sequence_parallel=False, loss_parallel=False, timeout=TIMEOUT),
            1,
        ),
        "fsdp2": (lambda: ParallelismStrategy(dp_shard_size=2, timeout=TIMEOUT), 2),
        "pp2": (lambda: PipelineParallelStrategy(pp_size=2, pp_schedule="1f1b", timeout=TIMEOUT), 1),
        "cp2 ulysses": (lambda: ContextParallelStrategy(cp_size=2, cp_backend="ulysses", timeout=TIMEOUT), 1),
        "cp2 ring": (lambda: ContextParallelStrategy(cp_size=2, cp_backend="ring", timeout=TIMEOUT), 1),
    },
    4: {
        "tp2 x fsdp2": (lambda: ParallelismStrategy(tp_size=2, dp_shard_size=2, timeout=TIMEOUT), 2),
        "fsdp2 full checkpointing": (
            lambda: ParallelismStrategy(dp_shard_size=4, activation_checkpointing="full", timeout=TIMEOUT),
            4,
        ),
    },
}


class LoraFineTune(FineTune):
    """What a LoRA user writes: only the trainable (adapter) parameters go to the optimizer."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=LR, momentum=0.9)


def lora_model() -> torch.nn.Module:
    torch.manual_seed(1)
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        init_lora_weights=False,
    )  # random non-zero lora_B: every adapter gets gradients
    return get_peft_model(tiny_model("llama_4l"), config)


def main() -> None:
    args = script_args()
    results = {}
    for name, (make_strategy, dp) in CASES[args.devices].items():
        reference = lora_model()
        base = {k: v.clone() for k, v in full_weights(reference).items() if "lora_" not in k}
        data = dataset(LOCAL_BATCH * dp, reference.config.vocab_size)
        module = LoraFineTune(copy.deepcopy(reference))
        trainer = make_trainer(make_strategy(), args.devices, STEPS, enable_checkpointing=False)
        trainer.fit(module, DataLoader(data, batch_size=LOCAL_BATCH, shuffle=False))
        ref_losses = reference_fit(reference, data, dp, STEPS, LOCAL_BATCH)
        trained = full_weights(module.model)
        optimizer_params = sum(p.numel() for g in trainer.optimizers[0].param_groups for p in g["params"])
        results[name] = {
            "loss_diff": max_diff(step_losses(module.micro_losses), ref_losses),
            "weight_diff": max_weight_diff(module.model, full_weights(reference)),
            "base_moved": max_over_ranks(
                max((trained[k] - v).abs().max().item() for k, v in base.items() if k in trained)
            ),
            "adapters_moved": max_over_ranks(
                max(
                    (trained[k] - w).abs().max().item()
                    for k, w in full_weights(lora_model()).items()
                    if "lora_" in k and k in trained
                )
            ),
            "optimizer_params": max_over_ranks(optimizer_params),  # DTensors count their global size
            "adapter_params": sum(p.numel() for p in reference.parameters() if p.requires_grad),
            "frozen_with_grad": max_over_ranks(
                sum(int(p.grad is not None) for p in module.parameters() if not p.requires_grad)
            ),
            "steps": trainer.global_step,
        }
    write_results(results, args.out)


if __name__ == "__main__":
    main()
