"""What the Trainer test scripts share: the user's LightningModule, the data, the one-process reference, the checks.

Every script runs `Trainer.fit` with a strategy on the user's unchanged module and compares it with one process
that sees the same global batches with Lightning's accumulation and clipping semantics. Lightning's subprocess
launcher re-runs a script once per rank, so the comparisons that call :func:`max_over_ranks` must run on every rank.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, default_collate

import lightning_plugins.testing.exit_report  # noqa: E402, F401  (before any door: reports the process-group threads alive at exit)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import make_batch  # noqa: E402

#: A dead peer fails the test in minutes instead of hanging for torch's default 30.
TIMEOUT = timedelta(minutes=3)
ACCUM, SEQ, MAX_NORM, LR = 2, 16, 0.5, 1.0
BATCHES_PER_EPOCH = 6  # 3 optimizer steps per epoch: the resume cases checkpoint at an epoch's end


class FineTune(L.LightningModule):
    """The user's module, unchanged: no configure_model, the loss is the HF model's own."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.micro_losses: list[float] = []
        self.val_losses: list[float] = []

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.micro_losses.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.val_losses.append(self.model(**batch).loss.item())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


def dataset(global_batch: int, vocab: int, *, seq: int = SEQ, batches: int = BATCHES_PER_EPOCH, seed: int = 0) -> list:
    """``batches`` global batches of ``global_batch`` rows each (of different valid lengths), as a list of rows."""
    rows = []
    for index in range(batches):
        batch = make_batch(global_batch, seq, vocab, seed=seed + index)
        rows += [{k: v[i] for k, v in batch.items()} for i in range(global_batch)]
    return rows


def global_batches(
    data: list[dict], dp: int, local_batch: int, *, epochs: int, shuffle: bool = True,
    collate: Callable = default_collate,
) -> list[dict]:
    """The batches one process must see to match `dp` ranks under Lightning's DistributedSampler.

    Lightning installs a ``DistributedSampler`` (seed 0; shuffling for training) on every loader; global batch k
    is the union of every data rank's k-th local batch (collated by ``collate``).
    """
    batches = []
    for epoch in range(epochs):
        per_rank = []
        for rank in range(dp):
            sampler = DistributedSampler(data, num_replicas=dp, rank=rank, shuffle=shuffle, seed=0)
            sampler.set_epoch(epoch)
            per_rank.append(list(sampler))
        for k in range(len(per_rank[0]) // local_batch):
            rows = [data[i] for indices in per_rank for i in indices[k * local_batch : (k + 1) * local_batch]]
            batches.append(collate(rows))
    return batches


def sgd_steps(
    model: torch.nn.Module,
    batches: list[dict],
    steps: int,
    *,
    must_clip: bool = False,
    before_step: Callable[[int], None] | None = None,
) -> list[float]:
    """``steps`` optimizer steps of a fresh SGD+momentum over ``batches`` as Lightning runs them.

    ACCUM micro-batches a step, clipping at MAX_NORM (``must_clip``: every step must clip); ``before_step(step)``
    runs before each step (e.g. Lightning's validation at an epoch's end). Returns the mean loss of each step.
    """
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    losses = []
    for step in range(steps):
        if before_step is not None:
            before_step(step)
        step_loss = 0.0
        for micro in range(ACCUM):
            loss = model(**batches[step * ACCUM + micro]).loss
            (loss / ACCUM).backward()
            step_loss += loss.item() / ACCUM
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        assert not must_clip or norm > MAX_NORM, "the test must exercise clipping"
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_loss)
    return losses


def reference_fit(model: torch.nn.Module, data: list[dict], dp: int, steps: int, local_batch: int) -> list[float]:
    """One process, a fresh optimizer, the data order of a fresh `fit`: the losses per optimizer step."""
    return sgd_steps(model, global_batches(data, dp, local_batch, epochs=1), steps)


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[dict]) -> list[float]:
    return [model(**batch).loss.item() for batch in batches]


