"""The two doors and the anchor, measured side by side: the same TP=2 layout through Lightning and Accelerate.

One run trains the TP benchmark's small Llama (``testing/tp_workload.py``: fp32, CPU, gloo, 2 ranks)
from one checkpoint, with the same batches, in one 2-rank world, through:

* ``lightning``: the Lightning door, a ``lightning.Trainer`` with ``ParallelismStrategy(tp_size=2)`` (SP + loss
  parallel) on a plain LightningModule (``model(**batch).loss``, SGD). Every round is a ``Trainer.fit`` of one
  step on the same, already parallelized model (the strategy recognises it); a callback times the step
  between barriers, so the Trainer's per-fit setup is outside the timed step (but inside the profiled and
  counted one: see below).
* ``accelerate``: the Accelerate door, ``ParallelAccelerator(tp_size=2, cpu=True)``: ``prepare(model,
  optimizer)`` and the user's loop (``accumulate``, ``model(**batch).loss``, ``backward``, optimizer step).
* ``engine``: ``parallelize(model, ParallelLayout(tp_size=2))`` and a bare torch loop: what both doors wrap,
  so the doors' own cost shows as the difference.
* ``anchor``: what an Accelerate user gets today. Accelerate's ``ParallelismConfig(tp_size=2)`` refuses CPU
  processes ("only compatible with ... Multi{Device} or DEEPSPEED, but got MULTI_CPU") and a plain
  ``Accelerator(cpu=True)`` cannot prepare a ``tp_plan`` model ("aten.cat.default got mixed torch.Tensor and
  DTensor"), so the anchor is transformers' ``tp_plan`` alone, as in the TP benchmark (its ``hf_tp``:
  ``DistributedConfig(tp_size=2)``, gathered logits, no SP).

Variants run in rotating order each round, so load from other processes on the machine falls on all of them.
Measured per variant, with the TP benchmark's helpers: tokens/s (median step wall time between barriers),
CPU seconds per step summed over ranks, peak tensor memory per rank (state alive at the step's start + the
profiler's peak of the step's own allocations), bytes each rank sends per step (every ``c10d``/functional
collective, ring algorithms). For ``lightning`` the profiled and the counted step is a whole ``Trainer.fit``
of one step, so its figures include the Trainer's setup (a few barriers and tiny broadcasts; no tensor of
model size): they can only err high.

Usage (the numbers in ``benchmarks/RESULTS.md`` were taken with the defaults)::

    python benchmarks/doors.py [--quick] [--layers 8 --hidden 512 ...] [--output table.md]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_plugins.testing.bench import (  # noqa: E402
    Timed,
    add_report_arguments,
    command,
    machine,
    write_json,
    write_report,
)
from lightning_plugins.testing.step_accounting import CommCounter, peak_step_allocation, state_bytes  # noqa: E402
from lightning_plugins.testing.tp_workload import Options, build_config, build_variant, make_batches  # noqa: E402
from lightning_plugins.testing.world import spawn_world  # noqa: E402

WORLD = 2
VARIANTS = ("lightning", "accelerate", "engine", "anchor")
LABELS = {
    "lightning": "Lightning door: Trainer + ParallelismStrategy(tp_size=2)",
    "accelerate": "Accelerate door: ParallelAccelerator(tp_size=2)",
    "engine": "engine alone: parallelize + torch loop",
    "anchor": "anchor: transformers tp_plan (TP=2, no SP, gathered logits)",
}


class Door:
    """One variant: ``step(batch)`` trains one batch and returns the loss; ``model``/``optimizer`` for accounting."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: Callable[[dict], float]) -> None:
        self.model, self.optimizer, self.step = model, optimizer, step


def _accelerate(checkpoint: str, opts: Options) -> Door:
    from transformers import AutoModelForCausalLM

    from lightning_plugins.accelerate import ParallelAccelerator

    accelerator = ParallelAccelerator(tp_size=WORLD, cpu=True)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=opts.lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()

    def step(batch: dict) -> float:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        return loss.item()

    return Door(model, optimizer, step)


