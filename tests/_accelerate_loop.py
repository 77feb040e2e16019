"""The plain Accelerate loop users write (prepare, accumulate, backward, clip, step), shared by the Accelerate parity
and save-habit tests: the model of a case, the prepared objects, and the loop over the loader."""

from __future__ import annotations

from typing import Any

import torch
from tiny_models import make_batch, tiny_model

ROWS, BATCH, SEQ, ACCUM, MAX_NORM, LR = 32, 4, 16, 2, 0.3, 0.5


class Rows(torch.utils.data.Dataset):
    """Fixed-length rows of different valid lengths (right padding, ``-100`` labels), with their index."""

    def __init__(self, vocab: int) -> None:
        self.batch = make_batch(ROWS, SEQ, vocab, seed=11)

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"index": torch.tensor(index), **{k: v[index] for k, v in self.batch.items()}}


def build(case: dict[str, Any]) -> torch.nn.Module:
    model = tiny_model(case.get("family", "llama"))
    if case.get("lora"):
        from lightning_plugins.adapters.lora import LoraOptions, apply_lora

        torch.manual_seed(1)
        model = apply_lora(model, LoraOptions(r=4, alpha=16))
        # lora_B starts at zero: give the adapter an effect at once. With std 0.3 the 7th micro-batch's grad norm was
        # ill-conditioned (on an AMD EPYC, one fp32 process 1.1e-5 and TP=2 5.1e-5 away from an fp64 process, 6e-5
        # apart); with 0.1 TP=2 is within 2e-7 of one process.
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.1, generator=torch.Generator().manual_seed(len(name)))
    return model


def prepared(accelerator: Any, model: torch.nn.Module, shuffle: bool) -> tuple[Any, Any, Any, Any]:
    """The user's objects, prepared: SGD + momentum over the trainable parameters, a decaying LR, the rows."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    loader = torch.utils.data.DataLoader(Rows(64), batch_size=BATCH, shuffle=shuffle)
    return accelerator.prepare(model, optimizer, loader, scheduler)


def run_loop(accelerator: Any, model: Any, optimizer: Any, loader: Any, scheduler: Any,
         save_at: tuple[int, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """The user's loop over ``loader``: per-micro-batch losses, norms, learning rates and gathered indices."""
    model.train()
    out: dict[str, Any] = {"loss": [], "norm": [], "lr": [], "index": []}
    for micro, batch in enumerate(loader):
        out["index"] += accelerator.gather_for_metrics(batch.pop("index")).tolist()
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            out["norm"].append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        out["loss"].append(loss.item())
        out["lr"].append(scheduler.get_last_lr()[0])
        if save_at is not None and micro + 1 == save_at[0]:
            accelerator.save_state(save_at[1])
    return out
