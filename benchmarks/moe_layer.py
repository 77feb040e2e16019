"""One mixture-of-experts layer, forward + backward: the engine's grouped path against transformers' own two.

One experts module of transformers 5 (Mixtral's ``MixtralExperts`` or Qwen3-MoE's ``Qwen3MoeExperts``: fused 3-D
``gate_up_proj``/``down_proj``) at a CPU-friendly size, fed the same tokens and the same top-k routing, run three
ways in one process:

* ``eager``: transformers' per-expert loop (``config._experts_implementation = "eager"``);
* ``hf_grouped_mm``: transformers' grouped implementation (``"grouped_mm"``);
* ``ours``: :func:`lightning_plugins.parallel.moe.experts.experts_forward` (what ``parallelize`` installs).

Each is timed as ``out = f(x); out.backward(grad)`` (median of ``--repeats``, the three interleaved, after the
checking run and ``--warmup`` more untimed runs; each repeat runs the three in a rotated order, so that none is
always first or last) and reported as ratios to ``ours``. The checking run asserts that
the outputs and the gradients of the input, the routing weights and both weights agree: in fp32 with ``eager`` to
1e-5 of the largest value; in bf16 (where summation order alone moves results by bf16's resolution) each one's
error against fp32 ``eager`` is at most twice the error of transformers' own eager loop in bf16.

Usage::

    python benchmarks/moe_layer.py [--family mixtral --hidden 512 --intermediate 1024 --experts 8 --top-k 2
                                    --tokens 2048 --dtypes fp32 bf16 --repeats 6 --threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_plugins.testing.bench import Timed, add_report_arguments, machine, print_run, write_rows

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
IMPLEMENTATIONS = ("eager", "hf_grouped_mm", "ours")
#: fp32: the largest difference from eager allowed, relative to the largest magnitude of eager's tensor.
TOLERANCE = 1e-5
#: bf16: each implementation's error against fp32 eager may be at most this times transformers' eager loop's own.
BF16_FACTOR = 2.0


def build_experts(family: str, hidden: int, intermediate: int, experts: int, top_k: int, seed: int = 0) -> nn.Module:
    """A transformers experts module of ``family`` with weights drawn from N(0, 0.02) (fp32)."""
    if family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts as Experts

        config = MixtralConfig(
            hidden_size=hidden, intermediate_size=intermediate, num_local_experts=experts, num_experts_per_tok=top_k
        )
    elif family == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as Experts

        config = Qwen3MoeConfig(
            hidden_size=hidden, moe_intermediate_size=intermediate, num_experts=experts, num_experts_per_tok=top_k
        )
    else:
        raise ValueError(f"moe_layer: unknown family {family!r}; use 'mixtral' or 'qwen3_moe'.")
    module = Experts(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    return module


def make_inputs(tokens: int, hidden: int, experts: int, top_k: int, seed: int = 1) -> dict[str, Tensor]:
    """Tokens, a softmax top-k routing of random router logits (weights renormalised, as Mixtral), an output grad."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen)
    weights, index = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return {"x": x, "index": index, "weights": weights, "grad": torch.randn(tokens, hidden, generator=gen)}


def implementation(name: str, module: nn.Module) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """The forward of implementation ``name`` on ``module``."""
    from lightning_plugins.parallel.moe.experts import experts_forward

    if name == "ours":
        return lambda x, index, weights: experts_forward(module, x, index, weights)

    def hf(x: Tensor, index: Tensor, weights: Tensor) -> Tensor:
        module.config._experts_implementation = "eager" if name == "eager" else "grouped_mm"
        return module(x, index, weights)

    return hf


def run_once(
    forward: Callable[[Tensor, Tensor, Tensor], Tensor],
    module: nn.Module,
    inputs: dict[str, Tensor],
    dtype: torch.dtype,
) -> dict[str, Tensor]:
    """One forward + backward; the output and the gradients of the input, the routing weights and the weights."""
    module.zero_grad(set_to_none=True)
    x = inputs["x"].to(dtype, copy=True).requires_grad_(True)
    weights = inputs["weights"].to(dtype, copy=True).requires_grad_(True)
    out = forward(x, inputs["index"], weights)
    out.backward(inputs["grad"].to(dtype))
    grads = {name: p.grad for name, p in module.named_parameters()}
    return {"out": out.detach(), "x": x.grad, "weights": weights.grad, **grads}


