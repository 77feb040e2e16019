"""``MemTracker`` without the bookkeeping the planner never reads, at a fraction of its cost per operation.

A dry run's step is a hundred thousand operations or more under ``FakeTensorMode``. ``MemTracker`` (torch 2.13) adds
to each a pytree map over its outputs, which builds a wrapper function per call, and to each module call snapshots of
every category (deep-copied) for its per-module statistics (``memory_tracking[module].snapshots``, ``input_mem``,
``output_mem``, ``local_peak``). The planner reads the peak per device only
(:meth:`~lightning_plugins.planner.measure.StepMemTracker.by_category`). :class:`LeanMemTracker` tracks the same
tensors in the same order and keeps every state the tracking depends on (the activation-checkpointing region, the
modules' parameters, buffers and gradient hooks), so every figure is the same; the per-module snapshots stay empty.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor, nn
from torch._guards import active_fake_mode
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModMemStats, _ModState
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

__all__ = ["LeanMemTracker"]

_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
#: What may sit next to tensors in a flat tuple or list of outputs without being a pytree node.
_LEAVES = (type(None), bool, int, float)


class LeanMemTracker(MemTracker):
    """``MemTracker`` whose operations and module hooks track the same memory without per-module statistics."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        # MemTracker.__torch_dispatch__ (torch 2.13) line by line, the outputs tracked without a pytree map where they
        # are a tensor or a flat tuple or list (see the module docstring).
        if DTensor in types:
            return NotImplemented
        if func is _WAIT_TENSOR and active_fake_mode():
            res = args[0]
        else:
            res = func(*args, **kwargs or {})
        if active_fake_mode() is self._fake_mode_on_entry:
            if self._in_opt:
                reftype = _MemRefType.OPT
            elif self._mod_tracker.is_bw and not self._in_ac:
                reftype = _MemRefType.TEMP
            else:
                reftype = _MemRefType.ACT
            _each_tensor(res, lambda tensor: self._track(reftype, tensor))
            self._update_peak_stats(_ModState.PEAK_BW if self._mod_tracker.is_bw else _ModState.PEAK_FW)
        return res

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        # MemTracker's cases without their statistics: a module met for the first time has its parameters and buffers
        # tracked (gradient hooks installed); one entered again inside backward opens the checkpointed region; one
        # entered again in forward (a pipeline stage per micro-batch, a re-used submodule) changes nothing tracked.
        if module not in self.memory_tracking:
            name = self._mod_tracker.get_known_fqn(module)
            if name is None:
                raise AssertionError
            self._track_module_params_and_buffers(module, install_grad_hooks=True)
            self.memory_tracking[module] = _ModMemStats(name)
        elif self._mod_tracker.is_bw and self._ac_mod is None:
            self._ac_mod = weakref.ref(module)
            self._in_ac = True

    def _post_fw_hook(self, module: nn.Module, inputs: Any, outputs: Any) -> None:
        if self._mod_tracker.is_bw and self._ac_mod is not None and self._ac_mod() is module:
            self._ac_mod = None  # the checkpointed region's recomputation is over
            self._in_ac = False

    def _pre_bw_hook(self, module: nn.Module | None, args: Any) -> None:
        """Statistics only in ``MemTracker``."""

    def _post_bw_hook(self, module: nn.Module | None, args: Any) -> None:
        """Statistics only in ``MemTracker``."""


def _each_tensor(outputs: Any, track: Any) -> None:
    """``track`` each tensor of an operation's outputs in ``tree_map_only``'s order."""
    if isinstance(outputs, Tensor):
        track(outputs)
    elif type(outputs) in (tuple, list) and all(isinstance(x, Tensor) or type(x) in _LEAVES for x in outputs):
        for output in outputs:
            if isinstance(output, Tensor):
                track(output)
    else:
        tree_map_only(Tensor, track, outputs)
