"""Packed vs unpacked rows under context parallelism: attention time against the query-key pairs attended.

A gloo world of ``cp`` CPU processes times forward + backward of :func:`ring_attention` and
:func:`ulysses_attention` (packed rows through its fused document pieces on CPU, :func:`local_attention`) on one row
of ``S`` tokens, sharded in the load-balanced layout as shipped (``segmented``: every segment of ``2 * cp`` chunks
of ``BALANCE_CHUNK`` tokens split head-tail) and, for ring attention, as it was before (``head-tail``: one segment,
the whole row split head-tail; Ulysses does the same work in any layout), in two ways:

* **unpacked**: the row is one sequence, causal;
* **packed**: the row holds documents whose lengths are drawn from a length mix (below) until they fill
  ``S`` (the last one cut to fit), passed as ``document_starts`` (what :mod:`lightning_plugins.parallel.context.wiring`
  derives from restarting ``position_ids``): no query attends another document.

Per (mix, S, cp) it reports, measured in the same world with the variants interleaved round by round (the
machine is shared, so ratios are taken within a round and the median ratio is kept):

* ``pairs``: attended query-key pairs of the packed row over those of the unpacked row,
  ``sum L_i (L_i + 1) / 2`` over ``S (S + 1) / 2``: what the packed row should cost if cost follows the pairs;
* ``ring computed``: the score entries ring attention really computes (its blocks' pieces, counted with its own
  ``active_block`` / ``block_pieces``), packed over unpacked, and their excess over the
  attended pairs (tile granularity); also for the slowest rank alone (packed over unpacked), which a step waits for;
* ``time ratio``: median over rounds of time(packed) / time(unpacked), per kernel and layout;
* the busiest rank's attended pairs of the packed row over the mean: the load balance under packing;
* ring time of the segmented layout over the head-tail one, packed and unpacked.

Length mixes (lognormal, fitted by moments to a published mean and standard deviation):

* ``alpaca``: single-turn instruction data. ShareChat (Yan et al. 2025, arXiv:2512.17843, Table 1) gives Alpaca
  19.67 +- 15.19 user and 64.51 +- 64.85 chatbot tokens per turn, one turn per sample: a sample of 84.2 +- 66.6
  tokens (sum of means, root-sum-square of the deviations: the two taken as independent);
* ``ultrachat``: multi-turn chat. UltraChat 200k's dataset card (HuggingFaceH4/ultrachat_200k) gives 207,865
  ``train_sft`` examples in 1,397,058,554 bytes: 6,721 bytes per example, about 1,500 tokens at 4.5 bytes per
  token; no spread is published, so a lognormal sigma of 1.0 is *assumed* (a standard deviation 1.3x the mean).

    python benchmarks/packed_attention.py                         # 8K and 16K, cp 2, both mixes
    python benchmarks/packed_attention.py --seqs 8192 --cps 2 4 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_plugins.testing.bench import Timed, add_world_arguments, machine, print_report, write_rows  # noqa: E402
from lightning_plugins.testing.world import world_rows  # noqa: E402

#: name -> (mean tokens, lognormal sigma, where the numbers come from); mu follows from the mean and sigma.
MIXES: dict[str, tuple[float, float, str]] = {
    "alpaca": (84.2, math.sqrt(math.log(1 + (66.6 / 84.2) ** 2)), "ShareChat Table 1, Alpaca: 84.2 +- 66.6 tokens"),
    "ultrachat": (1500.0, 1.0, "UltraChat 200k card: ~1,500 tokens mean; sigma 1.0 assumed"),
}


def document_lengths(mix: str, seq: int, seed: int) -> list[int]:
    """Lengths drawn from ``mix`` (lognormal, at least 1 token) until they fill ``seq``; the last is cut to fit."""
    mean, sigma, _ = MIXES[mix]
    mu = math.log(mean) - sigma**2 / 2
    generator = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < seq:
        draw = math.exp(mu + sigma * float(torch.randn((), generator=generator)))
        lengths.append(max(1, min(round(draw), seq - sum(lengths))))
    return lengths


def global_starts(lengths: list[int]) -> torch.Tensor:
    """``[S]``: the position where each token's document begins."""
    begins = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    return torch.repeat_interleave(begins, torch.tensor(lengths))


def attended_pairs(q_pos: torch.Tensor, starts: torch.Tensor | None) -> int:
    """Query-key pairs these queries attend: each attends its document's keys up to itself."""
    first = torch.zeros_like(q_pos) if starts is None else starts[q_pos]
    return int((q_pos - first + 1).sum())


