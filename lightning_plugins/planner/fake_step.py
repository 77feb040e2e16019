"""What makes one real-size training step run on a fake process group under fake tensors (the dry run's setting).

:func:`fake_world` is the process group; the context managers turn off what reads tensor values that fake
tensors do not have (packed-row detection, the pipeline's shape vote) or what would only repeat itself
(ring attention's query-row tiles, the chunked loss's chunks), and set the default dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist


_FAKE_WORLDS = 0


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """A fake process group: every collective returns at once, nothing is sent. Once per process.

    DTensor and pipelining keep process-wide caches that hold meshes of the process groups they met; a
    second fake world in the same process picks up the first one's entries and measures *wrong* numbers
    without failing. :func:`dry_run` therefore forks a process per world; this refuses a second one.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    global _FAKE_WORLDS
    if _FAKE_WORLDS:
        raise RuntimeError("fake_world: one fake world per process (caches of the first would corrupt the second).")
    _FAKE_WORLDS += 1
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@contextlib.contextmanager
def unpacked_rows() -> Iterator[None]:
    """Rows of one sequence each: transformers skips the mask then (SDPA runs causal), as a real run does.

    transformers looks for packed sequences in the position ids by reading their values, which fake
    tensors do not have; undecided, it would build a dense ``[batch, 1, seq, seq]`` mask that a real run
    of unpadded rows never makes. Context-parallel attention reads them too, for document boundaries.
    """
    from transformers import masking_utils

    from lightning_plugins.parallel.context import wiring

    originals = masking_utils.find_packed_sequence_indices, wiring._document_starts
    masking_utils.find_packed_sequence_indices = lambda *args, **kwargs: None
    wiring._document_starts = lambda *args, **kwargs: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices, wiring._document_starts = originals


@contextlib.contextmanager
def one_row_tile_only() -> Iterator[None]:
    """Ring attention's tiles (the pure-torch fallback for soft-capping; on CPU also the masked kernel calls of a
    window's short band runs and of short packed documents; the rest runs unmasked fused calls:
    :func:`lightning_plugins.parallel.context.tiles.block_pieces`) compute a K/V block a tile of query rows at a
    time, each tile's temporaries (scores, or the kernel's mask) freed before the next: under fake tensors the widest
    tile alone has the same peak. At 64K tokens over cp=4 a block has thousands of tiles, and running them all made a
    70B dry run take over half an hour. The widest is the last full tile: causal tiles stop at the last key their last
    query attends, which grows with the rows (the dry run plans unpacked rows, :func:`unpacked_rows`: no document
    boxes). A sliding window's tiles are boxed like documents': the one with the largest box alone."""
    from lightning_plugins.parallel.context import tiles

    originals = tiles._tile_starts, tiles._document_tiles

    def largest_box(*args: Any, **kwargs: Any) -> list[tuple[slice, slice]]:
        boxes = list(originals[1](*args, **kwargs))
        area = [(rows.stop - rows.start) * (cols.stop - cols.start) for rows, cols in boxes]
        return [boxes[area.index(max(area))]] if boxes else []

    tiles._tile_starts = lambda row_start, row_end, tile: [max(row_start, row_end - tile)]
    tiles._document_tiles = largest_box
    try:
        yield
    finally:
        tiles._tile_starts, tiles._document_tiles = originals


@contextlib.contextmanager
def one_loss_chunk_only() -> Iterator[None]:
    """The chunked loss (:mod:`lightning_plugins.parallel.memory.chunked_loss`) computes a chunk of tokens at a time, each
    chunk's logits freed before the next: under fake tensors the first (a full chunk: the widest) alone has the same
    peak. At a 128K vocabulary it ran 128 head tiles per micro-batch, a third of a 405B pipeline dry run's time."""
    from lightning_plugins.parallel.memory import chunked_loss

    original = chunked_loss._chunk_starts
    chunked_loss._chunk_starts = lambda tokens, chunk: range(0, min(tokens, 1), chunk)
    try:
        yield
    finally:
        chunked_loss._chunk_starts = original


