"""``lightning-plugins finetune RECIPE``: a recipe run through the Lightning door.

The recipe's sections become the objects the engine takes (layout, parallel and memory options, LoRA,
data); this file only builds the model, the data loaders, a plain LightningModule and the ``Trainer``:
Lightning's rich progress bar and the recipe's loggers (``train.loggers``, CSV always), ``output_dir/run.json``
(:mod:`lightning_plugins.recipe.manifest`), DCP checkpoints every N steps (resumed automatically
from the output directory, or from ``--resume``), evaluation on the held-out split, and at the end an
HF directory (full fine-tune) or a peft adapter directory (LoRA, plus merged weights when asked), a CSV
of the metrics and a loss-curve PNG. A non-finite loss or gradient norm stops the run or skips the step
(``train.on_nonfinite``: the strategy's guard, :mod:`lightning_plugins.run.nonfinite`).
"""

from __future__ import annotations

import math
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar
from typing_extensions import override

from lightning_plugins.checkpoint.checks import CHECKPOINT_NAME
from lightning_plugins.checkpoint.resume_choice import LATEST, handed_down_resume
from lightning_plugins.recipe.build import (
    batches_per_rank, build_loaders, build_model, make_objective, make_optimizer, total_steps,
)
from lightning_plugins.recipe.diff import reset_optimizer
from lightning_plugins.recipe.finish import check_exportable, export_trained, write_results
from lightning_plugins.recipe.launch import say
from lightning_plugins.recipe.meter import ThroughputMeter
from lightning_plugins.recipe.schema import Recipe


