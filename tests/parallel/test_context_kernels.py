"""Context-parallel kernels against single-process SDPA on the whole sequence.

Ring attention (on its fused kernels, and on its pure-torch tiles in the ``-tiled`` cases) and Ulysses, forward and
gradients (dq, dk, dv), causal and not, MHA/GQA/MQA, the load-balanced and the contiguous layout, padded sequences,
packed rows (attention within each document, against SDPA with a block-diagonal causal mask; Ulysses through its fused
document pieces and, in the ``-per-document`` cases, one SDPA call per document), in fp64 (exact up to rounding) and
fp32.
Starting ranks is the slow part (seconds each), so a single gloo world of 4 ranks runs every case at
every cp size: cp=4 on the world, cp=2 on the two sub-groups {0, 1} and {2, 3} (whose group ranks differ
from their global ranks, as in a real cp sub-mesh), cp=1 on the one-rank groups of ranks 1-3 (each case on one of
them). The single-process references (most of the work) are computed once, each by one rank, and broadcast. Each rank
writes its measured errors to a file; the tests below assert on them, one test per case and cp size.
"""

from __future__ import annotations

import functools
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning_plugins.testing.world import run_world

from lightning_plugins.parallel.context import (
    check_ulysses_heads,
    head_to_seq,
    load_balanced_indices,
    pad_for_context_parallel,
    reorder_sequence_load_balanced,
    ring_attention,
    seq_to_head,
    shard_sequence_load_balanced,
    ulysses_attention,
    unshard_sequence_load_balanced,
)
from lightning_plugins.parallel.context.sharding import BALANCE_CHUNK, sequence_positions
from lightning_plugins.parallel.context.tiles import active_block, row_tiles

CP_SIZES = (1, 2, 4)
WORLD_SIZE = 4
BATCH, HEADS, HEAD_DIM, SEQ = 2, 8, 16, 24
PADDED_LEN = 21  # padded to 22 (cp 1), 24 (cp 2 and 4); contiguous: 21 (cp 1), 22 (cp 2), 24 (cp 4)
# fp64 leaves only rounding; fp32 is the parity level the engine promises.
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Case:
    name: str
    kernel: str  # "ring" or "ulysses"
    causal: bool
    kv_heads: int
    dtype: str = "float64"
    load_balanced: bool = True
    real_len: int | None = None  # shorter than seq: padded with pad_for_context_parallel
    pass_valid_len: bool = False
    query_tile: int | None = None  # ring only: query rows per tile (uneven last tile, masks sliced)
    fused: bool = True  # ring only: False computes every block with the pure-torch tiles (the "-tiled" cases)
    packed: bool = False  # rows of several documents (DOCUMENTS), passed as document_starts
    seq: int = SEQ  # LONG_SEQ: several segments of the load-balanced layout (LONG_DOCUMENTS when packed)
    window: int | None = None  # sliding window: query i attends keys i - window < j <= i (causal only)
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) (Gemma 2)
    sinks: bool = False  # one sink logit per head in the softmax denominator (gpt-oss), its gradient checked
    scale: float | None = None  # the model's own scaling (Gemma 2's query_pre_attn_scalar)
    packed_kernel: bool = True  # Ulysses only: False runs attn_fn per document instead of the fused document pieces


def _cases() -> list[Case]:
    cases = []
    for kernel in ("ring", "ulysses"):
        for causal in (True, False):
            mode = "causal" if causal else "full"
            for kv_heads, heads_name in ((HEADS, "mha"), (2, "gqa"), (1, "mqa")):
                cases.append(Case(f"{kernel}-{mode}-{heads_name}", kernel, causal, kv_heads))
            cases.append(Case(f"{kernel}-{mode}-gqa-fp32", kernel, causal, 2, dtype="float32"))
            cases.append(Case(f"{kernel}-{mode}-gqa-contiguous", kernel, causal, 2, load_balanced=False))
            padded = dict(real_len=PADDED_LEN, pass_valid_len=True)
            cases.append(Case(f"{kernel}-{mode}-padded", kernel, causal, 2, **padded))
            cases.append(Case(f"{kernel}-{mode}-padded-contiguous", kernel, causal, 2, load_balanced=False, **padded))
        # Causal attention needs no valid_len: real tokens never attend trailing pads.
        cases.append(Case(f"{kernel}-causal-padded-no-valid-len", kernel, True, 2, real_len=PADDED_LEN))
    for causal, mode in ((True, "causal"), (False, "full")):
        cases.append(Case(f"ring-{mode}-gqa-tiled", "ring", causal, 2, query_tile=5, fused=False))
        padded = dict(real_len=PADDED_LEN, pass_valid_len=True)
        cases.append(Case(f"ring-{mode}-padded-tiled", "ring", causal, 2, query_tile=2, fused=False, **padded))
    return cases


