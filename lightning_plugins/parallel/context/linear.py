"""Context parallelism for Gated DeltaNet linear attention (Qwen3.5's and Qwen3-Next's ``linear_attn`` layers).

A rank's sequence shard needs what the shards before it leave behind: the recurrent state (one ``[k_dim, v_dim]``
matrix per value head) and the last ``kernel - 1`` inputs of the depthwise causal conv. Both layouts run the module's
own forward (transformers' chunked kernel, its torch fallback on CPU or a fused one where installed: nothing here
depends on which), replacing it as an instance attribute like the tensor-parallel split does:

* **Ulysses** (``cp_backend="ulysses"``): the linear-attention heads split over cp. Each rank all-gathers the
  sequence's hidden states, runs its key heads and their value heads over the *whole* sequence (the fused
  ``in_proj_qkv`` rows regrouped per head group as under tensor parallelism, see
  :func:`~lightning_plugins.parallel.linear_attention.head_group_rows`; ``out_proj`` by columns), and the partial
  outputs are reduce-scattered back to the ranks' shards. Exact: no state crosses a rank. Needs the key and value
  heads divisible by cp.
* **Ring** (``cp_backend="ring"``): the sequence stays sharded and the state is passed along the cp ranks in the
  *global* chunk order of the load-balanced layout (rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` of every
  segment, so the state goes 0, 1, ..., cp-1, cp-1, ..., 0 and on to the next segment). Each run of consecutive
  positions a rank holds is one call of the module's forward with a cache stand-in
  (:class:`~lightning_plugins.parallel.linear_documents.Carry`) that hands the kernel the received state as
  ``initial_state`` and prepends the received conv inputs; its final state and last conv inputs go to the rank holding
  the next run. The backward carries their gradients back the same way
  (:class:`_Send`, :class:`_Receive`; a token orders each rank's hand-offs, so the ranks' backward passes meet in
  reverse chain order). The kernel work of a layer is sequential over the ranks; everything else stays parallel.

Packed rows (``position_ids`` restarting at 0 for each document): transformers' torch kernels take no document
boundaries (they ignore ``cu_seqlens``), so both layouts cut the rows into documents themselves
(:func:`~lightning_plugins.parallel.linear_documents.run_documents`): Ulysses runs its heads per document of the whole
rows (their document starts read from the positions, all-gathered once per forward); the ring cuts each run at the
documents that begin inside it, a row's first document continues the received state unless the row starts a document
there, and the state after its last document is passed on. The same as one process with
:func:`~lightning_plugins.parallel.linear_documents.prepare_linear_attention_for_packing`: each document on its own.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_plugins.errors import LayoutError
from lightning_plugins.parallel.context.sharding import (
    reorder_sequence_load_balanced,
    sequence_positions,
    unshard_sequence_load_balanced,
)
from lightning_plugins.parallel.linear_attention import (
    HeadSplitLinearAttention,
    head_group_rows,
    is_gated_delta_net,
    linear_attention_problem,
    parameter_role,
)
from lightning_plugins.parallel.linear_documents import (
    DocumentLinearAttention,
    document_starts,
    host_positions,
    run_documents,
)

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (the old names warn).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = ["DocumentPositions", "LinearContextParallel", "apply_linear_context_parallel", "linear_attention_of"]


def linear_attention_of(layer: nn.Module) -> Optional[nn.Module]:
    """The decoder layer's Gated DeltaNet (``linear_attn``), or ``None``."""
    module = getattr(layer, "linear_attn", None)
    return module if module is not None and is_gated_delta_net(module) else None


class DocumentPositions:
    """The documents of the current forward's rows, read once per ``position_ids`` tensor and shared by the model's
    linear-attention layers (recomputation passes the same tensor and is not asked again): this rank's positions on
    the host (ring), and the whole rows' document starts (Ulysses, one all-gather of the positions per forward)."""

    def __init__(self) -> None:
        self._key: Optional[Tensor] = None
        self._local: Optional[Tensor] = None
        self._full: Optional[Tensor] = None

    def local(self, positions: Optional[Tensor], rows: int, local_len: int) -> Optional[Tensor]:
        """This rank's ``position_ids`` ``[rows, local_len]`` on the host, or ``None`` (none, or a dry run's)."""
        if positions is not self._key:
            self._key, self._full = positions, None
            self._local = host_positions(positions, rows, local_len)
        return self._local

    def full_starts(self, positions: Optional[Tensor], rows: int, local_len: int, group: Any) -> Optional[Tensor]:
        """Where documents begin in the whole rows ``[rows, cp * local_len]`` (natural order, host), or ``None`` when
        every row is one document."""
        local = self.local(positions, rows, local_len)
        if local is None or self._full is not None:
            return None if local is None or not bool(self._full[:, 1:].any()) else self._full
        size = dist.get_world_size(group)
        gathered = _all_gather_sequence(local.to(positions.device).contiguous(), group)
        self._full = document_starts(unshard_sequence_load_balanced(gathered, 1, size).to("cpu"))
        return self._full if bool(self._full[:, 1:].any()) else None


