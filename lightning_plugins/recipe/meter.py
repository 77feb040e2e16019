"""The metrics row both doors log every ``train.log_every`` optimizer steps: learning rate, gradient norm, tokens/s
and MFU (on known GPUs), under the same names (``train/lr``, ``train/grad_norm``, ``train/tokens_per_s``,
``train/mfu``)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from lightning_plugins.parallel.layout import ParallelLayout
from lightning_plugins.recipe.build import input_tokens, model_flops_utilization


class ThroughputMeter:
    """Counts the tokens a rank runs and turns them into a metrics row (collective: every rank calls :meth:`row`).

    Args:
        num_params: The whole model's parameters (counted before sharding), for MFU.
        layout: The run's layout: tensor- and pipeline-parallel peers run the same tokens.
    """

    def __init__(self, num_params: int, layout: ParallelLayout) -> None:
        self.num_params = num_params
        self._peers = layout.tp_size * layout.pp_size
        self._tokens, self._clock = 0, time.perf_counter()

    def count(self, batch: dict[str, torch.Tensor]) -> None:
        """Add the tokens ``batch`` runs forward (padding excluded)."""
        self._tokens += input_tokens(batch)

    def row(
        self, lr: float, grad_norm: Any, world_size: int, device: torch.device | None = None
    ) -> dict[str, float]:
        """The metrics since the last row (or the start), and the count starts again.

        Args:
            lr: The learning rate of the first parameter group.
            grad_norm: The last step's global gradient norm (``None``: not known, left out).
            world_size: Processes of the job (MFU is per GPU).
            device: Where the count is summed over the ranks (the process group's device).
        """
        tokens = torch.tensor(float(self._tokens), device=device)
        dist.all_reduce(tokens)  # every rank counts what it runs; TP and PP peers run the same tokens
        now = time.perf_counter()
        rate = tokens.item() / self._peers / (now - self._clock)
        self._clock, self._tokens = now, 0
        row = {"train/lr": lr, "train/tokens_per_s": rate}
        if grad_norm is not None:
            row["train/grad_norm"] = float(grad_norm)
        mfu = model_flops_utilization(rate, self.num_params, world_size)
        if mfu is not None:
            row["train/mfu"] = mfu
        return row