def _packed_cases() -> list[Case]:
    cases = []
    for kernel in ("ring", "ulysses"):
        cases.append(Case(f"{kernel}-packed", kernel, True, 2, packed=True))
        cases.append(Case(f"{kernel}-packed-contiguous", kernel, True, 2, load_balanced=False, packed=True))
        cases.append(Case(f"{kernel}-packed-fp32", kernel, True, 2, dtype="float32", packed=True))
    cases.append(Case("ring-packed-tiled", "ring", True, 2, query_tile=2, packed=True, fused=False))
    cases.append(Case("ulysses-packed-per-document", "ulysses", True, 2, packed=True, packed_kernel=False))
    cases.append(Case("ulysses-packed-long-per-document", "ulysses", True, 2, packed=True, seq=LONG_SEQ,
                      packed_kernel=False))
    for kernel in ("ring", "ulysses"):
        cases.append(Case(f"{kernel}-causal-long", kernel, True, 2, seq=LONG_SEQ))
        cases.append(Case(f"{kernel}-packed-long", kernel, True, 2, packed=True, seq=LONG_SEQ))
    cases.append(Case("ring-packed-long-tiled", "ring", True, 2, query_tile=16, packed=True, seq=LONG_SEQ, fused=False))
    cases.append(Case("ring-causal-long-padded", "ring", True, 2, seq=LONG_SEQ, real_len=LONG_SEQ - 3))
    return cases


# Document lengths of each row: rows packed differently, a one-token document, documents crossing shards.
DOCUMENTS = ((5, 7, 12), (1, 10, 3, 10))
# Longer than 2 * cp * BALANCE_CHUNK: the load-balanced layout cuts it into several segments (and a shorter last
# one); documents longer and shorter than a chunk, crossing segments.
LONG_SEQ = 1000
LONG_DOCUMENTS = ((700, 1, 299), (64, 64, 128, 3, 741))


def _variant_cases() -> list[Case]:
    """Sliding windows, soft-capping, sinks and the model's scaling: the attention of Gemma 2/3, Mistral, gpt-oss."""
    every = dict(window=WINDOW, softcap=2.0, sinks=True, scale=0.4)
    cases = []
    for kernel in ("ring", "ulysses"):
        cases.append(Case(f"{kernel}-window", kernel, True, 2, window=WINDOW))
        cases.append(Case(f"{kernel}-window-contiguous", kernel, True, 2, load_balanced=False, window=WINDOW))
        cases.append(Case(f"{kernel}-softcap", kernel, True, 2, softcap=2.0, scale=0.4))
        cases.append(Case(f"{kernel}-sinks", kernel, True, 1, sinks=True))
        cases.append(Case(f"{kernel}-every-variant-packed", kernel, True, 2, packed=True, **every))
        cases.append(Case(f"{kernel}-every-variant-fp32", kernel, True, 2, dtype="float32", **every))
    cases.append(Case("ring-window-tiled", "ring", True, 2, query_tile=2, window=WINDOW))
    cases.append(Case("ring-window-padded", "ring", True, 2, real_len=PADDED_LEN, pass_valid_len=True, window=WINDOW))
    cases.append(Case("ring-window-one-token", "ring", True, 2, window=1, sinks=True))
    cases.append(Case("ring-window-long", "ring", True, 2, seq=LONG_SEQ, window=LONG_WINDOW, softcap=2.0))
    cases.append(Case("ring-window-long-packed", "ring", True, 2, seq=LONG_SEQ, packed=True, window=LONG_WINDOW))
    # Without soft-capping, window bands and short documents run on the kernel with a mask (CPU): with sinks, MQA, fp32.
    masked = dict(window=WINDOW, sinks=True, scale=0.4)
    cases.append(Case("ring-window-sinks-packed-masked", "ring", True, 2, packed=True, **masked))
    cases.append(Case("ring-window-mqa-masked", "ring", True, 1, window=WINDOW))
    cases.append(Case("ulysses-window-sinks-packed", "ulysses", True, 2, packed=True, **masked))
    # A window wider than MIN_FUSED_ROWS keys: its band rows are reversed and plain causal squares and boxes, no mask.
    cases.append(Case("ring-window-long-bands", "ring", True, 2, seq=LONG_SEQ, window=LONG_WINDOW, sinks=True))
    cases.append(Case("ring-window-long-packed-masked-fp32", "ring", True, 2, "float32", seq=LONG_SEQ, packed=True,
                      window=LONG_WINDOW, sinks=True))
    # On CPU a band's whole 64-row chunks are one masked call (bands.BandCall, cp 1 and 2) and a window's staircase
    # of equal boxes off the diagonal one call without a mask (cp 4): see test_ring_pieces.py.
    cases.append(Case("ring-window-band-calls", "ring", True, 2, seq=BAND_SEQ, window=BAND_WINDOW, sinks=True))
    return cases