def apply_linear_context_parallel(
    layer: nn.Module, index: int, cp_mesh: Any, backend: str, documents: Optional[DocumentPositions] = None
) -> None:
    """Make decoder layer ``index``'s Gated DeltaNet context parallel over ``cp_mesh`` (``"ulysses"`` or ``"ring"``).

    Under tensor parallelism (applied first) the context-parallel forward runs inside the head split: each tp rank runs
    its heads' part over cp (Ulysses splits its local heads over cp again; the ring passes its heads' state along its
    cp ranks), on the parameters the split hands it.

    Raises:
        LayoutError: when the layer's linear attention is already context parallel, or Ulysses cannot split its (local)
            heads over cp; the message names the layer and the dimension.
    """
    module = linear_attention_of(layer)
    if module is None:
        raise LayoutError(f"Decoder layer {index} ({type(layer).__name__}) has no Gated DeltaNet `linear_attn`.")
    size = cp_mesh.size()
    outer = module.forward if isinstance(module.forward, HeadSplitLinearAttention) else None
    if isinstance(module.forward if outer is None else outer.forward, LinearContextParallel):
        raise LayoutError(
            f"Decoder layer {index}'s linear attention ({type(module).__name__}) is already context parallel; apply"
            f" context parallelism (cp_size={size}) once, to a fresh model."
        )
    if backend == "ulysses":
        problem = linear_attention_problem(module, size)
        if problem is not None:
            where = " (its heads per tensor-parallel rank)" if outer is not None else ""
            raise LayoutError(
                f"Ulysses context parallelism splits decoder layer {index}'s linear-attention heads"
                f" ({type(module).__name__}){where} over cp_size={size}, but {problem}. Use cp_backend='ring'."
            )
    inner = module.forward if outer is None else outer.forward
    if isinstance(inner, DocumentLinearAttention):  # the one-process document split: done here instead
        inner = inner.forward
    wrapper = LinearContextParallel(module, cp_mesh, backend, documents or DocumentPositions(), inner)
    if outer is None:
        module.forward = wrapper  # type: ignore[method-assign]
    else:
        outer.forward = wrapper  # the heads split over tp outside, the sequence over cp inside
    layer.register_forward_pre_hook(wrapper.note_positions, with_kwargs=True)


