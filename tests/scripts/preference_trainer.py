"""Run by tests/preference/test_preference_trainer.py: DPO and KTO in the user's own LightningModule, under each
strategy.

The module is what a user writes (as ``docs/lightning.md`` and ``docs/recipes.md`` tell it): a peft LoRA model in its
constructor, ``PreferenceObjective`` called in ``training_step`` on batches of ``collate_pairs`` (each micro-batch the
chosen rows of its pairs, then their rejected rows), TRL's metrics logged with ``log_dict``, an optimizer over the
trainable parameters. Each strategy shards the pairs over its data ranks (whole pairs), the sequences over its
context-parallel ranks; the run must match one process that sees the same global batches (Lightning's accumulation
and clipping). KTO (``KTOObjective`` on batches of ``collate_unpaired``: each example's row, its KL row within the
micro-batch, its label) runs under TP and CP, whose one data rank collates the batches one process sees. Rank 0 writes
the largest differences as JSON.

The model is in float64 (:data:`DTYPE`), so the tests compare at 1e-9, not fp32's 1e-5: a DPO gradient is the
difference of its chosen and rejected sequences' gradients, and over three steps at this learning rate that
cancellation lifts fp32's rounding past 1e-5. Measured in fp32: TP=2's adapter gradients differ from one process's by
7e-6 relative at step 0 (the reduction order of the split matmuls and the vocab-parallel loss), 5e-5 at step 1, 1e-3
for some at step 2, and the adapters by 1.8e-5, or under 1e-5, depending on what the process ran before (CI's chain
passed it, the script alone did not). In float64 every case matches one process to 2e-15 (losses), 2e-16 (adapters)
and 4e-11 (metrics, whose logit means are taken in fp32).
"""

from __future__ import annotations

import copy
import sys
from functools import partial
from pathlib import Path

import lightning as L
import torch
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import (  # noqa: E402
    ACCUM,
    LR,
    MAX_NORM,
    SEQ,
    TIMEOUT,
    full_weights,
    global_batches,
    make_trainer,
    max_diff,
    max_over_ranks,
    script_args,
    step_losses,
    write_results,
)
from tiny_models import make_batch, tiny_model  # noqa: E402

from lightning_plugins.data.packing import collate_pairs  # noqa: E402
from lightning_plugins.data.preference import collate_unpaired  # noqa: E402
from lightning_plugins.preference import PreferenceObjective, PreferenceOptions  # noqa: E402
from lightning_plugins.preference.kto import KTOObjective  # noqa: E402
from lightning_plugins.strategies import (  # noqa: E402
    ContextParallelStrategy,
    ParallelismStrategy,
    TensorParallelStrategy,
)

STEPS, LOCAL_PAIRS, BATCHES = 3, 2, 6  # one epoch: 6 micro-batches, 2 accumulated per step
DTYPE = torch.float64
DPO = PreferenceOptions(method="dpo", beta=0.5)
KTO = PreferenceOptions(method="kto", beta=0.5, desirable_weight=1.3, undesirable_weight=0.7)
#: KTO's gradient norms here are 0.23-0.47 (some under MAX_NORM): a lower clipping norm so that its steps clip too,
#: and the global norm the strategies reduce decides the update.
KTO_MAX_NORM = 0.2
CASES = {  # name: (strategy factory, data-parallel ranks, objective)
    "fsdp2": (lambda: ParallelismStrategy(dp_shard_size=2, timeout=TIMEOUT), 2, DPO),
    "tp2 sp+lp": (lambda: TensorParallelStrategy(tp_size=2, timeout=TIMEOUT), 1, DPO),
    "cp2 ring": (lambda: ContextParallelStrategy(cp_size=2, cp_backend="ring", timeout=TIMEOUT), 1, DPO),
    "kto tp2 sp+lp": (lambda: TensorParallelStrategy(tp_size=2, timeout=TIMEOUT), 1, KTO),
    "kto cp2 ring": (lambda: ContextParallelStrategy(cp_size=2, cp_backend="ring", timeout=TIMEOUT), 1, KTO),
}


def objective_of(options: PreferenceOptions) -> PreferenceObjective | KTOObjective:
    return KTOObjective(options) if options.unpaired else PreferenceObjective(options)


def max_norm_of(options: PreferenceOptions) -> float:
    return KTO_MAX_NORM if options.unpaired else MAX_NORM


class DPOFineTune(L.LightningModule):
    """The user's module: DPO (or KTO) on a LoRA model, the reference being its base (the adapters disabled)."""

    def __init__(self, model: torch.nn.Module, options: PreferenceOptions = DPO) -> None:
        super().__init__()
        self.model = model
        self.dpo = objective_of(options)
        self.micro_losses: list[float] = []
        self.micro_metrics: list[dict[str, float]] = []

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss, metrics = self.dpo(self.model, batch)
        self.log("train/loss", loss)
        self.log_dict({f"train/{name}": value for name, value in metrics.items()})
        self.micro_losses.append(loss.item())
        self.micro_metrics.append({name: value.item() for name, value in metrics.items()})
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=LR, momentum=0.9)


