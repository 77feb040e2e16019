"""The embedded demo: fine-tune the shipped tiny Llama with ``TensorParallelStrategy`` on CPU processes.

The LightningModule is the one a user already has (``training_step`` returns ``self.model(**batch).loss``).
The model is built on the meta device; the strategy parallelizes it and each rank reads only its
slices of the shipped safetensors. Afterwards the model is exported to a plain HF directory and
evaluated with plain ``transformers``.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from lightning_plugins.checkpoint.live_export import export_hf
from lightning_plugins.data import collate_causal_lm, exact_match, load_prompt_completion, read_jsonl, tiny_assets
from lightning_plugins.strategies import TensorParallelStrategy
from lightning_plugins.recipe.build import lr_lambda


class FineTune(L.LightningModule):
    """A plain fine-tuning module: nothing in it knows about parallelism."""

    def __init__(self, model: torch.nn.Module, lr: float) -> None:
        super().__init__()
        self.model = model
        self.lr = lr

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)
        total = self.trainer.max_steps
        warmup = min(30, total // 2)
        # Linear warmup then linear decay: this task's accuracy jumps late and needs the decay.
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, partial(lr_lambda, total=total, warmup=warmup, scheduler="linear", min_ratio=0.0)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _is_launcher_rank() -> bool:
    # Lightning's launcher re-runs this program once per extra rank with LOCAL_RANK set.
    return int(os.environ.get("LOCAL_RANK", "0")) == 0 and int(os.environ.get("NODE_RANK", "0")) == 0


def run_demo(
    devices: int = 2,
    tp_size: int = 2,
    max_steps: int = 400,
    lr: float = 3e-3,
    batch_size: int = 16,
    out_dir: str | Path = "outputs/demo",
    eval_limit: int | None = None,
) -> dict[str, float]:
    """Fine-tune the tiny model and report exact-match accuracy before and after.

    Returns:
        ``{"before": ..., "after": ...}`` on the launching rank (empty on the others).
    """
    torch.manual_seed(0)
    assets = tiny_assets()
    tokenizer = AutoTokenizer.from_pretrained(assets.model_dir)
    eval_records = read_jsonl(assets.eval_file)[:eval_limit]
    before = None
    if _is_launcher_rank():
        before = exact_match(AutoModelForCausalLM.from_pretrained(assets.model_dir), tokenizer, eval_records)
        print(f"exact match on {len(eval_records)} held-out examples before fine-tuning: {before:.1%}", flush=True)

    train = load_prompt_completion(assets.train_file, tokenizer, max_length=64)
    loader = DataLoader(
        train, batch_size=batch_size, shuffle=True, collate_fn=partial(collate_causal_lm, pad_token_id=tokenizer.pad_token_id)
    )
    with torch.device("meta"):  # no rank holds the full model: the strategy loads each rank's slices
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(assets.model_dir))
    module = FineTune(model, lr)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=TensorParallelStrategy(tp_size=tp_size, load_from=assets.model_dir),
        max_steps=max_steps,
        max_epochs=-(-max_steps // len(loader)),  # the epochs it takes (the progress bar shows them)
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        log_every_n_steps=10,
    )
    trainer.fit(module, loader)
    out = export_hf(module.model, out_dir, tokenizer)
    if not trainer.is_global_zero:
        return {}
    tuned = AutoModelForCausalLM.from_pretrained(out)
    after = exact_match(tuned, tokenizer, eval_records)
    print(f"exact match before: {before:.1%}  after: {after:.1%}  (HF checkpoint: {out})")
    for record in eval_records[:3]:
        ids = tokenizer(record["prompt"], return_tensors="pt").input_ids
        generated = tuned.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        text = tokenizer.decode(generated[0, ids.shape[1] :], skip_special_tokens=True)
        print(f"  {record['prompt']!r} -> {text!r} (expected {record['completion']!r})")
    return {"before": before, "after": after}
