"""Saved activations per decoder layer at real size against Korthikanti's floor, with and without each lever.

The planner's dry run (fake process group, FakeTensorMode) of Llama-3.1-8B at 8K tokens, fp32 weights computing in
bf16 (FSDP2 mixed precision), no activation checkpointing, under FSDP8 and TP2 x FSDP4 (with and without sequence
parallelism): ``RankMemory.activations_per_layer`` of the worst rank over the closed-form floor
(:func:`lightning_plugins.planner.rank_memory.korthikanti_activations`, flash attention: ``34sbh`` bytes a layer, ``/t``
under TP + SP).

    python benchmarks/activation_floor.py            # every row, about a minute a row on 2 cores
    python benchmarks/activation_floor.py --seq-len 512 --out rows.json
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from transformers import AutoConfig

from lightning_plugins.parallel.layout import ParallelLayout
from lightning_plugins.parallel.options import MemoryOptions, ParallelOptions
from lightning_plugins.planner.dryrun import dry_run
from lightning_plugins.planner.rank_memory import korthikanti_activations
from lightning_plugins.planner.workload import Workload
from lightning_plugins.testing.bench import Timed, add_report_arguments, machine, print_run, write_rows

GIB = 2**30
CONFIG = Path(__file__).resolve().parent.parent / "recipes" / "configs" / "Llama-3.1-8B"
BASE = MemoryOptions(param_dtype="bf16")
#: (layout label, layout, options)
LAYOUTS = [
    ("FSDP8", ParallelLayout().resolve(8), ParallelOptions()),
    ("TP2 x FSDP4, no SP", ParallelLayout(tp_size=2).resolve(8), ParallelOptions(sequence_parallel=False)),
    ("TP2 x FSDP4, SP", ParallelLayout(tp_size=2).resolve(8), ParallelOptions()),
]
#: (lever label, memory options): each row adds one lever to the one before.
LEVERS = [
    ("neither (`efficient_norms=False, efficient_mlp=False`)", replace(BASE, efficient_norms=False, efficient_mlp=False)),
    ("`efficient_norms`", replace(BASE, efficient_mlp=False)),
    ("`efficient_norms` + `efficient_mlp` (the defaults)", BASE),
    ("+ `sp_regather`", replace(BASE, sp_regather=True)),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    add_report_arguments(parser, out=True)
    args = parser.parse_args()
    config = AutoConfig.from_pretrained(CONFIG)
    print(f"| Llama-3.1-8B, {args.seq_len} tokens | levers | per layer GiB | / floor | peak GiB/GPU | dry run s |")
    print("|---|---|---:|---:|---:|---:|")
    rows = []
    with Timed() as run:
        for label, layout, options in LAYOUTS:
            sp = layout.tp_size > 1 and options.sequence_parallel
            for lever, memory in LEVERS:
                if memory.sp_regather and not sp:
                    continue
                workload = Workload(config, layout, options, memory, dtype="fp32", seq_len=args.seq_len)
                rows.append(_row(label, lever, workload))
    on = machine(run.load)
    print_run(run.elapsed, on)
    write_rows(args.out, args, on, rows)


def _row(label: str, lever: str, workload: Workload) -> dict:
    """One dry run: the worst rank's saved activations per layer against the floor, printed as a table row."""
    with Timed() as dry:
        worst = max(dry_run(workload), key=lambda rank: rank.total)
    floor = korthikanti_activations(workload, 1)
    per_layer = worst.activations_per_layer
    print(
        f"| {label} | {lever} | {per_layer / GIB:.2f} | {per_layer / floor:.2f} (floor {floor / GIB:.2f})"
        f" | {worst.total / GIB:.2f} | {dry.elapsed:.0f} |",
        flush=True,
    )
    return {"layout": label, "levers": lever, "per_layer_gib": per_layer / GIB, "floor_gib": floor / GIB,
            "peak_gib": worst.total / GIB, "dry_run_s": dry.elapsed}  # fmt: skip


if __name__ == "__main__":
    main()
