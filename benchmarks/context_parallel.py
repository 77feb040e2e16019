"""Context parallelism: memory per rank, tokens/s and bytes communicated against sequence length.

For cp = 1 (the model's own SDPA, one process), and cp = 2, 4 with both backends (Ulysses, ring), a
small Llama (GQA) trains one sequence per step through ``parallelize`` (FSDP2 over the cp ranks) on a
gloo world of ``cp`` CPU processes. Per configuration and sequence length, rank 0 reports:

* ``peak``: the peak of all tensor memory of the step (parameters, gradients, optimizer state,
  activations, temporaries), from ``torch.distributed._tools.mem_tracker.MemTracker``;
* ``saved``: the activations saved for backward at the end of forward (``saved_tensors_hooks``,
  each storage once, parameters excluded): the memory that grows with the sequence;
* ``tok/s``: global tokens per second of a training step (best of ``--steps`` after one warm-up);
* ``comm``: bytes this rank's attention sends to other ranks in one step (all-to-all slices for other
  ranks, ring sends), next to the analytical volume ``model`` of the backend.

    python benchmarks/context_parallel.py                       # 1K..8K, cp 1/2/4, both backends
    python benchmarks/context_parallel.py --seqs 1024 2048 --cps 1 2
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_plugins.testing.bench import Timed, add_world_arguments, machine, print_report, write_rows
from lightning_plugins.testing.models import tiny_llama
from lightning_plugins.testing.world import world_rows

MIB = 2**20


def _config(args: argparse.Namespace) -> Any:
    return tiny_llama(args.hidden, args.layers, args.heads, args.kv_heads, args.vocab, max(args.seqs), 2 * args.hidden)


def analytical_bytes(backend: str, cp: int, seq: int, args: argparse.Namespace, elem: int = 4) -> int:
    """Bytes one rank sends for attention in one training step (forward + backward, every layer).

    Ulysses: four all-to-alls forward (q, k, v in; out back) and four backward, each sending the
    (cp - 1) / cp of its local tensor that belongs to other ranks; k/v heads are first repeated to
    ``lcm(kv_heads, cp)``. Ring: the K/V block goes around the ring cp - 1 times forward and again
    backward, and the dK/dV accumulators cp times (the last hop brings the sum home).
    """
    if cp == 1:
        return 0
    head_dim = args.hidden // args.heads
    local = seq // cp * head_dim  # elements per head of one rank's shard (batch 1)
    if backend == "ulysses":
        kv = args.kv_heads * (cp // math.gcd(args.kv_heads, cp))
        per_layer = 2 * (2 * args.heads + 2 * kv) * local * (cp - 1) // cp
    else:
        per_layer = (3 * cp - 2) * 2 * args.kv_heads * local
    return per_layer * args.layers * elem


class _CommCounter:
    """Counts the bytes the context-parallel kernels send to other ranks (patched into torch.distributed)."""

    def __init__(self) -> None:
        self.sent = 0
        self._originals: dict[str, Any] = {}

    def __enter__(self) -> _CommCounter:
        a2a, batch = dist.all_to_all_single, dist.batch_isend_irecv

        def all_to_all_single(output, input, *args, group=None, **kwargs):
            size = dist.get_world_size(group)
            self.sent += input.numel() * input.element_size() * (size - 1) // size
            return a2a(output, input, *args, group=group, **kwargs)

        def batch_isend_irecv(ops):
            self.sent += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
            return batch(ops)

        self._originals = {"all_to_all_single": a2a, "batch_isend_irecv": batch}
        dist.all_to_all_single, dist.batch_isend_irecv = all_to_all_single, batch_isend_irecv
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)


class _SavedActivations:
    """Bytes of the distinct storages saved for backward (parameters excluded)."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not (tensor.is_leaf and tensor.requires_grad):
            storage = tensor.untyped_storage()
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def _measure(args: argparse.Namespace, cp: int, backend: str, seq: int) -> dict[str, Any]:
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import AutoModelForCausalLM

    from lightning_plugins import ParallelLayout, ParallelOptions, parallelize
    from lightning_plugins.parallel import context_parallel_batch, mesh_of

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(args), dtype=torch.float32)
    options = ParallelOptions(cp_backend=backend) if cp > 1 else ParallelOptions()  # cp=1: plain SDPA
    model = parallelize(model, ParallelLayout(cp_size=cp).resolve(cp), options)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    generator = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, args.vocab, (1, seq), generator=generator)
    batch = context_parallel_batch({"input_ids": ids, "labels": ids}, mesh_of(model))

    def step(saved: _SavedActivations | None = None) -> None:
        if saved is None:
            loss = model(**batch).loss
        else:
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up: optimizer state exists from here on, as in training
    times = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    saved = _SavedActivations()
    with _CommCounter() as comm:
        step(saved)
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return {
        "cp": cp,
        "backend": backend if cp > 1 else "sdpa (one process)",
        "seq": seq,
        "peak_mib": peak / MIB,
        "saved_mib": saved.total / MIB,
        "tokens_per_s": seq / min(times),
        "comm_mib": comm.sent / MIB,
        "model_mib": analytical_bytes(backend, cp, seq, args) / MIB,
    }


def _rank(rank: int, cp: int, args: argparse.Namespace, out: str) -> None:
    rows = []
    for backend in ("ulysses", "ring") if cp > 1 else ("sdpa",):
        for seq in args.seqs:
            rows.append(_measure(args, cp, backend, seq))
            if rank == 0:
                print(json.dumps(rows[-1]), flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def table(rows: list[dict[str, Any]]) -> str:
    base = {r["seq"]: r for r in rows if r["cp"] == 1}
    lines = [
        "| cp | backend | seq | peak MiB/rank | saved act. MiB/rank | saved vs cp=1 | tokens/s"
        " | comm MiB/rank/step | analytical MiB |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = f"{r['saved_mib'] / base[r['seq']]['saved_mib']:.3f}" if r["seq"] in base else "-"
        lines.append(
            f"| {r['cp']} | {r['backend']} | {r['seq']} | {r['peak_mib']:.1f} | {r['saved_mib']:.1f} | {ratio} |"
            f" {r['tokens_per_s']:.0f} | {r['comm_mib']:.2f} | {r['model_mib']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--steps", type=int, default=2, help="timed steps (best is reported) after one warm-up")
    add_world_arguments(parser)
    args = parser.parse_args(argv)

    rows: list[dict[str, Any]] = []
    with Timed() as run:
        for cp in args.cps:
            rows += world_rows(_rank, cp, cp, args, threads=args.threads)
    on = machine(run.load)
    print_report(table(rows), run.elapsed, on)
    write_rows(args.out, args, on, rows)


if __name__ == "__main__":
    main()