def make_trainer(strategy: Any, devices: int, max_steps: int, **kwargs: Any) -> L.Trainer:
    """A CPU Trainer of ``devices`` ranks accumulating ACCUM micro-batches a step and clipping at MAX_NORM (unless
    ``gradient_clip_val`` is given)."""
    kwargs.setdefault("gradient_clip_val", MAX_NORM)
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        accumulate_grad_batches=ACCUM,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def step_losses(micro: list[float]) -> list[float]:
    """The mean loss of each optimizer step from the micro-batch losses of ``training_step``."""
    return [sum(micro[i : i + ACCUM]) / ACCUM for i in range(0, len(micro), ACCUM)]


def full_weights(model: torch.nn.Module) -> dict:
    """This rank's parameters, each whole (DTensors gathered); a tied head is listed under its own name too."""
    weights = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.named_parameters()
    }
    if getattr(model.config, "tie_word_embeddings", False) and "model.embed_tokens.weight" in weights:
        weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    return weights


def max_over_ranks(value: float) -> float:
    tensor = torch.tensor(float(value), dtype=torch.float64)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return tensor.item()


def max_diff(a: list[float], b: list[float]) -> float:
    """The largest difference of two equally long lists, over every rank."""
    return max_over_ranks(max(abs(x - y) for x, y in zip(a, b, strict=True)))


def max_weight_diff(model: torch.nn.Module, expected: dict) -> float:
    """The largest difference over every rank's parameters (pipeline ranks hold different ones)."""
    local = max((w - expected[name]).abs().max().item() for name, w in full_weights(model).items())
    return max_over_ranks(local)


def fit_results(trainer: L.Trainer, module: FineTune, ref_losses: list[float], ref_weights: dict) -> dict:
    """What every fitted case reports: step losses and final weights against one process, the logged loss, steps."""
    return {
        "loss_diff": max_diff(step_losses(module.micro_losses), ref_losses),
        "weight_diff": max_weight_diff(module.model, ref_weights),
        "logged_diff": max_over_ranks(abs(trainer.callback_metrics["train_loss"].item() - module.micro_losses[-1])),
        "steps": trainer.global_step,
    }


def check_resume(
    make_strategy: Callable[[], Any],
    reference_model: torch.nn.Module,
    devices: int,
    data: list,
    tmp: Path,
    *,
    local_batch: int,
    steps: int,
) -> dict:
    """Stop after epoch 0 (3 steps) with a DCP checkpoint, resume to ``steps``: the same losses and weights."""
    ckpt_dir = tmp / "ckpts"
    first = FineTune(copy.deepcopy(reference_model))
    saver = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1)
    trainer = make_trainer(make_strategy(), devices, steps, callbacks=[saver])
    trainer.fit(first, DataLoader(data, batch_size=local_batch, shuffle=False))
    ckpt = ckpt_dir / "epoch=0-step=3.ckpt"
    second = FineTune(copy.deepcopy(reference_model))
    trainer = make_trainer(make_strategy(), devices, steps, enable_checkpointing=False)
    trainer.fit(second, DataLoader(data, batch_size=local_batch, shuffle=False), ckpt_path=ckpt)
    uninterrupted, resumed = step_losses(first.micro_losses), step_losses(second.micro_losses)
    return {
        "checkpoint_is_dir": ckpt.is_dir(),
        "partial_left": sorted(str(p) for p in ckpt_dir.glob("*.partial")),
        "resumed_steps": len(resumed),
        "loss_diff": max_diff(uninterrupted[3:], resumed),
        "weight_diff": max_weight_diff(second.model, full_weights(first.model)),
    }


#: The arguments of the script that runs now when ``script_chain.py`` runs several in one world (``None``: the
#: command line's). The command line itself stays the chain's: Lightning's launcher starts the other ranks with it.
ARGV: list[str] | None = None


def script_args(devices: bool = True) -> argparse.Namespace:
    """The command line every script takes: ``--out results.json`` (and ``--devices N`` unless told otherwise)."""
    parser = argparse.ArgumentParser()
    if devices:
        parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args(ARGV)


def write_results(results: dict, out: Path) -> None:
    """Rank 0 writes the measured differences as JSON (every rank computed them: some are collectives)."""
    if torch.distributed.get_rank() == 0:
        out.write_text(json.dumps(results, indent=1))
