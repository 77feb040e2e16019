"""Mixture-of-experts layers: grouped expert GEMMs, and expert parallelism with all-to-all dispatch and combine.

A transformers 5 mixture-of-experts decoder keeps each layer's routed experts in one module decorated with its
experts integration (``use_experts_implementation``): fused 3-D weights (``gate_up_proj`` or ``up_proj``, and
``down_proj``; ``[experts, out, in]``, or ``[experts, in, out]`` when ``is_transposed``), optional per-expert biases,
and ``forward(hidden_states [tokens, hidden], top_k_index [tokens, k], top_k_weights [tokens, k])``. Such modules
are found by that structure (:func:`expert_modules`), so every family built on the integration (Mixtral, Qwen2-MoE,
Qwen3-MoE, gpt-oss, ...) goes through one code path.

The engine replaces each one's forward by :func:`experts_forward`:

* **Dropless top-k.** Every (token, expert) pair the router chose is computed: no capacity factor, no dropped token.
* **Grouped GEMMs.** Pairs are sorted by expert and each projection is one ``grouped_mm`` over all experts (an exact
  per-expert loop where the kernel does not run: unaligned shapes, dtypes or devices it does not take).
* **Expert parallelism** (``ep_size > 1``). The experts are split over the ``ep`` ranks (a ``Shard(0)`` DTensor);
  each rank sends every pair to the rank holding its expert (all-to-all, uneven splits), computes the pairs it
  received with its own experts, and sends the results back (all-to-all); the routing weights are applied where
  the token lives. Both all-to-alls carry gradients, so the router and the tokens get theirs.

Under tensor parallelism the whole mixture-of-experts block (router, routed and shared experts) runs on this rank's
tokens (:class:`TokenLocalBlock`): its sequence shard under sequence parallelism, else a 1/tp slice of the sequence,
gathered after. Its weights are replicated over ``tp`` (the routed experts still split by ``ep``) and their gradients
summed over ``tp``. Splitting experts by tensor parallelism instead would add two collectives per layer for weights
that FSDP2 already shards; a token needs no communication to reach a replicated expert.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from lightning_plugins.parallel.moe.expert_adapters import adapted_weight, bind_expert_adapters

__all__ = [
    "ExpertMeshes",
    "TokenLocalBlock",
    "TokenLocalDropout",
    "apply_expert_parallel",
    "expert_meshes",
    "expert_modules",
    "experts_forward",
    "moe_block_name",
    "num_experts",
]

#: Where the 3-D weights of an experts module may live, and their optional biases.
_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")
_BIASES = ("gate_up_proj_bias", "up_proj_bias", "down_proj_bias")
#: Config keys that hold the number of routed experts, by family.
_EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers experts module (the experts integration's fused 3-D weights)."""
    down = getattr(module, "down_proj", None)
    return (
        hasattr(module, "_is_expert_parallel")
        and isinstance(getattr(module, "num_experts", None), int)
        and isinstance(down, torch.Tensor)
        and down.dim() == 3
    )


