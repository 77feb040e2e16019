"""Run by tests/test_context_trainer.py: `Trainer(strategy=ContextParallelStrategy(...))` against one process.

Lightning's subprocess launcher re-runs this script once per rank, so one launch checks every case.
The LightningModule is the user's, unchanged: it gets full-sequence batches (right padding, ``-100``
labels, a length not divisible by ``2 * cp``) and the strategy shards them along the sequence.
Rank 0 writes the measured differences as JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import make_batch, tiny_model  # noqa: E402
from trainer_parity import ACCUM, LOCAL_BATCH, MAX_NORM, FineTune, global_batches, max_weight_diff, step_losses  # noqa: E402

from lightning_plugins.strategies import ContextParallelStrategy, ParallelismStrategy  # noqa: E402

STEPS, SEQ, BATCHES = 3, 15, 4  # 15 tokens: padded to 16 (2 * cp for cp=2 and 4, 2 * cp * tp for cp2 x tp2)
LR = 1.0


def dataset(global_batch: int, vocab: int) -> list[dict]:
    rows = []
    for index in range(BATCHES):
        batch = make_batch(global_batch, SEQ, vocab, seed=index)  # rows of different valid lengths
        rows += [{k: v[i] for k, v in batch.items()} for i in range(global_batch)]
    return rows


def reference(model: torch.nn.Module, data: list[dict], dp: int) -> tuple[list[float], dict]:
    """One process, the whole global batch (attention mask applied), Lightning's accumulation and clipping."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    batches = global_batches(data, dp, epochs=2)
    losses = []
    for step in range(STEPS):
        step_loss = 0.0
        for micro in range(ACCUM):
            loss = model(**batches[step * ACCUM + micro]).loss
            (loss / ACCUM).backward()
            step_loss += loss.item() / ACCUM
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        assert norm > MAX_NORM, "the test must exercise clipping"
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_loss)
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


class SeesShards(FineTune):
    """Records the sequence length each rank's training_step receives."""

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.seen_lengths = getattr(self, "seen_lengths", set()) | {batch["input_ids"].shape[-1]}
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


CASES = {
    4: [
        ("ulysses cp2 x dp2", lambda: ContextParallelStrategy(cp_size=2, backend="ulysses"), 2),
        ("ring cp4", lambda: ContextParallelStrategy(cp_size=4, backend="ring"), 1),
        ("ParallelismStrategy ring cp2 x tp2", lambda: ParallelismStrategy(cp_size=2, tp_size=2, cp_backend="ring"), 1),
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results = {}
    for name, make_strategy, dp in CASES[args.devices]:
        reference_model = tiny_model("llama")
        data = dataset(LOCAL_BATCH * dp, reference_model.config.vocab_size)
        ref_losses, ref_weights = reference(copy.deepcopy(reference_model), data, dp)
        module = SeesShards(copy.deepcopy(reference_model))
        trainer = L.Trainer(
            accelerator="cpu",
            devices=args.devices,
            strategy=make_strategy(),
            max_steps=STEPS,
            gradient_clip_val=MAX_NORM,
            accumulate_grad_batches=ACCUM,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        trainer.fit(module, DataLoader(data, batch_size=LOCAL_BATCH, shuffle=False))
        results[name] = {
            "loss_diff": max(abs(a - b) for a, b in zip(step_losses(module.micro_losses), ref_losses, strict=True)),
            "weight_diff": max_weight_diff(module.model, ref_weights),
            "logged_diff": abs(trainer.callback_metrics["train_loss"].item() - module.micro_losses[-1]),
            "steps": trainer.global_step,
            "seen_lengths": sorted(module.seen_lengths),
        }
    if torch.distributed.get_rank() == 0:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