def _lightning(checkpoint: str, opts: Options) -> Door:
    import lightning as L
    from transformers import AutoModelForCausalLM

    from lightning_plugins.strategies import ParallelismStrategy

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)  # "GPU available: False ..." per fit

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            return self.model(**batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=opts.lr)  # stateless: a new one per fit changes nothing

    class Timer(L.Callback):
        """The step between barriers (the slower rank's time), and its loss."""

        def on_train_batch_start(self, *args: Any) -> None:
            dist.barrier()
            self.start = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *args: Any) -> None:
            self.cpu = time.process_time() - self.start[1]
            dist.barrier()
            self.wall = time.perf_counter() - self.start[0]
            self.loss = float(outputs["loss"])

    module, timer = Module(), Timer()

    def step(batch: dict) -> float:
        trainer = L.Trainer(
            accelerator="cpu", devices=WORLD, strategy=ParallelismStrategy(tp_size=WORLD), max_steps=1,
            callbacks=[timer], logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
        )  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "the number of training batches is small" and the like
            trainer.fit(module, torch.utils.data.DataLoader([batch], batch_size=None))
        return timer.loss

    door = Door(module.model, torch.optim.SGD(module.model.parameters(), lr=opts.lr), step)
    door.timer = timer  # type: ignore[attr-defined]
    return door


def _from_tp_benchmark(name: str, rank: int, checkpoint: str, opts: Options) -> Door:
    variant = build_variant(name, rank, checkpoint, opts)
    return Door(variant.model, variant.optimizer, variant.step)


def build(name: str, rank: int, checkpoint: str, opts: Options) -> Door:
    if name == "lightning":
        return _lightning(checkpoint, opts)
    if name == "accelerate":
        return _accelerate(checkpoint, opts)
    return _from_tp_benchmark({"engine": "ours_sp_lp", "anchor": "hf_tp"}[name], rank, checkpoint, opts)


def worker(rank: int, opts: Options, checkpoint: str, outdir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(_measure(rank, opts, checkpoint)))


def _measure(rank: int, opts: Options, checkpoint: str) -> dict[str, Any]:
    rounds = opts.warmup + opts.steps
    batches = make_batches(opts, rounds + 2)
    names = list(opts.variants)
    doors = {name: build(name, rank, checkpoint, opts) for name in names}
    wall: dict[str, list[float]] = defaultdict(list)
    cpu: dict[str, list[float]] = defaultdict(list)
    losses: dict[str, list[float]] = defaultdict(list)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            door = doors[name]
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            losses[name].append(door.step(batches[r]))
            c1 = time.process_time()
            dist.barrier()
            t1 = time.perf_counter()
            if r >= opts.warmup:
                timer = getattr(door, "timer", None)  # the Trainer's step alone, without fit's setup
                wall[name].append(timer.wall if timer else t1 - t0)
                cpu[name].append(timer.cpu if timer else c1 - c0)
        _log(rank, f"round {r + 1}/{rounds}: " + ", ".join(f"{n} {wall[n][-1]:.2f}s" for n in names if wall[n]))
    memory: dict[str, dict[str, int]] = {}
    comm: dict[str, list[dict]] = {}
    for name in names:
        door = doors[name]
        dist.barrier()
        # Lightning zeroes gradients at the start of a step, the others at the end: count the state a step
        # starts from in both cases (the Trainer frees the previous gradients before it allocates anything).
        door.model.zero_grad(set_to_none=True)
        base = state_bytes(door.model, door.optimizer)
        loss, peak = peak_step_allocation(lambda: door.step(batches[rounds]))
        losses[name].append(loss)
        memory[name] = {"state": base, "step_peak": peak, "peak": base + peak}
        dist.barrier()
        counter = CommCounter()
        with warnings.catch_warnings(), counter.mode:
            warnings.simplefilter("ignore")
            losses[name].append(door.step(batches[rounds + 1]))
        comm[name] = counter.records
        dist.barrier()
    _log(rank, "instrumented steps done")
    return {"rank": rank, "wall": wall, "cpu": cpu, "losses": losses, "memory": memory, "comm": comm}


