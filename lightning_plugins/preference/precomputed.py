"""``objective.reference: precomputed``: DPO's reference log-probabilities from one pass over the data before training,
so that no reference is held or run while training (TRL's ``precompute_ref_log_probs``).

Where the values live: in memory, on every rank, for the run. The pass runs at the objective's first call (the first
training micro-batch, before the first optimizer step), by every rank at once with the model as it is laid out: each
data-parallel rank (``dp``) takes every ``dp``-th row of the training and held-out sets, in batches of
``train.micro_batch_size`` pairs collated as the loaders collate them (the tensor- and context-parallel ranks of a data
rank share its batches, context parallelism shards them as the doors do), and one all-gather over the data ranks hands
every rank every row's two values (two floats a pair). A row's values are looked up by its row number, which each
example carries (:func:`numbered`), so any shuffling, epoch or resume finds them. The reference is the one the
objective computes per step (the base with the adapters disabled under LoRA, else the frozen copy of ``model.path``,
built for the pass and dropped after it). They are not stored in the ``datasets`` cache next to the tokenized rows:
the rows are prepared once per node before any process group or model exists (:mod:`lightning_plugins.data.prepared`),
and the values depend on the model, its weights and its layout besides; the pass costs one forward of the data, and
runs again when a run resumes.

A row's value is computed in a batch of other rows than during a per-step run (the pass's batches are not the
shuffled training batches), which changes its floating-point sum in the last bits only: under fp32 the losses and
metrics match the per-step reference's to ~1e-6 (``tests/preference/test_preference_recipe.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import Dataset

from lightning_plugins.parallel.hf_model import hf_model_of
from lightning_plugins.parallel.mesh import mesh_of
from lightning_plugins.preference.objective import REFERENCE_KEY, PreferenceObjective

__all__ = ["ROW_KEY", "PrecomputedReference", "numbered"]

#: The batch key of each pair's row number (the training set's rows first, then the held-out set's).
ROW_KEY = "row_numbers"


class _Numbered(Dataset):
    """A dataset whose examples carry their row number (``offset`` + index)."""

    def __init__(self, dataset: Any, offset: int) -> None:
        self.dataset, self.offset = dataset, offset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**self.dataset[index], ROW_KEY: self.offset + index}

    @property
    def column_names(self) -> list[str]:
        return self.dataset.column_names


class _NumberedCollate:
    """The loaders' collate, its batch carrying the examples' row numbers under :data:`ROW_KEY`."""

    def __init__(self, collate: Callable[[Sequence[Mapping[str, Any]]], dict[str, Tensor]]) -> None:
        self.collate = collate

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
        batch = self.collate([{key: value for key, value in ex.items() if key != ROW_KEY} for ex in examples])
        batch[ROW_KEY] = torch.tensor([ex[ROW_KEY] for ex in examples], dtype=torch.long)
        return batch


def numbered(train: Any, held: Any | None, collate: Callable) -> tuple[Dataset, Dataset | None, _NumberedCollate]:
    """The training and held-out sets with their row numbers (the held-out rows after the training rows), and the
    collate that keeps them in each batch."""
    return (_Numbered(train, 0), None if held is None else _Numbered(held, len(train)), _NumberedCollate(collate))


class PrecomputedReference:
    """``loss, metrics = objective(model, batch)`` as ``objective``'s, the reference's log-probabilities of the batch's
    rows looked up (``batch["ref_logps"]``) instead of computed; the pass that computes them runs at the first call.

    Args:
        objective: A paired method needing a reference (DPO).
        datasets: The numbered training and held-out sets (:func:`numbered`), whose rows the batches hold.
        collate: Their collate (the numbered one).
        micro_batch_size: Pairs per forward of the pass.
    """

    def __init__(
        self, objective: PreferenceObjective, datasets: Sequence[Any], collate: Callable, micro_batch_size: int
    ) -> None:
        self.objective, self.datasets, self.collate = objective, [d for d in datasets if d is not None], collate
        self.micro_batch_size = micro_batch_size
        self.table: Tensor | None = None
        self.options = objective.options

    def __call__(self, model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        if ROW_KEY not in batch:
            raise ValueError(f"objective.reference: precomputed needs each batch's row numbers (batch[{ROW_KEY!r}]).")
        if self.table is None:
            self.table = self.compute(model)
        given = {key: value for key, value in batch.items() if key != ROW_KEY}
        values = self.table.to(batch["input_ids"].device)[batch[ROW_KEY].to(batch["input_ids"].device)]
        given[REFERENCE_KEY] = values.t().reshape(-1)  # the chosen rows' values, then the rejected rows'
        return self.objective(model, given)

    def _example(self, row: int) -> Mapping[str, Any]:
        for dataset in self.datasets:
            if row < len(dataset):
                return dataset[row]
            row -= len(dataset)
        raise IndexError(row)

    def compute(self, model: nn.Module) -> Tensor:
        """The pass: every row's ``[chosen, rejected]`` reference log-probabilities, ``[rows, 2]``, on every rank."""
        from lightning_plugins.parallel.context import context_parallel_batch

        mesh = mesh_of(hf_model_of(model))
        data = mesh["dp"] if mesh is not None and mesh["dp"].size() > 1 else None
        ranks, rank = (1, 0) if data is None else (data.size(), data.get_local_rank())
        total = sum(len(dataset) for dataset in self.datasets)
        per_rank = math.ceil(total / ranks)
        mine = [min(rank + ranks * k, total - 1) for k in range(per_rank)]  # every rank as many (the last repeated)
        device = next(model.parameters()).device
        parts = []
        devices = [device] if device.type == "cuda" else []  # the pass leaves the training's random state as it was
        with torch.inference_mode(False), torch.no_grad(), torch.random.fork_rng(devices=devices):
            for start in range(0, per_rank, self.micro_batch_size):
                batch = self.collate([self._example(row) for row in mine[start : start + self.micro_batch_size]])
                batch = {k: v.to(device) for k, v in batch.items() if k != ROW_KEY}
                batch = context_parallel_batch(batch, mesh) if mesh is not None else batch
                parts.append(self.objective.reference_logps(model, batch).logps.detach().float().view(2, -1).t())
        self.objective.reference = None  # a full fine-tune's frozen copy: built for the pass, not held while training
        local = torch.cat(parts)
        if data is None:
            return local[:total].cpu()
        gathered = [torch.empty_like(local) for _ in range(ranks)]
        dist.all_gather(gathered, local.contiguous(), group=data.get_group())
        table = torch.stack(gathered, dim=1).reshape(-1, 2)  # row k * ranks + r: rank r's k-th, as dealt
        return table[:total].cpu()
