"""Packed rows through Gated DeltaNet linear attention (Qwen3.5, Qwen3-Next): the recurrent state and the causal conv
restart at each document start.

transformers' torch kernels take no document boundaries (they ignore ``cu_seqlens``), so one process run over a packed
row carries each document's state and conv inputs into the next. Here a row is cut into its documents (a document
begins where the ``position_ids`` do not count on by one, as transformers' own packed-sequence detection for the
attention layers finds it) and the module's own forward runs on the documents, a few calls per layer: documents of
similar lengths (within a factor of two) are right-padded into one batch. Right padding is exact: the conv and the
recurrence are causal, so a document's outputs never see the pads after it. The kernel is whatever the model has.

:func:`run_documents` also continues a carried state (context parallelism's ring passes the state of the positions
before a run of tokens, :mod:`lightning_plugins.parallel.context.linear`): a row's first document continues it unless
the row starts a document there, and the state and conv inputs after each row's last document are returned. Those
last documents run unpadded, in batches of equal length, so the returned state is exact.

:func:`prepare_linear_attention_for_packing` installs the one-process path (:class:`DocumentLinearAttention`);
``data.prepare_model_for_packing`` calls it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from lightning_plugins.parallel.linear_attention import is_gated_delta_net

__all__ = [
    "Carry",
    "DocumentLinearAttention",
    "document_starts",
    "host_positions",
    "prepare_linear_attention_for_packing",
    "run_documents",
]


class Carry:
    """What the Gated DeltaNet's forward reads from and writes to a cache, for one batch of runs of positions: the conv
    inputs and the recurrent state before them (zeros and ``None`` at a start), then the runs' own last conv inputs
    and final states."""

    def __init__(self, tail: Tensor, state: Tensor | None, width: int) -> None:
        self.tail, self.state, self.width = tail, state, width

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> Tensor:
        return self.tail

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        return self.state

    def is_recording_past(self, layer_idx: int) -> bool:
        return True  # never the in-place single-token decode path

    def update_conv_state(self, conv_input: Tensor, layer_idx: int, **kwargs: Any) -> Tensor:
        full = torch.cat([self.tail.to(conv_input.dtype), conv_input], dim=-1)
        self.tail = full[..., full.shape[-1] - self.width :]
        return full

    def update_recurrent_state(self, state: Tensor, layer_idx: int, **kwargs: Any) -> Tensor:
        self.state = state
        return state


def host_positions(positions: Tensor | None, rows: int, length: int) -> Tensor | None:
    """``position_ids`` as ``[rows, length]`` on the host, or ``None`` (none given, or fake tensors of a dry run, which
    plans unpacked rows)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if positions is None or isinstance(positions, FakeTensor) or positions.shape[-1] != length:
        return None
    return positions.detach().to("cpu", torch.long).reshape(-1, length).expand(rows, length)


def document_starts(positions: Tensor) -> Tensor:
    """Where documents begin in rows of ``position_ids`` ``[rows, length]`` (host booleans): where the ids do not count
    on by one. Column 0 is ``True`` (the caller decides whether the row continues a state there)."""
    first = torch.ones_like(positions[:, :1], dtype=torch.bool)
    return torch.cat([first, positions[:, 1:] != positions[:, :-1] + 1], dim=1)


class _Segment(NamedTuple):
    row: int
    lo: int
    hi: int
    carried: bool  # starts from the carried state (the row's first document, continued)
    last: bool  # the row's last document, whose final state and conv inputs are wanted