def ring_computed(seq: int, cp: int, rank: int, starts: torch.Tensor | None, batch_heads: int) -> int:
    """Score entries (per head) that ring attention computes on ``rank``: its blocks' pieces as the CPU kernel takes
    them (:func:`block_pieces`: a box or a masked box whole, a causal square's lower triangle)."""
    from lightning_plugins.parallel.context.tiles import FusedCall, active_block, block_pieces
    from lightning_plugins.parallel.context.sharding import sequence_positions

    q_pos = sequence_positions(seq, rank, cp, load_balanced=True)
    local_starts = None if starts is None else starts[q_pos][None]
    total = 0
    for source in range(cp):
        k_pos = sequence_positions(seq, source, cp, load_balanced=True)
        block = active_block(q_pos, k_pos, True, None, local_starts)
        for _, piece in [] if block is None else block_pieces(block, None, batch_heads, True, True):
            rows, cols = (piece.rows, piece.cols) if isinstance(piece, FusedCall) else piece[:2]
            height, width = rows.stop - rows.start, cols.stop - cols.start
            causal = isinstance(piece, FusedCall) and piece.causal
            total += height * (height + 1) // 2 if causal else height * width
    return total


def _timed(fn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> float:
    """Seconds of one forward + backward, between barriers (the slowest rank's time, seen by all)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    dist.barrier()
    start = time.perf_counter()
    fn(q, k, v).backward(grad)
    dist.barrier()
    return time.perf_counter() - start


@contextlib.contextmanager
def layout(name: str) -> Iterator[None]:
    """The load-balanced layout as shipped (``segmented``: chunks of ``BALANCE_CHUNK`` tokens) or as it was before
    (``head-tail``: one segment, rank r holds chunks r and 2cp-1-r of the whole row)."""
    from lightning_plugins.parallel.context import sharding

    shipped = sharding.BALANCE_CHUNK
    sharding.BALANCE_CHUNK = shipped if name == "segmented" else 1 << 40
    sharding._balanced_positions.cache_clear()
    sharding._rank_order.cache_clear()
    try:
        yield
    finally:
        sharding.BALANCE_CHUNK = shipped
        sharding._balanced_positions.cache_clear()
        sharding._rank_order.cache_clear()


LAYOUTS = ("head-tail", "segmented")


def _measure(args: argparse.Namespace, mix: str, seq: int) -> dict[str, Any]:
    from lightning_plugins.parallel.context import ring_attention, shard_sequence_load_balanced, ulysses_attention
    from lightning_plugins.parallel.context.sharding import sequence_positions

    rank, cp = dist.get_rank(), dist.get_world_size()
    lengths = document_lengths(mix, seq, args.seed)
    starts = global_starts(lengths)
    torch.manual_seed(seq)
    shapes = ((1, args.heads, seq, args.head_dim), *[(1, args.kv_heads, seq, args.head_dim)] * 2)
    full = [torch.randn(shape) for shape in (*shapes, shapes[0])]  # q, k, v and the output's gradient

    def sharded() -> tuple[list[torch.Tensor], torch.Tensor]:
        q_pos = sequence_positions(seq, rank, cp, load_balanced=True)
        return [shard_sequence_load_balanced(t, 2, rank, cp) for t in full], starts[q_pos][None]

    def variant(name: str, kernel: str, packed: bool) -> Any:
        with layout(name):
            local_starts = sharded()[1] if packed else None

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            with layout(name):
                if kernel == "ring":
                    return ring_attention(q, k, v, document_starts=local_starts)
                return ulysses_attention(q, k, v, document_starts=local_starts)

        return run

    variants = {(name, "ring", packed): variant(name, "ring", packed) for name in LAYOUTS for packed in (False, True)}
    variants |= {("segmented", "ulysses", packed): variant("segmented", "ulysses", packed) for packed in (False, True)}
    inputs = {}
    for name in LAYOUTS:
        with layout(name):
            inputs[name] = sharded()[0]
    for key, fn in variants.items():  # warm-up
        _timed(fn, *inputs[key[0]])
    rounds: list[dict[tuple[str, str, bool], float]] = []
    for index in range(args.rounds):
        order = list(variants) if index % 2 == 0 else list(reversed(variants))
        rounds.append({key: _timed(variants[key], *inputs[key[0]]) for key in order})

    unpacked_pairs, packed_pairs = seq * (seq + 1) // 2, sum(n * (n + 1) // 2 for n in lengths)
    row: dict[str, Any] = {
        "mix": mix,
        "seq": seq,
        "cp": cp,
        "documents": len(lengths),
        "mean_len": seq / len(lengths),
        "max_len": max(lengths),
        "pairs_ratio": packed_pairs / unpacked_pairs,
    }
    for name in LAYOUTS:
        with layout(name):
            q_pos = sequence_positions(seq, rank, cp, load_balanced=True)
            per_rank = torch.tensor([attended_pairs(q_pos, starts), attended_pairs(q_pos, None)])
            gathered = [torch.zeros_like(per_rank) for _ in range(cp)]
            dist.all_gather(gathered, per_rank)
            computed = [ring_computed(seq, cp, r, s, args.heads) for r in range(cp) for s in (starts, None)]
        row[name] = {
            "ring_computed_ratio": sum(computed[0::2]) / sum(computed[1::2]),
            "ring_excess_packed": sum(computed[0::2]) / packed_pairs,
            "ring_excess_unpacked": sum(computed[1::2]) / unpacked_pairs,
            "rank_pairs_packed": [int(g[0]) for g in gathered],
            "rank_pairs_unpacked": [int(g[1]) for g in gathered],
            "rank_computed_packed": computed[0::2],
            "rank_computed_unpacked": computed[1::2],
        }
        for packed in (False, True):
            kind = "packed" if packed else "unpacked"
            row[name][f"ring_{kind}_s"] = statistics.median(r[(name, "ring", packed)] for r in rounds)
        ratios = [r[(name, "ring", True)] / r[(name, "ring", False)] for r in rounds]
        row[name]["ring_ratio"], row[name]["ring_ratios"] = statistics.median(ratios), ratios
    ratios = [r[("segmented", "ring", True)] / r[("head-tail", "ring", True)] for r in rounds]
    row["ring_packed_segmented_over_head_tail"] = statistics.median(ratios)
    ratios = [r[("segmented", "ring", False)] / r[("head-tail", "ring", False)] for r in rounds]
    row["ring_unpacked_segmented_over_head_tail"] = statistics.median(ratios)
    ratios = [r[("segmented", "ulysses", True)] / r[("segmented", "ulysses", False)] for r in rounds]
    row["ulysses_ratio"] = statistics.median(ratios)
    for packed in (False, True):
        kind = "packed" if packed else "unpacked"
        row[f"ulysses_{kind}_s"] = statistics.median(r[("segmented", "ulysses", packed)] for r in rounds)
    return row


def _rank(rank: int, cp: int, args: argparse.Namespace, out: str) -> None:
    rows = []
    for seq in args.seqs:
        for mix in args.mixes:
            rows.append(_measure(args, mix, seq))
            if rank == 0:
                print(json.dumps(rows[-1]), flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| mix | S | cp | docs (mean / max len) | pairs packed/unpacked | layout | busiest rank's attended pairs / mean,"
        " packed | ring computed packed/unpacked (computed/attended: packed, unpacked) | slowest rank's computed"
        " | ring time packed/unpacked (s) | ring ratio | Ulysses time packed/unpacked (s) | Ulysses ratio |",
        "|---|---:|---:|---|---:|---|---:|---|---:|---|---:|---|---:|",
    ]
    for r in rows:
        for name in LAYOUTS:
            m = r[name]
            pairs = m["rank_pairs_packed"]
            balance = max(pairs) / (sum(pairs) / len(pairs))
            slowest = max(m["rank_computed_packed"]) / max(m["rank_computed_unpacked"])
            ulysses = (
                f"{r['ulysses_packed_s']:.3f} / {r['ulysses_unpacked_s']:.3f} | **{r['ulysses_ratio']:.3f}**"
                if name == "segmented"
                else "| "
            )
            lines.append(
                f"| {r['mix']} | {r['seq']} | {r['cp']} | {r['documents']} ({r['mean_len']:.0f} / {r['max_len']})"
                f" | {r['pairs_ratio']:.4f} | {name} | {balance:.2f} | {m['ring_computed_ratio']:.4f}"
                f" ({m['ring_excess_packed']:.2f}, {m['ring_excess_unpacked']:.2f}) | {slowest:.4f}"
                f" | {m['ring_packed_s']:.3f} / {m['ring_unpacked_s']:.3f} | **{m['ring_ratio']:.3f}** | {ulysses} |"
            )
    lines += [
        "",
        "| mix | S | cp | ring time segmented / head-tail, packed | unpacked |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mix']} | {r['seq']} | {r['cp']} | **{r['ring_packed_segmented_over_head_tail']:.3f}**"
            f" | {r['ring_unpacked_segmented_over_head_tail']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--cps", type=int, nargs="+", default=[2])
    parser.add_argument("--mixes", nargs="+", default=list(MIXES), choices=list(MIXES))
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (median ratio) after one warm-up")
    parser.add_argument("--seed", type=int, default=0, help="seed of the document lengths")
    add_world_arguments(parser)
    args = parser.parse_args()

    rows: list[dict[str, Any]] = []
    with Timed() as run:
        for cp in args.cps:
            rows += world_rows(_rank, cp, cp, args, threads=args.threads)
    on = machine(run.load)
    print_report(table(rows), run.elapsed, on)
    write_rows(args.out, args, on, rows)


if __name__ == "__main__":
    main()
