"""Run by tests/test_pipeline_trainer.py: `Trainer(strategy=PipelineParallelStrategy(...))` vs one process.

Lightning's subprocess launcher re-runs this script once per rank, so one launch checks every case.
The LightningModule is the user's, unchanged (`self.model(**batch).loss`); under the pipeline that call
runs forward and backward of the whole batch. Every rank holds different stages, so each difference is
the maximum over all ranks; rank 0 writes them as JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, default_collate

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import make_batch, tiny_model  # noqa: E402
from trainer_parity import make_trainer, step_losses  # noqa: E402

from lightning_plugins.strategies import PipelineParallelStrategy  # noqa: E402

STEPS, ACCUM, LOCAL_BATCH, SEQ, MAX_NORM, LR = 5, 2, 4, 16, 0.5, 1.0
BATCHES_PER_EPOCH = 6  # 3 optimizer steps per epoch: the resume case checkpoints at an epoch's end


class FineTune(L.LightningModule):
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


def dataset(global_batch: int, vocab: int, batches: int = BATCHES_PER_EPOCH, seed: int = 0) -> list[dict]:
    rows = []
    for index in range(batches):
        batch = make_batch(global_batch, SEQ, vocab, seed=seed + index)
        rows += [{k: v[i] for k, v in batch.items()} for i in range(global_batch)]
    return rows


def global_batches(data: list[dict], dp: int, epochs: int, shuffle: bool = True) -> list[dict]:
    """The global batches one process must see to match `dp` ranks under Lightning's DistributedSampler."""
    batches = []
    for epoch in range(epochs):
        per_rank = []
        for rank in range(dp):
            sampler = DistributedSampler(data, num_replicas=dp, rank=rank, shuffle=shuffle, seed=0)
            sampler.set_epoch(epoch)
            per_rank.append(list(sampler))
        for k in range(len(per_rank[0]) // LOCAL_BATCH):
            rows = [data[i] for indices in per_rank for i in indices[k * LOCAL_BATCH : (k + 1) * LOCAL_BATCH]]
            batches.append(default_collate(rows))
    return batches


def reference(model: torch.nn.Module, data: list[dict], dp: int, val: list[dict]) -> tuple[list, dict, list]:
    """One process: the losses per optimizer step, the final weights, and the validation losses
    Lightning computes (sanity check on the first 2 batches, then all batches after epoch 0's 3 steps)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    batches = global_batches(data, dp, epochs=2)
    val_batches = global_batches(val, dp, epochs=1, shuffle=False)
    losses, val_losses = [], evaluate(model, val_batches[:2])
    for step in range(STEPS):
        if step == 3:
            val_losses += evaluate(model, val_batches)
        step_loss = 0.0
        for micro in range(ACCUM):
            loss = model(**batches[step * ACCUM + micro]).loss
            (loss / ACCUM).backward()
            step_loss += loss.item() / ACCUM
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_loss)
    return losses, full_weights(model), val_losses


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[dict]) -> list[float]:
    return [model(**batch).loss.item() for batch in batches]


def full_weights(model: torch.nn.Module) -> dict:
    weights = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.named_parameters()
    }
    if getattr(model.config, "tie_word_embeddings", False) and "model.embed_tokens.weight" in weights:
        weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    return weights


def max_weight_diff(model: torch.nn.Module, expected: dict) -> float:
    """The largest difference over every rank's stages (each rank holds different parameters)."""
    local = max((w - expected[name]).abs().max().item() for name, w in full_weights(model).items())
    return max_over_ranks(local)


def max_over_ranks(value: float) -> float:
    tensor = torch.tensor(float(value), dtype=torch.float64)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return tensor.item()


CASES = {
    2: [
        ("llama 1f1b", "llama_4l", {"schedule": "1f1b"}),
        ("llama gpipe m4", "llama_4l", {"schedule": "gpipe", "microbatches": 4}),
        ("qwen3 interleaved_1f1b", "qwen3_4l", {"schedule": "interleaved_1f1b", "microbatches": 2}),
        ("llama tied zbv", "llama_tied_4l", {"schedule": "zbv_zero_bubble", "microbatches": 2}),
        ("llama tied 1f1b", "llama_tied_4l", {"schedule": "1f1b"}),
    ],
    4: [
        ("llama pp2 x tp2 1f1b", "llama_4l", {"schedule": "1f1b", "tp_size": 2}),
        ("llama pp2 x fsdp2 interleaved_1f1b", "llama_4l", {"schedule": "interleaved_1f1b", "microbatches": 2}),
    ],
}


#: Cases that also stop at an epoch's end with a DCP checkpoint and resume (a tied embedding saves one
#: weight from two ranks).
RESUME_CASES = {"llama 1f1b", "llama tied 1f1b", "llama pp2 x tp2 1f1b"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results = {}
    for name, family, options in CASES[args.devices]:
        reference_model = tiny_model(family)
        dp = args.devices // (2 * options.get("tp_size", 1))
        data = dataset(LOCAL_BATCH * dp, reference_model.config.vocab_size)
        val = dataset(LOCAL_BATCH * dp, reference_model.config.vocab_size, batches=3, seed=1000)
        ref_losses, ref_weights, ref_val = reference(copy.deepcopy(reference_model), data, dp, val)
        module = FineTune(copy.deepcopy(reference_model))
        strategy = PipelineParallelStrategy(pp_size=2, **options)
        trainer = make_trainer(strategy, args.devices, STEPS, enable_checkpointing=False)
        first = name == CASES[args.devices][0][0]
        val_loader = DataLoader(val, batch_size=LOCAL_BATCH, shuffle=False) if first else None
        trainer.fit(module, DataLoader(data, batch_size=LOCAL_BATCH, shuffle=False), val_loader)
        results[name] = {
            "loss_diff": max_over_ranks(
                max(abs(a - b) for a, b in zip(step_losses(module.micro_losses), ref_losses, strict=True))
            ),
            "weight_diff": max_weight_diff(module.model, ref_weights),
            "logged_diff": max_over_ranks(abs(trainer.callback_metrics["train_loss"].item() - module.micro_losses[-1])),
            "steps": trainer.global_step,
            "optimizer_params": sum(p.numel() for g in trainer.optimizers[0].param_groups for p in g["params"]),
            "model_params": sum(p.numel() for p in reference_model.parameters()),
        }
        if name in RESUME_CASES:
            tmp = args.out.parent / name.replace(" ", "_")
            results[f"resume {name}"] = check_resume(reference_model, options, args.devices, data, tmp)
        if first:
            results["validate"] = {
                "n": len(module.val_losses),
                "loss_diff": max_over_ranks(max(abs(a - b) for a, b in zip(module.val_losses, ref_val))),
                "expected_n": len(ref_val),
            }
    if torch.distributed.get_rank() == 0:
        args.out.write_text(json.dumps(results, indent=1))


def check_resume(reference_model: torch.nn.Module, options: dict, devices: int, data: list, tmp: Path) -> dict:
    """Stop after epoch 0 (3 steps) with a DCP checkpoint, resume to step 5: the same losses and weights."""
    ckpt_dir = tmp / "ckpts"
    first = FineTune(copy.deepcopy(reference_model))
    saver = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1)
    trainer = make_trainer(PipelineParallelStrategy(pp_size=2, **options), devices, STEPS, callbacks=[saver])
    trainer.fit(first, DataLoader(data, batch_size=LOCAL_BATCH, shuffle=False))
    ckpt = ckpt_dir / "epoch=0-step=3.ckpt"
    second = FineTune(copy.deepcopy(reference_model))
    trainer = make_trainer(PipelineParallelStrategy(pp_size=2, **options), devices, STEPS, enable_checkpointing=False)
    trainer.fit(second, DataLoader(data, batch_size=LOCAL_BATCH, shuffle=False), ckpt_path=ckpt)
    uninterrupted, resumed = step_losses(first.micro_losses), step_losses(second.micro_losses)
    return {
        "checkpoint_is_dir": ckpt.is_dir(),
        "resumed_steps": len(resumed),
        "loss_diff": max_over_ranks(max(abs(a - b) for a, b in zip(uninterrupted[3:], resumed, strict=True))),
        "weight_diff": max_weight_diff(second.model, full_weights(first.model)),
    }


if __name__ == "__main__":
    main()