def run_documents(
    forward: Callable[..., Tensor],
    hidden: Tensor,
    starts: Tensor | None,
    module: nn.Module,
    carry: tuple[Tensor, Tensor | None] | None = None,
    final: bool = False,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The Gated DeltaNet's ``forward`` over rows ``hidden [b, L, h]`` whose documents begin at ``starts [b, L]`` (host
    booleans; a row whose column 0 is ``False`` continues ``carry``).

    Args:
        forward: The module's forward (``hidden_states``, ``cache=``, ``attention_mask=``, ...).
        hidden: The rows.
        starts: Where documents begin; ``None``: nowhere (each row continues ``carry``).
        module: The Gated DeltaNet (its conv's width and channels, as the forward sees them).
        carry: The conv inputs ``[b, channels, kernel - 1]`` and recurrent state (or ``None``: zeros) before the rows.
        final: Return the conv inputs and state after each row's last document.
        **kwargs: The forward's other arguments; an ``attention_mask [b, L]`` is cut like the rows.

    Returns:
        The output ``[b, L, h_out]``, and with ``final`` the conv inputs and state after the rows (else ``None``).
    """
    if starts is None or not bool(starts[:, 1:].any()):
        fresh = None if starts is None or carry is None else starts[:, 0]
        return _whole_rows(forward, hidden, fresh, module, carry, final, kwargs)
    rows, length = starts.shape
    if carry is None:
        starts = starts.clone()
        starts[:, 0] = True
    segments = []
    for row in range(rows):
        cuts = [*starts[row].nonzero().flatten().tolist(), length]
        if cuts[0] != 0:
            cuts.insert(0, 0)
        for lo, hi in itertools.pairwise(cuts):
            segments.append(_Segment(row, lo, hi, lo == 0 and not bool(starts[row, 0]), final and hi == length))
    outs, finals, order = [], {}, []
    for group in _groups(segments):
        out, tail, state = _run_group(forward, hidden, group, module, carry, kwargs)
        for i, segment in enumerate(group):
            outs.append(out[i, : segment.hi - segment.lo])
            order.append(segment.row * length + torch.arange(segment.lo, segment.hi))
            if segment.last:
                finals[segment.row] = (tail[i], state[i])
    flat = torch.cat(outs)
    where = torch.empty(rows * length, dtype=torch.long)
    where[torch.cat(order)] = torch.arange(rows * length)
    out = flat.index_select(0, where.to(flat.device)).unflatten(0, (rows, length))
    if carry is not None and not any(s.carried for s in segments):  # every row starts a document here
        out = _Join.apply(out, *(t for t in carry if t is not None))
    if not final:
        return out, None, None
    return out, torch.stack([finals[r][0] for r in range(rows)]), torch.stack([finals[r][1] for r in range(rows)])


class _Join(torch.autograd.Function):
    """``out`` unchanged, with zero gradients for ``tensors``: a carry no document continues stays in the graph, so
    the backward of whatever produced it (context parallelism's receive, which sends the gradients back) still runs."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, *tensors: Tensor) -> Tensor:
        ctx.specs = [(t.shape, t.dtype, t.device) for t in tensors]
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        return (grad, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.specs))


def _whole_rows(
    forward: Callable[..., Tensor],
    hidden: Tensor,
    fresh: Tensor | None,
    module: nn.Module,
    carry: tuple[Tensor, Tensor | None] | None,
    final: bool,
    kwargs: dict,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Rows of one document each: one call (the carry dropped on the rows ``fresh`` marks, which start a document at
    column 0)."""
    if carry is None and not final:
        return forward(hidden, **kwargs), None, None
    tail, state = carry if carry is not None else (_zeros_tail(hidden, module, hidden.shape[0]), None)
    if carry is not None and fresh is not None and bool(fresh.any()):
        keep = (~fresh).to(tail.device)
        tail = tail * keep.to(tail.dtype)[:, None, None]
        state = None if state is None else state * keep.to(state.dtype)[:, None, None, None]
    cache = Carry(tail, state, module.conv_kernel_size - 1)
    out = forward(hidden, cache=cache, **kwargs)
    return out, cache.tail, cache.state


def _zeros_tail(hidden: Tensor, module: nn.Module, rows: int) -> Tensor:
    """The conv inputs before a document's start: zeros, ``[rows, channels, kernel - 1]``."""
    return hidden.new_zeros((rows, module.conv_dim, module.conv_kernel_size - 1))


def _groups(segments: list[_Segment]) -> list[list[_Segment]]:
    """Batches of segments: a row's last document (whose final state is wanted) with those of the same length only;
    the others greedily, longest first, each with those at least half as long (padding at most doubles the work)."""
    groups: list[list[_Segment]] = []
    lasts: dict[int, list[_Segment]] = {}
    for segment in segments:
        if segment.last:
            lasts.setdefault(segment.hi - segment.lo, []).append(segment)
    groups.extend(lasts.values())
    rest = sorted((s for s in segments if not s.last), key=lambda s: s.lo - s.hi)
    for segment in rest:
        if groups[len(lasts) :] and 2 * (segment.hi - segment.lo) >= groups[-1][0].hi - groups[-1][0].lo:
            groups[-1].append(segment)
        else:
            groups.append([segment])
    return groups


def _run_group(
    forward: Callable[..., Tensor],
    hidden: Tensor,
    group: list[_Segment],
    module: nn.Module,
    carry: tuple[Tensor, Tensor | None] | None,
    kwargs: dict,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """One call of the forward on a batch of segments, right-padded to the longest (with zeros)."""
    rows, length = hidden.shape[:2]
    longest = max(s.hi - s.lo for s in group)
    index = torch.full((len(group), longest), rows * length, dtype=torch.long)  # the pad: one zero row past the end
    for i, s in enumerate(group):
        index[i, : s.hi - s.lo] = torch.arange(s.row * length + s.lo, s.row * length + s.hi)
    index = index.to(hidden.device)
    flat = torch.cat([hidden.flatten(0, 1), hidden.new_zeros((1, *hidden.shape[2:]))])
    args = dict(kwargs)
    mask = args.get("attention_mask")
    if mask is not None:
        args["attention_mask"] = torch.cat([mask.flatten(), mask.new_zeros(1)])[index]
    carried = [i for i, s in enumerate(group) if s.carried]
    if not carried and not any(s.last for s in group):
        return forward(flat[index], **args), None, None
    if carry is None:
        tail = _zeros_tail(hidden, module, len(group))
    else:
        tail = carry[0].new_zeros((len(group), *carry[0].shape[1:]))
    state = None
    if carried:
        pick = torch.tensor([group[i].row for i in carried], device=tail.device)
        slots = torch.tensor(carried, device=tail.device)
        tail = tail.index_copy(0, slots, carry[0].index_select(0, pick))
        if carry[1] is not None:
            state = carry[1].new_zeros((len(group), *carry[1].shape[1:]))
            state = state.index_copy(0, slots, carry[1].index_select(0, pick))
    cache = Carry(tail, state, module.conv_kernel_size - 1)
    out = forward(flat[index], cache=cache, **args)
    return out, cache.tail, cache.state


class DocumentLinearAttention:
    """The one-process replacement of a Gated DeltaNet's forward (an instance attribute; the class stays
    transformers'): the module's own forward per document of packed rows (:func:`run_documents`), the documents read
    from the ``position_ids`` its decoder layer is given. Rows of one document, a cache (generation) or no position
    ids: the module's forward as it is."""

    def __init__(self, module: nn.Module) -> None:
        self.module, self.forward = module, module.forward
        self.positions: Tensor | None = None
        self._seen: tuple[Tensor | None, Tensor | None] = (None, None)

    def note_positions(self, layer: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of the decoder layer: the ``position_ids`` it is given (its linear attention is not)."""
        self.positions = kwargs.get("position_ids")

    def __call__(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if args or kwargs.get("cache") is not None or kwargs.get("cache_params") is not None:
            return self.forward(hidden_states, *args, **kwargs)
        starts = self._starts(hidden_states.shape[0], hidden_states.shape[1])
        if starts is None:
            return self.forward(hidden_states, **kwargs)
        return run_documents(self.forward, hidden_states, starts, self.module, **kwargs)[0]

    def _starts(self, rows: int, length: int) -> Tensor | None:
        """The rows' document starts, read once per ``position_ids`` tensor (recomputation asks again); ``None`` for
        rows of one document each."""
        if self.positions is None or self.positions is not self._seen[0]:
            positions = host_positions(self.positions, rows, length)
            starts = None if positions is None else document_starts(positions)
            self._seen = (self.positions, None if starts is None or not bool(starts[:, 1:].any()) else starts)
        return self._seen[1]


def prepare_linear_attention_for_packing(model: nn.Module) -> int:
    """Make every Gated DeltaNet of ``model`` (a decoder layer's ``linear_attn``) restart at each document of packed
    rows (:class:`DocumentLinearAttention`); idempotent. Call it before parallelizing (tensor parallelism wraps it).

    Returns:
        How many layers run per document.
    """
    count = 0
    for layer in model.modules():
        module = getattr(layer, "linear_attn", None)
        if module is None or not is_gated_delta_net(module) or not isinstance(module, nn.Module):
            continue
        if not isinstance(module.forward, DocumentLinearAttention):
            wrapper = DocumentLinearAttention(module)
            module.forward = wrapper  # type: ignore[method-assign]
            layer.register_forward_pre_hook(wrapper.note_positions, with_kwargs=True)
        count += 1
    return count
