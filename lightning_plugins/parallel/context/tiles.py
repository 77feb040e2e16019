"""Which query/key pairs ring attention computes: a block's active box and its query-row tiles.

Ring attention (:mod:`.ring`) attends this rank's queries to one K/V block at a time. Here is what it computes of
each: :func:`active_block` boxes a block to the rows and keys that can attend (``None`` when none can), and
:func:`row_tiles` cuts the box into tiles of query rows, each boxed to the keys it attends and carrying its own
small mask, so the temporaries stay bounded whatever the local length. Causal tiles stop at the last key their
last query attends; in packed rows each tile holds whole documents (a long one is cut into tiles), so short
documents cost what they attend, not a tile's square.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor

from lightning_plugins.parallel.context.bands import BandCall, band_mask


class _Documents(NamedTuple):
    """Packed rows: query ``i`` of row ``b`` attends only keys at or after ``starts[b, i]``, its document's start."""

    q_pos: Tensor  # [rows] global positions of the queries
    k_pos: Tensor  # [cols] global positions of the keys
    starts: Tensor  # [batch or 1, rows] global position where each query's document begins


class _Block(NamedTuple):
    """Where one query block meets one key block: rows ``[row_start, row_end)``, keys ``[col_start, col_end)``."""

    row_start: int
    row_end: int
    col_start: int
    col_end: int
    # Causal and partly masked: the (query, key) positions each tile is boxed and masked by; None when every
    # pair in the box attends. A [rows, cols] mask of the whole block is never built (at 128K tokens over cp=2
    # it would be 4 GiB).
    causal: Optional[tuple[Tensor, Tensor]]
    documents: Optional[_Documents] = None  # packed rows: each tile is boxed and masked by document


#: The box of one query block against one key block that :func:`active_block` returns.
ActiveBlock = _Block


def active_block(
    q_pos: Tensor, k_pos: Tensor, causal: bool, valid_len: Optional[int], starts: Optional[Tensor] = None
) -> Optional[_Block]:
    """The box of query rows x key columns that can attend, or ``None`` when the block is fully masked.

    Positions are sorted within a shard in both layouts, so the rows that attend anything form a
    contiguous range and the keys that are attended form a prefix: slicing to that box skips the
    masked work (with a single segment of the load-balanced layout, off-diagonal causal blocks shrink to a
    half; with several, the causal tiles of :func:`row_tiles` skip it). With packed rows (``starts``) a query attends only its own document, so the box narrows further,
    tile by tile (:func:`row_tiles`), and a block that holds none of a query's document is skipped.

    The positions are real tensors (:func:`~lightning_plugins.parallel.context.sharding.sequence_positions`), read outside any ``FakeTensorMode``.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return _block_of(q_pos, k_pos, causal, valid_len, starts)


def _block_of(
    q_pos: Tensor, k_pos: Tensor, causal: bool, valid_len: Optional[int], starts: Optional[Tensor]
) -> Optional[_Block]:
    row_end = len(q_pos) if valid_len is None else int((q_pos < valid_len).sum())
    col_end = len(k_pos) if valid_len is None else int((k_pos < valid_len).sum())
    if row_end == 0 or col_end == 0:
        return None
    if starts is not None:
        documents = _Documents(q_pos[:row_end], k_pos[:col_end], starts[:, :row_end])
        box = _document_box(documents, 0, row_end)
        return None if box is None else _Block(*box, None, documents)
    if not causal:
        return _Block(0, row_end, 0, col_end, None)
    # Keys after the last attending query are never attended; queries before the first key attend none.
    col_end = min(col_end, int(torch.searchsorted(k_pos, q_pos[row_end - 1], right=True)))
    row_start = int(torch.searchsorted(q_pos, k_pos[0]))
    if col_end == 0 or row_start >= row_end:
        return None
    # Both sorted: every pair attends when the first attending query comes at or after the last key.
    every_pair = bool(q_pos[row_start] >= k_pos[col_end - 1])
    return _Block(row_start, row_end, 0, col_end, None if every_pair else (q_pos, k_pos))


def _document_box(documents: _Documents, row_start: int, row_end: int) -> Optional[tuple[int, int, int, int]]:
    """The smallest box of rows ``[row_start, row_end)`` x keys in which queries attend their documents' keys.

    Query ``i`` of row ``b`` attends the keys from ``starts[b, i]`` to its own position; returns
    ``(first row, last row + 1, first key, last key + 1)``, or ``None`` when no query attends any key.
    """
    q_pos, starts = documents.q_pos[row_start:row_end], documents.starts[:, row_start:row_end]
    first = torch.searchsorted(documents.k_pos, starts.contiguous())
    last = torch.searchsorted(documents.k_pos, q_pos, right=True).expand_as(first)
    attends = last > first
    rows = attends.any(0).nonzero().flatten()
    if rows.numel() == 0:
        return None
    cols = int(first[attends].min()), int(last[attends].max())
    return row_start + int(rows[0]), row_start + int(rows[-1]) + 1, *cols


def _document_mask(documents: _Documents, rows: slice, cols: slice) -> Optional[Tensor]:
    """``[batch, 1, 1, rows, cols]`` (broadcast over heads): key at or after the query's document start, and causal."""
    keys = documents.k_pos[None, None, cols]
    mask = (keys >= documents.starts[:, rows, None]) & (keys <= documents.q_pos[rows, None])
    return None if bool(mask.all()) else mask[:, None, None]


