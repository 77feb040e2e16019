"""The parallel layout: dimension sizes, their validation, and the ``DeviceMesh`` built from them.

Every invalid combination fails here, before any collective runs, with a message that names the
constraint and a layout that would work.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_plugins.parallel.moe.experts import num_experts
from lightning_plugins.parallel.mesh import MeshRegistry
from lightning_plugins.parallel.teardown import track_mesh
from lightning_plugins.errors import LayoutError

#: Mesh dimension names, outermost to innermost.
MESH_DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """Sizes of the five parallel dimensions, given by name (``ParallelLayout(tp_size=2, dp_shard_size=-1)``)."""

    pp_size: int = 1
    """Pipeline stages."""
    dp_replicate_size: int = 1
    """Data-parallel replicas (HSDP's outer dimension when ``dp_shard_size > 1``)."""
    dp_shard_size: int = -1
    """Ranks that shard parameters, gradients and optimizer state (FSDP2). ``-1`` means whatever the world size leaves
    after the other dimensions."""
    cp_size: int = 1
    """Ranks that split the sequence inside attention (context parallel)."""
    tp_size: int = 1
    """Ranks that split weight matrices (tensor parallel)."""
    ep_size: int = 1
    """Ranks that split the routed experts of a mixture-of-experts model (expert parallel). They are drawn from the
    ``dp_shard x cp`` ranks (innermost first), so this adds no mesh dimension: it must divide ``dp_shard_size x
    cp_size`` and the number of experts; FSDP2 shards each expert over the rest."""

    def __post_init__(self) -> None:
        for name in ("pp_size", "dp_replicate_size", "cp_size", "tp_size", "ep_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"ParallelLayout: `{name}` must be a positive integer, got {value!r}.")
        if not isinstance(self.dp_shard_size, int) or (self.dp_shard_size < 1 and self.dp_shard_size != -1):
            raise LayoutError(
                f"ParallelLayout: `dp_shard_size` must be a positive integer or -1 (the rest), got {self.dp_shard_size!r}."
            )

    @property
    def sizes(self) -> tuple[int, ...]:
        """The sizes in mesh order (``pp, dp_replicate, dp_shard, cp, tp``); requires a resolved layout."""
        self._require_resolved()
        return (self.pp_size, self.dp_replicate_size, self.dp_shard_size, self.cp_size, self.tp_size)

    @property
    def world_size(self) -> int:
        """The number of ranks this layout spans; requires a resolved layout."""
        return int(torch.tensor(self.sizes).prod())

    @property
    def dp_size(self) -> int:
        """Ranks that see different samples (replicas x shards)."""
        self._require_resolved()
        return self.dp_replicate_size * self.dp_shard_size

    @property
    def fsdp_size(self) -> int:
        """Ranks over which FSDP2 shards or replicates parameters: data and context ranks together."""
        return self.dp_size * self.cp_size

    def resolve(self, world_size: int) -> ParallelLayout:
        """Fill in ``dp_shard_size=-1`` and check that the sizes multiply to ``world_size``.

        Raises:
            LayoutError: if the world size is not divisible by the fixed dimensions, or the product differs.
        """
        fixed = self.pp_size * self.dp_replicate_size * self.cp_size * self.tp_size
        if self.dp_shard_size == -1:
            if world_size % fixed:
                raise LayoutError(
                    f"World size {world_size} is not divisible by pp_size x dp_replicate_size x cp_size x tp_size"
                    f" = {fixed} ({self._fixed_str()}). Use a world size that is a multiple of {fixed}, or"
                    f" smaller sizes, e.g. {self._suggest(world_size)}."
                )
            return replace(self, dp_shard_size=world_size // fixed)._check_experts()
        if fixed * self.dp_shard_size != world_size:
            raise LayoutError(
                f"pp_size x dp_replicate_size x dp_shard_size x cp_size x tp_size = {fixed * self.dp_shard_size}"
                f" ({self._fixed_str()}, dp_shard_size={self.dp_shard_size}) must equal the world size"
                f" {world_size}. Set dp_shard_size=-1 to use the rest, e.g. {self._suggest(world_size)}."
            )
        return self._check_experts()

    def _check_experts(self) -> ParallelLayout:
        shard_cp = self.dp_shard_size * self.cp_size
        if shard_cp % self.ep_size:
            fits = [e for e in _divisors(shard_cp) if e > 1] or [1]
            raise LayoutError(
                f"ep_size={self.ep_size} does not divide dp_shard_size x cp_size = {self.dp_shard_size} x"
                f" {self.cp_size} = {shard_cp}: expert-parallel ranks are drawn from the data-parallel shard and"
                f" context ranks. Use ep_size in {fits}, or more data-parallel ranks (e.g. ParallelLayout(ep_size="
                f"{self.ep_size}, dp_shard_size={self.ep_size * max(1, shard_cp // self.ep_size)}, ...))."
            )
        return self

    def validate(self, config: Any | None = None) -> None:
        """Check a resolved layout against a transformers model config.

        Args:
            config: A ``transformers.PretrainedConfig`` (or any object with the same attribute names).

        Raises:
            LayoutError: naming the violated constraint and a size that would work.
        """
        self._require_resolved()
        if config is None:
            return
        heads = getattr(config, "num_attention_heads", None)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        checks = {
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "intermediate_size": getattr(config, "intermediate_size", None),
            "vocab_size": getattr(config, "vocab_size", None),
        }
        if self.tp_size > 1:
            for name, value in checks.items():
                if value is not None and value % self.tp_size:
                    good = [t for t in _divisors(self.world_size) if all(v is None or v % t == 0 for v in checks.values())]
                    extra = (
                        " (grouped-query attention: each tensor-parallel rank needs at least one whole kv head)"
                        if name == "num_key_value_heads"
                        else ""
                    )
                    raise LayoutError(
                        f"tp_size={self.tp_size} does not divide {name}={value} of this"
                        f" {getattr(config, 'model_type', 'model')} config{extra}. tp_size must divide"
                        f" num_attention_heads, num_key_value_heads, intermediate_size and vocab_size; valid"
                        f" tp_size values for world size {self.world_size}: {good}, e.g."
                        f" ParallelLayout(tp_size={max(good)}, dp_shard_size=-1)."
                    )
        self._validate_experts(config)
        layers = getattr(config, "num_hidden_layers", None)
        if layers is not None and self.pp_size > layers:
            raise LayoutError(
                f"pp_size={self.pp_size} exceeds num_hidden_layers={layers}: each pipeline stage needs at least"
                f" one decoder layer. Use pp_size <= {layers}."
            )

    def _validate_experts(self, config: Any) -> None:
        if self.ep_size == 1:
            return
        experts = num_experts(config)
        kind = getattr(config, "model_type", "model")
        if experts is None:
            raise LayoutError(
                f"ep_size={self.ep_size} splits the routed experts of a mixture-of-experts model, and this {kind} config"
                " declares none (no num_local_experts / num_experts). Use ep_size=1 for a dense model."
            )
        if experts % self.ep_size:
            good = [e for e in _divisors(self.dp_shard_size * self.cp_size) if experts % e == 0]
            raise LayoutError(
                f"ep_size={self.ep_size} does not divide the {experts} experts of this {kind} config: each"
                f" expert-parallel rank holds the same number of whole experts. Use ep_size in {good}."
            )

    def build_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """Build the 5-D ``DeviceMesh`` (names in ``MESH_DIM_NAMES``) plus the flattened dimensions.

        Flattened dimensions: ``dp`` (dp_replicate x dp_shard: ranks that see different samples),
        ``dp_shard_cp`` (dp_shard x cp: FSDP2's shard dimension) and ``dp_cp`` (every rank holding
        different tokens, over which the loss is normalised).
        """
        self._require_resolved()
        # Every group of the mesh waits as long as the world's process group: torch would give the groups it
        # creates for a dimension smaller than the world its own default (30 min), whatever the door's timeout.
        options = _world_group_options()
        override = None if options is None else dict.fromkeys(MESH_DIM_NAMES, options)
        mesh = init_device_mesh(device_type, self.sizes, mesh_dim_names=MESH_DIM_NAMES, backend_override=override)
        mesh["dp_replicate", "dp_shard"]._flatten("dp", backend_override=options)
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp", backend_override=options)
        mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp", backend_override=options)
        MESH_LAYOUTS.record(mesh, self)  # read back by from_mesh: ep_size is no dimension of the mesh
        return track_mesh(mesh)  # its cached groups are dropped when the process groups are released

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh) -> ParallelLayout:
        """The layout a mesh was built from by :meth:`build_mesh`; for another mesh, its sizes (missing names count as
        size 1, ``ep_size`` 1)."""
        if (layout := MESH_LAYOUTS.get(mesh)) is not None:
            return layout
        names = mesh.mesh_dim_names or ()
        sizes = {name: mesh.size(names.index(name)) if name in names else 1 for name in MESH_DIM_NAMES}
        return cls(**{f"{name}_size": sizes[name] for name in MESH_DIM_NAMES})

    def _require_resolved(self) -> None:
        if self.dp_shard_size == -1:
            raise LayoutError("ParallelLayout has dp_shard_size=-1: call `.resolve(world_size)` first.")

    def _fixed_str(self) -> str:
        return (
            f"pp_size={self.pp_size}, dp_replicate_size={self.dp_replicate_size}, cp_size={self.cp_size},"
            f" tp_size={self.tp_size}"
        )

    def _suggest(self, world_size: int) -> str:
        # Head counts are powers of two far more often than not: suggest the largest such divisor.
        tp = max(t for t in _divisors(world_size) if t <= self.tp_size and t & (t - 1) == 0)
        return f"ParallelLayout(tp_size={tp}, dp_shard_size=-1)"


#: The layout each mesh built by :meth:`ParallelLayout.build_mesh` was built from.
MESH_LAYOUTS: MeshRegistry[ParallelLayout] = MeshRegistry()

#: The size fields of :class:`ParallelLayout`: the mesh's, in order, then ``ep_size`` (drawn from dp_shard x cp).
SIZE_NAMES = (*(f"{name}_size" for name in MESH_DIM_NAMES), "ep_size")


def given_sizes(layout: ParallelLayout | None = None, **sizes: int | None) -> dict[str, int | None]:
    """The sizes a door was given: each size keyword that is not ``None``, else ``layout``'s, else ``None``.

    Lets a door take a whole :class:`ParallelLayout` (``layout=``), its sizes by name (``tp_size=2``), or both (the
    keywords override the layout's fields); one construction path for every door.

    Args:
        layout: A layout given whole, or ``None``.
        **sizes: ``pp_size``, ``dp_replicate_size``, ``dp_shard_size``, ``cp_size``, ``tp_size``, ``ep_size``
            (``None``: not given).
    """
    given = {name: value for name, value in sizes.items() if value is not None}
    return {name: given.get(name, getattr(layout, name, None)) for name in SIZE_NAMES}


def layout_of(layout: ParallelLayout | None = None, **sizes: int | None) -> ParallelLayout:
    """The layout of :func:`given_sizes` (sizes given nowhere keep :class:`ParallelLayout`'s defaults)."""
    return ParallelLayout(**{name: value for name, value in given_sizes(layout, **sizes).items() if value is not None})


def add_dimension_names(mesh: DeviceMesh, names: dict[str, tuple[str, ...]]) -> DeviceMesh:
    """Give ``mesh`` (built by :meth:`ParallelLayout.build_mesh`) more names: each a flattened view of the dimensions
    it spans (a name the mesh has already is left as it is), whose groups wait as long as the world's."""
    for name, dims in names.items():
        try:
            mesh[name]
        except KeyError:
            mesh[dims]._flatten(name, backend_override=_world_group_options())
    return mesh


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _world_group_options() -> Any:
    """Options carrying the default process group's timeout, for the groups of a mesh (``None``: torch's default).

    Only for a single-backend world (``gloo`` or ``nccl``); the options' backend must match the group's.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    backend = dist.get_backend()
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
    elif backend == "nccl" and dist.is_nccl_available():
        options = dist.ProcessGroupNCCL.Options()
    else:
        return None
    device = torch.device("cuda" if backend == "nccl" else "cpu")
    options._timeout = dist.distributed_c10d._get_default_group()._get_backend(device).options._timeout
    return options
