"""A recipe run through the Accelerate door, with the Lightning door's loop semantics.

Same data order (a ``DistributedSampler`` over the data-parallel ranks, seeded by ``train.seed``, as Lightning
installs), same accumulation, clipping and per-step schedule, same metric names, loggers (``train.loggers``
as Accelerate's trackers) and CSV layout (``train/loss``, ``train/lr``, ``train/grad_norm``, ``train/tokens_per_s``,
``train/mfu`` on GPUs, ``val/loss``; under a preference method TRL's metrics as ``train/rewards/chosen``, ...,
``val/logits/rejected``), the same ``output_dir/run.json``,
checkpoints ``output_dir/checkpoints/step=N.ckpt`` resumed automatically, the same non-finite guard
(``train.on_nonfinite``) and the same exports. Only the launcher differs: ``accelerate launch`` decides the world,
the recipe the rest.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import InitProcessGroupKwargs
from torch.utils.data import DataLoader, DistributedSampler

from lightning_plugins.accelerate.accelerator import ParallelAccelerator
from lightning_plugins.accelerate.metrics import recipe_trackers
from lightning_plugins.accelerate.settings import builtin_path, describe_launch
from lightning_plugins.accelerate.state import broadcast_from_first
from lightning_plugins.checkpoint import resume_choice
from lightning_plugins.checkpoint.checks import CHECKPOINT_NAME
from lightning_plugins.checkpoint.resume_choice import LATEST, agreed_resume
from lightning_plugins.parallel.optim.optim_in_backward import StepInBackward, step_in_backward
from lightning_plugins.recipe.build import build_loaders, build_model, make_objective, make_optimizer
from lightning_plugins.recipe.diff import reset_optimizer
from lightning_plugins.recipe.finish import check_exportable, export_dir, export_trained, write_results
from lightning_plugins.recipe.meter import ThroughputMeter
from lightning_plugins.errors import OptionsError
from lightning_plugins.recipe.schema import Recipe
from lightning_plugins.recipe.train import TrainSection
from lightning_plugins.recipe.manifest import write_manifest
from lightning_plugins.run.nonfinite import NonFiniteGuard, check_finite_weights, training_state
from lightning_plugins.run.perf import PerfMonitor
from lightning_plugins.run.preemption import Preemption
from lightning_plugins.recipe.record import hyperparameters, project_name


@dataclass
class Progress:
    """Optimizer steps taken; saved with every checkpoint (registered for checkpointing)."""

    step: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


#: ``loss, metrics = objective(model, batch)``: the recipe's loss of a micro-batch and what it logs with it.
Objective = Callable[[torch.nn.Module, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def _model_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
    return model(**batch).loss, {}


def objective_of(recipe: Recipe, train: DataLoader, held: DataLoader | None) -> Objective:
    """The recipe's objective, as the Lightning door's ``RecipeModule`` has it (:func:`~lightning_plugins.recipe.build.
    make_objective`): the model's own loss (SFT), or the preference loss of each batch with TRL's metrics (global means
    on every rank)."""
    return make_objective(recipe, train, held) or _model_loss


def make_accelerator(recipe: Recipe) -> ParallelAccelerator:
    """The recipe's layout and settings; the scheduler is stepped by the loop, once per optimizer step."""
    builtin = builtin_path()  # the launch config's: a recipe passes no plugin
    if recipe.objective.method != "sft" and builtin:  # before any process group or model
        raise OptionsError(
            f"objective.method={recipe.objective.method}: preference methods run on the engine's layouts (FSDP2, TP,"
            f" CP, EP), not under Accelerate's own {builtin} ({describe_launch()}), whose wrapped model computes"
            " neither the means over the data ranks nor the reference with the adapters disabled. Launch with a"
            " config that selects neither DeepSpeed nor FSDP (e.g. accelerate_configs/cpu_2proc.yaml, or"
            " 1node_8gpu.yaml) and set the recipe's layout."
        )
    return ParallelAccelerator(
        layout=recipe.layout, options=recipe.parallel, memory=recipe.memory,
        load_from=recipe.model.path if Path(recipe.model.path).is_dir() else None,
        async_checkpoint=recipe.train.async_checkpoint, recipe_record=recipe.to_yaml(),
        cpu=recipe.hardware.accelerator == "cpu" or not torch.cuda.is_available(),
        gradient_accumulation_steps=recipe.accumulation, step_scheduler_with_optimizer=False,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=recipe.train.collective_timeout_s))],
        log_with=recipe_trackers(recipe),
    )  # fmt: skip