@contextlib.contextmanager
def static_pipeline_shapes() -> Iterator[None]:
    """Skip the pipeline's peer-to-peer warm-up vote: it reads a received value, which a fake group never sends.

    Our stages always have static shapes (``lightning_plugins.parallel.pipeline`` builds them with the
    batch's shapes), which is what the vote would decide.
    """
    from torch.distributed.pipelining import schedules

    original = getattr(schedules._PipelineSchedule, "_warmup_p2p", None)
    if original is None:  # torch >= 2.15 skips the vote on a fake group itself (static shapes given)
        yield
        return

    def static(self: object, stages: list, has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = schedules.InferenceMode.STATIC

    schedules._PipelineSchedule._warmup_p2p = static
    try:
        yield
    finally:
        schedules._PipelineSchedule._warmup_p2p = original


@contextlib.contextmanager
def balanced_routing() -> Iterator[None]:
    """Route every expert the same number of (token, choice) pairs: the experts' forward without reading values.

    The engine's grouped forward (:func:`lightning_plugins.parallel.moe.experts.experts_forward`) counts the pairs per
    expert (``bincount``) and sizes the all-to-all and the grouped GEMM from those counts, which fake tensors do not
    have. A dry run plans a balanced router instead (the state the load-balancing loss drives to): each of the
    ``E`` experts gets ``ceil(tokens x k / E)`` pairs. What a step holds is kept: the gathered pairs
    (``tokens x k x hidden``), under expert parallelism the dispatch and combine buffers of the all-to-all
    (forward and backward, through the same autograd collective), and the experts' intermediate activations.
    """
    from lightning_plugins.parallel.moe import experts

    original = experts.experts_forward
    experts.experts_forward = _balanced_experts_forward
    try:
        yield
    finally:
        experts.experts_forward = original


def _balanced_experts_forward(
    module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """:func:`~lightning_plugins.parallel.moe.experts.experts_forward` with every expert receiving the same pairs."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    tokens, k = top_k_index.shape
    per_expert = -(-tokens * k // module.num_experts)
    rows = per_expert * module.num_experts
    pairs = hidden_states.repeat_interleave(k, dim=0)
    pairs = torch.cat([pairs, pairs.new_zeros(rows - tokens * k, pairs.shape[-1])]) if rows > tokens * k else pairs
    group = getattr(module, "_lp_ep_group", None)
    if group is not None:  # every rank sends and receives the same number of pairs to and from every rank
        split = [rows // group.size()] * group.size()
        pairs = all_to_all_single_autograd(pairs.contiguous(), split, split, group)
    out = _uniform_expert_mlp(module, pairs)
    if group is not None:
        out = all_to_all_single_autograd(out.contiguous(), split, split, group)
    out = out[: tokens * k] * top_k_weights.reshape(-1, 1).to(out.dtype)
    return out.view(tokens, k, -1).sum(dim=1).to(hidden_states.dtype)


def _uniform_expert_mlp(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The experts' MLP on rows ``x`` shared evenly by the module's (local) experts, as one batched GEMM."""

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w = weight if module.is_transposed else weight.transpose(-2, -1)  # [experts, in, out]
        out = torch.bmm(x.to(w.dtype).view(w.shape[0], x.shape[0] // w.shape[0], -1), w)
        return (out if bias is None else out + bias.unsqueeze(1)).reshape(-1, w.shape[-1])

    up = module.gate_up_proj if module.has_gate else module.up_proj
    up_bias = (module.gate_up_proj_bias if module.has_gate else module.up_proj_bias) if module.has_bias else None
    h = linear(x, up, up_bias)
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
    h = linear(h, module.down_proj, module.down_proj_bias if module.has_bias else None)
    if getattr(module, "has_post_expert_norm", False):
        h = module.post_expert_norm(h)
    return h
