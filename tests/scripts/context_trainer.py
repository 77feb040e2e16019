"""Run by tests/strategies/test_context_trainer.py: `Trainer(strategy=ContextParallelStrategy(...))` against one process.

Lightning's subprocess launcher re-runs this script once per rank, so one launch checks every case.
The LightningModule is the user's, unchanged: it gets full-sequence batches (right padding, ``-100``
labels, a length not divisible by ``2 * cp``) and the strategy shards them along the sequence.
Rank 0 writes the measured differences as JSON.
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

from lightning_plugins.strategies import ContextParallelStrategy, ParallelismStrategy  # noqa: E402

STEPS, LOCAL_BATCH, SEQ, BATCHES = 3, 2, 15, 4  # 15 tokens: padded to 16 (2 * cp for cp=2 and 4, 2 * cp * tp)


def reference(model: torch.nn.Module, data: list[dict], dp: int) -> tuple[list[float], dict]:
    """One process, the whole global batch (attention mask applied), Lightning's accumulation and clipping."""
    losses = sgd_steps(model, global_batches(data, dp, LOCAL_BATCH, epochs=2), STEPS, must_clip=True)
    return losses, full_weights(model)


class SeesShards(FineTune):
    """Records the sequence length each rank's training_step receives."""

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.seen_lengths = getattr(self, "seen_lengths", set()) | {batch["input_ids"].shape[-1]}
        return super().training_step(batch, batch_idx)


CASES = {
    4: [
        ("ulysses cp2 x dp2", "llama", lambda: ContextParallelStrategy(cp_size=2, cp_backend="ulysses"), 2),
        ("ring cp4", "llama", lambda: ContextParallelStrategy(cp_size=4, cp_backend="ring"), 1),
        (
            "ParallelismStrategy ring cp2 x tp2",
            "llama",
            lambda: ParallelismStrategy(cp_size=2, tp_size=2, cp_backend="ring"),
            1,
        ),
        # Issue 27's families (4 layers, windows of 8 tokens in rows of 16): Gemma 2's soft-capped logits, its
        # query_pre_attn_scalar and local layers over ring's 8 chunks; Mistral's window under Ulysses.
        ("gemma2 ring cp4", "gemma2", lambda: ContextParallelStrategy(cp_size=4, cp_backend="ring"), 1),
        (
            "mistral_sw ulysses cp2 x dp2",
            "mistral_sw",
            lambda: ContextParallelStrategy(cp_size=2, cp_backend="ulysses"),
            2,
        ),
    ],
}


def main() -> None:
    args = script_args()
    results = {}
    for name, family, make_strategy, dp in CASES[args.devices]:
        reference_model = tiny_model(family)
        data = dataset(LOCAL_BATCH * dp, reference_model.config.vocab_size, seq=SEQ, batches=BATCHES)
        ref_losses, ref_weights = reference(copy.deepcopy(reference_model), data, dp)
        module = SeesShards(copy.deepcopy(reference_model))
        trainer = make_trainer(make_strategy(), args.devices, STEPS, enable_checkpointing=False)
        trainer.fit(module, DataLoader(data, batch_size=LOCAL_BATCH, shuffle=False))
        results[name] = {
            **fit_results(trainer, module, ref_losses, ref_weights),
            "seen_lengths": sorted(module.seen_lengths),
        }
    write_results(results, args.out)


if __name__ == "__main__":
    main()
