"""Accelerate's ``FullyShardedDataParallelPlugin(fsdp_version=2, ...)`` read as the engine's ``dp_shard`` settings.

Accelerate's ND-parallel example passes an FSDP2 plugin next to its ``ParallelismConfig``. What that plugin
configures is what the engine's FSDP2 does over ``dp_shard x cp`` (:mod:`lightning_plugins.parallel.fsdp`), so its
settings become fields of :class:`~lightning_plugins.MemoryOptions` and the run stays on the engine with the user's
whole layout. A setting the engine has no equivalent for is refused with an :class:`OptionsError` naming it and the
fix, before any process group exists; nothing is dropped silently.

=================================  ==========================================================================
plugin setting                     engine
=================================  ==========================================================================
``auto_wrap_policy``               ``"transformer_based_wrap"`` (or unset): the engine shards each decoder layer
                                   (plus the embedding, the final norm with the head, and the root);
                                   ``transformer_cls_names_to_wrap`` must name the model's decoder layer class
``mixed_precision_policy``         ``param_dtype`` / ``reduce_dtype`` (bf16 or fp32)
``reshard_after_forward``          ``reshard_after_forward``
``cpu_offload``                    ``cpu_offload`` (FSDP2's ``CPUOffloadPolicy``)
``activation_checkpointing``       ``activation_checkpointing="full"``
``activation_checkpointing_offload``  ``activation_offload``
``state_dict_type``                ``SHARDED_STATE_DICT``: what ``save_state`` writes (one distributed checkpoint)
``cpu_ram_efficient_loading``      accepted: a model built on the meta device loads only each rank's slices
=================================  ==========================================================================
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

from lightning_plugins.errors import OptionsError
from lightning_plugins.parallel.dtypes import MIXED_PRECISION_DTYPES

__all__ = ["check_wrap_classes", "memory_settings", "merge_settings", "wrap_classes"]

#: dtype -> the short name ``MemoryOptions`` takes.
_DTYPE_NAMES = {dtype: name for name, dtype in MIXED_PRECISION_DTYPES.items() if len(name) == 4}


def memory_settings(owner: str, plugin: Any | None) -> dict[str, Any]:
    """The ``MemoryOptions`` fields an FSDP2 plugin sets (only those it sets away from Accelerate's defaults; none
    without a plugin).

    Raises:
        OptionsError: for a plugin setting the engine has no equivalent for, naming it and the fix.
    """
    if plugin is None:
        return {}
    _check_unsupported(owner, plugin)
    settings: dict[str, Any] = {}
    if plugin.reshard_after_forward is False:
        settings["reshard_after_forward"] = False
    if isinstance(plugin.cpu_offload, CPUOffloadPolicy):
        settings["cpu_offload"] = True
    if plugin.activation_checkpointing:
        settings["activation_checkpointing"] = "full"
    if plugin.activation_checkpointing_offload:
        settings["activation_offload"] = True
    if plugin.mixed_precision_policy is not None:
        settings.update(_mixed_precision(owner, plugin.mixed_precision_policy))
    return settings


def merge_settings(
    owner: str, from_plugin: dict[str, Any], settings: dict[str, Any], memory: Any | None
) -> dict[str, Any]:
    """``settings`` (keyword arguments) with the plugin's added; a setting given both ways must agree.

    Args:
        owner: Named in errors.
        from_plugin: :func:`memory_settings` of the plugin.
        settings: ``ParallelOptions``/``MemoryOptions`` fields passed as keywords.
        memory: The ``MemoryOptions`` passed, if any (a field it sets away from its default counts as given).

    Raises:
        OptionsError: naming both values and where each comes from.
    """
    defaults = type(memory)() if memory is not None else None
    for name, value in from_plugin.items():
        if name in settings:
            given, where = settings[name], f"{name}={settings[name]!r}"
        elif memory is not None and getattr(memory, name) != getattr(defaults, name):
            given, where = getattr(memory, name), f"memory.{name}={getattr(memory, name)!r}"
        else:
            continue
        if given != value:
            raise OptionsError(
                f"{owner}: {where} disagrees with the fsdp_plugin, which sets {name}={value!r}. Give the setting in"
                " one place: drop it from the plugin or from the arguments."
            )
    return {**from_plugin, **settings}


def wrap_classes(plugin: Any | None) -> tuple[str, ...]:
    """The layer class names the plugin wraps (``()``: none given, Accelerate would take ``_no_split_modules``)."""
    names = getattr(plugin, "transformer_cls_names_to_wrap", None) or ()
    return tuple(names.split(",") if isinstance(names, str) else names)


def check_wrap_classes(owner: str, names: tuple[str, ...], layers: nn.ModuleList) -> None:
    """The classes the plugin wraps must be the model's decoder layers, which is what the engine shards.

    Raises:
        OptionsError: naming the classes that are not decoder layers of this model, and the one that is.
    """
    layer_classes = sorted({type(layer).__name__ for layer in layers})
    other = [name for name in names if name not in layer_classes]
    if other:
        raise OptionsError(
            f"{owner}: fsdp_plugin.transformer_cls_names_to_wrap={list(names)} names {other}, which is not this"
            f" model's decoder layer class {layer_classes}. The engine shards each decoder layer (plus the embedding,"
            f" the final norm with the head, and the root) and cannot wrap other modules: pass"
            f" transformer_cls_names_to_wrap={layer_classes} (or leave it unset)."
        )


def _check_unsupported(owner: str, plugin: Any) -> None:
    """Refuse the plugin settings that have no equivalent in the engine's FSDP2."""
    policy = plugin.auto_wrap_policy
    if policy is not None and policy is not transformer_auto_wrap_policy:
        shown = (
            "'size_based_wrap'" if getattr(policy, "__name__", "") == "size_based_auto_wrap_policy" else repr(policy)
        )
        _refuse(
            owner, f"auto_wrap_policy={shown}",
            "the engine shards each decoder layer (plus the embedding, the final norm with the head, and the root)."
            " Use auto_wrap_policy='transformer_based_wrap' with the model's decoder layer class, or leave it unset",
        )  # fmt: skip
    if plugin.state_dict_type != StateDictType.SHARDED_STATE_DICT:
        _refuse(
            owner, f"state_dict_type={plugin.state_dict_type.name!r}",
            "save_state writes one sharded distributed checkpoint (which load_state reshards to any layout). Use"
            " state_dict_type='SHARDED_STATE_DICT'; for full weights use accelerator.save_model(model, directory), or"
            " get_state_dict(model) with save_pretrained on the main process",
        )  # fmt: skip
    if plugin.ignored_modules is not None:
        _refuse(
            owner, "ignored_modules",
            "the engine shards every parameter of the model. Freeze modules with requires_grad_(False) (or train an"
            " adapter with peft) and leave ignored_modules unset",
        )  # fmt: skip
    if plugin.param_init_fn is not None:
        _refuse(
            owner, "param_init_fn",
            "a model built on the meta device is materialized by loading each rank's slices of its checkpoint"
            " (ParallelAccelerator(load_from=...), default: the model's name_or_path). Leave param_init_fn unset",
        )  # fmt: skip
    if plugin.sharding_strategy is not None:
        _refuse(owner, f"sharding_strategy={plugin.sharding_strategy!r}", "use reshard_after_forward (True or False)")