class LinearContextParallel:
    """The replacement of a Gated DeltaNet's forward (an instance attribute; the class stays transformers').

    Args:
        module: The Gated DeltaNet.
        cp_mesh: The 1-D context-parallel mesh (its group is looked up at each call).
        backend: ``"ulysses"`` (heads split over cp) or ``"ring"`` (state passed along the ranks).
        documents: The model's shared reader of the rows' documents (packed rows).
        forward: The forward it runs (the module's own).
    """

    def __init__(
        self, module: nn.Module, cp_mesh: Any, backend: str, documents: DocumentPositions, forward: Any
    ) -> None:
        self.module, self.mesh, self.backend, self.documents = module, cp_mesh, backend, documents
        self.forward = forward
        self.positions: Optional[Tensor] = None

    def note_positions(self, layer: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of the decoder layer: the ``position_ids`` it is given (its linear attention is not)."""
        self.positions = kwargs.get("position_ids")

    def __call__(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        cache = kwargs.pop("cache", None) or kwargs.pop("cache_params", None)
        if args or _holds_state(cache, self.module):
            raise ValueError(
                f"{type(self.module).__name__} under context parallelism runs whole sequences: it cannot continue from"
                " a cache holding earlier tokens' states, nor take positional arguments beyond the hidden states."
            )
        if kwargs.pop("attention_mask", None) is not None:
            raise ValueError(
                "Context parallelism drops the attention mask when it shards the batch (context_parallel_batch);"
                " a Gated DeltaNet under context parallelism got one."
            )
        group = self.mesh.get_group()
        if self.backend == "ulysses":
            return self._heads(hidden_states, group, kwargs)
        return self._chain(hidden_states, group, kwargs)

    def _heads(self, hidden: Tensor, group: dist.ProcessGroup, kwargs: dict) -> Tensor:
        """Ulysses: this rank's heads over the whole sequence; the partial outputs reduce-scattered to the shards."""
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        full = unshard_sequence_load_balanced(_GatherSequence.apply(hidden, group), 1, size)
        starts = self.documents.full_starts(self.positions, hidden.shape[0], hidden.shape[1], group)
        with _local_heads(self.module, size, rank):
            if starts is None:
                out = self.forward(full, **kwargs)
            else:
                out = run_documents(self.forward, full, starts, self.module, **kwargs)[0]
        return _ScatterSequence.apply(reorder_sequence_load_balanced(out, 1, size), group)

    def _chain(self, hidden: Tensor, group: dist.ProcessGroup, kwargs: dict) -> Tensor:
        """Ring: the module's forward on each run of consecutive positions this rank holds, in global order, with the
        state and conv inputs of the run before it (received from its rank) and its own sent on; packed rows cut at
        their documents (:func:`_run_starts`)."""
        module, size = self.module, dist.get_world_size(group)
        tail_spec = ((hidden.shape[0], module.conv_dim, module.conv_kernel_size - 1), hidden.dtype)
        state_dtype = torch.promote_types(hidden.dtype, torch.float32)
        state_spec = ((hidden.shape[0], module.num_v_heads, module.head_k_dim, module.head_v_dim), state_dtype)
        positions = self.documents.local(self.positions, hidden.shape[0], hidden.shape[1])
        token: Optional[Tensor] = None
        outs = []
        for lo, hi, before, after in _chain_runs(hidden.shape[1] * size, size)[dist.get_rank(group)]:
            carry = None
            if before is not None:
                if token is None:  # this rank's first hand-off: a leaf, so the received tensors join the graph
                    token = hidden.new_zeros((), requires_grad=torch.is_grad_enabled())
                carry = _Receive.apply(token, before, group, tail_spec, state_spec)
                token = None
            starts = _run_starts(positions, lo, hi)
            out, tail, state = run_documents(
                self.forward, hidden[:, lo:hi], starts, module, carry, after is not None, **kwargs
            )
            outs.append(out)
            if after is not None:
                token = _Send.apply(tail.to(hidden.dtype), state.to(state_dtype), after, group)
        out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        return out if token is None else out + token.to(out.dtype)  # the last send's backward must run too


def _run_starts(positions: Optional[Tensor], lo: int, hi: int) -> Optional[Tensor]:
    """Where documents begin in the run ``[lo, hi)`` of this rank's positions (host booleans; ``None`` without
    positions: nowhere). Column 0: whether the row starts a document at the run (its position id is 0;
    ``context_parallel_batch`` checked that documents count up from 0), else it continues the state received."""
    if positions is None:
        return None
    run = positions[:, lo:hi]
    starts = document_starts(run)
    starts[:, 0] = run[:, 0] == 0
    return starts


def _holds_state(cache: Any, module: nn.Module) -> bool:
    """Whether a (transformers) cache holds states of earlier tokens for this layer. A fresh one, which the model makes
    when ``use_cache`` is on, is left as it is: the sequence's states are spread over the ranks."""
    if cache is None:
        return False
    try:
        return cache.get_recurrent_state(module.layer_idx) is not None or cache.get_conv_state(module.layer_idx) is not None
    except (AttributeError, IndexError, KeyError, TypeError, ValueError):
        return True


@functools.lru_cache(maxsize=64)
def _chain_runs(seq_len: int, size: int) -> tuple[tuple[tuple[int, int, Optional[int], Optional[int]], ...], ...]:
    """Per cp rank, its maximal runs of consecutive global positions in the load-balanced layout:
    ``(local start, local end, rank holding the position before, rank holding the position after)``."""
    positions = [sequence_positions(seq_len, rank, size, load_balanced=True).tolist() for rank in range(size)]
    owner = [0] * seq_len
    for rank, held in enumerate(positions):
        for p in held:
            owner[p] = rank
    chains = []
    for held in positions:
        runs, start = [], 0
        for i in range(1, len(held) + 1):
            if i == len(held) or held[i] != held[i - 1] + 1:
                first, end = held[start], held[i - 1] + 1
                before = owner[first - 1] if first > 0 else None
                runs.append((start, i, before, owner[end] if end < seq_len else None))
                start = i
        chains.append(tuple(runs))
    return tuple(chains)


class _Receive(torch.autograd.Function):
    """The conv inputs and state of the run before, from rank ``src``; the backward sends their gradients back."""

    @staticmethod
    def forward(ctx: Any, token: Tensor, src: int, group: Any, tail_spec: tuple, state_spec: tuple) -> tuple:
        ctx.src, ctx.group = src, group
        received = [torch.empty(shape, dtype=dtype, device=token.device) for shape, dtype in (tail_spec, state_spec)]
        for tensor in received:
            dist.recv(tensor, group=group, group_src=src)
        return tuple(received)

    @staticmethod
    def backward(ctx: Any, grad_tail: Tensor, grad_state: Tensor) -> tuple:
        for grad in (grad_tail, grad_state):
            dist.send(grad.contiguous(), group=ctx.group, group_dst=ctx.src)
        return grad_tail.new_zeros(()), None, None, None, None


class _Send(torch.autograd.Function):
    """A run's last conv inputs and final state to rank ``dst``; returns a token that orders the next hand-off (the
    backward receives their gradients)."""

    @staticmethod
    def forward(ctx: Any, tail: Tensor, state: Tensor, dst: int, group: Any) -> Tensor:
        ctx.dst, ctx.group = dst, group
        ctx.specs = [(t.shape, t.dtype, t.device) for t in (tail, state)]
        for tensor in (tail, state):
            dist.send(tensor.contiguous(), group=group, group_dst=dst)
        return tail.new_zeros(())

    @staticmethod
    def backward(ctx: Any, _: Tensor) -> tuple:
        grads = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.specs]
        for grad in grads:
            dist.recv(grad, group=ctx.group, group_src=ctx.dst)
        return grads[0], grads[1], None, None


