"""The host-memory levers on a GPU: peak memory, step time and the trained weights against the plain run.

An 852M-parameter Llama (16 layers of width 2048, 32K vocabulary) in fp32 with bf16 autocast, 2 x 2048 tokens per
step, AdamW, clipping; three steps per setting from the same initial weights, the third measured (peak of forward
and backward, peak of the optimizer step, what stays allocated after it, and their times). Settings: plain (twice:
the second shows the run-to-run noise of the GPU kernels, against which the levers' weights are compared),
``optimizer_offload`` with the host AdamW's per-parameter loop (``fused=False``) and fused (what
``make_optimizer`` uses), ``activation_offload``, full checkpointing with and without ``activation_offload``, and
FSDP2 on one rank (DTensor parameters) with and without ``optimizer_offload`` (loop). Needs only torch and
transformers besides the two modules it measures. Prints a table and writes JSON; ``offload_gpu_h100.json`` is one
H100 run (torch 2.11).

    python benchmarks/offload_gpu.py --out offload_gpu.json
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_plugins.parallel.memory.activation import apply_activation_checkpointing
from lightning_plugins.parallel.optim.offload import offload_optimizer
from lightning_plugins.testing.bench import Timed, add_report_arguments, machine, print_run, write_json

SETTINGS = {
    "plain": {},
    "plain, again (run-to-run noise)": {},
    "optimizer_offload": {"optimizer": True},
    "optimizer_offload, fused host AdamW": {"optimizer": True, "fused": True},
    "activation_offload": {"activations": True},
    "full AC": {"checkpointing": "full"},
    "full AC + activation_offload": {"checkpointing": "full", "activations": True},
    "fsdp2 (1 rank)": {"fsdp": True},
    "fsdp2 (1 rank) + optimizer_offload": {"fsdp": True, "optimizer": True},
}
GIB = 2**30


def _model(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers, num_attention_heads=16,
                         num_key_value_heads=4, vocab_size=32000, attn_implementation="sdpa", use_cache=False)  # fmt: skip
    return LlamaForCausalLM(config).cuda().train()


def _run(setting: dict, layers: int, batch: dict, steps: int) -> tuple[dict, torch.nn.Module]:
    assert torch.cuda.memory_allocated() < GIB, "the previous setting's model is still alive"
    model = _model(layers)
    apply_activation_checkpointing(model.model.layers, setting.get("checkpointing", "none"),
                                   offload=setting.get("activations", False))  # fmt: skip
    if setting.get("fsdp"):
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    hyper = {"lr": 1e-4, "weight_decay": 0.1}
    params = list(model.parameters())
    if setting.get("optimizer"):
        optimizer = offload_optimizer(torch.optim.AdamW, params, **hyper, fused=setting.get("fused", False))
    else:
        optimizer = torch.optim.AdamW(params, **hyper)
    losses, result = [], {}
    for step in range(steps):
        measured = step == steps - 1
        if measured:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if measured:
            torch.cuda.synchronize()
            result["forward_backward_s"] = time.perf_counter() - start
            result["peak_forward_backward_gib"] = torch.cuda.max_memory_allocated() / GIB
            torch.cuda.reset_peak_memory_stats()
            before_step = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    torch.cuda.synchronize()
    end = time.perf_counter()
    result.update(losses=losses, peak_optimizer_step_gib=torch.cuda.max_memory_allocated() / GIB,
                  resident_gib=torch.cuda.memory_allocated() / GIB, optimizer_step_s=end - before_step,
                  step_s=end - start)  # fmt: skip
    return result, model


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu() for p in model.parameters()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    add_report_arguments(parser, out=True, out_default="offload_gpu.json")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32000, (args.batch, args.seq), generator=gen).cuda()
    with Timed() as timed:
        results = _measure(args, {"input_ids": ids, "labels": ids})
    on = machine(timed.load, backend=f"nccl, {torch.cuda.get_device_name()}")
    print_run(timed.elapsed, on)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "machine": on, **vars(args)}
    write_json(args.out, {"meta": meta | {"out": str(args.out)}, "results": results}, indent=2)
    dist.destroy_process_group()


def _measure(args: argparse.Namespace, batch: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Every setting, its line printed as it is measured."""
    results, reference = {}, None
    for name, setting in SETTINGS.items():
        result, model = _run(setting, args.layers, batch, args.steps)
        weights = _weights(model)
        if reference is None:
            reference = weights
        result["max_weight_diff_vs_plain"] = max((a - b).abs().max().item() for a, b in zip(weights, reference))
        results[name] = result
        del model, weights
        gc.collect()  # FSDP2 modules sit in reference cycles: free them before the next setting is measured
        torch.cuda.empty_cache()
        print(f"{name:38s} peak fwd+bwd {result['peak_forward_backward_gib']:5.2f} GiB, step"
              f" {result['peak_optimizer_step_gib']:5.2f} GiB, resident {result['resident_gib']:5.2f} GiB; fwd+bwd"
              f" {result['forward_backward_s']:.3f} s, optimizer {result['optimizer_step_s']:.3f} s; losses"
              f" {[round(x, 4) for x in result['losses']]}; max |w - plain| {result['max_weight_diff_vs_plain']:.1e}",
              flush=True)  # fmt: skip
    return results


if __name__ == "__main__":
    main()
