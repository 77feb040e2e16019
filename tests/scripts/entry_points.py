"""Run by tests/strategies/test_entry_points.py: fit -> validate -> test -> predict -> fit again on one module.

Every strategy parallelizes the module's model once and recognises it afterwards, whatever entry point
comes next (a new Trainer included). Each result is compared with one process doing the same sequence:
training losses and weights, validation/test losses (per batch and as logged), predictions (greedy
tokens under TP and FSDP2; losses under PP and CP, where `generate` is refused with a clear message).
Rank 0 writes the largest differences over all ranks as JSON.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import (  # noqa: E402
    TIMEOUT,
    FineTune,
    dataset,
    evaluate,
    full_weights,
    global_batches,
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

from lightning_plugins import LayoutError  # noqa: E402
from lightning_plugins.strategies import (  # noqa: E402
    ContextParallelStrategy,
    ParallelismStrategy,
    PipelineParallelStrategy,
    TensorParallelStrategy,
)

LOCAL_BATCH = 4
FIRST_STEPS, SECOND_STEPS, PROMPT, NEW_TOKENS = 3, 2, 6, 4

CASES = [  # name, strategy factory, data-parallel ranks, whether `generate` works
    ("tp2", lambda: TensorParallelStrategy(tp_size=2, timeout=TIMEOUT), 1, True),
    ("pp2", lambda: PipelineParallelStrategy(pp_size=2, pp_schedule="1f1b", timeout=TIMEOUT), 1, False),
    ("cp2", lambda: ContextParallelStrategy(cp_size=2, cp_backend="ulysses", timeout=TIMEOUT), 1, False),
    ("fsdp2", lambda: ParallelismStrategy(dp_shard_size=2, timeout=TIMEOUT), 2, True),
]


class Evaluated(FineTune):
    """The user's module with the usual evaluation steps added."""

    def __init__(self, model: torch.nn.Module, generates: bool) -> None:
        super().__init__(model)
        self.generates = generates
        self.test_losses: list[float] = []

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        loss = self.model(**batch).loss
        self.val_losses.append(loss.item())
        self.log("val_loss", loss)

    def test_step(self, batch: dict, batch_idx: int) -> None:
        loss = self.model(**batch).loss
        self.test_losses.append(loss.item())
        self.log("test_loss", loss)

    def predict_step(self, batch: dict, batch_idx: int) -> dict:
        if not self.generates:
            return {"loss": self.model(**batch).loss.item()}
        prompt = batch["input_ids"][:, :PROMPT]
        tokens = self.model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS, do_sample=False
        )
        return {"prompt": prompt, "tokens": tokens}


def run_case(name: str, make_strategy, dp: int, generates: bool) -> dict:
    reference = tiny_model("llama_4l")
    vocab = reference.config.vocab_size
    data, val, test, pred = (
        dataset(LOCAL_BATCH * dp, vocab, batches=b, seed=s) for b, s in ((6, 0), (2, 100), (2, 200), (2, 300))
    )
    loader = lambda rows: DataLoader(rows, batch_size=LOCAL_BATCH, shuffle=False)  # noqa: E731
    module = Evaluated(copy.deepcopy(reference), generates)
    result: dict = {}

    trainer = make_trainer(make_strategy(), 2, FIRST_STEPS, enable_checkpointing=False)
    trainer.fit(module, loader(data))
    result["fit_loss"] = max_diff(
        step_losses(module.micro_losses), reference_fit(reference, data, dp, FIRST_STEPS, LOCAL_BATCH)
    )
    result["fit_weights"] = max_weight_diff(module.model, full_weights(reference))

    reference.eval()
    val_ref = evaluate(reference, global_batches(val, dp, LOCAL_BATCH, epochs=1, shuffle=False))
    metrics = trainer.validate(module, loader(val), verbose=False)[0]
    result["validate"] = max_diff(module.val_losses, val_ref)
    result["validate_logged"] = max_over_ranks(abs(metrics["val_loss"] - sum(val_ref) / len(val_ref)))

    test_ref = evaluate(reference, global_batches(test, dp, LOCAL_BATCH, epochs=1, shuffle=False))
    metrics = trainer.test(module, loader(test), verbose=False)[0]
    result["test"] = max_diff(module.test_losses, test_ref)
    result["test_logged"] = max_over_ranks(abs(metrics["test_loss"] - sum(test_ref) / len(test_ref)))

    predictions = trainer.predict(module, loader(pred))
    if generates:
        with torch.no_grad():
            expected = [
                reference.generate(
                    p["prompt"], attention_mask=torch.ones_like(p["prompt"]), max_new_tokens=NEW_TOKENS, do_sample=False
                )
                for p in predictions
            ]
        mismatched = sum(int(not torch.equal(p["tokens"], e)) for p, e in zip(predictions, expected, strict=True))
        result["predict_mismatched_batches"] = max_over_ranks(mismatched)
        result["predict_new_tokens"] = predictions[0]["tokens"].shape[-1] - PROMPT
    else:
        pred_ref = evaluate(reference, global_batches(pred, dp, LOCAL_BATCH, epochs=1, shuffle=False))
        result["predict"] = max_diff([p["loss"] for p in predictions], pred_ref)
        try:
            module.model.generate(torch.zeros(1, 2, dtype=torch.long))
            result["generate_refusal"] = ""
        except NotImplementedError as err:
            result["generate_refusal"] = str(err)

    reference.train()
    module.micro_losses.clear()
    trainer = make_trainer(make_strategy(), 2, SECOND_STEPS, enable_checkpointing=False)
    trainer.fit(module, loader(data))
    result["refit_loss"] = max_diff(
        step_losses(module.micro_losses), reference_fit(reference, data, dp, SECOND_STEPS, LOCAL_BATCH)
    )
    result["refit_weights"] = max_weight_diff(module.model, full_weights(reference))
    result["refit_steps"] = trainer.global_step

    if name == "tp2":  # the same module under another layout: refused, naming both
        try:
            make_trainer(ParallelismStrategy(dp_shard_size=2, timeout=TIMEOUT), 2, 1, enable_checkpointing=False).fit(
                module, loader(data)
            )
            result["other_layout_error"] = ""
        except LayoutError as err:
            result["other_layout_error"] = str(err)
    return result


def main() -> None:
    args = script_args()  # --devices 2 (the cases' worlds): it runs in the shared 2-rank world (tests/_launch.py)
    assert args.devices == 2, args.devices
    results = {name: run_case(name, make, dp, generates) for name, make, dp, generates in CASES}
    write_results(results, args.out)


if __name__ == "__main__":
    main()