def _sharded(loader: DataLoader, accelerator: ParallelAccelerator, shuffle: bool, seed: int) -> DataLoader:
    """``loader`` with the sampler Lightning installs: shards over the ``dp`` ranks, reshuffled per epoch."""
    if accelerator.device_mesh is None:  # Accelerate's DeepSpeed/FSDP shard over every process themselves
        return loader
    dp = accelerator.device_mesh["dp"]
    sampler = DistributedSampler(
        loader.dataset, num_replicas=dp.size(), rank=dp.get_local_rank(), shuffle=shuffle, seed=seed
    )
    return DataLoader(
        loader.dataset, batch_size=loader.batch_size, sampler=sampler, collate_fn=loader.collate_fn,
        drop_last=loader.drop_last, generator=loader.generator,  # its own: see lightning_plugins.checkpoint.resume
    )  # fmt: skip


def run_recipe(recipe: Recipe, resume: str | Path | None = LATEST) -> dict[str, Any]:
    """Train as the recipe says, export the result, draw the loss curve.

    Args:
        recipe: The run's recipe.
        resume: The checkpoint to resume from; ``None``: start fresh; :data:`~lightning_plugins.checkpoint.resume_choice.LATEST`:
            the newest intact one in ``train.output_dir``, if any. Rank 0's is every rank's.

    Returns:
        On the main process: the paths written and the last metrics; ``{}`` elsewhere.
    """
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    train = recipe.train
    out = Path(train.output_dir)
    accelerator = make_accelerator(recipe)
    write_manifest(recipe)
    accelerator.init_trackers(project_name(train), config=hyperparameters(recipe))
    preemption, guard = _guards(accelerator, recipe, out)
    set_seed(train.seed)
    model, tokenizer = build_model(recipe, on_meta=accelerator.builtin is None)
    num_params = sum(p.numel() for p in model.parameters())  # before sharding: the whole model
    train_loader, eval_loader, objective = _loaders(recipe, tokenizer, accelerator)
    set_seed(train.seed)  # again, as Lightning's strategy does after the adapters' init: dropout draws alike
    per_epoch = math.ceil(len(train_loader) / recipe.accumulation)
    total = train.max_steps or train.epochs * per_epoch
    optimizer, schedule = make_optimizer(model, recipe, total)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    model, optimizer, train_loader, schedule = accelerator.prepare(model, optimizer, train_loader, schedule)
    # Stepped in backward: hooks on the prepared (sharded) parameters; make_optimizer hooked the originals.
    fused = step_in_backward(optimizer.optimizer) if recipe.memory.optimizer_in_backward else None
    eval_loader = None if eval_loader is None else accelerator.prepare(eval_loader)
    ckpt = _resume(accelerator, recipe, resume, model, optimizer, schedule, total, progress)

    main = accelerator.is_main_process
    bar = tqdm(total=total, initial=progress.step, disable=not main, desc="train", dynamic_ncols=True)
    last: dict[str, float] = {}
    meter, norm = ThroughputMeter(num_params, accelerator.layout), None
    perf = PerfMonitor(out, train.log_every, train.profile, straggler_ratio=train.straggler_ratio,
                       sample=train.perf_sample, cuda=accelerator.device.type == "cuda", say=bar.write)  # fmt: skip
    model.train()
    try:  # an asynchronous save still in flight is finished before the run goes on or ends
        perf.begin(progress.step, total)
        while progress.step < total:
            epoch = train_loader.iteration
            for batch in train_loader:
                meter.count(batch)
                loss, metrics, norm = _train_step(accelerator, model, objective, batch, optimizer, schedule, recipe,
                                                  guard, fused, progress, norm)  # fmt: skip
                if not accelerator.sync_gradients:
                    continue
                progress.step += 1
                sampled = perf.step_end(progress.step)  # every rank
                last.update(row := {"train/loss": loss.item(), **{f"train/{k}": float(v) for k, v in metrics.items()}})
                _advance(bar, last)
                if progress.step % train.log_every == 0:
                    _log_step(accelerator, optimizer, meter, norm, row, sampled, epoch, progress.step)
                end_of_epoch = accelerator.gradient_state.end_of_dataloader
                if eval_loader is not None and (
                    progress.step % train.eval_every == 0 if train.eval_every else end_of_epoch
                ):
                    last.update(_evaluate(accelerator, model, objective, eval_loader))
                    accelerator.log({**_held_out(last), "epoch": epoch}, step=progress.step - 1)
                _save_or_stop(accelerator, model, optimizer, out, progress.step, train, preemption, bar)
                if progress.step >= total:
                    break
                perf.next_step(progress.step)
    except BaseException:
        perf.close()
        preemption.uninstall()
        accelerator.wait_for_checkpoint(failed=True)  # unpublished if it cannot complete
        raise
    accelerator.wait_for_checkpoint()
    perf.close()
    preemption.uninstall()
    bar.close()
    check_exportable(model.parameters(), recipe, progress.step)
    return _finish(accelerator, model, tokenizer, recipe, ckpt, last)


