"""Sample packing vs padding, measured: padding fraction and tokens/s on a realistic spread of lengths.

One process trains a small Llama (the tensor-parallel benchmark's size by default: hidden 512, 8 layers,
8 heads / 4 kv heads, intermediate 1376, vocab 16384; fp32, sdpa) on synthetic samples whose lengths are
drawn uniformly from 32-1024 tokens (random token ids, every token a target), in two ways:

* **padding**: batches of ``--batch`` samples in dataset order, right-padded to the longest sample of the
  batch (``lightning_plugins.data.collate_causal_lm``, what ``data.packing: false`` gives);
* **packing**: the same samples first-fit into rows of exactly ``--max-len`` tokens with restarting
  ``position_ids`` and no ``attention_mask`` (``pack_examples`` + ``collate_packed``), ``--rows`` rows per
  step; transformers masks attention block-diagonally from the positions. The default 7 rows hold about as
  many tokens (pads included) as a padded batch of 8 such samples, so both modes run steps of one size.

Both see the same ``--samples`` samples (packed all at once, as ``build_dataset`` does), their steps split
into ``--rounds`` rounds in which the order of the two modes alternates (so that the load of a shared
machine falls on both alike), after one warm-up step each. A step is forward + backward + an SGD step with learning rate 0, so the weights never
change and the token-summed loss of a round must be the same in both modes: the script checks it (the
math does not change, only the layout of the tokens).

Measured: the padding fraction (pad tokens / all tokens in the batches), real (non-pad) tokens/s (also
per CPU-second of the process, which another process's load on a shared machine disturbs less, and per
round), and all tokens/s (the per-token cost, which packing raises a little: its attention covers whole rows with a
mask instead of one sample). The padding fractions of larger synthetic datasets (10,000 samples) are
also reported for uniform and log-uniform length spreads, padded per batch or to ``--max-len``.

Usage::

    python benchmarks/packing.py                 # the defaults are the recorded run (a few minutes)
    python benchmarks/packing.py --quick         # a tiny model, seconds: checks that the script runs
"""

from __future__ import annotations

import argparse
import math
import random
import time
from dataclasses import dataclass, fields

import torch

from lightning_plugins.data import IGNORE_INDEX, collate_causal_lm, collate_packed, first_fit, pack_examples
from lightning_plugins.testing.bench import Timed, add_report_arguments, command, machine, write_report

PAD = 0  # samples use ids 1..vocab-1, so real tokens are the non-zero ones in both modes


@dataclass
class Options:
    hidden: int = 512
    layers: int = 8
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 1376
    vocab: int = 16384
    min_len: int = 32
    max_len: int = 1024
    batch: int = 8
    rows: int = 7
    samples: int = 96
    rounds: int = 4
    threads: int = 2
    seed: int = 0


def sample_lengths(n: int, lo: int, hi: int, rng: random.Random, spread: str = "uniform") -> list[int]:
    """``n`` lengths in ``[lo, hi]``: uniform, or log-uniform (many short samples, a few long ones)."""
    if spread == "uniform":
        return [rng.randint(lo, hi) for _ in range(n)]
    return [min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1))))) for _ in range(n)]


def padding_fractions(lengths: list[int], batch: int, max_len: int) -> dict[str, float]:
    """Pad tokens / all tokens when padding per batch, padding to ``max_len``, and packing into ``max_len`` rows."""
    real = sum(lengths)
    per_batch = sum(max(lengths[i : i + batch]) * len(lengths[i : i + batch]) for i in range(0, len(lengths), batch))
    packed_rows = len(first_fit(lengths, max_len))
    return {
        "padding, per batch": 1 - real / per_batch,
        f"padding to {max_len}": 1 - real / (len(lengths) * max_len),
        "packing": 1 - real / (packed_rows * max_len),
    }


def build_model(opts: Options) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=opts.hidden,
        intermediate_size=opts.intermediate,
        num_hidden_layers=opts.layers,
        num_attention_heads=opts.heads,
        num_key_value_heads=opts.kv_heads,
        vocab_size=opts.vocab,
        max_position_embeddings=opts.max_len,
        use_cache=False,  # also what lets transformers detect packed samples (see prepare_model_for_packing)
        attn_implementation="sdpa",
    )
    torch.manual_seed(opts.seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def batches(samples: list[dict], mode: str, opts: Options) -> list[dict[str, torch.Tensor]]:
    if mode == "padding":
        return [collate_causal_lm(samples[i : i + opts.batch], PAD) for i in range(0, len(samples), opts.batch)]
    rows = pack_examples(samples, opts.max_len)
    return [collate_packed(rows[i : i + opts.rows], PAD, opts.max_len) for i in range(0, len(rows), opts.rows)]


def run_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict) -> tuple[float, float, float]:
    """One step; returns (wall seconds, CPU seconds of this process, token-summed loss)."""
    start, cpu_start = time.perf_counter(), time.process_time()
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    targets = (batch["labels"][:, 1:] != IGNORE_INDEX).sum().item()
    return seconds, cpu, loss.item() * targets


