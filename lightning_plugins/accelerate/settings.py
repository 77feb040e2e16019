"""Where the Accelerate door's layout comes from, checked before any process group exists.

Sizes are given to :class:`~lightning_plugins.accelerate.ParallelAccelerator` (or by a recipe), or set in the
launch config's ``parallelism_config`` section (``accelerate launch`` exports them as
``PARALLELISM_CONFIG_*``); both is fine when they agree. A launch config that selects Accelerate's own
DeepSpeed or FSDP path keeps that path, which shards data-parallel ranks only.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

from lightning_plugins.parallel.layout import ParallelLayout
from lightning_plugins.errors import LayoutError
from lightning_plugins.run.faults import join_timeout

#: ``ParallelLayout`` field -> the variable ``accelerate launch`` exports for the config's ``parallelism_config_*`` key.
LAUNCH_SIZE_VARIABLES = {
    "tp_size": "PARALLELISM_CONFIG_TP_SIZE",
    "cp_size": "PARALLELISM_CONFIG_CP_SIZE",
    "dp_shard_size": "PARALLELISM_CONFIG_DP_SHARD_SIZE",
    "dp_replicate_size": "PARALLELISM_CONFIG_DP_REPLICATE_SIZE",
}
_DEFAULT_SIZES = {f.name: f.default for f in fields(ParallelLayout)}


def launch_config_file() -> str | None:
    """The config file of the ``accelerate launch`` that started this process, or ``None`` when unknown.

    ``accelerate launch`` runs torchrun in-process, so the launcher is this process's parent; its command line
    names ``--config_file`` (or Accelerate's default config is used).
    """
    try:
        argv = [a.decode() for a in Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return None
    if not any("accelerate" in Path(arg).name for arg in argv[:3]):  # `accelerate launch`, `-m accelerate.commands...`
        return None
    for index, arg in enumerate(argv):
        if arg == "--config_file" and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith("--config_file="):
            return arg.split("=", 1)[1]
    from accelerate.commands.config import default_config_file

    return default_config_file if Path(default_config_file).is_file() else None


def launched_world() -> tuple[int, int]:
    """``(processes per node, nodes)`` of the launched world (``(1, 1)`` for a plain ``python`` run)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return local, max(1, world // max(1, local))


def describe_launch() -> str:
    """The launch named for error messages: its config file and the world it started."""
    local, nodes = launched_world()
    config = launch_config_file()
    where = f"accelerate config {config}" if config else "the launcher (no accelerate config file found)"
    return f"{where}: {local * nodes} processes ({nodes} node(s) x {local})"


def launch_sizes(parallelism_config: Any | None = None) -> dict[str, int]:
    """The sizes Accelerate's ``ParallelismConfig`` sets: from ``parallelism_config`` or the launch environment.

    Raises:
        LayoutError: for sequence parallelism (``sp_size``, DeepSpeed's Ulysses), which this door spells
            ``cp_size`` with ``cp_backend="ulysses"``.
    """
    if parallelism_config is not None:
        sizes = {name: getattr(parallelism_config, name) for name in LAUNCH_SIZE_VARIABLES}
        sp_size = parallelism_config.sp_size
    elif os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
        sizes = {name: int(os.environ[var]) for name, var in LAUNCH_SIZE_VARIABLES.items() if var in os.environ}
        sp_size = int(os.environ.get("PARALLELISM_CONFIG_SP_SIZE", "1"))
    else:
        return {}
    if sp_size and sp_size > 1:
        raise LayoutError(
            f"parallelism_config_sp_size={sp_size} ({describe_launch()}) is DeepSpeed's sequence parallelism; under"
            " ParallelAccelerator it is context parallelism: set cp_size and cp_backend='ulysses' instead."
        )
    return {name: value for name, value in sizes.items() if value is not None}


def merge_sizes(owner: str, given: dict[str, int | None], parallelism_config: Any | None = None) -> ParallelLayout:
    """The layout from explicit sizes and the launch config's, which must agree where both are set.

    Args:
        owner: Named in errors.
        given: ``pp_size``, ``tp_size``, ... as passed (``None``: not given; ``dp_shard_size=-1`` counts as not given).
        parallelism_config: An ``accelerate.ParallelismConfig`` passed to the Accelerator, if any.

    Raises:
        LayoutError: naming both values and where the second one comes from.
    """
    launched = launch_sizes(parallelism_config)
    source = "parallelism_config=" if parallelism_config is not None else describe_launch()
    sizes = {}
    for name, default in _DEFAULT_SIZES.items():
        mine = given.get(name)
        mine = None if name == "dp_shard_size" and mine == -1 else mine
        theirs = launched.get(name)
        if mine is not None and theirs is not None and mine != theirs:
            raise LayoutError(
                f"{owner}: {name}={mine} was asked for, but the launch sets parallelism_config_{name}={theirs}"
                f" ({source}). Give the size in one place: drop the argument (or the recipe's layout.{name}), or"
                f" remove parallelism_config_{name} from the accelerate config."
            )
        sizes[name] = mine if mine is not None else theirs if theirs is not None else default
    return ParallelLayout(**sizes)


def resolved_layout(
    owner: str, given: dict[str, int | None], parallelism_config: Any | None = None
) -> tuple[ParallelLayout, int]:
    """The layout of the sizes given, ``parallelism_config`` and the launch (:func:`merge_sizes`), resolved for the
    launched world, and that world's size.

    Raises:
        LayoutError: when the layout does not fit the launched world, naming how it was launched.
    """
    layout = merge_sizes(owner, given, parallelism_config)
    local, nodes = launched_world()
    try:
        return layout.resolve(local * nodes), local * nodes
    except LayoutError as err:
        raise LayoutError(f"{owner}: the layout does not fit the world started by {describe_launch()}. {err}") from None


def builtin_path(deepspeed_plugin: Any | None = None, fsdp_plugin: Any | None = None) -> str | None:
    """``"DeepSpeed"`` or ``"FSDP"`` when Accelerate's own sharding is selected (plugin or launch config)."""
    if deepspeed_plugin is not None or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        return "DeepSpeed"
    if fsdp_plugin is not None or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return "FSDP"
    return None


def uses_fsdp2_plugin(kwargs: dict[str, Any], deepspeed_plugin: Any | None = None) -> bool:
    """Whether the Accelerator arguments pass an FSDP2 ``fsdp_plugin`` for the engine to map (not under DeepSpeed;
    an FSDP1 plugin selects Accelerate's own FSDP)."""
    plugin = kwargs.get("fsdp_plugin")
    return builtin_path(deepspeed_plugin) is None and plugin is not None and getattr(plugin, "fsdp_version", 1) == 2


def check_builtin(owner: str, layout: ParallelLayout, path: str) -> None:
    """Under Accelerate's DeepSpeed or FSDP only data-parallel sizes make sense.

    Raises:
        LayoutError: for a pipeline, tensor, context or expert size above 1, naming the launch config and the fix.
    """
    names = ("pp_size", "tp_size", "cp_size", "ep_size")
    bad = {name: getattr(layout, name) for name in names if getattr(layout, name) > 1}
    if bad:
        shown = ", ".join(f"{name}={value}" for name, value in bad.items())
        raise LayoutError(
            f"{owner}: {shown} under Accelerate's built-in {path} path ({describe_launch()}). {path} shards"
            " data-parallel ranks only. Launch with a config that leaves distributed_type at MULTI_GPU (e.g."
            " accelerate_configs/1node_8gpu.yaml, or cpu_2proc.yaml here) so the engine applies the layout, or"
            " keep the layout data-parallel (pp_size, tp_size, cp_size and ep_size 1)."
        )


@contextlib.contextmanager
def parallelism_config_off(fsdp: bool = False) -> Iterator[None]:
    """Hide the launch's ``ACCELERATE_USE_PARALLELISM_CONFIG`` from ``Accelerator.__init__`` (its sizes were read),
    and with ``fsdp`` its ``ACCELERATE_USE_FSDP`` (an FSDP2 plugin passed to the door was mapped onto the engine)."""
    names = ("ACCELERATE_USE_PARALLELISM_CONFIG", *(("ACCELERATE_USE_FSDP",) if fsdp else ()))
    hidden = {name: os.environ.pop(name) for name in names if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(hidden)


def join_slowly(kwargs: dict[str, Any]) -> Any:
    """The collective timeout of an ``InitProcessGroupKwargs`` in ``kwargs["kwargs_handlers"]`` (``None`` without
    one); the handler is replaced by a copy that lets ranks take at least torch's default to join (the timeout
    bounds the collectives once they have)."""
    from dataclasses import replace

    from accelerate.utils import InitProcessGroupKwargs

    handlers = list(kwargs.get("kwargs_handlers") or ())
    for index, handler in enumerate(handlers):
        if isinstance(handler, InitProcessGroupKwargs) and handler.timeout is not None:
            handlers[index] = replace(handler, timeout=join_timeout(handler.timeout))
            kwargs["kwargs_handlers"] = handlers
            return handler.timeout
    return None