def _log(rank: int, message: str) -> None:
    if rank == 0:
        print(f"[doors {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _mib(x: float) -> str:
    return f"{x / 2**20:.1f}"


def report(opts: Options, results: list[dict[str, Any]], elapsed: float, command: str, on: str) -> str:
    tokens = opts.batch * opts.seq
    names = list(opts.variants)
    r0 = results[0]
    reference = "lightning" if "lightning" in names else names[0]
    peak = {n: max(r["memory"][n]["peak"] for r in results) for n in names}
    sent = {n: max(sum(rec["wire"] for rec in r["comm"][n]) for r in results) for n in names}
    lines = [
        f"Model: Llama, hidden {opts.hidden}, {opts.layers} layers, {opts.heads} heads / {opts.kv_heads} kv heads,"
        f" intermediate {opts.intermediate}, vocab {opts.vocab}; batch {opts.batch} x seq {opts.seq} = {tokens}"
        f" tokens/step; fp32; SGD; 2 CPU ranks (gloo, 1 thread each); {opts.warmup} warm-up + {opts.steps} timed"
        " rounds, variants in rotating order.",
        "",
        f"| variant | tokens/s (median) | speed vs {reference} (paired median) | step s median [min-max]"
        f" | CPU s/step (sum of ranks) | peak MiB/rank | peak vs {reference} | comm MiB/rank/step | comm vs {reference}"
        " | max abs loss diff vs engine |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for n in names:
        walls = r0["wall"][n]
        median = statistics.median(walls)
        speed = statistics.median(ref / w for ref, w in zip(r0["wall"][reference], walls))
        cpu = sum(statistics.median(r["cpu"][n]) for r in results)
        diff = "-"
        if "engine" in names and n != "engine":
            diff = f"{max(abs(a - b) for a, b in zip(r0['losses'][n], r0['losses']['engine'])):.1e}"
        lines.append(
            f"| {LABELS[n]} | {tokens / median:.0f} | {speed:.2f}x | {median:.2f} [{min(walls):.2f}-{max(walls):.2f}]"
            f" | {cpu:.2f} | {_mib(peak[n])} | {peak[n] / peak[reference]:.2f}x | {_mib(sent[n])}"
            f" | {sent[n] / sent[reference]:.2f}x | {diff} |"
        )
    lines += ["", "Collectives per rank per step (rank 0), by op:", ""]
    lines += ["| variant | op | count | wire MiB |", "|---|---|---:|---:|"]
    for n in names:
        groups: dict[str, list[float]] = defaultdict(list)
        for rec in r0["comm"][n]:
            groups[rec["op"]].append(rec["wire"])
        for op, wires in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
            lines.append(f"| {n} | `{op}` | {len(wires)} | {sum(wires) / 2**20:.3f} |")
    lines += [
        "",
        f"Machine: {on}. Whole run {elapsed:.0f} s. Command: `{command}`",
    ]
    return "\n".join(lines)


_SIZE_FIELDS = ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "seq", "batch", "warmup", "steps")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    defaults = Options()
    for field in _SIZE_FIELDS:
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=getattr(defaults, field))
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    parser.add_argument("--quick", action="store_true", help="a tiny model and 1+2 rounds: checks the script runs")
    add_report_arguments(parser, output=True, json_out=True)
    args = parser.parse_args(argv)
    opts = Options(**{f: getattr(args, f) for f in _SIZE_FIELDS})
    if args.quick:
        opts = Options(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=256, seq=32, warmup=1, steps=2)
    opts.variants = tuple(v for v in args.variants.split(",") if v)
    if set(opts.variants) - set(VARIANTS):
        parser.error(f"--variants: known are {VARIANTS}")

    with Timed() as run, tempfile.TemporaryDirectory(prefix="doors_bench_") as tmp:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_config(build_config(opts), dtype=torch.float32)
            model.save_pretrained(Path(tmp, "model"))
            del model
        outdir = Path(tmp, "out")
        outdir.mkdir()
        spawn_world(worker, WORLD, opts, str(Path(tmp, "model")), str(outdir), errors=outdir)
        results = [json.loads(Path(outdir, f"rank{r}.json").read_text()) for r in range(WORLD)]
    ran = command(argv)
    write_json(args.json, {"options": vars(opts), "results": results, "elapsed": run.elapsed, "command": ran}, None)
    on = machine(run.load, packages=("transformers", "lightning", "accelerate"), python=True)
    text = report(opts, results, run.elapsed, ran, on)
    print(text)
    write_report(args.output, text)


if __name__ == "__main__":
    main()