class RecipeModule(L.LightningModule):
    """A plain fine-tuning module: the HF (or peft) model's own loss; nothing here knows the layout."""

    def __init__(self, model: torch.nn.Module, recipe: Recipe, total_steps: int, objective: Any = None) -> None:
        super().__init__()
        self.model = model
        self.recipe = recipe
        # Known before fit: `trainer.estimated_stepping_batches` would set up the training loader before a
        # checkpoint is restored, and Lightning would then never give the loader its saved position.
        self.total_steps = total_steps
        self._meter = ThroughputMeter(sum(p.numel() for p in model.parameters()), recipe.layout)  # before sharding
        self._logged_step = -1
        # A preference method (recipe.build.make_objective): the loss of each batch of pairs (or of unpaired examples,
        # KTO), with TRL's metrics; None: SFT.
        self.objective = objective

    def _loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The recipe's objective: the model's own loss (SFT), or the preference loss and its metrics."""
        if self.objective is None:
            return self.model(**batch).loss, {}
        return self.objective(self.model, batch)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self._meter.count(batch)
        loss, metrics = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        if metrics:  # already means over the global batch on every rank
            self.log_dict({f"train/{name}": value for name, value in metrics.items()})
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        # The loss is already the global one on every rank; syncing keeps Lightning's epoch mean exact too.
        loss, metrics = self._loss(batch)
        rows = batch["input_ids"].shape[0]
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=rows)
        if metrics:
            self.log_dict({f"val/{name}": value for name, value in metrics.items()}, sync_dist=True, batch_size=rows)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After every ``train.log_every``-th optimizer step: learning rate, gradient norm, tokens/s, MFU (GPUs)."""
        step = self.trainer.global_step
        if step == self._logged_step or step % self.recipe.train.log_every:
            return
        self._logged_step = step
        lr = self.trainer.optimizers[0].param_groups[0]["lr"]
        norm = getattr(self.trainer.strategy, "grad_norm", None)
        self.log_dict(self._meter.row(lr, norm, self.trainer.world_size), rank_zero_only=True)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """With ``train.resume_reset_optimizer`` (optim settings changed on resume): a new AdamW state and schedule."""
        if self.recipe.train.resume_reset_optimizer:
            schedule = self.trainer.lr_scheduler_configs[0].scheduler
            state = reset_optimizer(
                self.trainer.optimizers[0], schedule, self, self.recipe, self.total_steps, checkpoint["global_step"]
            )
            checkpoint["lr_schedulers"] = [state]  # what Lightning restores next

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer, schedule = make_optimizer(self, self.recipe, self.total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class _ProgressBar(RichProgressBar):
    """Lightning's rich bar without the logger's version number."""

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics


class _StepCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint``, which, after a resume, would write the restored step again after the first
    micro-batch (inside an accumulation window: a resume from that checkpoint would drop the window's gradients)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._last_global_step_saved = trainer.global_step  # that step's checkpoint is the one resumed from

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Resumed (--resume) from another run's directory: every step is kept (save_top_k=-1), so there is no best-k
        # record to carry over, and Lightning's warning that it is not reloaded says nothing.
        if state_dict.get("dirpath", self.dirpath) != self.dirpath:
            self.best_model_path = state_dict["best_model_path"]
            return
        super().load_state_dict(state_dict)


def build_trainer(recipe: Recipe, batches_per_epoch: int) -> L.Trainer:
    from lightning_plugins.strategies import ParallelismStrategy
    from lightning_plugins.strategies.loggers import RecordRun, recipe_loggers
    from lightning_plugins.strategies.perf import PerfCallback

    train = recipe.train
    strategy = ParallelismStrategy(
        layout=recipe.layout,
        options=recipe.parallel,
        memory=recipe.memory,
        load_from=recipe.model.path if Path(recipe.model.path).is_dir() else None,
        timeout=timedelta(seconds=train.collective_timeout_s),
        async_checkpoint=train.async_checkpoint,
        on_nonfinite=train.on_nonfinite,
        max_skipped_steps=train.max_skipped_steps,
        recipe_record=recipe.to_yaml(),
        preempt_signals=train.preempt_signals,
        perf=PerfCallback(train.output_dir, train.log_every, train.profile, sample=train.perf_sample,
                          straggler_ratio=train.straggler_ratio),  # fmt: skip
    )
    callbacks: list[Any] = [_ProgressBar(), RecordRun(recipe)]
    if train.checkpoint_every is not None:
        callbacks.append(
            _StepCheckpoint(
                dirpath=Path(train.output_dir) / "checkpoints",
                filename=CHECKPOINT_NAME,
                auto_insert_metric_name=False,
                every_n_train_steps=train.checkpoint_every,
                save_top_k=-1,
                # A step saved again after a resume (auto-resume skipped a damaged step=N.ckpt) replaces it, atomically
                # (resume.publish), instead of becoming step=N-v1.ckpt, which auto-resume would never pick.
                enable_version_counter=False,
            )
        )
    eval_kwargs: dict[str, Any] = {"num_sanity_val_steps": 0}
    if train.eval_every is not None:
        eval_kwargs.update(val_check_interval=train.eval_every * recipe.accumulation, check_val_every_n_epoch=None)
    return L.Trainer(
        accelerator=recipe.hardware.accelerator,
        devices=recipe.hardware.devices,
        num_nodes=recipe.hardware.nodes,
        strategy=strategy,
        max_steps=train.max_steps or -1,
        # With max_steps, the epochs it takes (Lightning's progress bar shows them).
        max_epochs=train.epochs or math.ceil(train.max_steps * recipe.accumulation / max(1, batches_per_epoch)),
        accumulate_grad_batches=recipe.accumulation,
        gradient_clip_val=recipe.optim.max_grad_norm,
        logger=recipe_loggers(recipe),
        log_every_n_steps=train.log_every,
        callbacks=callbacks,
        enable_model_summary=False,
        **eval_kwargs,
    )


def run_finetune(recipe: Recipe, resume: str | Path | None = LATEST) -> dict[str, Any]:
    """Train as the recipe says, export the result, draw the loss curve.

    Args:
        recipe: The run's recipe.
        resume: The checkpoint to resume from; ``None``: start fresh; :data:`~lightning_plugins.checkpoint.resume_choice.LATEST`:
            the newest intact one in ``train.output_dir``, if any, decided once for every rank.

    Returns:
        On global rank 0: the paths written (``model``, ``metrics``, ``loss_curve``) and the final losses.
    """
    L.seed_everything(recipe.train.seed, verbose=False)
    model, tokenizer = build_model(recipe)
    train_loader, eval_loader = build_loaders(recipe, tokenizer)
    batches = batches_per_rank(recipe, len(train_loader.dataset))
    module = RecipeModule(model, recipe, total_steps(recipe, batches), make_objective(recipe, train_loader, eval_loader))
    trainer = build_trainer(recipe, batches)
    ckpt = resume
    if resume == LATEST:  # the launching rank decides for the ranks it starts (other nodes': the strategy checks)
        launching = is_launcher_rank()
        ckpt = handed_down_resume(recipe.train.output_dir, say if launching else None, launching)
    trainer.fit(module, train_loader, eval_loader, ckpt_path=ckpt)
    check_exportable(module.model.parameters(), recipe, trainer.global_step)
    written = export_trained(module.model, tokenizer, recipe)
    if not trainer.is_global_zero:
        return {}
    return write_results(recipe, written, ckpt, {k: float(v) for k, v in trainer.callback_metrics.items()})


def is_launcher_rank() -> bool:
    """Whether this process started the run (Lightning re-runs the program once per extra rank)."""
    return int(os.environ.get("LOCAL_RANK", "0")) == 0 and int(os.environ.get("NODE_RANK", "0")) == 0
