"""``ParallelPlan``: a layout with its settings, resolved and checked once per run, owning the meshes built for it.

:func:`resolve` takes what a run is given (the :class:`ParallelLayout`, the :class:`ParallelOptions`, the
:class:`MemoryOptions`, the model's config and the world size), fills in the layout's ``dp_shard_size=-1``, runs
every check that needs neither weights nor a collective once (:func:`~lightning_plugins.parallel.checks.check_settings`)
and returns the plan. The plan then answers by name (as torchtitan's ``ParallelDims``): ``plan.tp_size``,
``plan.dp_size``, ``plan.mesh("tp")``, ``plan.experts``, ``plan.fsdp``. Its meshes are built on first use
(building a mesh creates process groups: a collective), once.

A door resolves its plan once, as soon as it knows the world, and before the model exists if it must (a Lightning
strategy's mesh exists before the module's ``configure_model`` builds the model): the model's config is then checked
once it is known (:meth:`ParallelPlan.check_config`, which ``parallelize`` calls), not a second time for a config
already checked.

A mesh a plan built remembers its plan (:func:`plan_of`), beside torch's object and not on it: a user's
``configure_model`` that calls ``parallelize(model, self.device_mesh)`` gets the door's plan back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_plugins.errors import LayoutError
from lightning_plugins.parallel.checks import check_model_fit, check_settings
from lightning_plugins.parallel.layout import MESH_DIM_NAMES, ParallelLayout
from lightning_plugins.parallel.mesh import MeshRegistry, data_mesh, fsdp_mesh
from lightning_plugins.parallel.moe.experts import ExpertMeshes, expert_meshes
from lightning_plugins.parallel.options import MemoryOptions, ParallelOptions
from lightning_plugins.parallel.pipeline.options import PipelineOptions

__all__ = ["ParallelPlan", "layout_of_mesh", "plan_of", "resolve"]


@dataclass(eq=False)
class ParallelPlan:
    """A resolved, checked layout with its settings, and the meshes built for it (see :func:`resolve`).

    Attributes:
        layout: The resolved layout (``dp_shard_size`` filled in).
        options: How each dimension is applied.
        memory: The memory levers.
        pipeline: The resolved pipeline options when ``pp_size > 1``, else ``None``.
        device_type: The device type the mesh is built on (``"cuda"``, ``"cpu"``).
        checked_config: Whether the layout and settings were checked against the model's config (else only what needs
            no model was: :meth:`check_config`, which ``parallelize`` calls, checks the rest).
    """

    layout: ParallelLayout
    options: ParallelOptions
    memory: MemoryOptions
    pipeline: PipelineOptions | None
    device_type: str
    checked_config: bool = False
    _mesh: DeviceMesh | None = field(default=None, repr=False)
    _experts: ExpertMeshes | None = field(default=None, repr=False)
    _config: Any = field(default=None, repr=False)  # the config checked against (``None``: none yet)

    def check_config(self, config: Any | None) -> None:
        """Check the layout and settings against the model's ``config`` (no collective runs), once per config: a plan
        resolved before the model existed gets its config here; one checked against this config already is not checked
        again. ``None`` checks nothing.

        Raises:
            LayoutError, OptionsError: as :func:`resolve` does.
        """
        if config is None or config is self._config:
            return
        # What needs no model was checked when the plan was resolved: only what the config adds runs here.
        self.pipeline = check_model_fit(self.layout, self.options, config)
        self.checked_config, self._config = True, config

    @property
    def pp_size(self) -> int:
        return self.layout.pp_size

    @property
    def tp_size(self) -> int:
        return self.layout.tp_size

    @property
    def cp_size(self) -> int:
        return self.layout.cp_size

    @property
    def ep_size(self) -> int:
        return self.layout.ep_size

    @property
    def dp_size(self) -> int:
        """Ranks that see different samples (replicas x shards)."""
        return self.layout.dp_size

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def built(self) -> bool:
        """Whether the mesh exists (its process groups were created)."""
        return self._mesh is not None

    def mesh(self, name: str | None = None) -> DeviceMesh:
        """The whole mesh (``name=None``) or its dimension ``name`` (one of ``MESH_DIM_NAMES`` or a flattened one:
        ``dp``, ``dp_shard_cp``, ``dp_cp``); built on the first call (collective: every rank calls it)."""
        if self._mesh is None:
            self.adopt(self.layout.build_mesh(self.device_type))
        assert self._mesh is not None
        return self._mesh if name is None else self._mesh[name]

    def build(self, device_type: str) -> DeviceMesh:
        """Build the mesh now on ``device_type`` (a collective: every rank calls it), for a door that resolved the plan
        before it knew its device (before it joined the process group); the mesh a plan holds already is returned."""
        if self._mesh is None:
            self.device_type = device_type
        elif self._mesh.device_type != device_type:
            raise LayoutError(
                f"This ParallelPlan's mesh is on {self._mesh.device_type!r}, not {device_type!r}: resolve a new plan."
            )
        return self.mesh()

    def adopt(self, mesh: DeviceMesh) -> None:
        """Use ``mesh`` (built for this layout, e.g. by a door) as this plan's mesh, and remember the plan for it."""
        if self._mesh is not None and self._mesh is not mesh:
            raise LayoutError("This ParallelPlan has a mesh already: a plan owns one mesh; resolve a new plan.")
        self._mesh = mesh
        PLANS.record(mesh, self)

    @property
    def experts(self) -> ExpertMeshes | None:
        """The expert meshes (``ep``, the experts' DTensor mesh, their FSDP2 mesh), or ``None`` when ``ep_size == 1``."""
        if self._experts is None and self.ep_size > 1:
            self._experts = expert_meshes(self.mesh(), self.ep_size)
        return self._experts

    @property
    def data(self) -> DeviceMesh | None:
        """Ranks that hold different tokens (``dp_cp``), over which the loss is normalised, or ``None``."""
        return data_mesh(self.mesh())

    @property
    def fsdp(self) -> DeviceMesh | None:
        """FSDP2's mesh (``dp_shard_cp``, or ``(dp_replicate, dp_shard_cp)`` for HSDP), or ``None``."""
        return fsdp_mesh(self.mesh())

    def same_settings(self, other: ParallelPlan) -> bool:
        """Whether ``other`` asks for the same layout and settings."""
        return (self.layout, self.options, self.memory) == (other.layout, other.options, other.memory)