def _mixed_precision(owner: str, policy: Any) -> dict[str, str | None]:
    """``param_dtype`` and ``reduce_dtype`` of an FSDP2 ``MixedPrecisionPolicy``."""
    if not isinstance(policy, MixedPrecisionPolicy):
        _refuse(owner, f"mixed_precision_policy={policy!r}", "pass an FSDP2 MixedPrecisionPolicy, 'bf16' or 'fp32'")
    settings = {}
    for name in ("param_dtype", "reduce_dtype"):
        dtype = getattr(policy, name)
        if dtype is not None and dtype not in _DTYPE_NAMES:
            _refuse(
                owner, f"mixed_precision_policy {name}={dtype}",
                "FSDP2 has no loss scaler for float16; use 'bf16' (or 'fp32')",
            )  # fmt: skip
        settings[name] = None if dtype is None else _DTYPE_NAMES[dtype]
    if policy.output_dtype not in (None, policy.param_dtype):
        _refuse(owner, f"mixed_precision_policy output_dtype={policy.output_dtype}", "leave output_dtype unset")
    if not policy.cast_forward_inputs:
        _refuse(owner, "mixed_precision_policy cast_forward_inputs=False", "leave cast_forward_inputs at True")
    return {name: value for name, value in settings.items() if value is not None}


def _refuse(owner: str, setting: str, fix: str) -> None:
    raise OptionsError(f"{owner}: fsdp_plugin {setting} has no equivalent in this engine's FSDP2: {fix}.")
