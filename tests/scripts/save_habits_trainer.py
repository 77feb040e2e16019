"""Run by tests/checkpoint/test_save_habits.py: after `trainer.fit`, the user saves the HF way, under several strategies.

`module.model.save_pretrained(out_dir, is_main_process=trainer.is_global_zero)` on every rank, for a transformers
model and for a peft `PeftModel`; then `export_hf` of the same trained model for comparison. One launch runs every
case (later Trainers reuse the launched ranks); rank 0 writes what each check measured as JSON.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import TIMEOUT, FineTune, dataset, make_trainer, script_args, write_results  # noqa: E402
from _saved import check_saved  # noqa: E402
from tiny_models import make_batch, tiny_model  # noqa: E402

from lightning_plugins.checkpoint.live_export import export_hf  # noqa: E402
from lightning_plugins.strategies import (  # noqa: E402
    ContextParallelStrategy,
    ParallelismStrategy,
    PipelineParallelStrategy,
    TensorParallelStrategy,
)

STEPS, LOCAL_BATCH = 3, 2
CASES = {  # name: (strategy, model family, LoRA, data-parallel ranks)
    "tp2": (lambda: TensorParallelStrategy(tp_size=2, timeout=TIMEOUT), "llama", False, 1),
    "pp2 tied": (
        lambda: PipelineParallelStrategy(pp_size=2, pp_schedule="1f1b", timeout=TIMEOUT), "llama_tied", False, 1
    ),
    "cp2 ring": (lambda: ContextParallelStrategy(cp_size=2, cp_backend="ring", timeout=TIMEOUT), "qwen2", False, 1),
    "fsdp2": (lambda: ParallelismStrategy(dp_shard_size=2, timeout=TIMEOUT), "llama", False, 2),
    "lora pp2": (lambda: PipelineParallelStrategy(pp_size=2, pp_schedule="1f1b", timeout=TIMEOUT), "llama", True, 1),
}


class LoraFineTune(FineTune):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


def build(family: str, lora: bool) -> torch.nn.Module:
    model = tiny_model(family)
    if not lora:
        return model
    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], init_lora_weights=False)
    return get_peft_model(model, config)  # random non-zero lora_B: the adapters change the loss


def main() -> None:
    args = script_args()
    root = args.out.parent
    results = {}
    for name, (make_strategy, family, lora, dp) in CASES.items():
        model = build(family, lora)
        module = (LoraFineTune if lora else FineTune)(copy.deepcopy(model))
        data = dataset(LOCAL_BATCH * dp, model.config.vocab_size)
        trainer = make_trainer(make_strategy(), args.devices, STEPS, enable_checkpointing=False)
        trainer.fit(module, DataLoader(data, batch_size=LOCAL_BATCH, shuffle=False))
        saved, exported = root / f"{name} saved", root / f"{name} exported"
        # The habit: every rank calls it, the global-zero rank writes.
        module.model.save_pretrained(saved, is_main_process=trainer.is_global_zero)
        export_hf(module.model, exported)
        batch = make_batch(4, 16, model.config.vocab_size, seed=99)
        results[name] = check_saved(module.model, saved, exported, batch, model, tiny_model(family) if lora else None)
        results[name]["written"] = sorted(p.name for p in saved.iterdir())
    write_results(results, args.out)


if __name__ == "__main__":
    main()
