"""Llama-3.1-8B on one GPU with the speed levers: tokens/s, MFU and peak memory next to the planner's prediction.

Random weights in the shape of ``recipes/configs/Llama-3.1-8B`` (bf16 parameters, SDPA attention), one row of 4,096
tokens per step, AdamW (``foreach``), through :func:`lightning_plugins.parallelize` on a world of one. Settings: LoRA
(r=16 on every linear of the decoder) and a full fine-tune (full activation checkpointing: 8B of bf16 weights,
gradients and AdamW state take 64 GB), each eager, with ``compile=True`` and with ``compile=True, float8=True``
(compute capability 8.9 or newer). ``--steps`` steps per setting after ``--warmup`` (compilation) steps; the
measured steps are timed with CUDA synchronisation. Each row: tokens/s, MFU (the planner's model FLOPs per token over
the GPU's dense bf16 peak), ``torch.cuda.max_memory_allocated`` of the measured steps, and the planner's tokens/s and
peak for the same settings (``lightning_plugins.planner.plan`` on this GPU). Anchor: NeMo AutoModel publishes
12,473 tokens/s per H100 for Llama-3 8B LoRA at 4K.

    python benchmarks/gpu_llama8b.py --out gpu_llama8b.json
    python benchmarks/gpu_llama8b.py --dry   # CPU, 2-layer tiny config: proves the script runs end to end

``--dry`` runs every setting on CPU (gloo) with a 2-layer, 256-wide model of the same family at 256 tokens: float8
is refused there (the row records the refusal), compile runs on inductor's C++ backend; the planner rows are for an
H100. Writes JSON (``--out``) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from lightning_plugins import MemoryOptions, OptionsError, ParallelLayout, ParallelOptions, parallelize
from lightning_plugins.adapters.lora import LoraOptions, apply_lora
from lightning_plugins.planner.hardware import GPUS, cluster_from, peak_flops
from lightning_plugins.planner.model_stats import load_model_config, model_stats
from lightning_plugins.planner.report import plan
from lightning_plugins.planner.workload import Workload
from lightning_plugins.testing.bench import Timed, add_report_arguments, machine, print_report, write_json

GIB = 2**30
LORA = LoraOptions(r=16, alpha=32, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
METHODS = {"lora": {}, "full": {"activation_checkpointing": "full"}}
KERNELS = {"eager": {}, "compile": {"compile": True}, "compile + float8": {"compile": True, "float8": True}}
TINY = {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024}  # fmt: skip


def _config(dry: bool) -> Any:
    config = load_model_config("Llama-3.1-8B")
    if dry:
        for key, value in TINY.items():
            setattr(config, key, value)
    config.use_cache = False
    return config


def _model(config: Any, device: str, lora: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.train()
    return apply_lora(model, LORA) if lora else model


def _gpu_key(device: str) -> str:
    if device != "cuda":
        return "H100"
    name = torch.cuda.get_device_name()  # as peak_flops matches it: "NVIDIA H100 80GB HBM3" is an H100
    return next((key for key in GPUS if key in name), "H100")


def _predicted(config: Any, method: str, options: ParallelOptions, memory: MemoryOptions, seq: int, device: str) -> dict:
    workload = Workload(
        config, ParallelLayout().resolve(1), options, memory, LORA if method == "lora" else None, seq_len=seq
    )
    result = plan(workload, cluster_from(_gpu_key(device), gpus=1))
    return {"predicted_tokens_per_s": result.step.tokens_per_s_per_gpu, "predicted_peak_gib": result.peak / GIB}


def _measure(config: Any, method: str, options: ParallelOptions, memory: MemoryOptions, args: argparse.Namespace) -> dict:
    device = "cuda" if torch.cuda.is_available() and not args.dry else "cpu"
    model = parallelize(_model(config, device, method == "lora"), ParallelLayout(), options, memory)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, foreach=True)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (1, args.seq), generator=gen).to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            sync()
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sync()
    seconds = (time.perf_counter() - start) / args.steps
    stats = model_stats(config)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad) if method == "lora" else 0
    flops = stats.flops_per_token(args.seq, trainable=method, adapter_params=adapters)
    tokens_per_s = args.seq / seconds
    peak = peak_flops(torch.cuda.get_device_name()) if device == "cuda" else None
    row = {
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * flops / peak if peak else None,
        "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / GIB if device == "cuda" else None,
    }
    del model, optimizer
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def run(args: argparse.Namespace, backend: str) -> list[dict]:
    """Every (method, kernels) row: measured, or the refusal that kept it from running, next to the prediction.

    The planner's predictions come first: its dry run makes its own fake process groups.
    """
    config = _config(args.dry)
    device = "cuda" if backend == "nccl" else "cpu"
    settings = [
        (method, kernels, ParallelOptions(**options), MemoryOptions(**memory))
        for method, memory in METHODS.items()
        for kernels, options in KERNELS.items()
    ]
    rows = [
        {"method": method, "kernels": kernels, "seq_len": args.seq, **_predicted(config, method, o, m, args.seq, device)}
        for method, kernels, o, m in settings
    ]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group(backend, rank=0, world_size=1)
    try:
        for row, (method, _, options, memory) in zip(rows, settings):
            try:
                row.update(_measure(config, method, options, memory, args))
            except OptionsError as err:  # float8 on a GPU (or CPU) that cannot run it
                row["refused"] = str(err)
            torch._dynamo.reset()
            print(json.dumps(row), flush=True)
    finally:
        dist.destroy_process_group()
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a markdown table."""

    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [
        "| method | kernels | tokens/s | MFU | max allocated GiB | planner tokens/s | planner peak GiB |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        measured = ("refused", "", "") if "refused" in r else (
            fmt(r["tokens_per_s"], ",.0f"), fmt(r["mfu"], ".1%"), fmt(r["max_memory_allocated_gib"], ".1f"))  # fmt: skip
        lines.append(
            f"| {r['method']} | {r['kernels']} | {' | '.join(measured)} | {r['predicted_tokens_per_s']:,.0f}"
            f" | {r['predicted_peak_gib']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry", action="store_true", help="CPU, 2-layer tiny config, 256 tokens")
    parser.add_argument("--seq", type=int, default=None, help="tokens per step (default 4096; 256 with --dry)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps (default 10; 1 with --dry)")
    parser.add_argument("--warmup", type=int, default=3, help="steps before measuring (compilation)")
    add_report_arguments(parser, out=True, out_default="gpu_llama8b.json")
    args = parser.parse_args()
    args.seq = args.seq or (256 if args.dry else 4096)
    args.steps = args.steps or (1 if args.dry else 10)
    if args.dry:
        args.warmup = min(args.warmup, 1)
    backend = "nccl" if torch.cuda.is_available() and not args.dry else "gloo"
    with Timed() as timed:
        rows = run(args, backend)
    device = torch.cuda.get_device_name() if backend == "nccl" else "cpu"
    on = machine(timed.load, backend="gloo" if device == "cpu" else f"nccl, {device}")
    write_json(args.out, {"device": device, "machine": on, "rows": rows})
    print_report(table(rows), timed.elapsed, on)


if __name__ == "__main__":
    main()
