"""Sequence parallelism for fallback families, measured: activation memory per rank under TP=2 with and without SP.

A family without a registered plan (Gemma 2, OLMo 2, Phi-3) gets its TP plan from the config's
``base_model_tp_plan`` and its sequence-parallel regions derived from its structure (``parallel/families.py``).
This script measures what that saves, against Llama (a registered family) at the same size as the anchor, and
compares it with what the planner's formula (``planner/rank_memory.py``: Korthikanti et al., SP divides a layer's
activations by ``tp``) predicts.

For each family one 2-rank world (gloo, CPU, fp32) runs the same model three ways: one process (rank 0),
``parallelize(model, ParallelLayout(tp_size=2))`` without sequence parallelism and with it (loss parallel follows
SP). Each takes one forward + backward on the same batch; measured:

* **saved per layer**: the distinct storages autograd saves for backward while the decoder layers run
  (``saved_tensors_hooks`` switched on by each layer's forward pre-hook and off by its forward hook; parameters
  excluded; the same accounting as ``benchmarks/tensor_parallel.py``), divided by the number of layers. The
  embedding, final norm, head and loss are left out: the formula is per layer.
* **sequence-length tensors**: of those bytes, the part held in tensors whose shape carries the full sequence
  (a dimension equal to ``seq``) and not the shard (``seq / 2``): under SP that is what the layer did not shard.
* the loss of each variant against the one process's (the math must not change).

Usage (the numbers in ``benchmarks/RESULTS.md`` were taken with the defaults)::

    python benchmarks/sp_fallback_memory.py [--quick] [--families llama,gemma2,olmo2,phi3] [--seq 1024 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_plugins.testing.bench import Timed, add_report_arguments, command, machine, write_report  # noqa: E402
from lightning_plugins.testing.world import spawn_world  # noqa: E402

WORLD = 2
VARIANTS = ("one process", "TP=2", "TP=2 + SP")
FAMILIES = ("llama", "gemma2", "olmo2", "phi3")


@dataclass
class Options:
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 688
    vocab: int = 4096
    seq: int = 1024
    batch: int = 1
    families: tuple[str, ...] = FAMILIES
    plain_norms: bool = False  # MemoryOptions(efficient_norms=False): the models' own RMSNorms (the "before")
    sp_regather: bool = False  # MemoryOptions(sp_regather=True): regions all-gather their input again in backward


def build_config(family: str, opts: Options) -> Any:
    """The family's config at the benchmark's size; each family keeps its own attention implementation."""
    from transformers import Gemma2Config, LlamaConfig, Olmo2Config, Phi3Config

    size = dict(
        hidden_size=opts.hidden, intermediate_size=opts.intermediate, num_hidden_layers=opts.layers,
        num_attention_heads=opts.heads, num_key_value_heads=opts.kv_heads, vocab_size=opts.vocab,
        max_position_embeddings=opts.seq,
    )  # fmt: skip
    if family == "llama":
        return LlamaConfig(**size, attn_implementation="sdpa")
    if family == "gemma2":  # soft-capping needs eager attention; alternating sliding windows of 256
        return Gemma2Config(
            **size, head_dim=opts.hidden // opts.heads, sliding_window=opts.seq // 4, attn_implementation="eager"
        )
    if family == "olmo2":
        return Olmo2Config(**size, pad_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    if family == "phi3":
        return Phi3Config(**size, pad_token_id=0, eos_token_id=2, bos_token_id=1, attn_implementation="sdpa")
    raise ValueError(f"--families: unknown family {family!r}; known: {list(FAMILIES)}")


class LayerActivations:
    """The distinct storages autograd saves while a decoder layer runs (parameters excluded), with their shapes."""

    def __init__(self, model: torch.nn.Module, layers: torch.nn.ModuleList) -> None:
        self.exclude = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: dict[int, tuple[int, list[int]]] = {}
        self.active = False
        for layer in layers:
            layer.register_forward_pre_hook(lambda *_: setattr(self, "active", True))
            layer.register_forward_hook(lambda *_: setattr(self, "active", False))

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        local = _local(tensor)
        ptr, nbytes = local.untyped_storage().data_ptr(), local.untyped_storage().nbytes()
        if self.active and ptr not in self.exclude:
            self.seen[ptr] = (nbytes, list(local.shape))
        return tensor

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)

    def totals(self, seq: int) -> dict[str, Any]:
        """All bytes; the bytes of tensors with a full-sequence dimension and no shard dimension, by shape."""
        full: dict[str, int] = {}
        for nbytes, shape in self.seen.values():
            if seq in shape and seq // WORLD not in shape:
                full[str(shape)] = full.get(str(shape), 0) + nbytes
        return {"saved": sum(n for n, _ in self.seen.values()), "full_sequence": full}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's own tensor behind a DTensor (whose shape is the global one) or a pending collective's output."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor._local_tensor
    return getattr(tensor, "elem", tensor)  # AsyncCollectiveTensor wraps the collective's output buffer


def worker(rank: int, opts: Options, checkpoints: dict[str, str], outdir: str) -> None:
    from transformers import AutoModelForCausalLM

    from lightning_plugins import MemoryOptions, ParallelLayout, ParallelOptions
    from lightning_plugins.parallel import parallelize
    from lightning_plugins.parallel.memory.norms import use_efficient_norms

    warnings.simplefilter("ignore")  # transformers' notes on loading, once per variant and rank
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, opts.vocab, (opts.batch, opts.seq), generator=gen)
    batch = {"input_ids": input_ids, "labels": input_ids.clone()}
    result: dict[str, Any] = {}
    for family in opts.families:
        result[family] = {}
        for name in VARIANTS:
            if name == "one process" and rank != 0:
                dist.barrier()
                continue
            model = AutoModelForCausalLM.from_pretrained(checkpoints[family], dtype=torch.float32)
            memory = MemoryOptions(efficient_norms=not opts.plain_norms, sp_regather=opts.sp_regather)
            if name == "one process" and memory.efficient_norms:
                use_efficient_norms(model)  # what parallelize does to the other variants
            elif name != "one process":
                sp = name.endswith("SP")
                options = ParallelOptions(sequence_parallel=sp, loss_parallel=sp)
                parallelize(model, ParallelLayout(tp_size=WORLD), options, memory)
            model.train()
            activations = LayerActivations(model, model.model.layers)
            with activations.hooks():
                loss = model(**batch).loss
            loss.backward()
            result[family][name] = {"loss": float(loss), **activations.totals(opts.seq)}
            del model, activations, loss
            if name == "one process":
                dist.barrier()
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(result))


def predictions(family: str, opts: Options) -> dict[str, float]:
    """Bytes per layer the planner's formula gives each variant, in fp32 (the formula counts 16-bit bytes)."""
    from lightning_plugins import ParallelLayout, ParallelOptions
    from lightning_plugins.planner.rank_memory import korthikanti_activations
    from lightning_plugins.planner.workload import Workload

    config = build_config(family, opts)
    flash = config._attn_implementation != "eager"
    out = {}
    for name, (tp, sp) in zip(VARIANTS, ((1, False), (WORLD, False), (WORLD, True))):
        workload = Workload(
            config, ParallelLayout(tp_size=tp).resolve(tp), ParallelOptions(sequence_parallel=sp),
            dtype="fp32", seq_len=opts.seq, micro_batch_size=opts.batch,
        )  # fmt: skip
        out[name] = 2 * korthikanti_activations(workload, 1, flash=flash)
    return out


