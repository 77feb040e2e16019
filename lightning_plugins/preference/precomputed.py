"""``objective.reference: precomputed``: DPO's reference log-probabilities from one pass over the data before training,
so that no reference is held or run while training (TRL's ``precompute_ref_log_probs``).

Where the values live: in memory, on every rank, for the run, and in a file next to the tokenized data
(``<data cache>/reference_logps/<key>.safetensors``, :func:`~lightning_plugins.data.prepared.cache_root`) that a later
run with the same key reads instead of running the pass. The key is a hash of everything the values depend on: the
prepared rows (their cache entries' names, themselves hashes of the data, the tokenizer and the data code), the model's
checkpoint directory (:func:`~lightning_plugins.data.prepared.file_identity`: its files' names, sizes and modification
times and its JSON files' bytes; the weights are not read through, so weights rewritten in place at the same size and
time would go unseen), its config, dtype and adapters, the layout (mesh shape and names) and the engine's settings, the
pass's batch size, the code of ``lightning_plugins`` and the torch and transformers versions: a changed model, data,
layout or code computes them anew. Every rank agrees on reading (one all-reduce) before any of them runs the pass, and
each node's first local rank writes its copy (atomically). The pass runs at the objective's first call (the first
training micro-batch, before the first optimizer step), by every rank at once with the model as it is laid out: each
data-parallel rank (``dp``) takes every ``dp``-th row of the training and held-out sets, in batches of
``train.micro_batch_size`` pairs collated as the loaders collate them (the tensor- and context-parallel ranks of a data
rank share its batches, context parallelism shards them as the doors do), and one all-gather over the data ranks hands
every rank every row's two values (two floats a pair). A row's values are looked up by its row number, which each
example carries (:func:`numbered`), so any shuffling, epoch or resume finds them. The reference is the one the
objective computes per step (the base with the adapters disabled under LoRA, else the frozen copy of ``model.path``,
built for the pass and dropped after it).

A row's value is computed in a batch of other rows than during a per-step run (the pass's batches are not the
shuffled training batches), which changes its floating-point sum in the last bits only: under fp32 the losses and
metrics match the per-step reference's to ~1e-6 (``tests/preference/test_kto_and_precomputed_recipes.py``; the tiny
recipe's were equal).
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
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


def code_identity() -> str:
    """A hash of the ``lightning_plugins`` package's code: values computed by other code are never read."""
    code = hashlib.sha256()
    for path in sorted(Path(__file__).parents[1].rglob("*.py")):
        code.update(str(path.relative_to(Path(__file__).parents[1])).encode() + path.read_bytes())
    return code.hexdigest()


def _adapters(model: nn.Module) -> str:
    """The model's peft adapter configs, canonical (their sets sorted: a repr's order changes from run to run)."""
    import json

    configs = {name: config.to_dict() for name, config in (getattr(model, "peft_config", None) or {}).items()}
    return json.dumps(configs, sort_keys=True, default=lambda x: sorted(map(str, x)) if isinstance(x, (set, frozenset))
                      else str(x))  # fmt: skip


class PrecomputedReference:
    """``loss, metrics = objective(model, batch)`` as ``objective``'s, the reference's log-probabilities of the batch's
    rows looked up (``batch["ref_logps"]``) instead of computed; the pass that computes them runs at the first call.

    Args:
        objective: A paired method needing a reference (DPO).
        datasets: The numbered training and held-out sets (:func:`numbered`), whose rows the batches hold.
        collate: Their collate (the numbered one).
        micro_batch_size: Pairs per forward of the pass.
        cache_dir: Where the values are kept between runs (``None``: not kept).
    """

    def __init__(
        self, objective: PreferenceObjective, datasets: Sequence[Any], collate: Callable, micro_batch_size: int,
        cache_dir: str | Path | None = None,
    ) -> None:  # fmt: skip
        self.objective, self.datasets, self.collate = objective, [d for d in datasets if d is not None], collate
        self.micro_batch_size = micro_batch_size
        self.cache_dir = None if cache_dir is None else Path(cache_dir) / "reference_logps"
        self.table: Tensor | None = None
        self.options = objective.options

    def __call__(self, model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        if ROW_KEY not in batch:
            raise ValueError(f"objective.reference: precomputed needs each batch's row numbers (batch[{ROW_KEY!r}]).")
        if self.table is None:
            self.table = self.cached(model)
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

    def cached(self, model: nn.Module) -> Tensor:
        """The values from the cache when every rank finds them there, else from the pass (then written)."""
        from safetensors.torch import load_file, save_file

        path = None if self.cache_dir is None else self.cache_dir / f"{self.key(model)}.safetensors"
        found = torch.tensor([float(path is not None and path.is_file())])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(found, op=dist.ReduceOp.MIN)  # one rank without the file: every rank runs the pass
        if path is not None and found.item() == 1.0:
            return load_file(str(path))["ref_logps"]
        table = self.compute(model)
        if path is not None and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
            save_file({"ref_logps": table.contiguous()}, str(partial))
            os.replace(partial, path)
        return table

    def key(self, model: nn.Module) -> str:
        """A hash of everything the values depend on (the module's docstring lists it)."""
        import transformers

        from lightning_plugins.data.prepared import file_identity
        from lightning_plugins.parallel.api import SETTINGS_ATTR

        hf = hf_model_of(model)
        source = Path(str(getattr(hf.config, "name_or_path", "") or ""))
        mesh = mesh_of(hf)
        parts = (
            [[Path(f["filename"]).parent.name for f in getattr(d, "dataset", d).cache_files] for d in self.datasets],
            file_identity(source) if source.is_dir() else str(source),
            hf.config.to_json_string(), str(next(model.parameters()).dtype), _adapters(model),
            None if mesh is None else (tuple(mesh.mesh.shape), mesh.mesh_dim_names),
            repr(getattr(hf, SETTINGS_ATTR, None)), self.micro_batch_size, repr(self.objective.reference),
            code_identity(), torch.__version__, transformers.__version__,
        )  # fmt: skip
        return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]

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
