"""Distributed checkpoints, measured: DCP save/load time and size against model size, sync vs async save, and
the peak host memory of ``lightning-plugins export`` against model size.

The "model" is a Llama-shaped set of fp32 weights (hidden 1024, intermediate 2816, vocab 8192; the number of
layers sets the size: 3 / 14 / 61 layers ~ 55M / 197M / 801M parameters; the largest tensor, the 8192 x 1024
embedding, is 32 MiB at every size). Weights only: a training checkpoint adds the optimizer state (AdamW: 2
more copies of the trainable weights), whose save and load cost the same per byte.

1. **Save / load**: ``dcp.save`` of the weights and ``dcp.load`` into preallocated tensors of the same
   layout, in one process and on 2 gloo ranks (each weight row-sharded over the ranks as a DTensor, as
   FSDP2 holds it). Bytes on disk are the checkpoint directory's. The load follows the save, so it reads
   from the page cache: it measures DCP's own cost, not the disk's.
2. **Sync vs async save** (one process, the middle size): a loop of fixed "training steps" (matmuls, ~0.1 s
   each) saving every ``--save-every`` steps with ``dcp.save`` or ``dcp.async_save`` (thread executor; the
   previous save is awaited before the next, as a trainer must), and with the doors' own path
   (``train.async_checkpoint``: ``AsyncCheckpointer`` writing into ``<name>.partial`` with this step's random
   states, renamed into place once complete). Time lost per save = (loop time - loop time without saves) /
   saves; for async also the time the call itself blocks (staging the copy).
3. **Export peak memory**: ``lightning-plugins export`` of each one-process checkpoint in a fresh process;
   the growth of its peak resident set (``VmHWM``) over the export, after imports.

Usage::

    python benchmarks/checkpoint.py              # the recorded run (~3-4 minutes, ~10 GB of temporary disk)
    python benchmarks/checkpoint.py --quick      # small sizes, seconds: checks that the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning_plugins.testing.world import spawn_world
from lightning_plugins.checkpoint.async_save import AsyncCheckpointer
from lightning_plugins.checkpoint.resume import publish, save_rng
from lightning_plugins.testing.bench import Timed, add_report_arguments, machine, print_run, write_rows

HIDDEN, INTERMEDIATE, VOCAB = 1024, 2816, 8192


def shapes(layers: int) -> dict[str, tuple[int, ...]]:
    """The weights of a Llama with ``layers`` decoder layers (q/k/v/o, gate/up/down, two norms each)."""
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"{p}self_attn.{name}.weight"] = (HIDDEN, HIDDEN)
        out[f"{p}mlp.gate_proj.weight"] = (INTERMEDIATE, HIDDEN)
        out[f"{p}mlp.up_proj.weight"] = (INTERMEDIATE, HIDDEN)
        out[f"{p}mlp.down_proj.weight"] = (HIDDEN, INTERMEDIATE)
        out[f"{p}input_layernorm.weight"] = (HIDDEN,)
        out[f"{p}post_attention_layernorm.weight"] = (HIDDEN,)
    out["model.norm.weight"] = (HIDDEN,)
    out["lm_head.weight"] = (VOCAB, HIDDEN)
    return out


def params(layers: int) -> int:
    return sum(torch.Size(s).numel() for s in shapes(layers).values())


def make_state(layers: int, rank: int = 0, world: int = 1, fill: bool = True) -> dict[str, torch.Tensor]:
    """The weights (this rank's rows of each as a DTensor when ``world > 1``)."""
    state: dict[str, torch.Tensor] = {}
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
    for name, shape in shapes(layers).items():
        rows = shape[0] // world
        local = torch.empty((rows, *shape[1:]))
        if fill:
            local.uniform_(-0.02, 0.02)
        if mesh is not None:
            from torch.distributed.tensor import DTensor, Shard

            local = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        state[name] = local
    return state


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def save_load(layers: int, directory: Path, rank: int = 0, world: int = 1) -> dict[str, float]:
    """Seconds to save the weights and to load them back into preallocated tensors of the same layout."""
    state = {"model": make_state(layers, rank, world)}
    _barrier(world)
    start = time.perf_counter()
    dcp.save(state, checkpoint_id=directory, no_dist=world == 1)
    _barrier(world)
    saved = time.perf_counter() - start
    target = {"model": make_state(layers, rank, world, fill=False)}
    _barrier(world)
    start = time.perf_counter()
    dcp.load(target, checkpoint_id=directory, no_dist=world == 1)
    _barrier(world)
    loaded = time.perf_counter() - start
    name = "model.layers.0.mlp.up_proj.weight"
    same = torch.equal(_local(target["model"][name]), _local(state["model"][name]))
    assert same, "loaded weights differ from the saved ones"
    return {"save_s": saved, "load_s": loaded}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _rank_entry(rank: int, world: int, layers: int, directory: str, out: str) -> None:
    result = save_load(layers, Path(directory), rank, world)
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def save_load_world(layers: int, directory: Path, world: int) -> dict[str, float]:
    out = directory.with_suffix(".json")
    spawn_world(_rank_entry, world, world, layers, str(directory), str(out), threads=None)
    return json.loads(out.read_text())


def _train_step(a: torch.Tensor, b: torch.Tensor, repeat: int) -> None:
    for _ in range(repeat):
        torch.mm(a, b)


def _door_save(saver: AsyncCheckpointer, state: dict[str, Any], target: Path) -> None:
    """What the doors do with ``train.async_checkpoint``: wait for the previous save, write this step's random states
    into ``<target>.partial``, start the DCP save, publish (rename) the directory once it is complete."""
    saver.wait()
    partial = target.with_name(target.name + ".partial")
    partial.mkdir(parents=True)
    save_rng(partial, 0)
    saver.save(state, partial, lambda: publish(partial, target))


def sync_vs_async(layers: int, root: Path, steps: int, save_every: int) -> dict[str, dict[str, float]]:
    """Loop time with no saves, with ``dcp.save``, with ``dcp.async_save`` and with the doors' asynchronous save
    (:class:`~lightning_plugins.checkpoint.async_save.AsyncCheckpointer`) every ``save_every`` steps."""
    state = {"model": make_state(layers)}
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    repeat = 1
    start = time.perf_counter()
    _train_step(a, b, 50)
    repeat = max(1, int(50 * 0.1 / (time.perf_counter() - start)))  # ~0.1 s per step
    results: dict[str, dict[str, float]] = {}
    for mode in ("none", "sync", "async", "door"):
        pending, blocked, saves, saver = None, 0.0, 0, AsyncCheckpointer()
        start = time.perf_counter()
        for step in range(1, steps + 1):
            _train_step(a, b, repeat)
            if mode != "none" and step % save_every == 0:
                target = root / f"{mode}_{step}"
                call = time.perf_counter()
                if mode == "sync":
                    dcp.save(state, checkpoint_id=target, no_dist=True)
                elif mode == "door":
                    _door_save(saver, state, target)
                else:
                    if pending is not None:
                        pending.result()
                    pending = dcp.async_save(state, checkpoint_id=target, no_dist=True)
                blocked += time.perf_counter() - call
                saves += 1
        if pending is not None:
            pending.result()
        saver.wait()
        results[mode] = {"loop_s": time.perf_counter() - start, "blocked_s": blocked, "saves": saves}
        for target in root.glob(f"{mode}_*"):
            shutil.rmtree(target)
    base = results["none"]["loop_s"]
    for mode in ("sync", "async", "door"):
        results[mode]["lost_per_save_s"] = (results[mode]["loop_s"] - base) / results[mode]["saves"]
    return results


_CHILD = """
import json, sys
import torch.distributed.checkpoint, transformers
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.llama import modeling_llama
import lightning_plugins.checkpoint.export
from lightning_plugins.cli import main
def kib():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM:')).split()[1])
before = kib()
import time
start = time.perf_counter()
main(['export', sys.argv[1], sys.argv[2], '--model', sys.argv[3]])
print(json.dumps({'growth_kib': kib() - before, 'seconds': time.perf_counter() - start}))
"""


def export_peak(checkpoint: Path, out: Path, model_dir: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(checkpoint), str(out), str(model_dir)], env=env,
                          capture_output=True, text=True, check=False)  # fmt: skip
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_config(layers: int, directory: Path) -> None:
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, vocab_size=VOCAB, num_hidden_layers=layers,
                num_attention_heads=8, num_key_value_heads=8).save_pretrained(directory)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[3, 14, 61], help="model sizes, in decoder layers")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="world sizes for save/load")
    parser.add_argument("--async-layers", type=int, default=14, help="model size of the sync vs async loop")
    parser.add_argument("--steps", type=int, default=60, help="training steps of the sync vs async loop")
    parser.add_argument("--save-every", type=int, default=30, help="steps between saves (~0.1 s each)")
    parser.add_argument("--async-only", action="store_true", help="only the sync vs async loop")
    parser.add_argument("--quick", action="store_true", help="small sizes: checks that the script runs")
    parser.add_argument("--tmp", default=None, help="where to write the checkpoints (default: the system's temp)")
    add_report_arguments(parser, out=True)
    args = parser.parse_args()
    if args.quick:
        args.layers, args.async_layers, args.steps, args.save_every = [1, 2], 1, 6, 3
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
    print(f"Machine: {machine(python=True)}\n")
    rows: list[dict] = []
    with Timed() as run, tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        root = Path(tmp)
        print("| params | fp32 weights | ranks | save (s) | save GB/s | load (s) | load GB/s | on disk |")
        print("|---|---|---|---|---|---|---|---|")
        exports = []
        for layers in [] if args.async_only else args.layers:
            size = params(layers) * 4
            for world in args.ranks:
                ckpt = root / f"ckpt_{layers}_{world}"
                result = save_load(layers, ckpt) if world == 1 else save_load_world(layers, ckpt, world)
                disk = directory_bytes(ckpt)
                rows.append({"layers": layers, "params": params(layers), "ranks": world, **result, "disk_bytes": disk})
                print(f"| {params(layers) / 1e6:.0f}M | {size / 2**30:.2f} GiB | {world} | {result['save_s']:.2f} |"
                      f" {size / 1e9 / result['save_s']:.2f} | {result['load_s']:.2f} | {size / 1e9 / result['load_s']:.2f} |"
                      f" {disk / 2**30:.2f} GiB |", flush=True)  # fmt: skip
                if world == 1:
                    model_dir = root / f"config_{layers}"
                    write_config(layers, model_dir)
                    exports.append((layers, export_peak(ckpt, root / f"hf_{layers}", model_dir)))
                    shutil.rmtree(root / f"hf_{layers}")
                shutil.rmtree(ckpt)
        largest = max(torch.Size(s).numel() for s in shapes(1).values()) * 4
        print(f"\nExport (`lightning-plugins export`, one process), largest tensor {largest / 2**20:.0f} MiB:\n")
        print("| params | fp32 weights | peak RSS growth | export (s) |")
        print("|---|---|---|---|")
        for layers, result in exports:
            print(f"| {params(layers) / 1e6:.0f}M | {params(layers) * 4 / 2**30:.2f} GiB |"
                  f" {result['growth_kib'] / 1024:.0f} MiB | {result['seconds']:.1f} |")  # fmt: skip
        loop = sync_vs_async(args.async_layers, root, args.steps, args.save_every)
        size = params(args.async_layers) * 4
        print(f"\nSync vs async save, {params(args.async_layers) / 1e6:.0f}M params ({size / 2**30:.2f} GiB), "
              f"{args.steps} steps, a save every {args.save_every}:\n")  # fmt: skip
        print("| save | loop (s) | saves | blocked in the call per save (s) | training time lost per save (s) |")
        print("|---|---|---|---|---|")
        for mode, result in loop.items():
            saves = result["saves"]
            blocked = f"{result['blocked_s'] / saves:.2f}" if saves else "-"
            lost = f"{result['lost_per_save_s']:.2f}" if saves else "-"
            print(f"| {mode} | {result['loop_s']:.1f} | {saves} | {blocked} | {lost} |")
    on = machine(run.load, python=True)
    print_run(run.elapsed, on)
    write_rows(args.out, args, on, {"save_load": rows, "export": dict(exports), "sync_vs_async": loop})


if __name__ == "__main__":
    main()
