"""Full fine-tuning vs LoRA vs QLoRA, measured side by side at TP=2 and FSDP2=2 (2 gloo ranks, CPU, fp32).

The model is the TP benchmark's small Llama (``lightning_plugins/testing/tp_workload.py``: h=512, 8 layers, vocab
16384; ``--layers``/``--seq`` shrink it). Each variant starts from the same weights, wraps them with peft
LoRA (r=16 on every projection) for ``lora``, stores the frozen base as NF4 (torchao) for ``qlora``,
applies the layout with ``parallelize`` and trains with AdamW. Per variant and rank:

* trainable parameters and the bytes of AdamW's state after a step (the goal: LoRA's state is the
  adapters' only);
* bytes of the frozen base weights this rank holds (the goal: NF4 ~0.28x the 16-bit bytes, i.e. ~0.14x
  of these fp32 bytes);
* peak tensor memory of a training step: the state alive before the step (parameters, buffers, optimizer
  state) plus the profiler's peak of the step's own allocations (see
  ``lightning_plugins.testing.step_accounting.peak_step_allocation``);
* tokens/s: median step time over the measured steps, the step bracketed by barriers.

QLoRA under TP is refused by the engine (NF4 blocks do not split row-wise); the table says so.

Usage::

    python benchmarks/finetune_methods.py [--layers 8 --seq 512 --steps 4] [--output table.md]
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_plugins.testing.bench import Timed, add_report_arguments, command, machine, write_report
from lightning_plugins.testing.step_accounting import peak_step_allocation
from lightning_plugins.testing.tp_workload import Options, build_config, make_batches
from lightning_plugins.testing.world import spawn_world

WORLD = 2
METHODS = ("full", "lora", "qlora")
LAYOUTS = {"tp2": {"tp_size": 2}, "fsdp2": {"dp_shard_size": 2}}


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _bytes(t: torch.Tensor) -> int:
    from lightning_plugins.adapters.qlora import nf4_nbytes
    from lightning_plugins.parallel.quantized import is_nf4

    local = _local(t)
    return nf4_nbytes(local) if is_nf4(local) else local.numel() * local.element_size()


def build(method: str, layout: str, reference: torch.nn.Module) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from lightning_plugins import ParallelLayout, parallelize
    from lightning_plugins.adapters.lora import LoraOptions, apply_lora

    model = copy.deepcopy(reference)
    if method != "full":
        torch.manual_seed(0)
        model = apply_lora(model, LoraOptions(r=16, alpha=32, quantize="nf4" if method == "qlora" else "none"))
    parallelize(model, ParallelLayout(**LAYOUTS[layout]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return model, optimizer


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict) -> float:
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def measure(rank: int, opts: Options) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(build_config(opts), dtype=torch.float32)
    batches = make_batches(opts, opts.warmup + opts.steps + 1)
    rows = []
    for layout in LAYOUTS:
        for method in METHODS:
            row: dict[str, Any] = {"method": method, "layout": layout}
            try:
                model, optimizer = build(method, layout, reference)
            except ValueError as err:  # LayoutError: the engine refuses this combination
                rows.append({**row, "refused": str(err)[:90] + "..."})
                continue
            times = []
            for index in range(opts.warmup + opts.steps):
                dist.barrier()
                start = time.perf_counter()
                _step(model, optimizer, batches[index])
                dist.barrier()
                if index >= opts.warmup:
                    times.append(time.perf_counter() - start)
            params = list(model.parameters())
            trainable = [p for p in params if p.requires_grad]
            state = sum(_bytes(p) for p in params) + sum(_bytes(b) for b in model.buffers())
            optimizer_bytes = sum(_bytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
            _, step_peak = peak_step_allocation(functools.partial(_step, model, optimizer, batches[-1]))
            rows.append({
                **row,
                "trainable": sum(p.numel() for p in trainable),  # DTensors: the global count
                "optimizer_bytes": optimizer_bytes,
                "base_bytes": sum(_bytes(p) for p in params if not p.requires_grad),
                # The decoder layers' frozen linear weights: what NF4 stores (embeddings, head, norms stay dense).
                "linear_bytes": sum(
                    _bytes(p) for n, p in model.named_parameters() if not p.requires_grad and ".layers." in n and p.dim() == 2
                ),
                "peak_bytes": state + optimizer_bytes + step_peak,
                "tokens_per_s": opts.batch * opts.seq / statistics.median(times),
            })
            del model, optimizer
    return rows


def worker(rank: int, opts: Options, outdir: str) -> None:
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(measure(rank, opts)))


def report(opts: Options, ranks: list[list[dict]], command: str, elapsed: float, on: str) -> str:
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    lines = [
        f"Command: `{command}` ({elapsed:.0f} s). Machine: {on}, fp32. Model: Llama h={opts.hidden}, "
        f"{opts.layers} layers, vocab {opts.vocab}; batch {opts.batch} x seq {opts.seq}; AdamW; LoRA r=16 on all projections.",
        "",
        "| layout | method | trainable params | AdamW state / rank (MiB) | frozen base / rank (MiB) | of which decoder linears (MiB) | peak / rank (MiB) | tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for index, row in enumerate(ranks[0]):
        if "refused" in row:
            lines.append(f"| {row['layout']} | {row['method']} | refused by the engine: {row['refused']} | | | | | |")
            continue
        worst = max(ranks, key=lambda rows: rows[index]["peak_bytes"])[index]
        lines.append(
            f"| {row['layout']} | {row['method']} | {row['trainable']:,} | {mib(worst['optimizer_bytes'])} |"
            f" {mib(worst['base_bytes'])} | {mib(worst['linear_bytes'])} | {mib(worst['peak_bytes'])} | {row['tokens_per_s']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=Options.layers)
    parser.add_argument("--seq", type=int, default=Options.seq)
    parser.add_argument("--steps", type=int, default=4)
    add_report_arguments(parser, output=True)
    args = parser.parse_args(argv)
    opts = replace(Options(), layers=args.layers, seq=args.seq, steps=args.steps, warmup=1)
    with Timed() as run, tempfile.TemporaryDirectory() as outdir:
        spawn_world(worker, WORLD, opts, outdir, errors=outdir)
        ranks = [json.loads(Path(outdir, f"rank{r}.json").read_text()) for r in range(WORLD)]
    table = report(opts, ranks, command(argv), run.elapsed, machine(run.load))
    print(table)
    write_report(args.output, table)


if __name__ == "__main__":
    main()