def expert_modules(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The experts modules inside ``module`` (names relative to it)."""
    for name, sub in module.named_modules():
        if is_experts_module(sub):
            yield name, sub


def moe_block_name(layer: nn.Module) -> str | None:
    """The name (relative to a decoder layer) of the block that routes tokens to its experts, or ``None``.

    That is the experts module's parent (``mlp`` in Mixtral and Qwen3-MoE, holding the router and, in Qwen2-MoE,
    the shared expert).
    """
    names = [name for name, _ in expert_modules(layer)]
    if not names:
        return None
    name = names[0]
    while name.endswith(".base_layer"):  # peft's LoRA wrappers around the experts (LoRA on expert weights)
        name = name.removesuffix(".base_layer")
    return name.rpartition(".")[0]


def num_experts(config: Any) -> int | None:
    """The number of routed experts a transformers config declares (``None`` for a dense model)."""
    config = getattr(config, "text_config", None) or config
    for key in _EXPERT_COUNT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


# ------------------------------------------------------------------------------------------------------------
# Meshes: the expert-parallel ranks are drawn from dp_shard x cp (innermost first), FSDP2 shards the experts over the
# rest.


@dataclass(frozen=True)
class ExpertMeshes:
    """The meshes of expert parallelism, taken from a layout's mesh.

    Attributes:
        ep: The ranks that split the experts (a slice of ``dp_shard x cp``, innermost ranks first).
        params: The experts' DTensor mesh: ``ep``, or ``(ep, tp)`` under tensor parallelism.
        fsdp: FSDP2's mesh for the experts: the rest of ``dp_shard x cp`` (``dp_shard_mod_ep``), with
            ``dp_replicate`` in front under HSDP.
        data_ranks: The ranks over which the dense weights' gradients are averaged (``dp_replicate x dp_shard x cp``):
            the experts' gradients are divided by the same number.
    """

    ep: DeviceMesh
    params: DeviceMesh
    fsdp: DeviceMesh
    data_ranks: int


def expert_meshes(mesh: DeviceMesh, ep_size: int) -> ExpertMeshes:
    """Build the expert meshes of ``mesh`` (a layout's mesh with its flattened ``dp_shard_cp``) for ``ep_size``."""
    shard_cp = mesh["dp_shard_cp"]
    split = shard_cp._unflatten(0, (shard_cp.size() // ep_size, ep_size), ("dp_shard_mod_ep", "ep"))
    ep, rest = split["ep"], split["dp_shard_mod_ep"]
    tp = mesh["tp"]
    params = DeviceMesh._concatenate([ep, tp]) if tp.size() > 1 else ep
    replicate = mesh["dp_replicate"]
    fsdp = DeviceMesh._concatenate([replicate, rest]) if replicate.size() > 1 else rest
    return ExpertMeshes(ep=ep, params=params, fsdp=fsdp, data_ranks=mesh["dp_cp"].size())


# ------------------------------------------------------------------------------------------------------------
# The forward.


def experts_forward(module: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """Dropless top-k through the experts of ``module``, grouped, dispatched to other ranks under expert parallelism.

    Args:
        module: A transformers experts module (see :func:`is_experts_module`); under expert parallelism its
            weights are this rank's experts (local tensors) and ``module._lp_ep_group`` the expert-parallel group.
        hidden_states: ``[tokens, hidden]``.
        top_k_index: ``[tokens, k]`` expert of each (token, choice).
        top_k_weights: ``[tokens, k]`` routing weight of each (token, choice).

    Returns:
        ``[tokens, hidden]``: each token's weighted sum over its chosen experts.
    """
    tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=module.num_experts)
    pairs = hidden_states[order // k]
    group = getattr(module, "_lp_ep_group", None)
    if group is None:
        out = _expert_mlp(module, pairs, counts)
    else:
        out = _dispatch_compute_combine(module, pairs, counts, group)
    weights = top_k_weights.reshape(-1)[order].unsqueeze(-1)
    out = (out * weights.to(out.dtype))[_inverse(order)]
    return out.view(tokens, k, -1).sum(dim=1).to(hidden_states.dtype)


def _dispatch_compute_combine(module: nn.Module, pairs: Tensor, counts: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Send each pair (sorted by expert) to its expert's rank, compute there, and bring the results back."""
    ranks = group.size()
    local = module.num_experts // ranks
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)  # [source rank, local expert] counts of what comes here
    send = counts.view(ranks, local).sum(dim=1).tolist()
    by_source = received.view(ranks, local)
    recv = by_source.sum(dim=1).tolist()
    arrived = all_to_all_single_autograd(pairs.contiguous(), recv, send, group)
    # Arrived rows are ordered (source rank, local expert); the grouped GEMM needs them by local expert.
    segment = torch.repeat_interleave(torch.arange(ranks * local, device=counts.device), by_source.reshape(-1))
    by_expert = torch.argsort((segment % local) * ranks + segment // local, stable=True)
    out = _expert_mlp(module, arrived[by_expert], by_source.sum(dim=0))
    out = out[_inverse(by_expert)]
    return all_to_all_single_autograd(out.contiguous(), send, recv, group)


def _expert_mlp(module: nn.Module, x: Tensor, counts: Tensor) -> Tensor:
    """The experts' MLP on rows ``x`` sorted by expert, ``counts[e]`` rows for the module's expert ``e``."""
    offsets = torch.cumsum(counts, dim=0)
    ends = offsets.tolist()
    row_expert = torch.repeat_interleave(torch.arange(len(ends), device=x.device), counts) if module.has_bias else None
    up = adapted_weight(module, "gate_up_proj" if module.has_gate else "up_proj")
    up_bias = (module.gate_up_proj_bias if module.has_gate else module.up_proj_bias) if module.has_bias else None
    h = _grouped_linear(x, up, offsets, ends, module.is_transposed, up_bias, row_expert)
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
    bias = module.down_proj_bias if module.has_bias else None
    h = _grouped_linear(h, adapted_weight(module, "down_proj"), offsets, ends, module.is_transposed, bias, row_expert)
    if getattr(module, "has_post_expert_norm", False):
        h = module.post_expert_norm(h)
    return h


def _grouped_linear(
    x: Tensor,
    weight: Tensor,
    offsets: Tensor,
    ends: list[int],
    transposed: bool,
    bias: Tensor | None,
    row_expert: Tensor | None,
) -> Tensor:
    """``x[rows of e] @ W_e`` for every expert ``e`` (``W_e`` is ``weight[e]``, or its transpose when stored
    ``[out, in]``), as one grouped GEMM where the kernel runs, else an exact loop."""
    w = weight if transposed else weight.transpose(-2, -1)  # [experts, in, out]
    x = x.to(w.dtype)
    if _grouped_mm_runs(x, w):
        out = torch.nn.functional.grouped_mm(_ContiguousGrad.apply(x), w, offs=offsets.to(torch.int32))
    else:
        parts, start = [], 0
        for expert, end in enumerate(ends):
            parts.append(x[start:end] @ w[expert])
            start = end
        out = torch.cat(parts) if parts else x.new_zeros(0, w.shape[-1])
    if bias is not None:
        out = out + bias[row_expert]
    return out


def _grouped_mm_runs(x: Tensor, w: Tensor) -> bool:
    """Whether ``grouped_mm`` takes these operands: its CPU kernel wants 16-byte-aligned rows, CUDA's bf16 on SM80+."""
    if not hasattr(torch.nn.functional, "grouped_mm"):
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    size = x.element_size()
    aligned = all(n * size % 16 == 0 for n in (x.shape[-1], w.shape[-1], w.shape[-2]))
    return aligned and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (the CPU grouped GEMM refuses expanded ones)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


def _inverse(permutation: Tensor) -> Tensor:
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(permutation.numel(), device=permutation.device)
    return inverse


# ------------------------------------------------------------------------------------------------------------
# Installing: the grouped forward everywhere; under expert parallelism each rank keeps its experts.


def apply_expert_parallel(layers: nn.ModuleList, meshes: ExpertMeshes | None) -> None:
    """Give every experts module in ``layers`` the grouped forward; with ``meshes``, split its experts over ``ep``.

    Under expert parallelism each 3-D weight (and per-expert bias) becomes a DTensor on ``meshes.params``,
    ``Shard(0)`` over ``ep`` (and ``Replicate`` over ``tp``); the forward runs on the local experts. peft LoRA
    adapters on expert weights are applied by that forward (:mod:`lightning_plugins.parallel.moe.expert_adapters`).
    """
    for layer in layers:
        for _, module in expert_modules(layer):
            module.forward = _GroupedForward(module)  # type: ignore[method-assign]
            bind_expert_adapters(layer, module)
            if meshes is None:
                continue
            module._lp_first_expert = meshes.ep.get_local_rank() * (module.num_experts // meshes.ep.size())
            placements = [Shard(0)] + [Replicate()] * (meshes.params.ndim - 1)
            for name in (*_WEIGHTS, *_BIASES):
                param = module._parameters.get(name)
                if param is not None and not isinstance(param, DTensor):
                    module.register_parameter(
                        name,
                        nn.Parameter(distribute_tensor(param.data, meshes.params, placements), param.requires_grad),
                    )
            module._lp_ep_group = meshes.ep.get_group()
            module._is_expert_parallel = True
            module.forward = OnLocalParameters(module)  # type: ignore[method-assign]


class _GroupedForward:
    """The replacement of an experts module's forward (an instance attribute, so the class stays transformers')."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        return experts_forward(self.module, hidden_states, top_k_index, top_k_weights)


# ------------------------------------------------------------------------------------------------------------
# Running a module on local tensors: its DTensor parameters are swapped for their local parts for one call.


def _local_parameters(module: nn.Module, args: tuple, names: tuple[str, ...] | None = None) -> None:
    """Replace each DTensor parameter of the module (recursively; only its own ``names`` when given)
    by its local part for the call.

    The local part is differentiable back to the DTensor: over ``tp`` (the tokens differ per rank) the gradient is a
    pending sum (``Partial``); over ``ep`` each rank's part is its own experts (``Shard``); a ``Shard`` over ``tp``
    (gpt-oss's per-head attention sinks) stays that rank's slice.
    """
    saved = []
    for sub in module.modules() if names is None else (module,):
        for name, param in list(sub._parameters.items()):
            if isinstance(param, DTensor) and (names is None or name in names):
                grad = [Partial() if p.is_replicate() else p for p in param.placements]
                saved.append((sub, name, param))
                sub._parameters[name] = param.to_local(grad_placements=grad)
    module._lp_saved_parameters = saved


def _restore_parameters(module: nn.Module, args: tuple, output: Any) -> None:
    for sub, name, param in getattr(module, "_lp_saved_parameters", ()):
        sub._parameters[name] = param
    module._lp_saved_parameters = []


class OnLocalParameters:
    """The replacement of a module's forward (an instance attribute) that runs it on the local parts of its DTensor
    parameters (:func:`_local_parameters`; only its own ``names`` when given) and puts the DTensors back even when the
    call does not return: activation checkpointing's recomputation stops early by raising, past any forward hook.
    """

    def __init__(self, module: nn.Module, names: tuple[str, ...] | None = None) -> None:
        self.module, self.names, self.forward = module, names, module.forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _local_parameters(self.module, args, self.names)
        try:
            return self.forward(*args, **kwargs)
        finally:
            _restore_parameters(self.module, args, None)


class TokenLocalBlock:
    """Run a mixture-of-experts block under tensor parallelism on this rank's tokens.

    Installed as a forward pre-hook and a forward hook on the block. Under sequence parallelism the input is the
    residual stream's ``Shard(1)`` DTensor, and the output returns as one; otherwise the replicated input is cut to
    this rank's share of the sequence and the output all-gathered. Inside, every parameter is a local tensor
    (:func:`_local_parameters`), so the family's own block forward runs unchanged.
    """

    def __init__(self, tp_mesh: DeviceMesh) -> None:
        self.mesh = tp_mesh

    def install(self, block: nn.Module) -> None:
        """Hold the block's parameters as DTensors replicated over ``tp`` (experts split by ``ep`` already are) and
        run it on this rank's tokens; LoRA dropouts inside it draw one process's masks (:class:`TokenLocalDropout`)."""
        for sub in block.modules():
            for name, param in list(sub._parameters.items()):
                if param is not None and not isinstance(param, DTensor):
                    replicated = distribute_tensor(param.data, self.mesh, [Replicate()])
                    sub.register_parameter(name, nn.Parameter(replicated, param.requires_grad))
            for adapter, dropout in getattr(sub, "lora_dropout", {}).items():
                if isinstance(dropout, nn.Dropout) and dropout.p > 0:
                    sub.lora_dropout[adapter] = TokenLocalDropout(dropout.p, self)
        block.register_forward_pre_hook(self.before, with_kwargs=True)
        block.register_forward_hook(self.after)
        block.forward = OnLocalParameters(block)  # type: ignore[method-assign]

    def before(self, block: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        x = args[0] if args else kwargs.pop("hidden_states")
        sharded = isinstance(x, DTensor)
        if not sharded:
            x = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False).redistribute(self.mesh, [Shard(1)])
        block._lp_token_local = (sharded, x.shape, x.stride())
        self.tokens = x.shape[:2]  # the whole batch's (rows, sequence), which TokenLocalDropout draws masks for
        return (x.to_local(), *args[1:]), kwargs

    def after(self, block: nn.Module, args: tuple, output: Any) -> Any:
        sharded, shape, stride = block._lp_token_local
        # gpt-oss's block returns (hidden states, router scores); the scores (unused by its layer) stay this rank's.
        output, *rest = output if isinstance(output, tuple) else (output,)
        out = DTensor.from_local(output, self.mesh, [Shard(1)], run_check=False, shape=shape, stride=stride)
        out = out if sharded else out.redistribute(self.mesh, [Replicate()]).to_local()
        return (out, *rest) if rest else out


class TokenLocalDropout(nn.Module):
    """LoRA dropout inside a token-local block: one process's mask, for this rank's tokens.

    Tensor-parallel ranks hold equal generators (the dropouts outside the block draw one process's masks from them),
    so a plain dropout would give every rank the same mask for different tokens and, with uneven shards, draw
    different amounts and leave the generators apart. Each rank instead draws the mask of the whole batch's tokens
    (``[rows, sequence, features]``, the draw ``torch.nn.functional.dropout`` makes on CPU for the one-process input)
    and keeps its own sequence shard's rows (the block's ``Shard(1)`` split).

    Args:
        p: Drop probability.
        block: The :class:`TokenLocalBlock` running the block (it records the whole batch's token shape).
    """

    def __init__(self, p: float, block: TokenLocalBlock) -> None:
        super().__init__()
        self.p, self.block = p, block

    def forward(self, x: Tensor) -> Tensor:
        if not self.training:
            return x
        rows, sequence = self.block.tokens
        noise = torch.empty((rows, sequence, x.shape[-1]), dtype=x.dtype, device=x.device)
        noise = noise.bernoulli_(1 - self.p).div_(1 - self.p)
        mesh = self.block.mesh
        return x * noise.chunk(mesh.size(), dim=1)[mesh.get_local_rank()].reshape(x.shape)

    def extra_repr(self) -> str:
        return f"p={self.p}"
