"""DPO with LoRA under FSDP2 and tensor parallelism (sequence parallel, loss parallel) trains exactly as one process.

fp32, gloo, one launched world of 2 ranks checking every case. Each micro-batch holds PAIRS chosen rows then their
PAIRS rejected rows; data-parallel ranks take whole pairs (both halves of a pair on the same rank). The reference of
DPO is the base with the adapters disabled (peft's ``disable_adapter()``) in the same model. SGD with momentum, two
micro-batches accumulated, clipping that triggers, random non-zero ``lora_B`` (policy and reference differ from the
start). The one-process run computes its log-probabilities from the full logits of a plain peft model; the parallel
runs through the engine's loss path: the chunked head (per-token mode, several chunks), or without chunking the
vocab-sharded logits of loss parallel. Compared: per-step losses and pre-clip gradient norms, TRL's metrics of every
micro-batch, and the final adapters, to 1e-5.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tiny_models import make_batch, tiny_model
from torch.distributed.tensor import DTensor

from lightning_plugins import ParallelLayout, parallelize
from lightning_plugins.adapters.lora import LoraOptions, apply_lora, trainable_parameters
from lightning_plugins.parallel import clip_grad_norm_, mesh_of
from lightning_plugins.parallel.options import with_settings
from lightning_plugins.preference import PreferenceObjective, PreferenceOptions
from lightning_plugins.preference.logps import find_parallel_loss
from lightning_plugins.testing.world import run_world

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

STEPS, ACCUM, PAIRS, SEQ, MAX_NORM, LR, TOL = 3, 2, 4, 13, 0.05, 1.0, 1e-5
OBJECTIVE = PreferenceOptions(method="dpo", beta=0.5)
TP2 = {"tp_size": 2}
# name -> (layout sizes, parallel/memory settings)
CASES = {
    "fsdp2 chunked": ({"dp_shard_size": 2}, {"loss_chunk_tokens": 7}),
    "tp2 sp+lp chunked": (TP2, {"loss_chunk_tokens": 7}),
    "tp2 sp+lp logits": (TP2, {"loss_chunk_tokens": None}),
}


def lora_model() -> torch.nn.Module:
    model = tiny_model("llama")
    model.config.use_cache = False
    torch.manual_seed(1)
    model = apply_lora(model, LoraOptions(r=4, alpha=8))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return model


def _pairs(vocab: int, step: int, micro: int) -> dict[str, torch.Tensor]:
    """PAIRS chosen rows, then their rejected rows (rows of different lengths and prompt masks)."""
    return make_batch(2 * PAIRS, SEQ, vocab, seed=100 * step + micro)


def _train(model, take, clip) -> tuple[list[float], list[list[float]]]:
    objective = PreferenceObjective(OBJECTIVE)
    params = trainable_parameters(model)
    optimizer = torch.optim.SGD(params, lr=LR, momentum=0.9)
    history, metrics = [], []
    for step in range(STEPS):
        step_loss = 0.0
        for micro in range(ACCUM):
            loss, logged = objective(model, take(_pairs(model.config.vocab_size, step, micro)))
            (loss / ACCUM).backward()
            step_loss += loss.item() / ACCUM
            metrics.append([value.item() for _, value in sorted(logged.items())])
        norm = clip(params, MAX_NORM)
        assert norm > MAX_NORM, "the test must exercise clipping"
        optimizer.step()
        optimizer.zero_grad()
        history += [step_loss, float(norm)]
    return history, metrics


@functools.cache
def _reference():
    model = lora_model()
    history, metrics = _train(model, lambda batch: batch, torch.nn.utils.clip_grad_norm_)
    return history, metrics, {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def _rows_of_rank(model):
    """This data rank's pairs: its share of the chosen rows and the same share of the rejected rows."""
    dp = mesh_of(model)["dp"]
    share = PAIRS // dp.size()
    first = dp.get_local_rank() * share
    rows = list(range(first, first + share)) + list(range(PAIRS + first, PAIRS + first + share))
    return lambda batch: {key: value[rows] for key, value in batch.items()}


def _run_case(sizes: dict, settings: dict) -> dict:
    want_history, want_metrics, want_adapters = _reference()
    model = lora_model()
    parallelize(model, ParallelLayout(**sizes).resolve(dist.get_world_size()), *with_settings("test", **settings))
    chunked = find_parallel_loss(model).chunked is not None
    history, metrics = _train(model, _rows_of_rank(model), clip_grad_norm_)
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in adapters.items()}
    start = {n: p.detach() for n, p in lora_model().named_parameters() if p.requires_grad}
    return {
        "chunked": chunked,
        "history_diff": max(abs(a - b) for a, b in zip(history, want_history)),
        "metrics_diff": max(abs(a - b) for got, want in zip(metrics, want_metrics) for a, b in zip(got, want)),
        "adapter_diff": max((full[n] - want_adapters[n]).abs().max().item() for n in want_adapters),
        "adapter_change": max((want_adapters[n] - start[n]).abs().max().item() for n in start),
    }


def _world(rank: int, world_size: int, out_dir: str) -> None:
    results = {name: _run_case(*case) for name, case in CASES.items()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@functools.cache
def _results() -> list[dict]:
    with tempfile.TemporaryDirectory() as out_dir:
        run_world(_world, 2, out_dir)
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("name", list(CASES), ids=str)
def test_dpo_matches_one_process(name: str) -> None:
    for rank, result in enumerate(_results()):
        where = (name, rank, result[name])
        assert result[name]["history_diff"] <= TOL and result[name]["metrics_diff"] <= TOL, where
        assert result[name]["adapter_diff"] <= TOL, where
        assert result[name]["adapter_change"] > 100 * TOL, where  # the adapters moved: parity means something
        assert result[name]["chunked"] == (CASES[name][1]["loss_chunk_tokens"] is not None), where
