"""Tensor parallelism for Gated DeltaNet linear attention (Qwen3.5's and Qwen3-Next's ``linear_attn``): its heads
split over tp.

A rank runs the module's own forward (transformers' chunked kernel, the torch fallback on CPU or a fused one where
installed: the split does not depend on which) on its key heads and their value heads::

    input:       the region's replicated DTensor (all-gathered once under sequence parallelism), used locally
    in_proj_qkv: output channels [q | k | v]; the rank's channels are its key heads' q and k and its value heads' v
    conv1d:      depthwise over those channels, the same rows
    in_proj_z/a/b, dt_bias, A_log: by value head (contiguous, ``Shard(0)``)
    in_proj_qkvz/ba (Qwen3-Next): fused per key head, so by key-head group (contiguous, ``Shard(0)``)
    norm:        per head over head_v_dim: head-local, its weight replicated
    out_proj:    row-parallel; the partial sums reduced once (reduce-scattered along the sequence under sp)

The fused ``[q | k | v]`` rows a rank needs are not one contiguous block, so ``in_proj_qkv`` and ``conv1d`` (and
LoRA's ``lora_B`` on ``in_proj_qkv``) are held as ``Shard(0)`` of the checkpoint's own order, like any
column-parallel weight (sharded loading, export and checkpoints see the transformers tensor), and each forward
regroups the rows by one all-to-all over tp (each rank receives about ``(tp - 1) / tp`` of its own part); the
backward sends the rows' gradients back the same way. That moves the rank's part of a weight, never activations.
The module's head counts and channel sizes are set to the local ones, as its forward reshapes by them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

__all__ = [
    "LINEAR_PROJECTIONS",
    "HeadSplitLinearAttention",
    "head_group_rows",
    "is_gated_delta_net",
    "linear_attention_problem",
    "parameter_role",
]

#: The input projections of Qwen3.5's Gated DeltaNet (q/k/v fused as [q | k | v], z, a, b each by value head) and of
#: Qwen3-Next's (q/k/v/z and b/a fused per key head: a contiguous split gives a rank its key heads' groups).
_SEPARATE = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b")
_GROUPED = ("in_proj_qkvz", "in_proj_ba")
#: The projections of a Gated DeltaNet, split with its heads (LoRA's targets there).
LINEAR_PROJECTIONS = (*_SEPARATE, *_GROUPED, "out_proj")
_ATTRIBUTES = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "key_dim", "value_dim", "conv_dim")
_REQUIRED = ("out_proj", "conv1d", "norm", "dt_bias", "A_log", *_ATTRIBUTES)


def is_gated_delta_net(module: nn.Module) -> bool:
    """Whether ``module`` is shaped like transformers' Gated DeltaNet (Qwen3.5's ``Qwen3_5GatedDeltaNet``, Qwen3-Next's
    ``Qwen3NextGatedDeltaNet``)."""
    has = lambda names: all(hasattr(module, name) for name in names)
    return has(_REQUIRED) and (has(_SEPARATE) or has(_GROUPED))


def _role(path: str) -> tuple[str, str] | None:
    """``(projection or parameter, part)`` of a parameter path inside the module; ``part`` is ``weight``, ``bias``,
    ``lora_A`` or ``lora_B``. ``None`` for a path this split has no rule for."""
    head, _, rest = path.partition(".")
    if head in ("dt_bias", "A_log") and not rest:
        return head, "param"
    if head == "norm" and rest == "weight":
        return head, "weight"
    if head not in (*LINEAR_PROJECTIONS, "conv1d"):
        return None
    if rest in ("weight", "bias", "base_layer.weight", "base_layer.bias"):
        return head, rest.rpartition(".")[2]
    kind = rest.partition(".")[0]
    if kind in ("lora_A", "lora_B") and rest.endswith(".weight") and rest.count(".") == 2:
        return head, kind
    return None


def parameter_role(path: str) -> tuple[str, str] | None:
    """``(projection or parameter, part)`` of a parameter path inside a Gated DeltaNet (see :func:`_role`); ``None`` for
    a path a head split has no rule for."""
    return _role(path)


def head_group_rows(key_dim: int, value_dim: int, size: int, rank: int) -> torch.Tensor:
    """The rows of the fused ``[q | k | v]`` channels (``in_proj_qkv``'s outputs, ``conv1d``'s channels) that hold rank
    ``rank``'s heads when the heads are split over ``size`` ranks: its key heads' q and k and its value heads' v."""
    k_rows, v_rows = torch.arange(key_dim).chunk(size)[rank], torch.arange(value_dim).chunk(size)[rank]
    return torch.cat([k_rows, key_dim + k_rows, 2 * key_dim + v_rows])


def _placement(role: tuple[str, str]) -> Placement:
    """How a parameter is held over tp (the checkpoint's order; ``in_proj_qkv``/``conv1d`` rows are regrouped per call;
    Qwen3-Next's ``in_proj_qkvz``/``in_proj_ba`` are grouped per key head, so their contiguous rows are the rank's)."""
    owner, part = role
    if owner == "norm":
        return Replicate()
    if owner == "out_proj":
        return Shard(1) if part in ("weight", "lora_A") else Replicate()
    return Replicate() if part == "lora_A" else Shard(0)


