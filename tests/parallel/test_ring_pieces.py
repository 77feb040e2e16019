"""Which path ring attention computes each block by (:func:`block_pieces`), and that the pieces are exact.

The pieces of every active block, fused calls (a fully visible box, a causal square, a reversed one, or, where the
kernel takes a mask, a box and its mask) and pure-torch tiles (a box and its mask), must cover exactly the (query,
key) pairs attention attends, each once: the kernel parity world (``test_context_kernels.py``) checks the numbers,
this checks the partition, quickly and over wider layouts.
"""

from __future__ import annotations

import pytest
import torch

from lightning_plugins.parallel.context.bands import BandCall
from lightning_plugins.parallel.context.fused import CPU_KERNEL, CUDA_KERNEL, fused_kernel_for, takes_masks
from lightning_plugins.parallel.context.ring import _first_keys
from lightning_plugins.parallel.context.sharding import sequence_positions
from lightning_plugins.parallel.context.tiles import MIN_FUSED_ROWS, FusedCall, active_block, block_pieces


def _documents(lengths_per_row: list[list[int]]) -> torch.Tensor:
    rows = []
    for lengths in lengths_per_row:
        begins = torch.tensor([0, *lengths[:-1]]).cumsum(0)
        rows.append(torch.repeat_interleave(begins, torch.tensor(lengths)))
    return torch.stack(rows)


def _coverage(
    seq: int,
    cp: int,
    load_balanced: bool = True,
    causal: bool = True,
    valid_len: int | None = None,
    starts: torch.Tensor | None = None,
    window: int | None = None,
    fused: bool = True,
    masked: bool = False,
) -> tuple[int, int]:
    """Checks every rank's pieces against the mask; returns (fused calls, tiles) over all ranks and blocks."""
    batch = 1 if starts is None else starts.shape[0]
    index = torch.arange(seq)
    allowed = torch.ones(batch, seq, seq, dtype=torch.bool)
    if causal:
        allowed &= index[None, :] <= index[:, None]
    if starts is not None:
        allowed &= index[None, None, :] >= starts[:, :, None]
    if window is not None:
        allowed &= index[None, :] > index[:, None] - window
    if valid_len is not None:
        allowed &= (index[:, None] < valid_len) & (index[None, :] < valid_len)
    calls = tiles = 0
    for rank in range(cp):
        q_pos = sequence_positions(seq, rank, cp, load_balanced)
        first = _first_keys(q_pos, None if starts is None else starts[:, q_pos], window)
        for source in range(cp):
            k_pos = sequence_positions(seq, source, cp, load_balanced)
            covered = torch.zeros(batch, len(q_pos), len(k_pos), dtype=torch.long)
            block = active_block(q_pos, k_pos, causal, valid_len, first)
            for rows_of, piece in [] if block is None else block_pieces(block, None, 1, fused, masked):
                cov = covered[rows_of]
                if isinstance(piece, BandCall):
                    assert masked, piece  # one masked call for the band's chunks: only where the kernel takes masks
                    calls += 1
                    for rows, cols, mask in piece.chunks():
                        cov[:, rows, _offset(cols, block.col_start)] += mask.long()
                elif isinstance(piece, FusedCall):
                    calls += 1
                    rows, cols = piece.rows, _offset(piece.cols, block.col_start)
                    height, width = rows.stop - rows.start, cols.stop - cols.start
                    assert not piece.causal or height == width, piece  # causal squares only: both alignments agree
                    box = torch.ones(height, width, dtype=torch.long)
                    if piece.mask is not None:
                        assert masked and not piece.causal, piece
                        box = piece.mask.reshape(-1, height, width).long()
                    if piece.reverse:
                        assert piece.causal and height == width, piece
                        box = box.triu()  # row i attends keys i..: a causal square reversed
                    cov[:, rows, cols] += box.tril() if piece.causal and not piece.reverse else box
                else:
                    tiles += 1
                    rows, cols, mask = piece
                    cols = _offset(cols, block.col_start)
                    box = torch.ones(rows.stop - rows.start, cols.stop - cols.start, dtype=torch.long)
                    cov[:, rows, cols] += box if mask is None else mask.reshape(-1, *box.shape).long()
            expected = allowed[:, q_pos][:, :, k_pos].long()
            assert torch.equal(covered, expected), (rank, source, (covered - expected).nonzero()[:5].tolist())
    return calls, tiles


