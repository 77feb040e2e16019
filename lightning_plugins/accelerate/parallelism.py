"""Accelerate's ``ParallelismConfig``, answering for the engine's layout.

Loops written for Accelerate's ND parallelism ask ``accelerator.parallelism_config`` which dimensions are on
(``dp_cp_dim_names`` to average the loss over ``torch_device_mesh["dp_cp"]``, ``non_data_parallel_size``, ...).
:func:`parallelism_config_of` answers those questions from the :class:`~lightning_plugins.ParallelLayout` (the one
place the sizes live) with Accelerate's own properties; the mesh is the engine's, which carries Accelerate's dimension
names and flattened views (``dp``, ``dp_shard_cp``, ``dp_cp``) plus ``pp``.
"""

from __future__ import annotations

from dataclasses import dataclass

from accelerate import ParallelismConfig
from torch.distributed.device_mesh import DeviceMesh

from lightning_plugins.parallel.layout import ParallelLayout

__all__ = ["LayoutParallelismConfig", "parallelism_config_of"]


@dataclass(repr=False)
class LayoutParallelismConfig(ParallelismConfig):
    """A ``ParallelismConfig`` with the engine's pipeline and expert sizes; every query answers as Accelerate's.

    ``pp`` counts among the dimensions that see the same batch, so ``total_size`` (the world) is still
    ``data_parallel_size x non_data_parallel_size``. Built from a resolved layout, it skips Accelerate's refusal of
    tensor/context parallelism over pure replicas, which the engine trains.
    """

    pp_size: int = 1
    ep_size: int = 1

    def __post_init__(self) -> None:
        self.cp_backend, self.sp_size, self.sp_backend = "torch", 1, "deepspeed"
        self._sizes = {"dp_replicate": self.dp_replicate_size, "dp_shard": self.dp_shard_size, "tp": self.tp_size,
                       "cp": self.cp_size, "sp": self.sp_size}  # fmt: skip

    @property
    def non_dp_dim_names(self) -> list[str]:
        """Enabled dimensions that receive the same batch: ``pp`` first, then Accelerate's (``tp``, ``cp``)."""
        return (["pp"] if self.pp_size > 1 else []) + super().non_dp_dim_names

    @property
    def total_size(self) -> int:
        return self.pp_size * super().total_size

    @property
    def non_data_parallel_size(self) -> int:
        return self.pp_size * super().non_data_parallel_size


def parallelism_config_of(layout: ParallelLayout, mesh: DeviceMesh | None) -> LayoutParallelismConfig:
    """The ``ParallelismConfig`` of a resolved ``layout``, holding ``mesh`` as its device mesh."""
    config = LayoutParallelismConfig(
        dp_replicate_size=layout.dp_replicate_size, dp_shard_size=layout.dp_shard_size, tp_size=layout.tp_size,
        cp_size=layout.cp_size, pp_size=layout.pp_size, ep_size=layout.ep_size,
    )  # fmt: skip
    config.device_mesh = mesh
    return config