def linear_attention_problem(module: nn.Module, tp_size: int) -> str | None:
    """Why ``module`` cannot be split over ``tp_size`` ranks by heads, or ``None`` when it can."""
    if not is_gated_delta_net(module):
        return (
            "it is not a Gated DeltaNet (in_proj_qkv/z/a/b or in_proj_qkvz/ba, conv1d, dt_bias, A_log, norm, out_proj)"
        )
    for heads in ("num_k_heads", "num_v_heads"):
        if getattr(module, heads) % tp_size:
            return f"its {heads}={getattr(module, heads)} is not divisible by tp_size={tp_size}"
    unknown = [name for name, _ in module.named_parameters() if _role(name) is None]
    if unknown:
        return f"tensor parallelism has no rule for its parameters {sorted(unknown)}"
    biases = [name for name, _ in module.named_parameters() if name.startswith("out_proj") and name.endswith("bias")]
    if biases:
        return f"its row-parallel out_proj has a bias {biases}"
    return None


class HeadSplitLinearAttention:
    """The replacement of a Gated DeltaNet's forward (an instance attribute, so the class stays transformers'):
    its heads split over ``tp_mesh``.

    Args:
        module: The Gated DeltaNet (checked by :func:`linear_attention_problem`).
        tp_mesh: The 1-D tensor-parallel mesh.
        sequence_parallel: Return the output reduce-scattered along the sequence (``Shard(1)``); else replicated.
    """

    def __init__(self, module: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool) -> None:
        self.module, self.mesh, self.sp = module, tp_mesh, sequence_parallel
        self.forward = module.forward
        self._plan_regrouping(module.key_dim, module.value_dim)
        self.regrouped: set[tuple[nn.Module, str]] = set()
        for path, param in list(module.named_parameters()):
            role = _role(path)
            if role is None:  # refused by linear_attention_problem before anything is split
                raise ValueError(f"no tensor-parallel rule for {path}")
            owner_name, _, leaf = path.rpartition(".")
            owner = module.get_submodule(owner_name)
            if not isinstance(param, DTensor):
                sharded = distribute_tensor(param.data, tp_mesh, [_placement(role)])
                owner.register_parameter(leaf, nn.Parameter(sharded, param.requires_grad))
            if role[0] in ("in_proj_qkv", "conv1d") and role[1] in ("weight", "bias", "lora_B"):
                self.regrouped.add((owner, leaf))
        for heads in ("num_k_heads", "num_v_heads"):
            setattr(module, heads, getattr(module, heads) // tp_mesh.size())
        module.key_dim, module.value_dim = (
            module.num_k_heads * module.head_k_dim,
            module.num_v_heads * module.head_v_dim,
        )
        module.conv_dim = 2 * module.key_dim + module.value_dim

    def _plan_regrouping(self, key: int, value: int) -> None:
        """Which rows of its ``Shard(0)`` part of the fused [q | k | v] channels a rank sends to each rank.

        Rank ``r`` runs its key heads' q and k and its value heads' v: as many rows as its shard holds, in increasing
        order, so the rows it receives from ranks 0, 1, ... (each holding a contiguous range) arrive in its order.
        """
        size, rank = self.mesh.size(), self.mesh.get_local_rank()
        shard = (2 * key + value) // size

        def rows_of(r: int) -> torch.Tensor:
            return head_group_rows(key, value, size, r)

        mine = rows_of(rank)
        sends = [rows_of(r)[(rows_of(r) // shard) == rank] - rank * shard for r in range(size)]
        self.send_index = torch.cat(sends)
        self.send_splits = [len(rows) for rows in sends]
        self.receive_splits = [int(((mine // shard) == r).sum()) for r in range(size)]

    def _regrouped(self, param: DTensor) -> torch.Tensor:
        """The rank's head-group rows of a fused-channel parameter, by one all-to-all over tp (its backward sends
        each row's gradient back to the rank whose shard holds it)."""
        local = param.to_local()
        send = local.index_select(0, self.send_index.to(local.device)).contiguous()
        return all_to_all_single_autograd(send, self.receive_splits, self.send_splits, self.mesh.get_group())

    def install(self) -> None:
        self.module.forward = self  # type: ignore[method-assign]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args:
            x, args = args[0], args[1:]
        else:
            x = kwargs.pop("hidden_states")
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
        # The region's replicated input: each rank's gradient is a partial sum, reduced once where it was replicated.
        x = x.to_local(grad_placements=[Partial()])
        saved = self._local_parameters()
        try:
            out = self.forward(x, *args, **kwargs)
        finally:
            for owner, leaf, param in saved:
                owner._parameters[leaf] = param
        partial = DTensor.from_local(out, self.mesh, [Partial()], run_check=False)
        reduced = partial.redistribute(self.mesh, [Shard(1)] if self.sp else [Replicate()])
        local = reduced.to_local()
        if isinstance(local, AsyncCollectiveTensor):  # recomputation may stop before anyone waits for it
            local.trigger_wait()
        return reduced if self.sp else local

    def _local_parameters(self) -> list[tuple[nn.Module, str, nn.Parameter]]:
        saved = []
        for owner in self.module.modules():
            for leaf, param in list(owner._parameters.items()):
                if not isinstance(param, DTensor):
                    continue
                saved.append((owner, leaf, param))
                if (owner, leaf) in self.regrouped:
                    owner._parameters[leaf] = self._regrouped(param)
                else:
                    grad = [Partial() if p.is_replicate() else p for p in param.placements]
                    owner._parameters[leaf] = param.to_local(grad_placements=grad)
        return saved