def _loaders(
    recipe: Recipe, tokenizer: Any, accelerator: ParallelAccelerator
) -> tuple[DataLoader, DataLoader | None, Objective]:
    """The training and held-out loaders, each sharded over the data-parallel ranks (the held-out one unshuffled),
    and the objective of their batches."""
    train_loader, eval_loader = build_loaders(recipe, tokenizer)
    objective = objective_of(recipe, train_loader, eval_loader)
    train_loader = _sharded(train_loader, accelerator, True, recipe.train.seed)
    eval_loader = None if eval_loader is None else _sharded(eval_loader, accelerator, False, recipe.train.seed)
    return train_loader, eval_loader, objective


def _guards(accelerator: ParallelAccelerator, recipe: Recipe, out: Path) -> tuple[Preemption, NonFiniteGuard]:
    """The preemption handler (installed) and the non-finite guard of the run."""
    train = recipe.train
    # Workers started by torchrun (`accelerate launch`) must not outlive it.
    preemption = Preemption(train.preempt_signals, watch_parent="TORCHELASTIC_RUN_ID" in os.environ)
    preemption.install()
    stepped_early = accelerator.builtin == "DeepSpeed" or recipe.memory.optimizer_in_backward
    guard = NonFiniteGuard(
        train.on_nonfinite, train.max_skipped_steps, lambda: resume_choice.latest_checkpoint(out), stepped_early
    )
    return preemption, guard


def _resume(
    accelerator: ParallelAccelerator, recipe: Recipe, resume: str | Path | None, model: torch.nn.Module,
    optimizer: Any, schedule: Any, total: int, progress: Progress,
) -> Path | None:  # fmt: skip
    """The checkpoint resumed from (rank 0's decision, for every rank), loaded; ``None`` for a fresh start."""
    ckpt = agreed_resume(Path(recipe.train.output_dir), resume, accelerator.print, broadcast_from_first)
    if ckpt is not None:
        accelerator.load_state(ckpt)
        # Optim settings changed on resume: a new AdamW state and schedule (rank 0's reading of its checkpoint).
        if broadcast_from_first(recipe.train.resume_reset_optimizer):
            reset_optimizer(optimizer, schedule, model, recipe, total, progress.step)
    return ckpt


def _train_step(
    accelerator: ParallelAccelerator, model: torch.nn.Module, objective: Objective, batch: Any, optimizer: Any,
    schedule: Any, recipe: Recipe, guard: NonFiniteGuard, fused: StepInBackward | None, progress: Progress, norm: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], Any]:  # fmt: skip
    """One micro-batch's forward and backward, and at the end of an accumulation the clipped optimizer step: the
    loss, the objective's metrics, and the gradient norm (``norm`` as it was between optimizer steps)."""
    with accelerator.accumulate(model):
        loss, metrics = objective(model, batch)
        guard.observe_loss(loss)
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            # With clipping off, the same global norm with no limit (gradients scaled by exactly 1);
            # stepped in backward, the norm the hooks accumulated before applying each gradient.
            clip_to = recipe.optim.max_grad_norm or math.inf
            norm = fused.grad_norm() if fused else accelerator.clip_grad_norm_(model.parameters(), clip_to)
            guard.check(progress.step + 1, norm, optimizer)  # a skipped step leaves no gradients
        optimizer.step()
        if accelerator.sync_gradients:
            schedule.step()
        optimizer.zero_grad()
    return loss, metrics, norm


def _advance(bar: Any, last: dict[str, float]) -> None:
    """One optimizer step more on the progress bar, with the latest training and held-out losses."""
    bar.update(1)
    bar.set_postfix({k.split("/")[0] + " loss": f"{last[k]:.3f}" for k in ("train/loss", "val/loss") if k in last})


def _held_out(last: dict[str, float]) -> dict[str, float]:
    return {key: value for key, value in last.items() if key.startswith("val/")}


