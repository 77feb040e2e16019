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
from accelerate.data_loader import DataLoaderShard, get_sampler, prepare_data_loader
from accelerate.scheduler import AcceleratedScheduler
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from lightning_plugins.parallel import context_parallel_batch
from lightning_plugins.checkpoint.resume import ResumableLoader


class ParallelDataLoader(ResumableLoader, DataLoaderShard):
    """A ``DataLoaderShard`` (as Accelerate prepared it) that hands context-parallel ranks their shards.

    It also knows its place in the epoch (:class:`~lightning_plugins.checkpoint.resume.ResumableLoader`): a :meth:`position`
    given back with :meth:`resume_from` makes the next iteration that epoch, from the batch after the last one.
    """

    mesh: DeviceMesh | None
    owner: str
    last_shards: dict[str, Any]
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
        loader.__dict__.update(mesh=mesh, owner=owner, sampler_generator=generator, last_shards={})
        return loader

    def order_generator(self) -> torch.Generator | None:
        return self.sampler_generator

    def __iter__(self) -> Iterator[Any]:
        for batch in self._positioned(super().__iter__):
            yield batch if self.mesh is None else self._shard(batch)

    def _shard(self, batch: Any) -> Any:
        try:
            sharded = context_parallel_batch(batch, self.mesh)
        except ValueError as err:
            raise ValueError(f"{self.owner} (cp_size={self.mesh['cp'].size()}): {err}") from None
        #: The last batch's sequence shards, by name: what ``maybe_context_parallel`` compares its buffers with.
        self.last_shards = dict(sharded) if isinstance(sharded, dict) else {}
        return sharded

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


def shard_over_data_ranks(
    accelerator: Any, data_loader: DataLoader, device_placement: bool | None
) -> ParallelDataLoader:
    """``data_loader`` prepared by Accelerate's ``prepare_data_loader`` over the ``dp`` mesh dimension only (a loader
    whose sampler is a ``DistributedSampler`` is already sharded and is only placed on the device), as a
    :class:`ParallelDataLoader` that context-shards its batches under context parallelism."""
    mesh = accelerator.device_mesh
    dp = mesh["dp"]
    sharded = isinstance(getattr(data_loader, "sampler", None), DistributedSampler)
    sampler = get_sampler(data_loader)
    if isinstance(sampler, RandomSampler) and sampler.generator is None and not accelerator.use_seedable_sampler:
        # Accelerate gives it a generator only for several processes; save_state needs the epoch's order in one.
        sampler.generator = torch.Generator().manual_seed(int(torch.empty((), dtype=torch.int64).random_()))
    shard = prepare_data_loader(
        data_loader,
        accelerator.device,
        num_processes=1 if sharded else dp.size(),
        process_index=0 if sharded else dp.get_local_rank(),
        split_batches=accelerator.split_batches,
        put_on_device=accelerator.device_placement if device_placement is None else device_placement,
        rng_types=accelerator.rng_types.copy(),
        dispatch_batches=False,
        even_batches=accelerator.even_batches,
        use_seedable_sampler=accelerator.use_seedable_sampler,
        data_seed=accelerator.dataloader_config.data_seed,
        non_blocking=accelerator.non_blocking,
        use_stateful_dataloader=accelerator.use_stateful_dataloader,
    )
    assert isinstance(shard, DataLoaderShard)
    context = mesh if accelerator.layout.cp_size > 1 else None
    owner = type(accelerator).__name__
    return ParallelDataLoader.adopt(shard, context, owner, getattr(sampler, "generator", None))
