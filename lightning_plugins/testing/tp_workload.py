"""The workload of the tensor-parallel benchmark, which ``benchmarks/doors.py`` and ``benchmarks/finetune_methods.py``
train too: its sizes (:class:`Options`), its small Llama (:func:`build_config`: untied embeddings), its seeded batches
(:func:`make_batches`) and the variants that train it on a world of :data:`WORLD` ranks (:func:`build_variant`: one
process, transformers' own TP plan, ``parallelize`` with and without sequence and loss parallelism)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from lightning_plugins.testing.models import tiny_llama

#: The ranks of the world the variants run in.
WORLD = 2


@dataclass
class Options:
    """The model's sizes, the batch, the steps (``warmup`` untimed, then ``steps`` timed), SGD's learning rate and the
    variants to train."""

    hidden: int = 512
    layers: int = 8
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 1376
    vocab: int = 16384
    seq: int = 512
    batch: int = 2
    warmup: int = 2
    steps: int = 6
    lr: float = 1e-3
    variants: tuple[str, ...] = ("single_1t", "hf_tp", "ours_tp", "ours_sp_lp")


def make_batches(opts: Options, count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` batches of ``opts.batch`` x ``opts.seq`` random tokens, seeded: every rank and variant sees them."""
    gen = torch.Generator().manual_seed(1234)
    batches = []
    for _ in range(count):
        ids = torch.randint(0, opts.vocab, (opts.batch, opts.seq), generator=gen)
        batches.append({"input_ids": ids, "labels": ids.clone()})
    return batches


def build_config(opts: Options) -> Any:
    """The small Llama of ``opts``' sizes (untied embeddings)."""
    return tiny_llama(
        opts.hidden, opts.layers, opts.heads, opts.kv_heads, opts.vocab, opts.seq, opts.intermediate,
        tie_word_embeddings=False,
    )  # fmt: skip


@dataclass
class Variant:
    """One variant on this rank: ``step(batch)`` trains one batch and returns the loss."""

    name: str
    model: torch.nn.Module | None  # None on ranks that sit this variant out
    optimizer: torch.optim.Optimizer | None
    threads: int = 1

    def step(self, batch: dict[str, torch.Tensor]) -> float:
        from torch.distributed.tensor import DTensor

        assert self.model is not None and self.optimizer is not None
        torch.set_num_threads(self.threads)
        try:
            loss = self.model(**batch).loss  # the output (and its logits) is dropped here, as in a training_step
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            value = loss.detach()
            if isinstance(value, DTensor):
                value = value.full_tensor()
            return float(value)
        finally:
            torch.set_num_threads(1)


def build_variant(name: str, rank: int, checkpoint: str, opts: Options) -> Variant:
    """The variant ``name`` loaded from ``checkpoint``: ``single_1t``/``single_2t`` (rank 0 alone), ``hf_tp``
    (transformers' TP plan), ``ours_tp`` / ``ours_sp_lp`` (``parallelize`` without / with SP and loss parallel)."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name.startswith("single"):
            model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32) if rank == 0 else None
        elif name == "hf_tp":
            from transformers import DistributedConfig

            model = AutoModelForCausalLM.from_pretrained(
                checkpoint, dtype=torch.float32, distributed_config=DistributedConfig(tp_size=WORLD)
            )
        else:
            from lightning_plugins import ParallelLayout, ParallelOptions
            from lightning_plugins.parallel import parallelize

            model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
            sp_lp = name == "ours_sp_lp"
            options = ParallelOptions(sequence_parallel=sp_lp, loss_parallel=sp_lp)
            parallelize(model, ParallelLayout(tp_size=WORLD), options)
    if model is None:
        return Variant(name, None, None)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=opts.lr)
    return Variant(name, model, optimizer, threads=2 if name == "single_2t" else 1)