WINDOW = 5  # shorter than every shard at cp 1 and 2, longer than a load-balanced chunk at cp 4: crosses ranks
LONG_WINDOW = 90  # across chunks of the segmented load-balanced layout
BAND_SEQ, BAND_WINDOW = 1024, 200  # band runs of 64+ rows at cp 1 and 2, a staircase of equal boxes at cp 4
CASES = _cases() + _packed_cases() + _variant_cases()
BF16_CASES = [Case(f"{kernel}-causal-gqa-bf16", kernel, True, 2, dtype="bfloat16") for kernel in ("ring", "ulysses")]


# ----------------------------------------------------------------------------------------------------
# Inside the world
# ----------------------------------------------------------------------------------------------------


def _max_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.double() - expected.double()).abs().max().item()


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask=None) -> torch.Tensor:
    """One-process attention, kv heads repeated explicitly (independent of the kernels' GQA handling)."""
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _document_starts(documents: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """``[BATCH, seq]``: the index where each token's document begins."""
    rows = []
    for lengths in documents:
        assert sum(lengths) == sum(documents[0])
        begins = torch.tensor([0, *lengths[:-1]]).cumsum(0)
        rows.append(torch.repeat_interleave(begins, torch.tensor(lengths)))
    return torch.stack(rows)


def _document_mask(starts: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal ``[batch, 1, seq, seq]``: query i attends keys from its document's start to i."""
    index = torch.arange(starts.shape[-1])
    return ((index[None, None, :] >= starts[:, :, None]) & (index[None, None, :] <= index[None, :, None]))[:, None]


def _eager(q, k, v, mask: torch.Tensor, case: Case, sinks: torch.Tensor | None) -> torch.Tensor:
    """One-process eager attention with soft-capping, a boolean mask and sinks, as transformers' eager kernels."""
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) * (case.scale or q.shape[-1] ** -0.5)
    if case.softcap is not None:
        scores = case.softcap * torch.tanh(scores / case.softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
    return (torch.softmax(scores, dim=-1)[..., : k.shape[2]]) @ v


def _reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad: torch.Tensor,
    causal: bool,
    valid: int,
    mask=None,
    case: Case | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """SDPA (eager for the attention variants) on the whole unpadded sequence: out, dq, dk, dv (zero-padded back to
    the padded length), and the sinks' gradient when there are sinks."""
    length = q.shape[2]
    q, k, v = (t[:, :, :valid].detach().requires_grad_() for t in (q, k, v))
    variant = case is not None and (case.window or case.softcap or case.sinks or case.scale)
    if variant:
        index = torch.arange(valid)
        allowed = (index[None, :] <= index[:, None]) & (index[None, :] > index[:, None] - (case.window or valid))
        mask = allowed if mask is None else mask[..., :valid, :valid] & allowed
        out = _eager(q, k, v, mask, case, sinks)
    else:
        out = _sdpa(q, k, v, causal, mask)
    out.backward(grad[:, :, :valid])
    grads = tuple(F.pad(t, (0, 0, 0, length - valid)) for t in (out.detach(), q.grad, k.grad, v.grad))
    return grads if sinks is None else (*grads, sinks.grad)


def _seq_at(case: Case, cp: int) -> int:
    """The case's sequence length at ``cp``: its real length padded as pad_for_context_parallel pads it."""
    valid = case.real_len or case.seq
    if valid == case.seq:
        return case.seq
    ids = torch.zeros(1, valid, dtype=torch.long)
    return pad_for_context_parallel(ids, None, None, cp, pad_id=0, load_balanced=case.load_balanced).input_ids.shape[-1]


def _inputs(case: Case, seq: int) -> tuple[torch.Tensor, ...]:
    """q, k, v, the output's gradient, the document starts and the sinks (None if unused): the same on every rank."""
    torch.manual_seed(0)
    dtype = DTYPES[case.dtype]
    q = torch.randn(BATCH, HEADS, seq, HEAD_DIM, dtype=torch.float64)
    k, v = (torch.randn(BATCH, case.kv_heads, seq, HEAD_DIM, dtype=torch.float64) for _ in range(2))
    grad = torch.randn(BATCH, HEADS, seq, HEAD_DIM, dtype=torch.float64)
    grad[:, :, case.real_len or case.seq :] = 0  # a loss with ignored pad labels sends no gradient into pad rows
    q, k, v, grad = (t.to(dtype) for t in (q, k, v, grad))
    starts = _document_starts(DOCUMENTS if case.seq == SEQ else LONG_DOCUMENTS) if case.packed else None
    sinks = torch.randn(HEADS, dtype=torch.float64).to(dtype) if case.sinks else None
    return q, k, v, grad, starts, sinks


def _case_reference(case: Case, seq: int) -> tuple[torch.Tensor, ...]:
    """:func:`_reference` of the case's inputs: bf16 is judged against the exact answer (fp64 reference), the others
    against SDPA in their dtype."""
    q, k, v, grad, starts, sinks = _inputs(case, seq)
    ref_dtype = torch.float64 if case.dtype == "bfloat16" else DTYPES[case.dtype]
    mask = None if starts is None else _document_mask(starts)
    ref_sinks = None if sinks is None else sinks.to(ref_dtype).requires_grad_()
    return _reference(*(t.to(ref_dtype) for t in (q, k, v, grad)), case.causal, case.real_len or case.seq, mask, case,
                      ref_sinks)  # fmt: skip


def _shared_references(rank: int, world_size: int) -> dict[tuple[str, int], tuple[torch.Tensor, ...]]:
    """Every case's reference at every sequence length it runs at, each computed by one rank and broadcast: the
    reference does not depend on the rank or on cp, and computing it is most of the world's work."""
    # Longest first, dealt in turn: the ranks' shares of the work come out about even.
    keys = sorted({(case, _seq_at(case, cp)) for cp in CP_SIZES for case in CASES + BF16_CASES},
                  key=lambda key: (-key[1], key[0].name))  # fmt: skip
    own = {key: tuple(t.contiguous() for t in _case_reference(*key))
           for index, key in enumerate(keys) if index % world_size == rank}  # fmt: skip
    references = {}
    for index, (case, seq) in enumerate(keys):
        if (case, seq) in own:
            reference = own[case, seq]
        else:  # tensors of the reference's shapes and dtypes, filled by the broadcast
            reference = tuple(torch.empty_like(t) for t in _reference_like(case, seq))
        for tensor in reference:
            dist.broadcast(tensor, src=index % world_size)
        references[case.name, seq] = reference
    return references


def _reference_like(case: Case, seq: int) -> tuple[torch.Tensor, ...]:
    """Tensors shaped as :func:`_case_reference`'s: out, dq, dk, dv (and dsinks)."""
    q, k, _, _, _, sinks = _inputs(case, seq)
    ref_dtype = torch.float64 if case.dtype == "bfloat16" else DTYPES[case.dtype]
    like = (q, q, k, k) if sinks is None else (q, q, k, k, sinks)
    return tuple(t.to(ref_dtype) for t in like)


def _run_case(case: Case, group: dist.ProcessGroup, ref: tuple[torch.Tensor, ...]) -> dict[str, float]:
    """The kernel on ``group`` against ``ref`` (:func:`_case_reference` of the case at this cp's length)."""
    cp = dist.get_world_size(group)
    cp_rank = dist.get_rank(group)
    dtype = DTYPES[case.dtype]
    seq = _seq_at(case, cp)
    valid = case.real_len or case.seq
    q, k, v, grad, starts, sinks = _inputs(case, seq)

    if case.load_balanced:
        positions = load_balanced_indices(seq, cp_rank, cp)
        shard = functools.partial(shard_sequence_load_balanced, dim=2, cp_rank=cp_rank, cp_size=cp)
    else:
        positions = sequence_positions(seq, cp_rank, cp, load_balanced=False)
        shard = lambda t: t.chunk(cp, dim=2)[cp_rank]  # noqa: E731
    local = [shard(t).detach().requires_grad_() for t in (q, k, v)]
    if case.kernel == "ring":
        kernel = functools.partial(ring_attention, query_tile=case.query_tile, fused=case.fused)
    else:
        kernel = functools.partial(ulysses_attention, packed_kernel=case.packed_kernel)
    valid_len = valid if case.pass_valid_len else None
    if starts is not None:
        kernel = functools.partial(kernel, document_starts=shard(starts[:, None])[:, 0])
    if sinks is not None:
        sinks.requires_grad_()
        kernel = functools.partial(kernel, sinks=sinks)
    variants = dict(window=case.window, softcap=case.softcap, scale=case.scale)
    kernel = functools.partial(kernel, **{name: value for name, value in variants.items() if value is not None})
    out = kernel(*local, group, causal=case.causal, load_balanced=case.load_balanced, valid_len=valid_len)
    out.backward(shard(grad))

    real = positions < valid
    errors = {}
    for name, actual, expected in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in local)), ref):
        assert actual.shape == local[0].shape if name in ("out", "dq") else actual.shape == local[1].shape
        errors[name] = _max_err(actual[:, :, real], shard(expected)[:, :, real])
    if sinks is not None:
        # Each rank holds its queries' share of the sinks' gradient; summed over the group, the whole one.
        dist.all_reduce(sinks.grad, group=group)
        errors["dsinks"] = _max_err(sinks.grad, ref[4])
    if case.pass_valid_len:
        errors["pad_out"] = out[:, :, ~real].abs().sum().item()  # documented: pad rows output zero
    if dtype == torch.bfloat16:
        # What one process gets in bf16: the bar for the kernel's own rounding.
        errors["sdpa_out"] = _max_err(shard(_sdpa(q, k, v, case.causal))[:, :, real], shard(ref[0])[:, :, real])
    return errors