def _log_step(
    accelerator: ParallelAccelerator, optimizer: Any, meter: ThroughputMeter, norm: Any, metrics: dict[str, float],
    sampled: dict[str, Any], epoch: int, step: int,
) -> None:  # fmt: skip
    """Log the step's loss and metrics and ``sampled`` perf figures with the learning rate, gradient norm, throughput
    and the experts' balance."""
    lr, world = optimizer.param_groups[0]["lr"], dist.get_world_size()
    row = {**metrics, **meter.row(lr, norm, world, accelerator.device)}
    row.update(sampled)
    row.update(accelerator.moe_balance())  # every rank: one all-reduce
    accelerator.log({**row, "epoch": epoch}, step=step - 1)  # on the main process


def _save_or_stop(
    accelerator: ParallelAccelerator, model: torch.nn.Module, optimizer: Any, out: Path, step: int,
    train: TrainSection, preemption: Preemption, bar: Any,
) -> None:  # fmt: skip
    """The periodic checkpoint; on a preemption every rank agreed on, a checkpoint (if none was just written) and the
    end of the run."""
    every, saved = train.checkpoint_every, None
    if every and step % every == 0:
        saved = _save(accelerator, model, optimizer, out, step)
    if preemption.agree(accelerator.device):  # every rank, once per optimizer step
        if every and saved is None:
            saved = _save(accelerator, model, optimizer, out, step)
        accelerator.wait_for_checkpoint()
        bar.close()  # the message gets a line of its own
        preemption.finish(step, saved)


def _save(
    accelerator: ParallelAccelerator, model: torch.nn.Module, optimizer: Any, out: Path, step: int
) -> Path:
    """Write ``out/checkpoints/step=<step>.ckpt`` (refused if the weights or optimizer state are not finite)."""
    check_finite_weights(training_state(model.parameters(), [optimizer]), f"checkpoint step={step}", step)
    path = out / "checkpoints" / f"{CHECKPOINT_NAME.format(step=step)}.ckpt"
    accelerator.save_state(path)
    return path


@torch.no_grad()
def _evaluate(
    accelerator: ParallelAccelerator, model: torch.nn.Module, objective: Objective, loader: Any
) -> dict[str, float]:
    """The held-out loss and metrics (``val/...``) as Lightning's ``sync_dist`` epoch means compute them (row-weighted,
    averaged over ranks; a metric a batch does not report, as KTO's ``rewards/chosen`` of a batch without desirable
    examples, is the mean over the batches that do)."""
    model.eval()
    totals: dict[str, torch.Tensor] = {"loss": torch.zeros((), dtype=torch.float64, device=accelerator.device)}
    rows: dict[str, int] = {}
    for batch in loader:
        count = batch["input_ids"].shape[0]
        loss, metrics = objective(model, batch)
        for name, value in {"loss": loss, **metrics}.items():
            totals[name] = totals.get(name, 0) + value.detach().double() * count
            rows[name] = rows.get(name, 0) + count
    model.train()
    counts = [max(1, rows.get(name, 0)) for name in totals]
    means = torch.stack(list(totals.values())) / torch.tensor(counts, dtype=torch.float64, device=accelerator.device)
    dist.all_reduce(means)
    return {f"val/{name}": value for name, value in zip(totals, (means / dist.get_world_size()).tolist())}


def _finish(
    accelerator: ParallelAccelerator,
    model: torch.nn.Module,
    tokenizer: Any,
    recipe: Recipe,
    ckpt: Path | None,
    last: dict[str, float],
) -> dict[str, Any]:
    """Export (HF directory, or peft adapter and merged weights), merge the metrics, draw the loss curve."""
    unwrapped = accelerator.unwrap_model(model)
    if accelerator.builtin is None:
        written = export_trained(unwrapped, tokenizer, recipe)
    else:  # Accelerate's DeepSpeed/FSDP gather the full state dict themselves
        state = accelerator.get_state_dict(model)
        target = export_dir(recipe)
        if accelerator.is_main_process:
            unwrapped.save_pretrained(target, state_dict=state, safe_serialization=True)
            tokenizer.save_pretrained(target)
        written = {"model": target}
    accelerator.wait_for_everyone()
    for tracker in accelerator.trackers:  # the main process's (`end_training` would also end the process group)
        tracker.finish()
    if not accelerator.is_main_process:
        return {}
    return write_results(recipe, written, ckpt, last)