def lora_model() -> torch.nn.Module:
    torch.manual_seed(1)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    # random non-zero lora_B: policy and reference differ
    return get_peft_model(tiny_model("llama").to(DTYPE), config)


def pairs(count: int, vocab: int) -> list[dict]:
    """``count`` pairs as ``encode_preference`` makes them (token ids, labels with the prompt masked), of
    different lengths."""
    rows = make_batch(2 * count, SEQ, vocab, seed=7)
    lengths = rows["attention_mask"].sum(dim=1).tolist()
    side = {name: [rows[key][i, : lengths[i]].tolist() for i in range(2 * count)]
            for name, key in (("input_ids", "input_ids"), ("labels", "labels"))}  # fmt: skip
    return [{f"{which}_{name}": side[name][i + offset] for which, offset in (("chosen", 0), ("rejected", count))
             for name in ("input_ids", "labels")} for i in range(count)]  # fmt: skip


def unpaired(count: int, vocab: int) -> list[dict]:
    """``count`` unpaired examples as ``encode_unpaired`` makes them (a 3-token prompt, the rest the completion, of
    different lengths), desirable and undesirable in turn."""
    rows = make_batch(count, SEQ, vocab, seed=11)
    ids = [rows["input_ids"][i, : int(rows["attention_mask"][i].sum())].tolist() for i in range(count)]
    return [{"prompt_ids": row[:3], "completion_ids": row[3:], "completion_labels": row[3:], "label": i % 2 == 0}
            for i, row in enumerate(ids)]  # fmt: skip


def reference_fit(
    model: torch.nn.Module, batches: list[dict], options: PreferenceOptions = DPO
) -> tuple[list[float], list[dict], bool]:
    """One process over the global batches: the step losses, each micro-batch's metrics, whether every step clipped."""
    objective, params = objective_of(options), [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=LR, momentum=0.9)
    losses, metrics, clipped = [], [], True
    for step in range(STEPS):
        step_loss = 0.0
        for micro in range(ACCUM):
            loss, logged = objective(model, batches[step * ACCUM + micro])
            (loss / ACCUM).backward()
            step_loss += loss.item() / ACCUM
            metrics.append({name: value.item() for name, value in logged.items()})
        max_norm = max_norm_of(options)
        clipped &= bool(torch.nn.utils.clip_grad_norm_(params, max_norm) > max_norm)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_loss)
    return losses, metrics, clipped


def metrics_error(got: dict[str, float], want: dict[str, float]) -> float:
    """The largest difference of one micro-batch's metrics relative to the largest of them past 1 (its
    log-probabilities: sums of tens). Every metric is computed from those sums, the rewards as differences of two
    (beta x (policy - reference)): their rounding error scales with the sums, not with their own value (in fp32 a
    reward of 0.12 from sums of -52 differed 1.8e-5 under TP=2)."""
    scale = max(1.0, *(abs(value) for value in want.values()))
    return max(abs(got[key] - want[key]) for key in want) / scale


def _adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value for name, value in full_weights(model).items() if "lora_" in name}


def main() -> None:
    args = script_args()
    results = {}
    for name, (make_strategy, dp, options) in CASES.items():
        reference = lora_model()
        start = _adapters(reference)
        local = LOCAL_PAIRS * (2 if options.unpaired else 1)  # KTO: as many rows as DPO's pairs
        make_data, collator = (unpaired, collate_unpaired) if options.unpaired else (pairs, collate_pairs)
        data = make_data(local * dp * BATCHES, reference.config.vocab_size)
        collate = partial(collator, pad_token_id=0)
        module = DPOFineTune(copy.deepcopy(reference), options)
        trainer = make_trainer(
            make_strategy(), args.devices, STEPS, enable_checkpointing=False, gradient_clip_val=max_norm_of(options)
        )
        trainer.fit(module, DataLoader(data, batch_size=local, shuffle=False, collate_fn=collate))
        batches = global_batches(data, dp, local, epochs=1, collate=collate)
        want_losses, want_metrics, clipped = reference_fit(reference, batches, options)
        got, want = _adapters(module.model), _adapters(reference)
        metrics = list(zip(module.micro_metrics, want_metrics, strict=True))
        logged = trainer.callback_metrics["train/rewards/margins"].item()
        results[name] = {
            "steps": trainer.global_step,
            "clipped": clipped,
            "loss_diff": max_diff(step_losses(module.micro_losses), want_losses),
            "metrics_diff": max_over_ranks(max(metrics_error(g, w) for g, w in metrics)),
            "metric_names_match": all(g.keys() == w.keys() for g, w in metrics),
            "logged_diff": max_over_ranks(abs(logged - module.micro_metrics[-1]["rewards/margins"])),
            "adapter_diff": max_over_ranks(max((got[k] - want[k]).abs().max().item() for k in want)),
            "adapters_moved": max((want[k] - start[k]).abs().max().item() for k in start),
        }
    write_results(results, args.out)


if __name__ == "__main__":
    main()