#: The plan each mesh was built (or adopted) by.
PLANS: MeshRegistry[ParallelPlan] = MeshRegistry()


def plan_of(mesh: DeviceMesh) -> ParallelPlan | None:
    """The plan that built (or adopted) ``mesh``, or ``None``."""
    return PLANS.get(mesh)


def layout_of_mesh(mesh: DeviceMesh) -> ParallelLayout:
    """The layout of ``mesh``: its plan's, else the one :meth:`ParallelLayout.build_mesh` recorded, else its sizes (a
    mesh built without either, e.g. by Lightning's ``ModelParallelStrategy``: see :meth:`ParallelLayout.from_mesh`)."""
    plan = plan_of(mesh)
    return plan.layout if plan is not None else ParallelLayout.from_mesh(mesh)


def resolve(
    layout: ParallelLayout | DeviceMesh,
    options: ParallelOptions | None = None,
    memory: MemoryOptions | None = None,
    config: Any | None = None,
    world_size: int | None = None,
    device_type: str | None = None,
) -> ParallelPlan:
    """Resolve and check a layout with its settings, once: the plan a run hands to ``parallelize``.

    Args:
        layout: The layout (``dp_shard_size=-1`` is resolved against ``world_size``), or a mesh built by
            :meth:`ParallelLayout.build_mesh` or a plan (its layout; the plan adopts it).
        options: How each dimension is applied; defaults when ``None`` (a mesh's plan's when given a mesh).
        memory: The memory levers; defaults when ``None`` (a mesh's plan's when given a mesh).
        config: The model's ``transformers`` config, checked against; ``None`` checks what needs no model.
        world_size: The number of ranks; the process group's when ``None``.
        device_type: The mesh's device type; the mesh's, or the process group's backend's when ``None``.

    Raises:
        LayoutError, OptionsError: for any invalid combination, before any collective runs.
    """
    mesh = layout if isinstance(layout, DeviceMesh) else None
    if mesh is not None:
        known = plan_of(mesh)
        if known is not None and (options or known.options, memory or known.memory) == (known.options, known.memory):
            known.check_config(config)  # checked when it was resolved; against this config once
            return known
        layout = _layout_of_mesh(mesh)
        options = options or (known.options if known else None)
        memory = memory or (known.memory if known else None)
    options, memory = options or ParallelOptions(), memory or MemoryOptions()
    if mesh is None:
        layout = layout.resolve(_world_size(world_size))
    pipeline = check_settings(layout, options, memory, config)
    plan = ParallelPlan(layout, options, memory, pipeline, device_type or _device_type(mesh), config is not None)
    plan._config = config
    if mesh is not None:
        plan._mesh = mesh  # the registry keeps the first plan of a door's mesh; this one reuses the mesh
    return plan


def _layout_of_mesh(mesh: DeviceMesh) -> ParallelLayout:
    if not set(MESH_DIM_NAMES) <= set(mesh.mesh_dim_names or ()):
        raise LayoutError(
            f"parallelize needs a mesh with dimensions {MESH_DIM_NAMES} (got {mesh.mesh_dim_names});"
            " build it with `ParallelLayout(...).build_mesh(device_type)`."
        )
    return layout_of_mesh(mesh)


def _world_size(world_size: int | None) -> int:
    if world_size is not None:
        return world_size
    if not dist.is_initialized():
        raise LayoutError(
            "parallelize needs an initialized process group (torch.distributed.init_process_group, torchrun, or a"
            " Lightning strategy); for one process, use a world of size 1."
        )
    return dist.get_world_size()


def _device_type(mesh: DeviceMesh | None) -> str:
    if mesh is not None:
        return mesh.device_type
    return "cuda" if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"
