"""What the labels of a batch mean under pipeline parallelism is what transformers makes of them in one process.

* ``shift_labels`` alone (no ``labels``): transformers' causal LMs compute no loss (only logits), so one process's
  result cannot come out of a pipeline, which returns the loss only: refused with this project's message, in
  training and evaluation alike (no loss made up from the ``shift_labels``).
* A custom ``ignore_index=`` (transformers' ``ForCausalLMLoss`` reads it): the same per-step losses and weights as
  one process given the same batches, with ``labels`` and with ``shift_labels`` (the chunked head included).

PP=2 on 2 ranks, fp32, SGD, 2 steps.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from lightning_plugins.testing.world import run_world
from tiny_models import make_batch, tiny_model
from torch.distributed.tensor import DTensor

from lightning_plugins import ParallelLayout, ParallelOptions, parallelize

BATCH, SEQ, STEPS, LR, TOL = 4, 16, 2, 0.5, 1e-5


def _batches(vocab: int) -> list[dict]:
    """Per step: labels padded with -1 and ``ignore_index=-1``; then other targets as ``shift_labels`` with it."""
    batches = []
    for step in range(STEPS):
        batch = make_batch(BATCH, SEQ, vocab, seed=step)
        labels = batch["labels"].masked_fill(batch["labels"] == -100, -1)
        shifted = F.pad(labels, (0, 1), value=-1)[:, 1:].roll(1, dims=0)
        batches.append({**batch, "labels": labels, "ignore_index": -1})
        batches.append({**batch, "labels": labels, "shift_labels": shifted, "ignore_index": -1})
    return batches


def _fit(model: torch.nn.Module, batches: list[dict], pipelined: bool) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        if not pipelined:  # the pipeline ran backward itself
            loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _check(rank: int, world_size: int) -> None:
    reference = tiny_model("llama_4l")
    model = parallelize(
        copy.deepcopy(reference), ParallelLayout(pp_size=2).resolve(world_size), ParallelOptions(pp_microbatches=2)
    )
    model.train()
    batch = make_batch(BATCH, SEQ, reference.config.vocab_size, seed=9)
    shift = F.pad(batch.pop("labels"), (0, 1), value=-100)[:, 1:]
    assert reference(**batch, shift_labels=shift).loss is None  # one process: logits, no loss
    for mode in ("train", "eval"):
        getattr(model, mode)()
        with pytest.raises(ValueError, match=r"only `shift_labels`, for which transformers computes no loss"):
            model(**batch, shift_labels=shift)
    model.train()

    batches = _batches(reference.config.vocab_size)
    want, got = _fit(reference, batches, False), _fit(model, batches, True)
    assert len(set(want)) == len(want)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= TOL, (got, want)
    for name, param in model.named_parameters():  # this rank's stage
        local = param.full_tensor() if isinstance(param, DTensor) else param
        diff = (local.detach() - reference.get_parameter(name).detach()).abs().max().item()
        assert diff <= TOL, (name, diff)


def test_pipeline_labels_mean_what_transformers_means() -> None:
    run_world(_check, 2)