def _reduce_scatter_sequence(x: Tensor, group: Any) -> Tensor:
    """``[b, cp * s, ...]`` (rank order) summed over the group; rank ``r`` keeps ``[b, s, ...]``, its shard."""
    size = dist.get_world_size(group)
    parts = x.unflatten(1, (size, x.shape[1] // size)).movedim(1, 0)
    out = x.new_empty(parts.shape[1:])
    _reduce_scatter_single(out, parts.flatten(0, 1).contiguous(), group=group)  # gloo: concatenated along dim 0
    return out


def _all_gather_sequence(x: Tensor, group: Any) -> Tensor:
    """Every rank's ``[b, s, ...]`` as ``[b, cp * s, ...]`` in rank order."""
    size = dist.get_world_size(group)
    gathered = x.new_empty((size * x.shape[0], *x.shape[1:]))  # gloo: concatenated along dim 0
    _all_gather_single(gathered, x.contiguous(), group=group)
    return gathered.unflatten(0, (size, x.shape[0])).movedim(0, 1).flatten(1, 2)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return _all_gather_sequence(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        return _reduce_scatter_sequence(grad, ctx.group), None


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return _reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        return _all_gather_sequence(grad, ctx.group), None


def _head_piece(param: Tensor, role: tuple[str, str], rows: Tensor, size: int, rank: int) -> Optional[Tensor]:
    """This rank's heads' part of one parameter (as tensor parallelism splits it), or ``None`` when it keeps it all."""
    owner, part = role
    if owner == "norm" or (part == "lora_A" and owner != "out_proj"):
        return None
    if owner == "out_proj":
        return param.chunk(size, 1)[rank] if part in ("weight", "lora_A") else None
    if owner in ("in_proj_qkv", "conv1d"):
        return param.index_select(0, rows.to(param.device))
    return param.chunk(size, 0)[rank]  # in_proj_z/a/b, in_proj_qkvz/ba (fused per key head), dt_bias, A_log


@contextlib.contextmanager
def _local_heads(module: nn.Module, size: int, rank: int) -> Iterator[None]:
    """The module as it runs rank ``rank``'s heads: its parameters' parts in place (differentiable slices of the
    parameters, so the gradients land in the whole ones) and its head counts and channel sizes the local ones."""
    rows = head_group_rows(module.key_dim, module.value_dim, size, rank)
    saved = []
    for path, param in list(module.named_parameters()):
        role = parameter_role(path)
        piece = None if role is None else _head_piece(param, role, rows, size, rank)
        if piece is not None:
            owner_name, _, leaf = path.rpartition(".")
            owner = module.get_submodule(owner_name)
            saved.append((owner, leaf, param))
            owner._parameters[leaf] = piece  # type: ignore[assignment]
    sizes = {name: getattr(module, name) for name in ("num_k_heads", "num_v_heads", "key_dim", "value_dim", "conv_dim")}
    module.num_k_heads, module.num_v_heads = sizes["num_k_heads"] // size, sizes["num_v_heads"] // size
    module.key_dim, module.value_dim = module.num_k_heads * module.head_k_dim, module.num_v_heads * module.head_v_dim
    module.conv_dim = 2 * module.key_dim + module.value_dim
    try:
        yield
    finally:
        for owner, leaf, param in saved:
            owner._parameters[leaf] = param
        for name, value in sizes.items():
            setattr(module, name, value)