def _reversed_squares(seq: int, cp: int, window: int) -> int:
    """Fused calls over all ranks and blocks that are reversed causal squares (a window's band, load-balanced)."""
    count = 0
    for rank in range(cp):
        q_pos = sequence_positions(seq, rank, cp, True)
        starts = _first_keys(q_pos, None, window)
        for source in range(cp):
            block = active_block(q_pos, sequence_positions(seq, source, cp, True), True, None, starts)
            pieces = [] if block is None else block_pieces(block, None, 1, True)
            count += sum(isinstance(piece, FusedCall) and piece.reverse for _, piece in pieces)
    return count


def _offset(cols: slice, start: int) -> slice:
    return slice(cols.start + start, cols.stop + start)


@pytest.mark.parametrize(
    ("cp", "segments"), [(1, 1), (2, 1), (4, 1), (2, 2), pytest.param(4, 2, marks=pytest.mark.slow), (1, 2)]
)
def test_causal_blocks_are_fused_calls_only(cp: int, segments: int) -> None:
    """Unpacked causal rows, both layouts: every block is fused, a diagonal block one causal call, and there are few."""
    seq = 2 * cp * (8 if segments == 1 else 64 * segments)
    for load_balanced in (True, False):
        calls, tiles = _coverage(seq, cp, load_balanced)
        assert tiles == 0
        # Head-tail layout: one call per block; segmented: a full call per step of a block's staircase.
        assert calls <= cp * cp * (1 if segments == 1 or not load_balanced else 2 * segments)
    assert _coverage(seq, cp, causal=False) == (cp * cp, 0)