#: A packed tile takes the next document in while its box stays within this many times the pairs its queries attend:
#: fewer, larger tiles for short documents (each tile has a fixed cost), at most twice their area.
_DOCUMENT_WASTE = 2.0
#: The same bound for a masked fused call (:func:`block_pieces` with ``masked``): the kernel's fixed cost per call is
#: small against a pure-torch tile's, and it computes its whole box, so boxes are kept closer to their pairs (a
#: 512-key window's band at S 4096, cp 2: 28 masked calls per rank computing 1.17x its pairs, not 7 computing 1.96x).
_MASKED_WASTE = 1.25

#: Elements of one score-sized temporary (``batch x heads x rows x keys``) that ring attention aims at.
_SCORE_ELEMENTS = 1 << 22


def _tile_starts(row_start: int, row_end: int, tile: int) -> range:
    """The first row of each query-row tile of ``[row_start, row_end)`` (the planner's dry run keeps only the
    last full tile, the widest: :func:`lightning_plugins.planner.fake_step.one_row_tile_only`)."""
    return range(row_start, row_end, tile)


def row_tiles(
    block: _Block, query_tile: Optional[int], batch_heads: int, waste: float = _DOCUMENT_WASTE
) -> Iterator[tuple[slice, slice, Optional[Tensor]]]:
    """Query-row tiles of an active block: (rows, keys, mask), the keys relative to the block's first key.

    Rows are independent in attention, so a block is computed a tile at a time: the probabilities of
    one tile against the block's keys are the largest temporaries, whatever the local length. A causal
    tile stops at the last key its last query attends (the masked triangle of a diagonal block is skipped
    a tile at a time); packed rows are tiled by document (:func:`_document_tiles`, boxes within ``waste`` times
    their pairs). Masks are built per tile.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    width = block.col_end - block.col_start
    tile = query_tile or max(1, _SCORE_ELEMENTS // (batch_heads * width))
    if block.documents is not None:
        # A packed or windowed tile is boxed to its own keys, usually far fewer than the block's: without a fixed
        # query_tile its rows grow while the box stays within the score budget (a 1024-key window over a 16K-key
        # block: ~200-row tiles, not 16-row ones; 25x fewer tiles, each still under the budget).
        budget = None if query_tile else max(tile * width, _SCORE_ELEMENTS // batch_heads)
        with unset_fake_temporarily():
            for rows, cols in _document_tiles(block.documents, block.row_start, block.row_end, tile, budget, waste):
                mask = _document_mask(block.documents, rows, cols)
                yield rows, slice(cols.start - block.col_start, cols.stop - block.col_start), mask
        return
    for start in _tile_starts(block.row_start, block.row_end, tile):
        stop = min(start + tile, block.row_end)
        if block.causal is None:
            yield slice(start, stop), slice(0, width), None
            continue
        with unset_fake_temporarily():  # positions are real tensors, also in the planner's dry run
            yield _causal_tile(block.causal, start, stop, width)


def _causal_tile(
    causal: tuple[Tensor, Tensor], start: int, stop: int, width: int
) -> tuple[slice, slice, Optional[Tensor]]:
    """Causal rows ``[start, stop)`` boxed to the keys up to the last one their last query attends, with their mask."""
    q_pos, k_pos = causal
    cols = min(width, int(torch.searchsorted(k_pos, q_pos[stop - 1], right=True)))
    every_pair = bool(q_pos[start] >= k_pos[cols - 1])
    return slice(start, stop), slice(0, cols), None if every_pair else q_pos[start:stop, None] >= k_pos[None, :cols]


def _document_tiles(
    documents: _Documents,
    row_start: int,
    row_end: int,
    tile: int,
    budget: Optional[int] = None,
    waste: float = _DOCUMENT_WASTE,
) -> Iterator[tuple[slice, slice]]:
    """Tiles of packed rows ``[row_start, row_end)``: (rows, keys), whole documents per tile, each boxed to its keys.

    Rows are cut where a query's first attended key changes (a document begins, in any row of the batch: a tile
    boxes the union; under a sliding window, every row), and a document longer than ``tile`` rows into tiles of
    ``tile`` rows. Consecutive pieces then merge while the tile stays within ``tile`` rows (or, given ``budget``,
    its box within ``budget`` query-key pairs) and its box within ``waste`` times the pairs attended; rows that
    attend no key of this block are skipped.
    """
    q_pos, starts = documents.q_pos[row_start:row_end], documents.starts[:, row_start:row_end]
    # Sorted positions: a row's first attended key never decreases along the rows, nor does its last.
    first = torch.searchsorted(documents.k_pos, starts.contiguous()).amin(0)
    last = torch.searchsorted(documents.k_pos, q_pos, right=True)
    attends = last > first
    begins = torch.ones_like(attends)
    begins[1:] = (first[1:] != first[:-1]) | (attends[1:] != attends[:-1])
    cuts = begins.nonzero().flatten().tolist() + [len(q_pos)]
    first_at, last_at, attends_at = first.tolist(), last.tolist(), attends.tolist()
    held: Optional[list[int]] = None  # the tile being grown: [first row, end row, first key, attended pairs]
    for begin, end in zip(cuts[:-1], cuts[1:]):
        if not attends_at[begin]:
            continue
        for lo in range(begin, end, tile):
            hi = min(lo + tile, end)
            pairs = sum(last_at[lo:hi]) - first_at[lo] * (hi - lo)
            if held is not None and held[1] == lo:
                area = (hi - held[0]) * (last_at[hi - 1] - held[2])
                small = hi - held[0] <= tile if budget is None else area <= budget
                if small and area <= waste * (held[3] + pairs):
                    held[1], held[3] = hi, held[3] + pairs
                    continue
            if held is not None:
                yield slice(row_start + held[0], row_start + held[1]), slice(held[2], last_at[held[1] - 1])
            held = [lo, hi, first_at[lo], pairs]
    if held is not None:
        yield slice(row_start + held[0], row_start + held[1]), slice(held[2], last_at[held[1] - 1])


class FusedCall(NamedTuple):
    """A piece of a block that one call of a fused kernel computes (:mod:`.fused`): query rows x keys (relative to the
    block's first key) where every pair attends, or, ``causal``, a square whose ``i``-th row attends its keys ``0..i``,
    or, with a ``mask`` (a tile's, see :func:`row_tiles`), the box's pairs the mask allows, or, ``causal`` and
    ``reverse``, a square whose ``i``-th row attends its keys ``i..`` (a causal square with rows and keys reversed)."""

    rows: slice
    cols: slice
    causal: bool
    mask: Optional[Tensor] = None
    reverse: bool = False


#: A tile of the pure-torch fallback: (rows, keys relative to the block's first key, mask or ``None``).
Tile = tuple[slice, slice, Optional[Tensor]]

#: How ring attention computes a part of a block: a fused call, a band's masked call, or a pure-torch tile.
Piece = Union[FusedCall, BandCall, Tile]

#: Packed rows: a run of rows goes to the fused kernel when at least this many rows share their first key (one
#: document's rows); shorter runs (short documents, a sliding window's band, whose first key moves every row) go to the
#: pure-torch tiles, which take many of them in one tile instead of one kernel call each.
MIN_FUSED_ROWS = 32


def block_pieces(
    block: _Block, query_tile: Optional[int], batch_heads: int, fused: bool, masked: bool = False
) -> list[tuple[slice, Piece]]:
    """How ring attention computes one active block: (batch rows, piece), each piece a :class:`FusedCall` for the
    fused kernel or a :data:`Tile` of :func:`row_tiles` for the pure-torch fallback.

    In a block, each query row attends a contiguous range of keys (sorted positions; from its document's start or
    window's first key, when there is one, to its own position). Runs of rows whose ranges share a first key and
    whose last key stays put (a fully visible box) or moves one key a row (a causal square, with a fully visible box
    before it) are fused calls: a diagonal block of the load-balanced layout is one causal call, an off-diagonal one
    a full call per step of its staircase. What the fused kernel cannot express falls back to the tiles: every block
    when not ``fused`` (no fused kernel for the device or dtype, or soft-capping), and the rows of a sliding window's
    band or of short documents (under :data:`MIN_FUSED_ROWS`). With ``masked`` (the kernel takes a mask,
    :func:`~.fused.takes_masks`) those tiles are fused calls too, each with its tile's mask, so no block of an
    unsoft-capped attention is left to pure torch. Rows packed differently in each batch row are planned one batch
    row at a time.
    """
    if not fused:
        return [(slice(None), tile) for tile in row_tiles(block, query_tile, batch_heads)]
    if block.documents is None and block.causal is None:
        return [(slice(None), FusedCall(slice(block.row_start, block.row_end), slice(0, _width(block)), False))]
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    pieces: list[tuple[slice, Piece]] = []
    waste = _MASKED_WASTE if masked else _DOCUMENT_WASTE
    with unset_fake_temporarily():  # positions are real tensors, also in the planner's dry run
        planned = [(batch, sub, _fused_calls(sub, masked)) for batch, sub in _batch_blocks(block)]
    for batch, sub, (calls, tile_rows) in planned:
        shift = sub.col_start - block.col_start  # the sub-block's keys relative to the block's first key
        for call in calls:
            pieces.append((batch, call._replace(cols=_shifted(call.cols, shift))))
        for start, stop in tile_rows:
            sub_rows = sub._replace(row_start=start, row_end=stop)
            for rows, cols, mask in row_tiles(sub_rows, query_tile, batch_heads, waste):
                cols = _shifted(cols, shift)
                pieces.append((batch, FusedCall(rows, cols, False, mask) if masked else (rows, cols, mask)))
    return pieces


def _width(block: _Block) -> int:
    return block.col_end - block.col_start


def _shifted(cols: slice, shift: int) -> slice:
    return slice(cols.start + shift, cols.stop + shift)


def _batch_blocks(block: _Block) -> list[tuple[slice, _Block]]:
    """The block for all batch rows at once, or, when its batch rows are packed differently, one per batch row
    (boxed to that row's documents, ``None`` boxes dropped)."""
    documents = block.documents
    if documents is None or documents.starts.shape[0] == 1 or bool((documents.starts == documents.starts[:1]).all()):
        return [(slice(None), block)]
    subs = []
    for b in range(documents.starts.shape[0]):
        own = documents._replace(starts=documents.starts[b : b + 1])
        box = _document_box(own, block.row_start, block.row_end)
        if box is not None:
            subs.append((slice(b, b + 1), _Block(*box, None, own)))
    return subs


def _key_ranges(block: _Block) -> tuple[Tensor, Tensor]:
    """Per row of the block: the first key it attends and one past its last, relative to the block's first key (a row
    attending nothing has ``last <= first``)."""
    rows = slice(block.row_start, block.row_end)
    if block.documents is None:
        assert block.causal is not None
        q_pos, k_pos = block.causal
        last = torch.searchsorted(k_pos, q_pos[rows], right=True).clamp(max=block.col_end)
        return torch.zeros_like(last), last - block.col_start
    q_pos, k_pos, starts = block.documents
    first = torch.searchsorted(k_pos, starts[:, rows].contiguous())[0]
    last = torch.searchsorted(k_pos, q_pos[rows], right=True)
    return first.clamp(min=block.col_start) - block.col_start, last.clamp(max=block.col_end) - block.col_start


def _staircase(first: Tensor, last: Tensor) -> list[tuple[int, int, int]]:
    """Runs ``[a, b)`` of rows (relative to the first) with one first key and a last key that stays put (kind 0), moves
    one key a row (kind 1), a band whose first and last keys both move one key a row (kind 2: a sliding window), or
    none of these (kind -1; a single row is kind 0)."""
    if len(first) == 1:
        return [(0, 1, 0)]
    step, first_step = last[1:] - last[:-1], first[1:] - first[:-1]
    code = torch.where((first_step == 0) & (step <= 1), step, -1)
    code = torch.where((first_step == 1) & (step == 1), 2, code)
    values, counts = torch.unique_consecutive(code, return_counts=True)
    runs: list[tuple[int, int, int]] = []
    start, row, kind = 0, 0, 0  # the open run: rows [start, row]; kind of its steps (0 while it has none)
    for value, count in zip(values.tolist(), counts.tolist()):
        if value >= 0 and (row == start or kind == value):
            row, kind = row + count, value
        elif value >= 0:  # the other kind: the open run ends at `row`, the next begins after it
            runs.append((start, row + 1, kind))
            start, row, kind = row + 1, row + count, value if count > 1 else 0
        else:  # no staircase between these rows: one run of them
            runs.append((start, row + 1, kind))
            if count > 1:
                runs.append((row + 1, row + count, -1))
            start, row, kind = row + count, row + count, 0
    runs.append((start, row + 1, kind))
    return runs


def _fused_calls(block: _Block, masked: bool = False) -> tuple[list[FusedCall | BandCall], list[tuple[int, int]]]:
    """The block's fused calls, and the row ranges (absolute) left to the tiles: see :func:`block_pieces`."""
    first_t, last_t = _key_ranges(block)
    first, last = first_t.tolist(), last_t.tolist()
    calls, tile_rows = [], []
    for a, b, kind in _staircase(first_t, last_t):
        narrow = kind == 2 and last[a] - first[a] < MIN_FUSED_ROWS  # e.g. one-token documents: a call per row
        if kind < 0 or narrow or (block.documents is not None and b - a < MIN_FUSED_ROWS):
            if tile_rows and tile_rows[-1][1] == block.row_start + a:
                tile_rows[-1] = (tile_rows[-1][0], block.row_start + b)
            else:
                tile_rows.append((block.row_start + a, block.row_start + b))
            continue
        lo = first[a]
        if kind == 2:
            band = _masked_band_calls if masked else _band_calls
            calls += band(block.row_start + a, b - a, lo, last[a] - lo, *([_band_keys(block)] if masked else []))
            continue
        if kind == 1 and last[a] <= lo:
            a += 1  # its first row attends nothing; the rest each attend one key more
        if a >= b or last[a] <= lo:
            continue
        rows = slice(block.row_start + a, block.row_start + b)
        if kind == 0:
            calls.append(FusedCall(rows, slice(lo, last[a]), False))
            continue
        diagonal = last[a] - 1  # the key the run's first row attends last: the causal square starts there
        if diagonal > lo:
            calls.append(FusedCall(rows, slice(lo, diagonal), False))
        calls.append(FusedCall(rows, slice(diagonal, diagonal + b - a), True))
    return (_strided_boxes(calls, _band_keys(block)) if masked else calls), tile_rows


def _band_calls(row: int, count: int, first: int, width: int) -> list[FusedCall]:
    """Fused calls of a band: rows ``[row, row + count)`` where row ``row + i`` attends keys ``[first + i, first + i +
    width)``. Each chunk of at most ``width`` rows is a reversed causal square (row ``i`` attends the chunk's first
    keys from ``i`` on), a full box, and a causal square one key to the right of its diagonal: exactly the band's
    pairs, no mask."""
    calls = []
    for start in range(0, count, width):
        n, lo = min(width, count - start), first + start
        rows = slice(row + start, row + start + n)
        calls.append(FusedCall(rows, slice(lo, lo + n), True, reverse=True))
        if width > n:
            calls.append(FusedCall(rows, slice(lo + n, lo + width), False))
        if n > 1:
            calls.append(FusedCall(slice(rows.start + 1, rows.stop), slice(lo + width, lo + width + n - 1), True))
    return calls


#: Keys a batched call's windows may hold together (:class:`~.bands.BandCall`), at least: the kernel's dK/dV of the
#: windows are that large (16K keys of 8 heads of 128 in bf16: 32 MiB). A block's own key count when larger.
BAND_KEYS = 1 << 14


def _band_keys(block: _Block) -> int:
    return max(BAND_KEYS, _width(block))


#: Rows of a chunk of a sliding window's band in its masked call (:mod:`.bands`): the box a row computes is
#: ``width + BAND_ROWS - 1`` keys; 32-128 measured alike at a 256-512-key window (RESULTS.md, issue 48).
BAND_ROWS = 64


def _masked_band_calls(row: int, count: int, first: int, width: int, keys: int) -> list[FusedCall | BandCall]:
    """A band (rows as in :func:`_band_calls`) for a kernel that takes masks: its whole chunks of :data:`BAND_ROWS`
    rows in :class:`~.bands.BandCall` s of as many chunks as keep their windows' keys within ``keys``
    (:data:`BAND_KEYS` or the block's: the kernel's dK/dV of the windows stay that small), the rest in one masked
    call."""
    span = BAND_ROWS + width - 1
    per_call = max(1, keys // span) * BAND_ROWS
    whole = count // BAND_ROWS * BAND_ROWS
    calls: list[FusedCall | BandCall] = []
    for start in range(0, whole, per_call):
        rows = slice(row + start, row + min(whole, start + per_call))
        cols = slice(first + start, first + start + (rows.stop - rows.start) + width - 1)
        calls.append(BandCall(rows, cols, BAND_ROWS, BAND_ROWS, span, width))
    if count > whole:
        n, lo = count - whole, first + whole
        rows, cols = slice(row + whole, row + count), slice(lo, lo + n + width - 1)
        calls.append(FusedCall(rows, cols, False, band_mask(n, width)))
    return calls


def _strided_boxes(calls: list[FusedCall | BandCall], keys: int) -> list[FusedCall | BandCall]:
    """Consecutive fully visible calls of one shape, rows adjoining and keys a constant step apart (a window's
    staircase off the diagonal), as one :class:`~.bands.BandCall` without a mask: one kernel call for as many as keep
    their boxes' keys within ``keys`` (as :func:`_masked_band_calls`)."""
    out: list[FusedCall | BandCall] = []
    run: list[FusedCall] = []

    def close() -> None:
        if len(run) > 1:
            head = run[0]
            chunk, span = head.rows.stop - head.rows.start, head.cols.stop - head.cols.start
            step = run[1].cols.start - head.cols.start
            rows, cols = slice(head.rows.start, run[-1].rows.stop), slice(head.cols.start, run[-1].cols.stop)
            out.append(BandCall(rows, cols, chunk, step, span))
        else:
            out.extend(run)
        run.clear()

    for call in calls:
        if isinstance(call, FusedCall) and not call.causal and call.mask is None:
            span = call.cols.stop - call.cols.start
            if run and _continues(run, call) and (len(run) + 1) * span <= keys:
                run.append(call)
                continue
            close()
            run.append(call)
            continue
        close()
        out.append(call)
    close()
    return out


def _continues(run: list[FusedCall], call: FusedCall) -> bool:
    """Whether ``call`` extends ``run``: same shape, rows right after, keys one more step on (a positive step)."""
    last = run[-1]
    same = (call.rows.stop - call.rows.start, call.cols.stop - call.cols.start) == (
        last.rows.stop - last.rows.start,
        last.cols.stop - last.cols.start,
    )
    step = call.cols.start - last.cols.start
    steady = step > 0 and (len(run) == 1 or step == last.cols.start - run[-2].cols.start)
    return same and call.rows.start == last.rows.stop and steady