def _run_ulysses_layout_checks(group: dist.ProcessGroup) -> dict[str, float]:
    """seq_to_head/head_to_seq against the full tensor: content, round trip, and both backwards."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(1)
    full, full_grad = torch.randn(2, BATCH, HEADS, SEQ, HEAD_DIM, dtype=torch.float64)
    heads = slice(rank * HEADS // cp, (rank + 1) * HEADS // cp)

    x = shard_sequence_load_balanced(full, 2, rank, cp).requires_grad_()
    head_sharded = seq_to_head(x, group)
    # The gathered sequence is in rank order: natural order after unsharding.
    checks = {"seq_to_head": _max_err(unshard_sequence_load_balanced(head_sharded, 2, cp), full[:, heads])}
    back = head_to_seq(head_sharded, group)
    checks["round_trip"] = _max_err(back, x)
    # Backward of seq_to_head: the upstream gradient of this rank's head slice, in rank order, must come
    # back as the gradient of this rank's sequence shard over all heads.
    head_sharded.backward(reorder_sequence_load_balanced(full_grad[:, heads], 2, cp))
    checks["seq_to_head_backward"] = _max_err(x.grad, shard_sequence_load_balanced(full_grad, 2, rank, cp))

    y = reorder_sequence_load_balanced(full[:, heads], 2, cp).requires_grad_()
    seq_sharded = head_to_seq(y, group)
    checks["head_to_seq"] = _max_err(seq_sharded, shard_sequence_load_balanced(full, 2, rank, cp))
    seq_sharded.backward(shard_sequence_load_balanced(full_grad, 2, rank, cp))
    checks["head_to_seq_backward"] = _max_err(y.grad, reorder_sequence_load_balanced(full_grad[:, heads], 2, cp))

    # cp + 1 heads: cp > 1 cannot split them and must fail before any collective, identically on every
    # rank (no hang); cp = 1 splits anything and must not fail.
    odd_heads = torch.zeros(1, cp + 1, 2 * cp, 4)
    try:
        ulysses_attention(odd_heads, odd_heads, odd_heads, group)
        checks["indivisible_heads_raised"] = 0.0
    except ValueError:
        checks["indivisible_heads_raised"] = 1.0
    return checks


def _cp_group(rank: int, world_size: int, cp: int) -> dist.ProcessGroup:
    """The group of ``cp`` consecutive ranks that holds ``rank``."""
    # Every rank must create every group, in the same order.
    groups = [dist.new_group(list(range(start, start + cp))) for start in range(0, world_size, cp)]
    return groups[rank // cp]


def _world(rank: int, world_size: int, out_dir: str) -> None:
    references = _shared_references(rank, world_size)
    results = {}
    for cp in CP_SIZES:
        group = _cp_group(rank, world_size, cp)
        cases = CASES + BF16_CASES
        if cp == 1:  # one-rank groups all compute the same: each case once, on a rank whose group rank is not its own
            cases = cases[rank - 1 :: world_size - 1] if rank else []
        results[cp] = {case.name: _run_case(case, group, references[case.name, _seq_at(case, cp)]) for case in cases}
        results[cp]["ulysses-layout"] = _run_ulysses_layout_checks(group)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@functools.cache
def _world_results() -> dict[int, dict[str, dict[str, float]]]:
    """Per cp size, every case's errors: the worst over all ranks."""
    with tempfile.TemporaryDirectory() as out_dir:
        run_world(_world, WORLD_SIZE, out_dir)
        per_rank = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    worst: dict[int, dict[str, dict[str, float]]] = {cp: {} for cp in CP_SIZES}
    for cp in CP_SIZES:
        for ran in per_rank:  # at cp=1 each case ran on one rank; at cp 2 and 4 on every rank
            for name, errors in ran[str(cp)].items():
                case = worst[cp].setdefault(name, {})
                case.update({key: max(value, case.get(key, value)) for key, value in errors.items()})
    return worst


