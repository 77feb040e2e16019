"""Ring attention with a sliding window against full causal attention: time against the query-key pairs attended.

A gloo world of ``cp`` CPU processes times forward + backward of :func:`ring_attention` on one row of ``S`` tokens
in the load-balanced layout, full causal and with a sliding window of ``W`` keys (query ``i`` sees keys
``i - W < j <= i``; blocks and query-row tiles wholly outside the window are skipped). Per (S, W, cp) it reports:

* ``pairs``: attended query-key pairs with the window over full causal: what the window should cost if cost follows
  the pairs (about ``W / S * (2 - W / S)`` for ``W << S``);
* ``computed``: the score entries ring attention really computes (its blocks' pieces, counted with its own
  :func:`active_block` / :func:`block_pieces`), windowed over causal, and the windowed run's excess over its pairs;
* ``time ratio``: median over rounds of time(windowed) / time(causal), the two interleaved round by round (the
  machine is shared, so ratios are taken within a round);
* ``CPU-time ratio``: the same for rank 0's process CPU time (one thread per rank: what the rank computed, less moved
  by other processes' load than the wall clock).

Every block still travels the ring (the kernel skips the compute of a block outside every local query's window,
not its transfer).

    python benchmarks/windowed_attention.py                          # S 4096, W 512, cp 2 and 4
    python benchmarks/windowed_attention.py --seqs 8192 --windows 512 1024 --cps 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_plugins.testing.bench import Timed, add_world_arguments, machine, print_report, write_rows  # noqa: E402
from lightning_plugins.testing.world import world_rows  # noqa: E402


def computed_entries(seq: int, cp: int, window: int | None, batch_heads: int) -> int:
    """Score entries (per head) that ring attention computes over all ranks: its blocks' pieces as the CPU kernel
    takes them (:func:`block_pieces`: a box or a masked box whole, a band's masked boxes whole, a causal square's lower
    triangle)."""
    from lightning_plugins.parallel.context.ring import _first_keys
    from lightning_plugins.parallel.context.sharding import sequence_positions
    from lightning_plugins.parallel.context.bands import BandCall
    from lightning_plugins.parallel.context.tiles import FusedCall, active_block, block_pieces

    total = 0
    for rank in range(cp):
        q_pos = sequence_positions(seq, rank, cp, load_balanced=True)
        starts = _first_keys(q_pos, None, window)
        for source in range(cp):
            k_pos = sequence_positions(seq, source, cp, load_balanced=True)
            block = active_block(q_pos, k_pos, True, None, starts)
            for _, piece in [] if block is None else block_pieces(block, None, batch_heads, True, True):
                if isinstance(piece, BandCall):
                    total += piece.count * piece.chunk * piece.span
                    continue
                rows, cols = (piece.rows, piece.cols) if isinstance(piece, FusedCall) else piece[:2]
                height, width = rows.stop - rows.start, cols.stop - cols.start
                causal = isinstance(piece, FusedCall) and piece.causal
                total += height * (height + 1) // 2 if causal else height * width
    return total


def attended_pairs(seq: int, window: int | None) -> int:
    """Query-key pairs of a causal row of ``seq`` tokens, within a window of ``window`` keys when given."""
    return sum(min(i + 1, window or seq) for i in range(seq))


def _timed(
    window: int | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor
) -> tuple[float, float]:
    """Seconds of one forward + backward, between barriers (the slowest rank's time, seen by all), and the CPU seconds
    of this rank's process in it (less moved by other processes' load on a shared machine than the wall clock)."""
    from lightning_plugins.parallel.context import ring_attention

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    ring_attention(q, k, v, window=window).backward(grad)
    cpu = time.process_time() - cpu
    dist.barrier()
    return time.perf_counter() - start, cpu


def _measure(args: argparse.Namespace, seq: int, window: int) -> dict[str, Any]:
    from lightning_plugins.parallel.context import shard_sequence_load_balanced

    rank, cp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seq)
    shapes = ((1, args.heads, seq, args.head_dim), *[(1, args.kv_heads, seq, args.head_dim)] * 2)
    local = [shard_sequence_load_balanced(torch.randn(shape), 2, rank, cp) for shape in (*shapes, shapes[0])]
    variants = (None, window)
    for variant in variants:  # warm-up
        _timed(variant, *local)
    rounds = []
    for index in range(args.rounds):
        order = variants if index % 2 == 0 else variants[::-1]
        rounds.append({variant: _timed(variant, *local) for variant in order})
    windowed, causal = (computed_entries(seq, cp, w, args.heads) for w in (window, None))
    cpu = [{variant: seconds[1] for variant, seconds in r.items()} for r in rounds]
    rounds = [{variant: seconds[0] for variant, seconds in r.items()} for r in rounds]
    return {
        "seq": seq,
        "window": window,
        "cp": cp,
        "pairs_ratio": attended_pairs(seq, window) / attended_pairs(seq, None),
        "computed_ratio": windowed / causal,
        "computed_over_pairs": windowed / attended_pairs(seq, window),
        "causal_s": statistics.median(r[None] for r in rounds),
        "windowed_s": statistics.median(r[window] for r in rounds),
        "time_ratio": statistics.median(r[window] / r[None] for r in rounds),
        "cpu_ratio": statistics.median(r[window] / r[None] for r in cpu),
    }


def _rank(rank: int, args: argparse.Namespace, out: str) -> None:
    rows = [_measure(args, seq, window) for seq in args.seqs for window in args.windows]
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| S | W | cp | pairs W/causal | computed W/causal (computed/attended) | time causal / W (s) | time ratio"
        " | CPU-time ratio (rank 0) |",
        "|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['seq']} | {r['window']} | {r['cp']} | {r['pairs_ratio']:.4f} | {r['computed_ratio']:.4f}"
            f" ({r['computed_over_pairs']:.2f}) | {r['causal_s']:.3f} / {r['windowed_s']:.3f}"
            f" | **{r['time_ratio']:.3f}** | **{r['cpu_ratio']:.3f}** |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096])
    parser.add_argument("--windows", type=int, nargs="+", default=[512])
    parser.add_argument("--cps", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (median ratio) after one warm-up")
    add_world_arguments(parser)
    args = parser.parse_args()

    rows: list[dict[str, Any]] = []
    with Timed() as run:
        for cp in args.cps:
            rows += world_rows(_rank, cp, args, threads=args.threads)
    on = machine(run.load)
    print_report(table(rows), run.elapsed, on)
    write_rows(args.out, args, on, rows)


if __name__ == "__main__":
    main()