def measure(opts: Options) -> dict[str, dict[str, float]]:
    torch.set_num_threads(opts.threads)
    rng = random.Random(opts.seed)
    gen = torch.Generator().manual_seed(opts.seed)
    n = opts.samples
    samples = []
    for length in sample_lengths(n + opts.batch, opts.min_len, opts.max_len, rng):
        ids = torch.randint(PAD + 1, opts.vocab, (length,), generator=gen).tolist()
        samples.append({"input_ids": ids, "labels": ids})
    warmup, samples = samples[n:], samples[:n]
    model = build_model(opts)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    modes = ("padding", "packing")
    stats = {mode: {"seconds": 0.0, "cpu": 0.0, "real": 0, "total": 0, "loss_sum": 0.0, "steps": 0, "rounds": []} for mode in modes}
    for mode in modes:
        run_step(model, optimizer, batches(warmup, mode, opts)[0])
    # The whole set is packed at once, as build_dataset does; each mode's steps are then split into rounds.
    steps = {mode: batches(samples, mode, opts) for mode in modes}
    for round_ in range(opts.rounds):
        for mode in modes if round_ % 2 == 0 else modes[::-1]:
            todo, entry = steps[mode], stats[mode]
            entry["rounds"].append([0, 0.0])  # real tokens, wall seconds
            for batch in todo[round_ * len(todo) // opts.rounds : (round_ + 1) * len(todo) // opts.rounds]:
                seconds, cpu, loss_sum = run_step(model, optimizer, batch)
                real = int((batch["input_ids"] != PAD).sum())
                entry["rounds"][-1][0] += real
                entry["rounds"][-1][1] += seconds
                entry["seconds"] += seconds
                entry["cpu"] += cpu
                entry["loss_sum"] += loss_sum
                entry["steps"] += 1
                entry["total"] += batch["input_ids"].numel()
                entry["real"] += real
        print(f"round {round_ + 1}/{opts.rounds}: " + ", ".join(f"{m} {stats[m]['seconds']:.1f}s" for m in modes), flush=True)
    real = {stats[m]["real"] for m in modes}
    assert len(real) == 1, f"the modes saw different tokens: {real}"
    a, b = (stats[m]["loss_sum"] for m in modes)
    assert abs(a - b) <= 1e-4 * abs(a), f"token-summed losses differ: padding {a}, packing {b}"
    return stats


def report(opts: Options, stats: dict, elapsed: float, command: str, on: str) -> str:
    lines = [
        f"Command ({elapsed:.0f} s wall): `{command}`",
        f"Machine: {on}; {opts.threads} torch threads.",
        "",
        f"Model: Llama hidden {opts.hidden}, {opts.layers} layers, {opts.heads} heads / {opts.kv_heads} kv heads,"
        f" intermediate {opts.intermediate}, vocab {opts.vocab}, fp32, sdpa. Samples: {opts.samples},"
        f" lengths uniform in [{opts.min_len}, {opts.max_len}]; padding: batches of {opts.batch} samples padded to the"
        f" longest; packing: rows of {opts.max_len} tokens, {opts.rows} rows per step.",
        "",
        "| mode | steps | tokens per step (real + pad) | padding fraction | real tokens/s | all tokens/s | time (s) |"
        " real tokens/s vs padding | real tokens per CPU-s vs padding |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = stats["padding"]["real"] / stats["padding"]["seconds"]
    base_cpu = stats["padding"]["real"] / stats["padding"]["cpu"]
    for mode, s in stats.items():
        rate = s["real"] / s["seconds"]
        lines.append(
            f"| {mode} | {s['steps']} | {s['total'] / s['steps']:.0f} | {1 - s['real'] / s['total']:.3f} | {rate:.0f} |"
            f" {s['total'] / s['seconds']:.0f} | {s['seconds']:.1f} | {rate / base:.2f}x | {s['real'] / s['cpu'] / base_cpu:.2f}x |"
        )
    ratios = [
        (pk[0] / pk[1]) / (pd[0] / pd[1]) for pd, pk in zip(stats["padding"]["rounds"], stats["packing"]["rounds"])
    ]
    lines += ["", "Packing's real tokens/s over padding's, per round: " + ", ".join(f"{r:.2f}x" for r in ratios) + "."]
    lines += ["", "Padding fraction of 10,000 synthetic samples (no training; first fit into rows of max_len):", ""]
    lines += [f"| lengths in [{opts.min_len}, {opts.max_len}] | padding, per batch of {opts.batch} | padding to {opts.max_len} | packing |", "|---|---|---|---|"]
    for spread in ("uniform", "log-uniform"):
        fractions = padding_fractions(sample_lengths(10_000, opts.min_len, opts.max_len, random.Random(1), spread), opts.batch, opts.max_len)
        lines.append(f"| {spread} | " + " | ".join(f"{v:.3f}" for v in fractions.values()) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    defaults = Options()
    for field in fields(Options):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=int, default=getattr(defaults, field.name))
    parser.add_argument("--quick", action="store_true", help="a tiny model and few samples: checks the script runs")
    add_report_arguments(parser, output=True)
    args = parser.parse_args(argv)
    opts = Options(**{field.name: getattr(args, field.name) for field in fields(Options)})
    if args.quick:
        opts = Options(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=256, max_len=128, min_len=8,
                       samples=16, rounds=2, threads=opts.threads)
    with Timed() as run:
        stats = measure(opts)
    text = report(opts, stats, run.elapsed, command(argv), machine(run.load, python=True))
    print(text)
    write_report(args.output, text)


if __name__ == "__main__":
    main()
