"""Run by tests/test_trainer_parity.py: `Trainer(strategy=...)` against a one-process reference.

Lightning's subprocess launcher re-runs this script once per rank, so one launch checks every case
(later Trainers reuse the launched ranks). Rank 0 writes the measured differences as JSON.
"""

from __future__ import annotations

import argparse
from datetime import timedelta
import copy
import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, default_collate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import make_batch, tiny_model  # noqa: E402

from lightning_plugins.strategies import ParallelismStrategy  # noqa: E402

# A dead peer fails the test in minutes instead of hanging for torch's default 30.
TIMEOUT = timedelta(minutes=3)

STEPS, ACCUM, LOCAL_BATCH, SEQ, MAX_NORM, LR = 5, 2, 2, 16, 0.5, 1.0
BATCHES_PER_EPOCH = 6  # 3 optimizer steps per epoch: the resume case checkpoints at an epoch's end


class FineTune(L.LightningModule):
    """The user's module, unchanged: no configure_model, the loss is the HF model's own."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.micro_losses: list[float] = []

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.micro_losses.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


def dataset(global_batch: int, vocab: int) -> list[dict]:
    rows = []
    for index in range(BATCHES_PER_EPOCH):
        batch = make_batch(global_batch, SEQ, vocab, seed=index)  # rows of different valid lengths
        rows += [{k: v[i] for k, v in batch.items()} for i in range(global_batch)]
    return rows


def global_batches(data: list[dict], dp: int, epochs: int) -> list[dict]:
    """The batches one process must see to match `dp` ranks under Lightning's DistributedSampler.

    Lightning always installs a shuffling ``DistributedSampler`` (seed 0) for training; global batch k
    is the union of every data rank's k-th local batch.
    """
    batches = []
    for epoch in range(epochs):
        per_rank = []
        for rank in range(dp):
            sampler = DistributedSampler(data, num_replicas=dp, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            per_rank.append(list(sampler))
        for k in range(len(per_rank[0]) // LOCAL_BATCH):
            rows = [data[i] for indices in per_rank for i in indices[k * LOCAL_BATCH : (k + 1) * LOCAL_BATCH]]
            batches.append(default_collate(rows))
    return batches


def reference(model: torch.nn.Module, data: list[dict], dp: int) -> tuple[list[float], dict]:
    """One process, the whole global batch, Lightning's accumulation and clipping semantics."""
    losses = sgd_steps(model, global_batches(data, dp, epochs=2), STEPS)
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def sgd_steps(model: torch.nn.Module, batches: list[dict], steps: int) -> list[float]:
    """``steps`` optimizer steps of a fresh SGD+momentum over ``batches`` as Lightning runs them
    (ACCUM micro-batches each, clipping at MAX_NORM): the mean loss of each step."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    losses = []
    for step in range(steps):
        step_loss = 0.0
        for micro in range(ACCUM):
            loss = model(**batches[step * ACCUM + micro]).loss
            (loss / ACCUM).backward()
            step_loss += loss.item() / ACCUM
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_loss)
    return losses


def make_trainer(strategy: ParallelismStrategy, devices: int, max_steps: int, **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        gradient_clip_val=MAX_NORM,
        accumulate_grad_batches=ACCUM,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def step_losses(micro: list[float]) -> list[float]:
    return [sum(micro[i : i + ACCUM]) / ACCUM for i in range(0, len(micro), ACCUM)]


def max_weight_diff(model: torch.nn.Module, expected: dict) -> float:
    worst = 0.0
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        worst = max(worst, (full.detach() - expected[name]).abs().max().item())
    return worst


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
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
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
        results[name] = {
            "loss_diff": max(abs(a - b) for a, b in zip(step_losses(module.micro_losses), ref_losses, strict=True)),
            "weight_diff": max_weight_diff(module.model, ref_weights),
            "logged_diff": abs(trainer.callback_metrics["train_loss"].item() - module.micro_losses[-1]),
            "steps": trainer.global_step,
        }
        if name == CASES[args.devices][0][0]:
            results["resume"] = check_resume(reference_model, options, args.devices, data, args.out.parent)
    if torch.distributed.get_rank() == 0:
        args.out.write_text(json.dumps(results, indent=1))


def check_resume(reference_model: torch.nn.Module, options: dict, devices: int, data: list, tmp: Path) -> dict:
    """Stop after epoch 0 (3 steps) with a DCP checkpoint, resume to step 5: the same losses."""
    ckpt_dir = tmp / "ckpts"
    first = FineTune(copy.deepcopy(reference_model))
    saver = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1)
    trainer = make_trainer(ParallelismStrategy(**options, timeout=TIMEOUT), devices, STEPS, callbacks=[saver])
    trainer.fit(first, DataLoader(data, batch_size=LOCAL_BATCH, shuffle=False))
    ckpt = ckpt_dir / "epoch=0-step=3.ckpt"
    second = FineTune(copy.deepcopy(reference_model))
    trainer = make_trainer(ParallelismStrategy(**options, timeout=TIMEOUT), devices, STEPS, enable_checkpointing=False)
    trainer.fit(second, DataLoader(data, batch_size=LOCAL_BATCH, shuffle=False), ckpt_path=ckpt)
    uninterrupted, resumed = step_losses(first.micro_losses), step_losses(second.micro_losses)
    return {
        "checkpoint_is_dir": ckpt.is_dir(),
        "partial_left": sorted(str(p) for p in ckpt_dir.glob("*.partial")),
        "resumed_steps": len(resumed),
        "loss_diff": max(abs(a - b) for a, b in zip(uninterrupted[3:], resumed, strict=True)),
        "weight_diff": max_weight_diff(second.model, {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in first.model.named_parameters()}),
    }


if __name__ == "__main__":
    main()
