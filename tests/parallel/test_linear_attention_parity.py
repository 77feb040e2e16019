"""Tensor parallelism for Qwen3.5's Gated DeltaNet linear attention: its heads split over tp, exact against one process.

The tiny Qwen3.5 (``tiny_models.CONFIGS["qwen3_5"]``: two Gated DeltaNet layers, 2 key heads serving 4 value heads,
then a gated softmax-attention layer) trains under tp=2 with and without sequence and loss parallelism, through
:func:`test_parallel_parity._check_cases` (per-step losses, pre-clip gradient norms and final weights against one
process, 3 steps of SGD with momentum, clipping and accumulation, fp32, gloo). The LoRA case adapts every projection
the family splits (the linear attention's fused ``in_proj_qkv``, ``in_proj_z/_a/_b`` and ``out_proj`` included) with
random non-zero ``lora_B`` and dropout on, and compares the adapters with one process's peft. The refusal of a module
tensor parallelism cannot split is in ``test_layout_errors.py``.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from test_parallel_parity import BATCH, SEQ, _check_cases, _full
from tiny_models import make_batch, tiny_model
from torch.distributed.tensor import DTensor

from lightning_plugins import ParallelLayout, parallelize
from lightning_plugins.adapters.lora import LoraOptions, apply_lora, trainable_parameters
from lightning_plugins.parallel import clip_grad_norm_
from lightning_plugins.parallel.options import with_settings
from lightning_plugins.testing.world import run_world

TP2 = {"tp_size": 2}
CASES = [
    ("qwen3_5", TP2, {}),
    ("qwen3_5", TP2, {"sequence_parallel": False, "loss_parallel": False}),
]
LORA_CASES = [TP2 | {"options": {}}]
# The wider matrix (-m slow): Qwen3-Next, Qwen3.5 MoE (the routed and shared experts on each rank's tokens, the linear attention by
# heads), recomputation under activation checkpointing, the sequence shard gathered again in backward (sp_regather),
# LoRA without sequence parallelism, and TP x FSDP2 (the regrouped weights gathered over tp from FSDP2's unsharded
# DTensors).
SLOW_CASES = [
    ("qwen3_5_moe", TP2, {}),
    ("qwen3_5", TP2, {"sequence_parallel": False, "activation_checkpointing": "full"}),
    ("qwen3_5", TP2, {"sp_regather": True}),
    ("qwen3_next", TP2, {}),  # q/k/v/z and b/a fused per key head
    # Each rank's slices read from a safetensors checkpoint, and the trained model exported back (the regrouped weights
    # are held in the checkpoint's order).
    ("qwen3_5", TP2, {"load": True, "export": True}),
]
SLOW_LORA_CASES = [TP2 | {"options": {"sequence_parallel": False, "loss_parallel": False}}]
FOUR_RANKS = [("qwen3_5", {"tp_size": 2, "dp_shard_size": 2}, {"activation_checkpointing": "selective"})]
LORA_STEPS, LORA_MAX_NORM, TOL = 4, 0.05, 1e-5


def _lora_model(family: str) -> torch.nn.Module:
    """LoRA (with dropout) on every projection the family splits, ``lora_B`` random (peft starts it at zero)."""
    model = tiny_model(family)
    model.config.use_cache = False
    torch.manual_seed(1)
    peft_model = apply_lora(model, LoraOptions(r=4, alpha=8, dropout=0.1))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    adapted = {
        name.rpartition(".lora_A")[0].rpartition(".")[2]
        for name, _ in peft_model.named_parameters()
        if ".lora_A" in name
    }
    assert {"in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj", "q_proj"} <= adapted, adapted
    return peft_model


def _train_lora(model: torch.nn.Module, clip) -> list[float]:
    params = trainable_parameters(model)
    optimizer = torch.optim.SGD(params, lr=1.0, momentum=0.9)
    torch.manual_seed(3)  # the dropout masks (tensor-parallel ranks draw one process's)
    model.train()
    history, norms = [], []
    for step in range(LORA_STEPS):
        total = 0.0
        for micro in range(2):
            loss = model(**make_batch(BATCH, SEQ, model.config.vocab_size, seed=100 * step + micro)).loss / 2
            loss.backward()
            total += loss.item()
        norm = clip(params, LORA_MAX_NORM)
        assert norm > LORA_MAX_NORM, "the test must exercise clipping"
        optimizer.step()
        optimizer.zero_grad()
        history.append(total)
        norms.append(float(norm))
    return history + norms


def _check_lora(rank: int, world_size: int, cases: list[dict]) -> None:
    if not cases:
        return
    reference = _lora_model("qwen3_5")
    initial = copy.deepcopy(reference)
    want = _train_lora(reference, torch.nn.utils.clip_grad_norm_)
    expected = dict(reference.named_parameters())
    for case in cases:
        case = dict(case)
        options = case.pop("options")
        model = copy.deepcopy(initial)
        parallelize(model, ParallelLayout(**case).resolve(world_size), *with_settings("test", **options))
        assert isinstance(
            model.get_base_model().model.layers[0].linear_attn.in_proj_qkv.lora_B["default"].weight, DTensor
        )
        got = _train_lora(model, clip_grad_norm_)
        where = f"qwen3_5 LoRA {case} {options}"
        torch.testing.assert_close(
            torch.tensor(got), torch.tensor(want), atol=TOL, rtol=0, msg=lambda m, where=where: f"{where}: {m}"
        )
        for name, param in model.named_parameters():
            message = f"{where} {name}"
            torch.testing.assert_close(
                _full(param.detach()),
                expected[name].detach(),
                atol=TOL,
                rtol=0,
                msg=lambda m: f"{message}: {m}",  # noqa: B023
            )


def _check(rank: int, world_size: int, cases: list, lora_cases: list[dict], tmp: str) -> None:
    _check_cases(rank, world_size, cases, tmp)
    _check_lora(rank, world_size, lora_cases)


def test_linear_attention_tensor_parallel_matches_one_process(tmp_path: Path) -> None:
    run_world(_check, 2, CASES, LORA_CASES, str(tmp_path))


@pytest.mark.slow
def test_linear_attention_tensor_parallel_wider_matrix(tmp_path: Path) -> None:
    run_world(_check, 2, SLOW_CASES, SLOW_LORA_CASES, str(tmp_path))


@pytest.mark.slow
def test_linear_attention_tensor_parallel_with_fsdp2(tmp_path: Path) -> None:
    run_world(_check, 4, FOUR_RANKS, [], str(tmp_path))
