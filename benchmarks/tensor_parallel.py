"""Tensor parallel, measured: one process vs transformers' TP plan (Lightning's anchor) vs ``parallelize``.

One run of this script trains the same small Llama (fp32, CPU, gloo) side by side in one 2-rank world:

* ``single_1t``: the plain transformers model in one process with one thread (rank 0; rank 1 waits in a
  barrier); ``single_2t`` (not run by default: ``--variants``) gives that process both cores.
* ``hf_tp``: what a ``lightning.pytorch.strategies.ModelParallelStrategy`` user gets from transformers'
  own plan: ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=2))`` applies the config's
  ``base_model_tp_plan`` (+ ``embed_tokens: embedding_rowwise``, ``lm_head: colwise_gather_output``) on a
  2-rank mesh; the logits are gathered and the loss is transformers' standard one. The Trainer itself is
  left out: it only adds the same per-step bookkeeping to every variant.
* ``ours_sp_lp``: ``parallelize(model, ParallelLayout(tp_size=2))`` (sequence parallel + loss parallel).
* ``ours_tp``: the same with ``sequence_parallel=False, loss_parallel=False``.

Every variant starts from the same checkpoint, sees the same batches and takes forward + backward + one
SGD step; their losses are compared step by step (the math must not change). The variants run
interleaved (rotating order each round) so that the load of a shared machine falls on all of them alike.

Measured per variant:

* **tokens/s**: ``batch * seq / step wall time`` (median over the measured rounds, after warmup), the
  step bracketed by barriers so it is the slowest rank's time; also CPU seconds per step summed over
  ranks (``time.process_time``), which is less sensitive to other processes on the machine.
* **peak tensor memory per rank**: torch CPU has no allocator statistics, so one extra step runs under
  ``torch.profiler`` with ``profile_memory=True``. That records every allocation and free made through
  c10's CPU allocator (all tensor storages: activations, gradients, DTensor temporaries, collective
  buffers; not gloo's own internal buffers, not Python objects). Peak = bytes of the model state alive
  at the start of the step (parameters + buffers + optimizer state; gradients are ``None`` there) +
  the highest running sum of the step's allocations minus frees of blocks allocated during the step.
  Frees of blocks that existed before the step are ignored, so the figure can only err high. A second
  step under ``torch.distributed._tools.mem_tracker.MemTracker`` (dispatch-mode + weakref accounting of
  live tensors, by category) cross-checks it; the distinct storages autograd saves for backward
  (``saved_tensors_hooks``, parameters excluded) give the activation memory alone.
* **bytes communicated per rank per step**: one extra step runs under a ``TorchDispatchMode`` that sees
  every collective op, both the in-place ``c10d.*`` ops behind ``torch.distributed.all_reduce`` & co. and
  the functional ``_c10d_functional.*`` ops DTensor uses (it returns ``NotImplemented`` for DTensor
  arguments, as ``CommDebugMode`` does, so DTensor desugars into its collectives first). ``CommDebugMode``
  runs nested in the same step as a cross-check of the op counts. Bytes are reported as what each rank
  sends on the wire with ring algorithms over N ranks: all-reduce ``2(N-1)/N * S``; all-gather,
  reduce-scatter, all-to-all ``(N-1)/N * S`` where S is the full (unsharded) tensor.

Analytical minimum per step (Megatron-LM layout; b batch, s sequence, h hidden, V vocab, L layers,
fp32 so 4 bytes an element, A = 4bsh; ring over N ranks):

* TP without SP: each decoder layer all-reduces A twice forward (after o_proj and down_proj) and twice
  backward (the input gradients of the q/k/v and gate/up regions); the vocab-parallel embedding
  all-reduces A forward; the column-parallel lm_head all-reduces its input gradient A backward:
  ``(4L + 2)`` all-reduces of A.
* TP with SP: every all-reduce above becomes a reduce-scatter + all-gather pair (same bytes on the wire):
  per layer 2 AG + 2 RS forward and 2 AG + 2 RS backward; embedding RS forward + AG backward; lm_head AG
  forward + RS backward. Plus the parameter gradients of the sequence-sharded norms (2L + 1 vectors of h)
  are partial sums and must be all-reduced: ``(2L + 1)`` all-reduces of 4h.
* Loss: gathered logits cost one all-gather of the fp32 logits (4bsV) forward, none backward; loss
  parallel costs two all-reduces of per-token statistics (max: 4bs; target logit + sum of exps: 8bs).

Usage (the numbers recorded in ``benchmarks/RESULTS.md`` were taken with the defaults)::

    python benchmarks/tensor_parallel.py [--quick] [--layers 8 --hidden 512 ...] [--output table.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # weight-loading bars, once per variant and rank

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
from lightning_plugins.testing.step_accounting import (  # noqa: E402
    CommCounter,
    peak_step_allocation,
    state_bytes,
    wire_bytes,
)
from lightning_plugins.testing.tp_workload import (  # noqa: E402
    WORLD,
    Options,
    Variant,
    build_config,
    build_variant,
    make_batches,
)
from lightning_plugins.testing.world import spawn_world  # noqa: E402

LABELS = {
    "single_1t": "one process, 1 thread",
    "single_2t": "one process, 2 threads",
    "hf_tp": "transformers tp_plan, TP=2 (Lightning ModelParallelStrategy anchor)",
    "ours_tp": "ours, TP=2, no SP, no loss parallel",
    "ours_sp_lp": "ours, TP=2 + SP + loss parallel",
}


# --------------------------------------------------------------------------------------------------
# Memory accounting
# --------------------------------------------------------------------------------------------------


class SavedActivations:
    """``saved_tensors_hooks`` that add up the distinct storages autograd keeps for backward (not parameters)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.exclude = {_storage(p)[0] for p in model.parameters()}
        self.seen: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        ptr, nbytes = _storage(tensor)
        if ptr not in self.exclude:
            self.seen[ptr] = nbytes
        return tensor

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor._local_tensor
    tensor = getattr(tensor, "elem", tensor)  # AsyncCollectiveTensor wraps the collective's output buffer
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def memtracker_peak(fn: Callable[[], Any], variant: Variant) -> dict[str, int]:
    """Cross-check: ``torch.distributed._tools.mem_tracker.MemTracker``'s peak, by category, for one step."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(variant.model, variant.optimizer)
    with warnings.catch_warnings(), tracker:
        warnings.simplefilter("ignore")
        fn()
    peak: dict[str, int] = defaultdict(int)
    for per_device in tracker.get_tracker_snapshot("peak").values():
        for kind, nbytes in per_device.items():
            peak[str(kind).rsplit(".", 1)[-1]] += nbytes
    return dict(peak)


# --------------------------------------------------------------------------------------------------
# The variants
# --------------------------------------------------------------------------------------------------


def worker(rank: int, opts: Options, checkpoint: str, outdir: str) -> None:
    result = _measure(rank, opts, checkpoint)
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(result))


def _measure(rank: int, opts: Options, checkpoint: str) -> dict[str, Any]:
    from torch.distributed.tensor.debug import CommDebugMode

    rounds = opts.warmup + opts.steps
    batches = make_batches(opts, rounds + 2)
    variants = {name: build_variant(name, rank, checkpoint, opts) for name in opts.variants}
    _log(rank, f"built {', '.join(variants)}")
    names = list(opts.variants)
    wall: dict[str, list[float]] = defaultdict(list)
    cpu: dict[str, list[float]] = defaultdict(list)
    losses: dict[str, list[float]] = defaultdict(list)

    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            variant = variants[name]
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            if variant.model is not None:
                losses[name].append(variant.step(batches[r]))
            c1 = time.process_time()
            dist.barrier()
            t1 = time.perf_counter()
            if r >= opts.warmup:
                wall[name].append(t1 - t0)
                cpu[name].append(c1 - c0)
        _log(rank, f"round {r + 1}/{rounds}: " + ", ".join(f"{n} {wall[n][-1]:.2f}s" for n in names if wall[n]))

    memory: dict[str, dict[str, int]] = {}
    comm: dict[str, Any] = {}
    _log(rank, "instrumented steps (memory, then communication)")
    for name in names:
        variant = variants[name]
        dist.barrier()
        if variant.model is not None:
            base = state_bytes(variant.model, variant.optimizer)
            saved = SavedActivations(variant.model)
            with saved.hooks():
                loss, peak = peak_step_allocation(lambda: variant.step(batches[rounds]))
            losses[name].append(loss)
            memory[name] = {"state": base, "step_peak": peak, "peak": base + peak, "saved": saved.total}
            memory[name]["memtracker"] = memtracker_peak(
                lambda: losses[name].append(variant.step(batches[rounds])), variant
            )
        dist.barrier()
        if variant.model is not None:
            counter = CommCounter()
            debug = CommDebugMode()
            with warnings.catch_warnings(), debug, counter.mode:
                warnings.simplefilter("ignore")
                losses[name].append(variant.step(batches[rounds + 1]))
            comm[name] = {
                "records": counter.records,
                "debug_counts": {str(k): v for k, v in debug.get_comm_counts().items()},
            }
        dist.barrier()
    return {
        "rank": rank,
        "wall": wall,
        "cpu": cpu,
        "losses": losses,
        "memory": memory,
        "comm": comm,
        "local_params": {
            n: sum(_local_numel(p) for p in v.model.parameters()) for n, v in variants.items() if v.model is not None
        },
    }


def _log(rank: int, message: str) -> None:
    if rank == 0:
        print(f"[tensor_parallel {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _local_numel(p: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    return (p._local_tensor if isinstance(p, DTensor) else p).numel()


# --------------------------------------------------------------------------------------------------
# Analytical minimum and the report
# --------------------------------------------------------------------------------------------------


def analytical_minimum(opts: Options, *, sequence_parallel: bool, loss_parallel: bool, n: int = WORLD) -> dict:
    """Bytes each rank must send per step (ring algorithms), by term; see the module docstring."""
    b, s, h, v, layers, f = opts.batch, opts.seq, opts.hidden, opts.vocab, opts.layers, 4
    act = b * s * h * f
    terms: dict[str, float] = {}
    terms["decoder layers"] = layers * 4 * wire_bytes("all_reduce", act, n)  # = 4 AG + 4 RS with SP
    terms["embedding + lm_head input"] = 2 * wire_bytes("all_reduce", act, n)
    if sequence_parallel:
        terms["SP norm weight grads"] = (2 * layers + 1) * wire_bytes("all_reduce", h * f, n)
    if loss_parallel:
        terms["loss (max, target logit + sum exp)"] = wire_bytes("all_reduce", b * s * f, n) + wire_bytes(
            "all_reduce", 2 * b * s * f, n
        )
    else:
        terms["gather logits"] = wire_bytes("all_gather", b * s * v * f, n)
    return {"terms": terms, "total": sum(terms.values())}


MINIMUM_LAYOUT = {"hf_tp": (False, False), "ours_tp": (False, False), "ours_sp_lp": (True, True)}


def _mib(x: float) -> str:
    return f"{x / 2**20:.1f}"


def report(opts: Options, results: list[dict[str, Any]], elapsed: float, command: str, on: str) -> str:
    tokens = opts.batch * opts.seq
    names = list(opts.variants)
    r0 = results[0]
    lines: list[str] = [
        f"Model: Llama, hidden {opts.hidden}, {opts.layers} layers, {opts.heads} heads / {opts.kv_heads} kv heads,"
        f" intermediate {opts.intermediate}, vocab {opts.vocab}; batch {opts.batch} x seq {opts.seq} ="
        f" {tokens} tokens/step; fp32; SGD; {opts.warmup} warmup + {opts.steps} measured rounds, variants"
        " interleaved in rotating order.",
        "",
        "| variant | tokens/s (median) | speed vs transformers TP (paired median) | step s median [min-max]"
        " | CPU s/step (sum of ranks) | peak tensor MiB/rank | comm MiB/rank/step | analytical min MiB/rank/step"
        " | measured/min | max abs loss diff vs one process |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    walls = {n: r0["wall"][n] for n in names}
    single_losses = r0["losses"].get("single_1t")
    for n in names:
        median = statistics.median(walls[n])
        cpu = sum(statistics.median(r["cpu"][n]) for r in results)
        peak = max(r["memory"][n]["peak"] for r in results if n in r["memory"])
        measured = max(
            (sum(rec["wire"] for rec in r["comm"][n]["records"]) for r in results if n in r["comm"]), default=0.0
        )
        if n in MINIMUM_LAYOUT:
            sp, lp = MINIMUM_LAYOUT[n]
            minimum = analytical_minimum(opts, sequence_parallel=sp, loss_parallel=lp)["total"]
            minimum_text, ratio = _mib(minimum), f"{measured / minimum:.2f}"
        else:
            minimum_text, ratio = "0", "-"
        # Per-round ratios: both were timed in the same round, so a load spike hits both.
        rel = statistics.median(h / w for h, w in zip(walls["hf_tp"], walls[n]))
        diff = "-"
        if single_losses and n != "single_1t":
            diff = f"{max(abs(a - b) for a, b in zip(r0['losses'][n], single_losses)):.1e}"
        lines.append(
            f"| {LABELS[n]} | {tokens / median:.0f} | {rel:.2f}x"
            f" | {median:.2f} [{min(walls[n]):.2f}-{max(walls[n]):.2f}]"
            f" | {cpu:.2f} | {_mib(peak)} | {_mib(measured)} | {minimum_text} | {ratio} | {diff} |"
        )
    lines += [
        "",
        "Peak tensor memory per rank (worse rank) = model state alive at the step's start (the storages behind"
        " parameters and buffers; gradients are None there and SGD keeps no state) + the peak of the step's own"
        " allocations (forward, backward, optimizer step; profiler, c10 CPU allocator). 'Saved for backward' is"
        " the distinct storages autograd held at the end of forward (activations, not parameters):",
        "",
        "| variant | local params MiB | state MiB (storages held) | saved for backward MiB | step peak MiB | peak MiB"
        " | MemTracker peak MiB (its ACT + TEMP at peak) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for n in names:
        mem = max((r["memory"][n] for r in results if n in r["memory"]), key=lambda m: m["peak"])
        tracked = mem["memtracker"]
        lines.append(
            f"| {LABELS[n]} | {_mib(r0['local_params'][n] * 4)} | {_mib(mem['state'])} | {_mib(mem['saved'])}"
            f" | {_mib(mem['step_peak'])} | {_mib(mem['peak'])} | {_mib(tracked['Total'])}"
            f" ({_mib(tracked.get('ACT', 0))} + {_mib(tracked.get('TEMP', 0))}) |"
        )
    lines += [
        "",
        "Collectives per rank per step (rank 0; rank 1 issues the same ops unless noted), wire bytes as sent by one"
        " rank with ring algorithms:",
        "",
        "| variant | op | shape (first tensor) | count | wire MiB each | wire MiB total |",
        "|---|---|---|---:|---:|---:|",
    ]
    for n in names:
        if n not in r0["comm"]:
            continue
        groups: dict[tuple, list[dict]] = defaultdict(list)
        for rec in r0["comm"][n]["records"]:
            groups[(rec["op"], tuple(rec["shape"]))].append(rec)
        for (op, shape), recs in sorted(groups.items(), key=lambda kv: -sum(x["wire"] for x in kv[1])):
            lines.append(
                f"| {n} | `{op}` | {list(shape)} | {len(recs)} | {recs[0]['wire'] / 2**20:.3f}"
                f" | {sum(x['wire'] for x in recs) / 2**20:.3f} |"
            )
        ops = [(x["op"], x["shape"]) for x in r0["comm"][n]["records"]]
        if any([(x["op"], x["shape"]) for x in r["comm"][n]["records"]] != ops for r in results[1:] if n in r["comm"]):
            lines.append(f"| {n} | (rank 1 differs) | | | | |")
    lines += ["", "`CommDebugMode` counts in the same step (cross-check):", ""]
    for n in names:
        if n in r0["comm"]:
            counts = ", ".join(f"{k}: {v}" for k, v in r0["comm"][n]["debug_counts"].items())
            lines.append(f"* {n}: {counts or 'none'}")
    lines += ["", "Analytical minimum, MiB per rank per step:", ""]
    for label, (sp, lp) in (("TP, no SP, gathered logits", (False, False)), ("TP + SP + loss parallel", (True, True))):
        mini = analytical_minimum(opts, sequence_parallel=sp, loss_parallel=lp)
        terms = "; ".join(f"{k} {v / 2**20:.3f}" for k, v in mini["terms"].items())
        lines.append(f"* {label}: {terms}; total {mini['total'] / 2**20:.3f}")
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
    parser.add_argument("--variants", default=",".join(defaults.variants), help="comma-separated subset")
    parser.add_argument("--quick", action="store_true", help="a tiny model and 1+2 rounds: checks the script runs")
    add_report_arguments(parser, output=True, json_out=True)
    args = parser.parse_args(argv)
    opts = Options(**{f: getattr(args, f) for f in _SIZE_FIELDS})
    opts.variants = tuple(v for v in args.variants.split(",") if v)
    if args.quick:
        opts = Options(
            hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=256, seq=32, warmup=1, steps=2,
            variants=opts.variants,
        )
    unknown = set(opts.variants) - set(LABELS)
    if unknown or "hf_tp" not in opts.variants:
        parser.error(f"--variants: unknown {sorted(unknown)} or no hf_tp (the reference); known: {list(LABELS)}")

    with Timed() as run, tempfile.TemporaryDirectory(prefix="tp_bench_") as tmp:
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
    write_json(args.json, {"options": asdict(opts), "results": results, "elapsed": run.elapsed, "command": ran}, None)
    text = report(opts, results, run.elapsed, ran, machine(run.load, packages=("transformers", "lightning"), python=True))
    print(text)
    write_report(args.output, text)


if __name__ == "__main__":
    main()
