"""Accelerate's prepared data loader and scheduler, told about data-parallel ranks rather than processes.

Under tensor, context or pipeline parallelism several processes must read the *same* samples: Accelerate
shards loaders over every process and steps schedulers once per process. Here loaders are sharded over
the ``dp`` mesh dimension only (by Accelerate's own ``prepare_data_loader``), context-parallel ranks get
their load-balanced sequence shard of each batch, and each loader remembers how far it got so that
``save_state``/``load_state`` resume mid-epoch on the next batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from accelerate.data_loader import DataLoaderShard
from accelerate.scheduler import AcceleratedScheduler
from torch.distributed.device_mesh import DeviceMesh

from lightning_plugins.parallel import context_parallel_batch
from lightning_plugins.checkpoint.resume import ResumableLoader


class ParallelDataLoader(ResumableLoader, DataLoaderShard):
    """A ``DataLoaderShard`` (as Accelerate prepared it) that hands context-parallel ranks their shards.

    It also knows its place in the epoch (:class:`~lightning_plugins.checkpoint.resume.ResumableLoader`): a :meth:`position`
    given back with :meth:`resume_from` makes the next iteration that epoch, from the batch after the last one.
    """

    mesh: DeviceMesh | None
    owner: str
    sampler_generator: torch.Generator | None

    @classmethod
    def adopt(
        cls, shard: DataLoaderShard, mesh: DeviceMesh | None, owner: str, generator: torch.Generator | None
    ) -> ParallelDataLoader:
        """The prepared ``shard`` as this class (same state).

        Args:
            shard: What ``accelerate.data_loader.prepare_data_loader`` returned.
            mesh: The mesh when context parallelism is on (batches are then sharded along the sequence).
            owner: Named in errors.
            generator: The sampler's generator, whose state at an epoch's start fixes that epoch's order.
        """
        loader = cls.__new__(cls)
        loader.__dict__.update(shard.__dict__)  # bypasses DataLoader.__setattr__, which guards set-once fields
        loader.__dict__.update(mesh=mesh, owner=owner, sampler_generator=generator)
        return loader

    def order_generator(self) -> torch.Generator | None:
        return self.sampler_generator

    def __iter__(self) -> Iterator[Any]:
        for batch in self._positioned(super().__iter__):
            yield batch if self.mesh is None else self._shard(batch)

    def _shard(self, batch: Any) -> Any:
        try:
            return context_parallel_batch(batch, self.mesh)
        except ValueError as err:
            raise ValueError(f"{self.owner} (cp_size={self.mesh['cp'].size()}): {err}") from None

    def position(self) -> dict[str, Any]:
        """Where the loader stands: its epoch (Accelerate's ``iteration``) and its place in it."""
        place = super().position()
        return {**place, "epoch": self.iteration + place["epochs_done"]}

    def resume_from(self, position: dict[str, Any]) -> None:
        """Continue from a :meth:`position`: the next iteration is that epoch, from the batch after the last one."""
        self.iteration = position["epoch"]
        super().resume_from(position)


class DataParallelScheduler(AcceleratedScheduler):
    """Accelerate's scheduler wrapper, stepping once per data-parallel replica rather than per process.

    Accelerate advances the schedule ``num_processes`` times per optimizer step (without ``split_batches``
    every process reads its own batch); under tensor/context/pipeline parallelism only the ``dp`` ranks do.
    """

    def __init__(self, scheduler: Any, optimizers: Any, *, replicas: int, **kwargs: Any) -> None:
        super().__init__(scheduler, optimizers, **kwargs)
        self.replicas = replicas

    def step(self, *args: Any, **kwargs: Any) -> None:
        if (
            not self.step_with_optimizer
            or self.split_batches
            or not self.gradient_state.sync_gradients
            or any(opt.step_was_skipped for opt in self.optimizers)
        ):
            super().step(*args, **kwargs)
            return
        total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR must not step past its end
        for _ in range(self.replicas):
            if total is None or self.scheduler._step_count <= total:
                self.scheduler.step(*args, **kwargs)
