"""Pipeline bubble per schedule: measured idle fraction per rank next to theory, and peak activations.

Runs the engine's own pipeline (``parallelize(..., ParallelLayout(pp_size=p), ParallelOptions(pp_schedule=...))`` and
``Pipeline.step``) on gloo/CPU with real p2p and the real torch schedules. Only the decoder layers'
compute is emulated: each layer *sleeps* a fixed time in forward (F), in the input-gradient pass (I)
and in the weight-gradient pass (W), F = I = W, so ranks do not compete for this machine's cores.

* idle fraction of a rank = (time blocked waiting on pipeline p2p, plus waiting at the end for the
  slowest rank) / (wall time of the step until every rank is done): the bubble as the rank sees it;
* layer share = (time in the emulated layer compute) / (wall time); the rest, 1 - idle - layer share,
  is the runtime's own work (embedding, head, loss, masks, schedule bookkeeping);
* theory: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) for interleaved 1F1B with v stages per rank;
* peak activations: the most bytes held for backward at once on a rank, tracked on the tensors each
  layer saves (1 MiB per layer and micro-batch), which is what separates GPipe (all m micro-batches
  in flight) from 1F1B (at most p).

Usage::

    python benchmarks/pipeline_bubble.py [--layer-ms 4] [--steps 2] [--out results.json]
"""

from __future__ import annotations

import argparse
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_plugins.testing.bench import Timed, add_report_arguments, machine, print_report, write_json
from lightning_plugins.testing.world import spawn_world

LAYERS = 8  # the same model for every layout: p=2 -> 4 layers per stage (2 interleaved), p=4 -> 2 (1)
ACT_BYTES = 1 << 20  # activation saved per layer and micro-batch
SCHEDULES = [
    "gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"
]
MICROBATCHES = [4, 8, 16]


class _Clock:
    """Per-rank accounting: compute time, time blocked on p2p, live activation bytes."""

    busy = 0.0
    blocked = 0.0
    schedule_end = 0.0
    live = 0
    peak = 0

    @classmethod
    def work(cls, seconds: float) -> None:
        start = time.perf_counter()
        time.sleep(seconds)
        cls.busy += time.perf_counter() - start

    @classmethod
    def hold(cls, tensor: torch.Tensor) -> None:
        cls.live += ACT_BYTES
        cls.peak = max(cls.peak, cls.live)
        weakref.finalize(tensor, cls._release)

    @classmethod
    def _release(cls) -> None:
        cls.live -= ACT_BYTES


