"""What makes one real-size training step run on a fake process group under fake tensors (the dry run's setting).

:func:`fake_world` is the process group; the context managers turn off what reads tensor values that fake
tensors do not have (packed-row detection, the pipeline's shape vote) or what would only repeat itself
(ring attention's query-row tiles), and set the default dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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
    """Ring attention computes each K/V block a tile of query rows at a time, each tile's temporaries freed before
    the next: under fake tensors the widest tile alone has the same peak. At 64K tokens over cp=4 a block has
    thousands of tiles, and running them all made a 70B dry run take over half an hour. The widest is the last full
    tile: causal tiles stop at the last key their last query attends, which grows with the rows (the dry run plans
    unpacked rows, :func:`unpacked_rows`: no document boxes)."""
    from lightning_plugins.parallel.context import tiles

    original = tiles._tile_starts
    tiles._tile_starts = lambda row_start, row_end, tile: [max(row_start, row_end - tile)]
    try:
        yield
    finally:
        tiles._tile_starts = original


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