def report(opts: Options, results: list[dict[str, Any]], elapsed: float, command: str, on: str) -> str:
    mib = lambda x: f"{x / 2**20:.2f}"  # noqa: E731
    lines = [
        f"Per family: hidden {opts.hidden}, {opts.layers} layers, {opts.heads} heads / {opts.kv_heads} kv heads,"
        f" intermediate {opts.intermediate}, vocab {opts.vocab}; batch {opts.batch} x seq {opts.seq}; fp32;"
        " one forward + backward. Saved for backward per decoder layer, MiB per rank (worse rank); formula:"
        " `korthikanti_activations` x 2 (fp32), eager attention with its 5as/h term:",
        "",
        "| family | one process | TP=2 | TP=2 + SP | SP / TP=2 measured | SP / TP=2 formula"
        " | SP / one process measured | formula (1/tp) | one process / floor | TP=2 + SP / floor"
        " | full-sequence tensors under SP | max loss diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for family in opts.families:
        per_rank = [r[family] for r in results]
        saved = {n: max(r[n]["saved"] for r in per_rank if n in r) / opts.layers for n in VARIANTS}
        full = max(sum(r["TP=2 + SP"]["full_sequence"].values()) for r in per_rank) / opts.layers
        formula = predictions(family, opts)
        one_loss = per_rank[0]["one process"]["loss"]
        diff = max(abs(r[n]["loss"] - one_loss) for r in per_rank for n in VARIANTS if n in r)
        lines.append(
            f"| {family} | {mib(saved['one process'])} | {mib(saved['TP=2'])} | {mib(saved['TP=2 + SP'])}"
            f" | {saved['TP=2 + SP'] / saved['TP=2']:.2f} | {formula['TP=2 + SP'] / formula['TP=2']:.2f}"
            f" | {saved['TP=2 + SP'] / saved['one process']:.2f}"
            f" | {formula['TP=2 + SP'] / formula['one process']:.2f}"
            f" | {saved['one process'] / formula['one process']:.2f} | {saved['TP=2 + SP'] / formula['TP=2 + SP']:.2f}"
            f" | {mib(full)} ({full / saved['TP=2 + SP']:.0%}) | {diff:.1e} |"
        )
    lines += [
        "",
        "Under TP=2 + SP, the tensors saved per layer that still hold the full sequence (rank 0, MiB per layer):",
        "",
    ]
    for family in opts.families:
        shapes = sorted(results[0][family]["TP=2 + SP"]["full_sequence"].items(), key=lambda kv: -kv[1])
        listed = ", ".join(f"{shape} {mib(nbytes / opts.layers)}" for shape, nbytes in shapes)
        lines.append(f"* {family}: {listed or 'none'}")
    lines += [
        "",
        f"Machine: {on}. Whole run {elapsed:.0f} s. Command: `{command}`",
    ]
    return "\n".join(lines)


_SIZE_FIELDS = ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "seq", "batch")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    defaults = Options()
    for name in _SIZE_FIELDS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated subset")
    parser.add_argument("--quick", action="store_true", help="a tiny size: checks the script runs")
    parser.add_argument("--plain-norms", action="store_true", help="the models' own RMSNorms (efficient_norms=False)")
    parser.add_argument("--sp-regather", action="store_true", help="regions re-gather their input in backward")
    add_report_arguments(parser, output=True)
    args = parser.parse_args(argv)
    opts = Options(
        **{f: getattr(args, f) for f in _SIZE_FIELDS},
        families=tuple(args.families.split(",")),
        plain_norms=args.plain_norms,
        sp_regather=args.sp_regather,
    )
    if args.quick:
        opts = Options(
            hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=256, seq=64, families=opts.families,
            plain_norms=opts.plain_norms, sp_regather=opts.sp_regather,
        )
    with Timed() as run, tempfile.TemporaryDirectory(prefix="sp_fallback_") as tmp:
        from transformers import AutoModelForCausalLM

        checkpoints = {}
        for family in opts.families:
            torch.manual_seed(0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = AutoModelForCausalLM.from_config(build_config(family, opts), dtype=torch.float32)
                checkpoints[family] = str(Path(tmp, family))
                model.save_pretrained(checkpoints[family])
        spawn_world(worker, WORLD, opts, checkpoints, tmp, errors=tmp)
        results = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(WORLD)]
    text = report(opts, results, run.elapsed, command(argv), machine(run.load, python=True))
    print(text)
    write_report(args.output, text)


if __name__ == "__main__":
    main()