# ----------------------------------------------------------------------------------------------------
# Distributed tests
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("cp", CP_SIZES)
def test_kernel_matches_sdpa(cp: int, case: Case) -> None:
    errors = _world_results()[cp][case.name]
    tolerance = TOLERANCE[DTYPES[case.dtype]]
    for name in ("out", "dq", "dk", "dv", *(("dsinks",) if case.sinks else ())):
        assert errors[name] <= tolerance, f"{case.name} cp={cp}: {name} max abs error {errors[name]:.3g}"
    if "pad_out" in errors:
        assert errors["pad_out"] == 0.0


@pytest.mark.parametrize("case", BF16_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("cp", CP_SIZES)
def test_kernel_bf16_no_worse_than_one_process(cp: int, case: Case) -> None:
    # Inputs and output are rounded to bf16 either way; with fp32 softmax statistics the kernel adds no
    # error of its own, so it must land within a rounding step of what single-process SDPA gets.
    errors = _world_results()[cp][case.name]
    assert 0 < errors["out"] <= 1.5 * errors["sdpa_out"], errors


@pytest.mark.parametrize("cp", CP_SIZES)
def test_ulysses_all_to_all_layout(cp: int) -> None:
    checks = _world_results()[cp]["ulysses-layout"]
    assert checks.pop("indivisible_heads_raised") == (1.0 if cp > 1 else 0.0)
    # Pure data movement: exact.
    assert checks == dict.fromkeys(checks, 0.0), checks


# ----------------------------------------------------------------------------------------------------
# Single-process tests
# ----------------------------------------------------------------------------------------------------


def _segmented_layout(seq: int, rank: int, cp: int) -> list[int]:
    """The load-balanced positions of ``rank``, written out: chunks r and 2cp-1-r of each segment of 2cp chunks."""
    expected, start = [], 0
    while start < seq:
        span = min(2 * cp * BALANCE_CHUNK, seq - start)
        chunk = span // (2 * cp)
        for index in (rank, 2 * cp - 1 - rank):
            expected += range(start + index * chunk, start + (index + 1) * chunk)
        start += span
    return expected


@pytest.mark.parametrize("segments", (1, 3))
@pytest.mark.parametrize("cp", (1, 2, 3, 4))
def test_load_balanced_shards_partition_and_invert(cp: int, segments: int) -> None:
    seq = 2 * cp * 3 if segments == 1 else 2 * 2 * cp * BALANCE_CHUNK + 2 * cp * 5  # two full, one shorter
    x = torch.arange(seq) * 10
    shards = [shard_sequence_load_balanced(x, 0, r, cp) for r in range(cp)]
    for r, shard in enumerate(shards):
        expected = _segmented_layout(seq, r, cp)
        if segments == 1:  # the classic head-tail split
            assert expected == [*range(r * 3, (r + 1) * 3), *range((2 * cp - 1 - r) * 3, (2 * cp - r) * 3)]
        assert load_balanced_indices(seq, r, cp).tolist() == expected
        assert torch.equal(shard, x[expected])
    gathered = torch.cat(shards)
    assert torch.equal(unshard_sequence_load_balanced(gathered, 0, cp), x)
    assert torch.equal(reorder_sequence_load_balanced(x, 0, cp), gathered)


def test_load_balanced_shards_reject_indivisible_length() -> None:
    with pytest.raises(ValueError, match="pad_for_context_parallel"):
        shard_sequence_load_balanced(torch.zeros(10), 0, 0, 2)


def _ring_work(
    seq: int, cp: int, load_balanced: bool, query_tile: int | None = None, starts: torch.Tensor | None = None
) -> tuple[list[int], list[int]]:
    """Per rank: the pairs its queries attend and the score entries ring attention computes (blocks' tiles)."""
    attended, computed = [], []
    for rank in range(cp):
        q_pos, pairs, area = sequence_positions(seq, rank, cp, load_balanced), 0, 0
        local_starts = None if starts is None else starts[q_pos][None]
        for source in range(cp):
            block = active_block(q_pos, sequence_positions(seq, source, cp, load_balanced), True, None, local_starts)
            for rows, cols, mask in [] if block is None else row_tiles(block, query_tile, 1):
                box = (rows.stop - rows.start) * (cols.stop - cols.start)
                area += box
                pairs += box if mask is None else int(mask.sum())
        attended.append(pairs)
        computed.append(area)
    return attended, computed


@pytest.mark.parametrize("segments", (1, 4))
@pytest.mark.parametrize("cp", (2, 4, 8))
def test_load_balancing_evens_causal_work(cp: int, segments: int) -> None:
    """Every rank attends the same pairs, and skipped blocks and tiles cover exactly the masked pairs."""
    seq = 2 * cp * (4 if segments == 1 else BALANCE_CHUNK * segments)
    attended, _ = _ring_work(seq, cp, load_balanced=True)
    assert len(set(attended)) == 1
    assert sum(attended) == seq * (seq + 1) // 2
    contiguous, _ = _ring_work(seq, cp, load_balanced=False)
    assert contiguous[-1] > contiguous[0]
    # Causal tiles stop at the last key their last query attends: with tiles of 1/8 of the local rows the
    # computed area stays within 1 + 1/8 (and rounding) of the attended pairs.
    tiled, computed = _ring_work(seq, cp, load_balanced=True, query_tile=seq // cp // 8)
    assert tiled == attended
    assert sum(computed) <= 1.2 * sum(attended), (computed, attended)


def test_load_balancing_evens_packed_rows() -> None:
    """Packed rows (a long document, then short ones): the busiest rank attends within 10% of the mean, where one
    head-tail split of the whole row (a single segment) gives it 2x; ring computes each rank's tiles within 2x of
    what it attends (short documents are tiled whole, not in a tile's square)."""
    seq, cp = 8192, 4
    generator = torch.Generator().manual_seed(0)
    lengths = [3000]
    while sum(lengths) < seq:
        lengths.append(min(int(torch.randint(20, 300, (), generator=generator)), seq - sum(lengths)))
    starts = torch.repeat_interleave(torch.tensor([0, *lengths[:-1]]).cumsum(0), torch.tensor(lengths))
    attended, computed = _ring_work(seq, cp, load_balanced=True, starts=starts)
    assert sum(attended) == sum(n * (n + 1) // 2 for n in lengths)
    mean = sum(attended) / cp
    assert max(attended) <= 1.1 * mean, attended
    assert max(c / a for c, a in zip(computed, attended)) <= 2.0, (computed, attended)
    chunk = seq // (2 * cp)
    head_tail = []
    for rank in range(cp):
        held = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in (rank, 2 * cp - 1 - rank)])
        head_tail.append(int((held - starts[held] + 1).sum()))
    assert sum(head_tail) == sum(attended) and max(head_tail) >= 1.5 * mean, head_tail



def test_windowed_tiles_are_boxed_to_the_window() -> None:
    """A sliding window over a long shard: tiles grow to the score budget within the window's box (not the block's
    width), cover exactly the window's pairs, and are far fewer than row-capped ones (Gemma 3 at 64K over cp=4 had
    4084 tiles of 16 rows per rank and layer: seconds of Python per layer, and a dry run that did not finish)."""
    from lightning_plugins.parallel.context.ring import _first_keys
    from lightning_plugins.parallel.context.tiles import _SCORE_ELEMENTS

    seq, cp, window, batch_heads = 32768, 4, 1024, 16
    q_pos = sequence_positions(seq, 0, cp, True)
    starts = _first_keys(q_pos, None, window)
    row_capped = _SCORE_ELEMENTS // (batch_heads * seq // cp)  # the budget's rows over a whole block's keys
    tiles, capped_tiles, attended = 0, 0, 0  # capped: at least the block's rows over the capped tile's
    for source in range(cp):
        block = active_block(q_pos, sequence_positions(seq, source, cp, True), True, None, starts)
        if block is None:
            continue
        capped_tiles += (block.row_end - block.row_start) // row_capped
        for rows, cols, mask in row_tiles(block, None, batch_heads):
            box = (rows.stop - rows.start) * (cols.stop - cols.start)
            assert box * batch_heads <= _SCORE_ELEMENTS
            attended += box if mask is None else int(mask.sum())
            tiles += 1
    assert attended == sum(min(int(p) + 1, window) for p in q_pos)
    assert tiles * 10 <= capped_tiles, (tiles, capped_tiles)


def test_pad_for_context_parallel() -> None:
    ids = torch.arange(2 * 21).view(2, 21)
    labels = ids + 100
    batch = pad_for_context_parallel(ids, labels, None, cp_size=4, pad_id=-1)
    assert batch.valid_len == 21
    assert batch.input_ids.shape == (2, 24)
    assert torch.equal(batch.input_ids[:, :21], ids) and (batch.input_ids[:, 21:] == -1).all()
    assert torch.equal(batch.labels[:, :21], labels) and (batch.labels[:, 21:] == -100).all()
    assert batch.position_ids.shape == (2, 24) and torch.equal(batch.position_ids[1], torch.arange(24))

    positions = torch.arange(5, 26).view(1, 21)  # given positions continue, and keep their own shape
    batch = pad_for_context_parallel(ids, None, positions, cp_size=2, pad_id=0, load_balanced=False)
    assert batch.input_ids.shape == (2, 22) and batch.labels is None
    assert batch.position_ids.tolist() == [list(range(5, 27))]

    short_ids, short_labels = ids[:, :16], labels[:, :16]  # already a multiple of 2 * cp: untouched
    even = pad_for_context_parallel(short_ids, short_labels, None, cp_size=4, pad_id=0)
    assert even.input_ids is short_ids and even.labels is short_labels and even.valid_len == 16


def test_check_ulysses_heads_names_the_constraint_and_a_fix() -> None:
    check_ulysses_heads(32, 8, 4)
    check_ulysses_heads(32, 2, 8)  # kv heads are repeated up to cp, no constraint on them
    with pytest.raises(ValueError, match=r"query heads \(12\) must be divisible by cp_size \(8\).*cp_size=6"):
        check_ulysses_heads(12, 4, 8)
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        check_ulysses_heads(12, 5, 2)


def test_ring_attention_rejects_odd_local_length_before_communicating() -> None:
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="odd"):
        ring_attention(q, q, q, group=None)


def test_ring_attention_rejects_empty_query_tiles() -> None:
    q = torch.zeros(1, 2, 4, 4)
    with pytest.raises(ValueError, match="query_tile must be a positive"):
        ring_attention(q, q, q, group=None, query_tile=0)
