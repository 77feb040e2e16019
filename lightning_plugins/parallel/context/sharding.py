"""The sequence split of context parallelism: the load-balanced layout and padding, on plain tensors.

**Load-balanced layout.** With causal attention, a plain contiguous split gives the last rank ``cp`` times the work
of the first. Instead the global sequence of length ``S`` is cut into segments of ``2 * cp`` equal chunks of
:data:`BALANCE_CHUNK` tokens (the last segment takes what is left, in ``2 * cp`` equal chunks), and rank ``r`` holds
chunks ``r`` and ``2 * cp - 1 - r`` of every segment, in sequence order. In a causal row the work of a position
grows linearly with it, so each segment gives every rank the same number of attended query/key pairs. Small
segments keep that true for packed rows, where the work restarts at every document: a long document is spread
over all ranks a segment at a time, and short documents fall on the ranks evenly (one segment of ``2 * cp`` chunks
per row, ``S <= 2 * cp * BALANCE_CHUNK``, is the classic head-tail split). :func:`shard_sequence_load_balanced` and
:func:`load_balanced_indices` shard ``input_ids``, ``labels`` and ``position_ids`` consistently (the model must get
the *global* ``position_ids`` of its shard for RoPE). Concatenating the rank shards in rank order, as an all-gather
or the Ulysses all-to-all does, gives the *rank order* of the sequence; :func:`unshard_sequence_load_balanced` turns
it into natural order and :func:`reorder_sequence_load_balanced` turns natural order back into rank order.

**Padding.** Both kernels need ``S`` divisible by ``2 * cp`` (``cp`` without load balancing);
:func:`pad_for_context_parallel` pads at the end, with ``-100`` labels. In causal attention trailing pads
are never attended by real tokens (every real position is smaller), so padding changes nothing for them;
non-causal attention must be told ``valid_len`` so that pad keys are masked out. Positions at or after
``valid_len`` neither attend nor are attended, and their attention output is zero.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_plugins.parallel.loss import IGNORE_INDEX

#: Tokens in one chunk of the load-balanced layout (see the module docstring). Smaller chunks balance packed rows
#: of shorter documents; larger ones keep more of each short document on one rank. Measured in
#: ``benchmarks/packed_attention.py`` (RESULTS.md, "Packed rows under context parallelism").
BALANCE_CHUNK = 64


def _check_divisible(seq_len: int, cp_size: int, num_chunks: int) -> None:
    if seq_len % num_chunks != 0:
        raise ValueError(
            f"Context parallelism with cp_size={cp_size} splits the sequence into {num_chunks} equal chunks, "
            f"but the sequence length {seq_len} is not divisible by {num_chunks}. Pad it first with "
            f"`pad_for_context_parallel` (to a multiple of {num_chunks})."
        )


@functools.lru_cache(maxsize=256)
def _balanced_positions(seq_len: int, cp_rank: int, cp_size: int) -> Tensor:
    """:func:`load_balanced_indices`, cached (ring attention asks for every block of every layer); never modified."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    span = 2 * cp_size * BALANCE_CHUNK
    full, rest = divmod(seq_len, span)
    with unset_fake_temporarily():  # real also under the planner's FakeTensorMode: the cache outlives it
        chunks = torch.tensor([cp_rank, 2 * cp_size - 1 - cp_rank])
        pieces = []
        for count, chunk, offset in ((full, BALANCE_CHUNK, 0), (int(rest > 0), rest // (2 * cp_size), full * span)):
            if count:
                starts = offset + torch.arange(count)[:, None] * 2 * cp_size * chunk + chunks[None, :] * chunk
                pieces.append((starts[..., None] + torch.arange(chunk)).flatten())
        return torch.cat(pieces)


@functools.lru_cache(maxsize=64)
def _rank_order(seq_len: int, cp_size: int) -> tuple[Tensor, Tensor]:
    """The global positions of the rank-order concatenation of all shards, and its inverse permutation."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        order = torch.cat([_balanced_positions(seq_len, rank, cp_size) for rank in range(cp_size)])
        return order, torch.argsort(order)


def load_balanced_indices(seq_len: int, cp_rank: int, cp_size: int) -> Tensor:
    """The global sequence positions that one rank holds in the load-balanced layout.

    Args:
        seq_len: Global sequence length ``S``; must be divisible by ``2 * cp_size``.
        cp_rank: The rank within the context-parallel group.
        cp_size: Size of the context-parallel group.

    Returns:
        A sorted ``LongTensor`` of ``S / cp_size`` positions: chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank``
        of every segment of ``2 * cp_size`` chunks (see the module docstring).
    """
    _check_divisible(seq_len, cp_size, 2 * cp_size)
    return _balanced_positions(seq_len, cp_rank, cp_size).clone()


def sequence_positions(seq_len: int, cp_rank: int, cp_size: int, load_balanced: bool) -> Tensor:
    """Global positions of one rank's shard, for either layout (sorted ascending in both).

    Real tensors also under a ``FakeTensorMode`` (the planner's dry run): they depend on nothing but the sizes, and
    :func:`_active_block` reads them.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if load_balanced:
        _check_divisible(seq_len, cp_size, 2 * cp_size)
        return _balanced_positions(seq_len, cp_rank, cp_size)
    _check_divisible(seq_len, cp_size, cp_size)
    local = seq_len // cp_size
    with unset_fake_temporarily():
        return torch.arange(cp_rank * local, (cp_rank + 1) * local)


def shard_sequence_load_balanced(x: Tensor, dim: int, cp_rank: int, cp_size: int) -> Tensor:
    """This rank's load-balanced shard of a full (natural order) sequence tensor.

    Differentiable; use it for ``input_ids``, ``labels``, ``position_ids`` and anything else indexed by
    sequence position, so that all of them are sharded the same way.

    Args:
        x: Tensor holding the whole sequence along ``dim``.
        dim: The sequence dimension.
        cp_rank: The rank within the context-parallel group.
        cp_size: Size of the context-parallel group.

    Returns:
        The positions :func:`load_balanced_indices` names, in order, along ``dim``.
    """
    _check_divisible(x.shape[dim], cp_size, 2 * cp_size)
    return x.index_select(dim, _balanced_positions(x.shape[dim], cp_rank, cp_size).to(x.device))


def unshard_sequence_load_balanced(x: Tensor, dim: int, cp_size: int) -> Tensor:
    """Natural sequence order from the rank-ordered concatenation of load-balanced shards.

    ``x`` is what an all-gather of the shards along ``dim`` (or the Ulysses all-to-all) produces: rank
    0's shard, then rank 1's, and so on. Differentiable; inverse of :func:`reorder_sequence_load_balanced`.

    Args:
        x: Tensor holding all ``cp_size`` shards, in rank order, along ``dim``.
        dim: The sequence dimension.
        cp_size: Size of the context-parallel group.

    Returns:
        ``x`` with its sequence in natural order.
    """
    _check_divisible(x.shape[dim], cp_size, 2 * cp_size)
    return x.index_select(dim, _rank_order(x.shape[dim], cp_size)[1].to(x.device))


def reorder_sequence_load_balanced(x: Tensor, dim: int, cp_size: int) -> Tensor:
    """Rank order from a natural-order sequence: the inverse of :func:`unshard_sequence_load_balanced`.

    Args:
        x: Tensor holding the whole sequence, in natural order, along ``dim``.
        dim: The sequence dimension.
        cp_size: Size of the context-parallel group.

    Returns:
        The ``cp_size`` load-balanced shards of ``x`` concatenated in rank order along ``dim``.
    """
    _check_divisible(x.shape[dim], cp_size, 2 * cp_size)
    return x.index_select(dim, _rank_order(x.shape[dim], cp_size)[0].to(x.device))


class ContextParallelBatch(NamedTuple):
    """A batch padded for context parallelism (see :func:`pad_for_context_parallel`)."""

    input_ids: Tensor
    labels: Optional[Tensor]
    position_ids: Tensor
    valid_len: int
    """Sequence length before padding: positions at or after it are padding."""


def pad_for_context_parallel(
    input_ids: Tensor,
    labels: Optional[Tensor],
    position_ids: Optional[Tensor],
    cp_size: int,
    pad_id: int,
    *,
    load_balanced: bool = True,
    ignore_index: int = IGNORE_INDEX,
) -> ContextParallelBatch:
    """Pad a batch at the end of its sequence so that context parallelism can split it evenly.

    The sequence (last dimension) is padded to a multiple of ``2 * cp_size`` (``cp_size`` without load
    balancing). Pad labels are ``ignore_index``, so the loss ignores them; pad positions continue the
    position ids, so RoPE stays well defined. In causal attention real tokens never attend to trailing
    pads; non-causal attention needs the returned ``valid_len`` passed to the kernel.

    Labels must already be the next-token targets (shifted by one) when the model is context parallel:
    a shift inside the loss would cross shard boundaries.

    Args:
        input_ids: Token ids, ``[..., seq]``.
        labels: Targets shaped like ``input_ids``, or ``None``.
        position_ids: Position ids ``[..., seq]``, or ``None`` for ``0 .. seq-1``.
        cp_size: Size of the context-parallel group.
        pad_id: Token id used for padding.
        load_balanced: Whether the sequence will be sharded with the load-balanced layout.
        ignore_index: Label value that the loss ignores.

    Returns:
        The padded ``input_ids``, ``labels`` and ``position_ids``, and the original length ``valid_len``.
    """
    seq_len = input_ids.shape[-1]
    multiple = 2 * cp_size if load_balanced else cp_size
    num_pad = -seq_len % multiple
    if position_ids is None:
        position_ids = torch.arange(seq_len, device=input_ids.device).expand_as(input_ids)
    if num_pad == 0:
        return ContextParallelBatch(input_ids, labels, position_ids, seq_len)
    input_ids = F.pad(input_ids, (0, num_pad), value=pad_id)
    if labels is not None:
        labels = F.pad(labels, (0, num_pad), value=ignore_index)
    steps = torch.arange(1, num_pad + 1, device=position_ids.device, dtype=position_ids.dtype)
    position_ids = torch.cat([position_ids, position_ids[..., -1:] + steps], dim=-1)
    return ContextParallelBatch(input_ids, labels, position_ids, seq_len)