class _InputPath(torch.autograd.Function):
    """The part of a layer on the path to its input: F in forward, I in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        _Clock.work(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        _Clock.work(ctx.seconds)
        return grad, None


class _WeightPath(torch.autograd.Function):
    """The part that only feeds the weight gradient: holds the activation, W in backward."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, seconds: float) -> torch.Tensor:
        activation = torch.empty(ACT_BYTES // 4)
        _Clock.hold(activation)
        ctx.save_for_backward(activation)
        ctx.seconds = seconds
        return weight.sum() * 0.0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        _Clock.work(ctx.seconds)
        return grad.reshape(1).clone(), None


class SleepLayer(nn.Module):
    """Stands in for a decoder layer: same call signature, F/I/W of fixed duration."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.weight = nn.Parameter(torch.zeros(1))

    def forward(self, hidden: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return _InputPath.apply(hidden, self.seconds) + _WeightPath.apply(self.weight, self.seconds)


def _theory(schedule: str, p: int, m: int, v: int) -> float | None:
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    return None


def _time_p2p_waits() -> None:
    """Count the time the schedules spend blocked in their p2p waits (all of them go through this)."""
    from torch.distributed.pipelining import schedules

    wait = schedules._wait_batch_p2p

    def timed(work: Any) -> Any:
        start = time.perf_counter()
        try:
            return wait(work)
        finally:
            _Clock.blocked += time.perf_counter() - start

    schedules._wait_batch_p2p = timed


def _mark_schedule_end(schedule: Any) -> None:
    step = schedule.step

    def timed(*args: Any, **kwargs: Any) -> Any:
        try:
            return step(*args, **kwargs)
        finally:
            _Clock.schedule_end = time.perf_counter()

    schedule.step = timed


def _measure(p: int, layer_s: float, steps: int) -> list[dict]:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lightning_plugins import LayoutError, OptionsError, ParallelLayout, ParallelOptions, parallelize
    from lightning_plugins.parallel import pipeline_of

    rows = []
    for schedule in SCHEDULES:
        for m in MICROBATCHES:
            config = LlamaConfig(
                hidden_size=16, intermediate_size=32, num_hidden_layers=LAYERS, num_attention_heads=2,
                num_key_value_heads=2, vocab_size=32, max_position_embeddings=32,
            )
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config)
            for index in range(LAYERS):
                model.model.layers[index] = SleepLayer(layer_s)
            try:
                model = parallelize(model, ParallelLayout(pp_size=p), ParallelOptions(pp_schedule=schedule, pp_microbatches=m))
            except (LayoutError, OptionsError) as err:  # the schedule does not fit p or m
                rows.append({"schedule": schedule, "p": p, "m": m, "skipped": str(err).split(".")[0]})
                continue
            pipeline = pipeline_of(model)
            batch = torch.randint(0, config.vocab_size, (m, 8), generator=torch.Generator().manual_seed(0))
            idle, share, walls, peak = [], [], [], 0
            for step in range(steps + 1):  # the first step builds the stages: not measured
                if step == 1:
                    _mark_schedule_end(pipeline._schedule)
                dist.barrier()
                _Clock.busy, _Clock.blocked, _Clock.peak = 0.0, 0.0, _Clock.live
                start = time.perf_counter()
                pipeline.step(batch, labels=batch)
                dist.barrier()  # the step ends for everyone when the last rank is done (e.g. before clipping)
                end = time.perf_counter()
                wall = end - start
                # After its schedule, a rank waits for the others (in the loss reduction and the barrier).
                _Clock.blocked += end - _Clock.schedule_end
                if step:
                    idle.append(_Clock.blocked / wall)
                    share.append(_Clock.busy / wall)
                    walls.append(wall)
                    peak = max(peak, _Clock.peak)
            v = pipeline.options.stages_per_rank
            mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
            measured = torch.tensor([mean(idle), mean(share), float(peak), mean(walls)])
            gathered = [torch.zeros(4) for _ in range(p)]
            dist.all_gather(gathered, measured)
            rows.append({
                "schedule": schedule, "p": p, "m": m, "v": v,
                "idle_per_rank": [round(g[0].item(), 3) for g in gathered],
                "layer_share_per_rank": [round(g[1].item(), 3) for g in gathered],
                "peak_act_mib_per_rank": [int(g[2].item()) >> 20 for g in gathered],
                "step_ms": round(max(g[3].item() for g in gathered) * 1000, 1),
                "theory": _theory(schedule, p, m, v),
            })
            del model, pipeline
    return rows


def _entry(rank: int, p: int, layer_s: float, steps: int, queue: Any) -> None:
    _time_p2p_waits()
    rows = _measure(p, layer_s, steps)
    if rank == 0:
        queue.put(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layer-ms", type=float, default=10.0, help="F = I = W per layer, milliseconds")
    parser.add_argument("--steps", type=int, default=2, help="measured steps per configuration")
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    add_report_arguments(parser, out=True)
    args = parser.parse_args()
    rows: list[dict] = []
    ctx = mp.get_context("spawn")
    with Timed() as run:
        for p in args.pp:
            queue = ctx.SimpleQueue()
            spawn_world(_entry, p, p, args.layer_ms / 1000, args.steps, queue)
            rows += queue.get()
    print_report(table(rows), run.elapsed, machine(run.load))
    write_json(args.out, rows)


def table(rows: list[dict]) -> str:
    """The rows as a markdown table (a schedule that cannot run this ``p`` says why)."""
    lines = [
        "| schedule | p | v | m | theory | idle, mean | idle per rank | layer share, mean | step (ms)"
        " | peak activations per rank (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "skipped" in row:
            lines.append(f"| {row['schedule']} | {row['p']} | | {row['m']} | | n/a: {row['skipped']} | | | | |")
            continue
        theory = "" if row["theory"] is None else f"{row['theory']:.3f}"
        mean = sum(row["idle_per_rank"]) / len(row["idle_per_rank"])
        per_rank = " / ".join(f"{x:.3f}" for x in row["idle_per_rank"])
        share = sum(row["layer_share_per_rank"]) / len(row["layer_share_per_rank"])
        mem = " / ".join(str(x) for x in row["peak_act_mib_per_rank"])
        lines.append(
            f"| {row['schedule']} | {row['p']} | {row['v']} | {row['m']} | {theory} | {mean:.3f} | {per_rank}"
            f" | {share:.3f} | {row['step_ms']:.0f} | {mem} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