@pytest.mark.parametrize("cp", (1, 2, pytest.param(4, marks=pytest.mark.slow)))
def test_pieces_cover_every_variant_exactly(cp: int) -> None:
    seq = 2 * cp * 64 * 2 + 2 * cp * 10  # two segments and a shorter one
    assert _coverage(seq, cp, valid_len=seq - 7)[1] == 0
    assert _coverage(seq, cp, causal=False, valid_len=seq - 7)[1] == 0
    # A window narrower than a block: its band rows are fused calls (reversed and plain causal squares, full boxes),
    # short runs of them (where the layout's chunks cut the band) tiles,
    assert _coverage(seq, cp, window=40)[0] > 0 and _reversed_squares(seq, cp, window=40) > 0
    # and a window narrower than MIN_FUSED_ROWS keys (a call per few rows) mostly tiles.
    assert _coverage(seq, cp, window=3)[1] > 0
    _coverage(seq, cp, window=3 * seq)  # wider than the sequence: plain causal
    # Packed rows, packed alike and differently per batch row: long documents fused, short ones tiled.
    long_and_short = [[seq // 2, 1, 5, seq - seq // 2 - 6]] * 2
    calls, tiles = _coverage(seq, cp, starts=_documents(long_and_short))
    assert calls > 0 and tiles > 0
    _coverage(seq, cp, starts=_documents([[100, 3, seq - 103], [64, 64, 128, 3, seq - 259]]))
    _coverage(seq, cp, starts=_documents([[100, 3, seq - 103], [64, 64, 128, 3, seq - 259]]), window=70)
    assert _coverage(seq, cp, starts=_documents([[seq]]), load_balanced=False, fused=False)[0] == 0


@pytest.mark.parametrize("cp", (1, 2, pytest.param(4, marks=pytest.mark.slow)))
def test_masked_kernel_leaves_nothing_to_the_tiles(cp: int) -> None:
    """Where the kernel takes a mask (CPU), window bands and short documents are masked fused calls: no tile is left."""
    seq = 2 * cp * 64 * 2 + 2 * cp * 10
    for window in (3, 40, 3 * seq):
        calls, tiles = _coverage(seq, cp, window=window, masked=True)
        assert calls > 0 and tiles == 0
    packings = ([[seq // 2, 1, 5, seq - seq // 2 - 6]] * 2, [[100, 3, seq - 103], [64, 64, 128, 3, seq - 259]])
    for rows in packings:
        for window in (None, 70):
            calls, tiles = _coverage(seq, cp, starts=_documents(rows), window=window, masked=True)
            assert calls > 0 and tiles == 0
    # fused=False (no kernel) still tiles everything, whatever `masked` says.
    assert _coverage(seq, cp, window=40, fused=False, masked=True)[0] == 0


def _band_calls(seq: int, cp: int, window: int) -> tuple[int, int]:
    """Over all ranks and blocks, the masked band calls and the unmasked staircase calls (:class:`BandCall` s)."""
    bands = staircases = 0
    for rank in range(cp):
        q_pos = sequence_positions(seq, rank, cp, True)
        starts = _first_keys(q_pos, None, window)
        for source in range(cp):
            block = active_block(q_pos, sequence_positions(seq, source, cp, True), True, None, starts)
            for _, piece in [] if block is None else block_pieces(block, None, 1, True, True):
                bands += isinstance(piece, BandCall) and piece.width is not None
                staircases += isinstance(piece, BandCall) and piece.width is None
    return bands, staircases


@pytest.mark.parametrize("cp", (1, 2, 4))
def test_window_bands_are_batched_calls_where_the_kernel_takes_masks(cp: int) -> None:
    """The kernel parity world's ``ring-window-band-calls`` case (S 1024, W 200) runs a band's whole chunks as one masked
    call (cp 1, 2) and a staircase of equal boxes as one call (cp 4), covering the window's pairs exactly."""
    bands, staircases = _band_calls(1024, cp, 200)
    assert (bands > 0, staircases > 0) == ((True, False) if cp < 4 else (False, True))
    assert _coverage(1024, cp, window=200, masked=True)[1] == 0
    # Without masks (CUDA's flash op) the band is reversed and plain causal squares, never a BandCall.
    assert _coverage(1024, cp, window=200)[0] > 0


def test_batched_calls_keep_their_windows_within_the_key_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run whose windows hold more keys than ``BAND_KEYS`` (and the block) is cut into several batched calls, each
    within it, still covering every pair once."""
    from lightning_plugins.parallel.context import tiles

    whole = sum(_band_calls(1024, cp, 200)[0] for cp in (1, 2))
    monkeypatch.setattr(tiles, "BAND_KEYS", 300)
    assert sum(_band_calls(1024, cp, 200)[0] for cp in (1, 2)) > whole
    for cp in (1, 2, 4):
        assert _coverage(1024, cp, window=200, masked=True)[1] == 0


@pytest.mark.slow
@pytest.mark.parametrize("cp", (2, 3, 4, 8))
@pytest.mark.parametrize("load_balanced", (True, False))
def test_pieces_cover_random_packings(cp: int, load_balanced: bool) -> None:
    generator = torch.Generator().manual_seed(cp)
    seq = 2 * cp * 64 * 3
    for trial in range(4):
        rows = []
        for _ in range(2):
            lengths = []
            while sum(lengths) < seq:
                high = MIN_FUSED_ROWS * (8 if trial % 2 else 2)
                lengths.append(min(int(torch.randint(1, high, (), generator=generator)), seq - sum(lengths)))
            rows.append(lengths)
        _coverage(seq, cp, load_balanced, starts=_documents(rows), valid_len=seq - trial)
        _coverage(seq, cp, load_balanced, starts=_documents(rows[:1]), window=17 + 50 * trial)
        _coverage(seq, cp, load_balanced, starts=_documents(rows), window=17 + 50 * trial, masked=True)


def test_fused_kernel_for_cpu_and_the_fallback() -> None:
    assert fused_kernel_for(torch.zeros(1, 1, 2, 8)) == CPU_KERNEL
    assert takes_masks(CPU_KERNEL) and not takes_masks(CUDA_KERNEL) and not takes_masks(None)
    assert fused_kernel_for(torch.zeros(1, 1, 2, 8, dtype=torch.bfloat16)) == CPU_KERNEL
    assert fused_kernel_for(torch.zeros(1, 1, 2, 8, dtype=torch.long)) is None
    assert fused_kernel_for(torch.zeros(1, 1, 2, 8, device="meta")) is None