def max_relative(result: dict[str, Tensor], reference: dict[str, Tensor]) -> float:
    """The largest difference over every tensor of ``result``, relative to the largest value of its reference."""
    return max(
        ((result[k].float() - reference[k].float()).abs().max() / reference[k].float().abs().max()).item()
        for k in reference
    )


def time_once(forward: Callable, module: nn.Module, inputs: dict[str, Tensor], dtype: torch.dtype) -> float:
    """Seconds of one :func:`run_once`."""
    start = time.perf_counter()
    run_once(forward, module, inputs, dtype)
    return time.perf_counter() - start


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Check the three implementations agree, then time them; the table's rows as a dict."""
    module = build_experts(args.family, args.hidden, args.intermediate, args.experts, args.top_k)
    inputs = make_inputs(args.tokens, args.hidden, args.experts, args.top_k)
    rows: dict[str, Any] = {}
    fp32_eager: dict[str, Tensor] = {}
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        module.to(dtype)
        forwards = {name: implementation(name, module) for name in IMPLEMENTATIONS}
        results = {name: run_once(forwards[name], module, inputs, dtype) for name in IMPLEMENTATIONS}
        reference = results["eager"] if dtype == torch.float32 else fp32_eager
        errors = {name: max_relative(results[name], reference) for name in IMPLEMENTATIONS}
        for name in IMPLEMENTATIONS:
            bound = TOLERANCE if dtype == torch.float32 else BF16_FACTOR * errors["eager"]
            assert errors[name] <= bound, (
                f"{name} ({dtype_name}) differs from fp32 eager by {errors[name]:.3g} relative (bound {bound:.3g})"
            )
        if dtype == torch.float32:
            fp32_eager = results["eager"]
        times: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
        for _ in range(args.warmup):
            for name in IMPLEMENTATIONS:
                time_once(forwards[name], module, inputs, dtype)
        for repeat in range(args.repeats):  # interleaved and rotated: a busy spell or a position hits all alike
            shift = repeat % len(IMPLEMENTATIONS)
            for name in IMPLEMENTATIONS[shift:] + IMPLEMENTATIONS[:shift]:
                times[name].append(time_once(forwards[name], module, inputs, dtype))
        medians = {name: statistics.median(t) for name, t in times.items()}
        rows[dtype_name] = {
            "median_s": medians,
            "ratio_to_ours": {name: medians[name] / medians["ours"] for name in IMPLEMENTATIONS},
            "max_relative_error": errors,
        }
    module.to(torch.float32)
    return rows


def table(rows: dict[str, Any]) -> str:
    """The measurements as a markdown table, one row per dtype."""
    lines = [
        "| dtype | eager (ms) | hf grouped_mm (ms) | ours (ms) | eager / ours | hf grouped_mm / ours"
        " | max rel. error |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for dtype, row in rows.items():
        ms = {k: 1e3 * v for k, v in row["median_s"].items()}
        ratio = row["ratio_to_ours"]
        error = max(row["max_relative_error"].values())
        lines.append(
            f"| {dtype} | {ms['eager']:.1f} | {ms['hf_grouped_mm']:.1f} | {ms['ours']:.1f} | {ratio['eager']:.2f} |"
            f" {ratio['hf_grouped_mm']:.2f} | {error:.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="mixtral", choices=("mixtral", "qwen3_moe"))
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=tuple(DTYPES))
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print the measurements as JSON too")
    add_report_arguments(parser, out=True)
    args = parser.parse_args()
    if "bf16" in args.dtypes and args.dtypes[0] != "fp32":
        parser.error("--dtypes: bf16 is checked against the fp32 run, so list fp32 first")
    torch.set_num_threads(args.threads)
    with Timed() as run:
        rows = measure(args)
    on = machine(run.load)
    print_run(run.elapsed, on)
    print(
        f"{args.family} experts: hidden {args.hidden}, intermediate {args.intermediate}, {args.experts} experts,"
        f" top-{args.top_k}, {args.tokens} tokens, {args.threads} threads; median of {args.repeats}"
    )
    print(table(rows))
    if args.json:
        print(json.dumps(rows, indent=1))
    write_rows(args.out, args, on, rows)


if __name__ == "__main__":
    main()
