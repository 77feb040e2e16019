"""The recipe's ``train`` section, by concern: how long and in what batches (:class:`Schedule`), what is written
to disk (:class:`Outputs`), what guards the run (:class:`Guards`), where metrics go (:class:`Logging`), and what
measures its speed (:class:`Performance`).

Each concern is a small class of its own; :class:`TrainSection` joins them, so a recipe still writes every key
flat under ``train:`` (``train.max_steps``, ``train.loggers``): the YAML keys are the user's contract.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from typing import Literal

from pydantic import Field, field_validator, model_validator

from lightning_plugins.recipe.sections import Section
from lightning_plugins.run.perf import ProfileOptions


def known_names(names: list[str], known: Sequence[str], kind: str, case: Callable[[str], str]) -> list[str]:
    """``names`` if each is one of ``known``; else the first unknown one named, with the closest known one."""
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(case(name), known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ValueError(f"unknown {kind} {name!r}: {hint}use some of {', '.join(known)}")
    return names


class Schedule(Section):
    """How long, and in what batches."""

    global_batch_size: int | None = Field(None, ge=1)
    """Samples (packed rows with ``data.packing``) per optimizer step over all data ranks; or give
    ``global_batch_tokens`` instead."""
    global_batch_tokens: int | None = Field(None, ge=1)
    """Tokens per optimizer step (``global_batch_tokens / data.max_seq_len`` rows)."""
    micro_batch_size: int = Field(1, ge=1)
    """Samples per data-parallel rank per forward (under pipeline parallelism the batch the pipeline splits into
    ``parallel.pp_microbatches``)."""
    max_steps: int | None = Field(None, ge=1)
    """Optimizer steps; or ``epochs``."""
    epochs: int | None = Field(None, ge=1)
    """Passes over the training data (when ``max_steps`` is not given)."""
    eval_every: int | None = Field(None, ge=1)
    """Evaluate on the held-out split every N optimizer steps (``null``: at each epoch end)."""
    seed: int = 0
    """Seed of weights that are created (LoRA), data order and dropout."""

    @model_validator(mode="after")
    def _one_of_each(self) -> Schedule:
        if (self.global_batch_size is None) == (self.global_batch_tokens is None):
            raise ValueError("give exactly one of global_batch_size (samples) and global_batch_tokens")
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError("give exactly one of max_steps and epochs")
        return self


class Outputs(Section):
    """What the run writes: checkpoints, the exported model, and where."""

    checkpoint_every: int | None = Field(None, ge=1)
    """Write a distributed checkpoint every N optimizer steps (``null``: none)."""
    async_checkpoint: bool = False
    """Write checkpoints in the background while training goes on (DCP's async save); each is moved into place only once
    complete, and the last one is waited for before the run ends."""
    output_dir: str = "outputs/finetune"
    """Checkpoints, metrics, the loss curve and the exported model (relative to the current directory)."""
    merge_lora: bool = False
    """With LoRA: also export the adapters merged into full weights."""
    resume_reset_optimizer: bool = False
    """On a resume whose ``optim`` settings differ from the checkpoint's, load the weights, step and data position but
    rebuild AdamW's state and the schedule from the new settings (the doors' ``--resume-reset-optimizer``; without it
    such a resume is refused: see :mod:`lightning_plugins.recipe.diff`)."""


class Guards(Section):
    """What stops or saves a run that goes wrong: a hung peer, a non-finite step, a preemption."""

    collective_timeout_s: float = Field(1800.0, gt=0)
    """How long any collective waits for its peers before it fails (the process group's timeout, in seconds). A rank
    that dies ends the job at once; one that hangs ends it after this long, with a message naming the rank. Raise it if
    a step, a checkpoint save or the first load may legitimately keep one rank away from the others longer."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """What a NaN or infinite loss or gradient norm on any rank does: ``stop`` ends the run with an error naming the
    step, the quantity, the ranks and the last checkpoint; ``skip`` skips that optimizer step as AMP's grad scaler does
    (no update; the learning-rate schedule goes on)."""
    max_skipped_steps: int = Field(10, ge=1)
    """With ``on_nonfinite: skip``, stop after this many consecutive skipped steps."""
    preempt_signals: list[str] = Field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    """The signals that preempt the run (to the launcher or the whole process group): every rank finishes its optimizer
    step, writes ``checkpoints/step=N.ckpt`` and exits non-zero (the ranks with status 75); a SLURM job requeues itself
    (:mod:`lightning_plugins.run.preemption`). ``[]``: none (Ctrl-C never is one; a worker whose launcher is gone stops
    so in any case)."""

    @field_validator("preempt_signals")
    @classmethod
    def _known_signals(cls, names: list[str]) -> list[str]:
        from lightning_plugins.run.preemption import SIGNALS

        return known_names(names, SIGNALS, "signal", str.upper)


class Logging(Section):
    """Where the metrics and the hyperparameters go."""

    log_every: int = Field(10, ge=1)
    """Log loss, learning rate, gradient norm and tokens/s every N optimizer steps."""
    loggers: list[str] = Field(default_factory=lambda: ["csv"])
    """Where the metrics and the hyperparameters (the resolved recipe, flat dotted keys) go, on rank 0: some of ``csv``,
    ``tensorboard`` (``output_dir/tensorboard``), ``wandb`` (its files in ``output_dir``), ``mlflow``
    (``MLFLOW_TRACKING_URI``, else a file store in ``output_dir/mlruns``), through Lightning's loggers and Accelerate's
    trackers with the same metric names. CSV (``output_dir/logs``) is written whatever the list says: ``metrics.csv``
    and the loss curve are built from it."""
    project: str | None = None
    """The wandb project and MLflow experiment (default: the output directory's name); each attempt is a run of its own,
    named ``version_N`` as its CSV directory."""
    wandb_offline: bool = False
    """Keep wandb's run on disk only (as ``WANDB_MODE=offline`` does); ``wandb sync`` uploads it."""

    @field_validator("loggers")
    @classmethod
    def _known_loggers(cls, names: list[str]) -> list[str]:
        from lightning_plugins.recipe.record import LOGGERS

        return known_names(names, LOGGERS, "logger", str.lower)


class Performance(Section):
    """What measures where a step's time goes."""

    profile: ProfileOptions | None = None
    """``{start_step: N, steps: K}``: ``torch.profiler`` over optimizer steps N..N+K-1 on every rank, a Chrome trace per
    rank in ``output_dir/profile/`` and, printed by rank 0 and in ``profile/summary.json``, where each rank's time went
    (compute, communication by collective, exposed communication, data wait, idle; :mod:`lightning_plugins.run.perf`).
    ``null``: off."""
    perf_sample: bool = True
    """Profile the last optimizer step of every ``log_every`` window to log each rank's step, own and data-wait time,
    the slowest rank and its ratio to the median (``perf/*`` metrics, ``output_dir/ranks.jsonl``). Each sampled step
    costs the profiler's recording and reading (about 0.1 s per step of the tiny TP recipe, whose steps take about as
    long; a real model's fewer, longer ops cost less in proportion), plus about a second for the profiler's first start
    in each process."""
    straggler_ratio: float = Field(1.25, gt=1)
    """Rank 0 prints a line naming the slowest rank when its own time (its step less the time it waited on its peers) is
    at least this many times the median (and 50 ms more: not a hiccup)."""


class TrainSection(Performance, Logging, Guards, Outputs, Schedule):
    """How long, in what batches, and where the results go: the concerns above, their keys flat under ``train:``."""

    @model_validator(mode="after")
    def _profile_within_the_run(self) -> TrainSection:
        if self.profile is not None and self.max_steps is not None:
            self.profile.check_within(self.max_steps)
        return self
