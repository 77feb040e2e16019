"""Checks of a directory a save habit wrote from a parallelized model (shared by the Lightning script and the
Accelerate world of test_save_habits.py; every function that takes the model runs on every rank)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_plugins.parallel.hf_model import hf_model_of
from lightning_plugins.parallel import context_parallel_batch, mesh_of


def weight_files(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor in the directory's safetensors files (an HF model or a peft adapter)."""
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    assert tensors, f"no weights in {directory}: {sorted(p.name for p in Path(directory).iterdir())}"
    return tensors


def differing(saved: str | Path, exported: str | Path) -> list[str]:
    """The entries in which two directories' weights differ (a missing entry, or any bit of a tensor)."""
    a, b = weight_files(saved), weight_files(exported)
    return sorted(set(a) ^ set(b)) + sorted(k for k in set(a) & set(b) if not torch.equal(a[k], b[k]))


def _max_over_ranks(value: float) -> float:
    tensor = torch.tensor(float(value), dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def trained_vs_saved(model: nn.Module, saved: str | Path) -> tuple[float, int]:
    """The largest difference between the trained parameters every rank holds (DTensors gathered; pipeline ranks
    hold different ones) and the saved tensors of the same name, and how many saved tensors no rank holds."""
    tensors = weight_files(saved)
    peft = hf_model_of(model) is not model
    diff, held, compared = 0.0, torch.zeros(len(tensors)), set()
    keys = list(tensors)
    params = list(model.named_parameters(remove_duplicate=False))  # a tied head under its own name too
    for name, param in params:
        key = name.replace(".default", "") if peft else name
        if key in tensors:
            full = param.full_tensor() if isinstance(param, DTensor) else param
            diff = max(diff, (full.detach() - tensors[key]).abs().max().item())
            held[keys.index(key)] = 1
            compared.add(id(param))
    for name, param in params:  # an adapter file holds adapters only; transformers leaves a tied head out
        assert id(param) in compared or (peft and not param.requires_grad), f"{name} was not saved"
    dist.all_reduce(held, op=dist.ReduceOp.MAX)
    return _max_over_ranks(diff), int((held == 0).sum())


def load_saved(directory: str | Path, base: nn.Module | None = None) -> nn.Module:
    """The saved directory loaded in plain transformers (or peft onto ``base``), every weight read from it."""
    from transformers import AutoModelForCausalLM

    if base is None:
        model, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        return model
    from peft import PeftModel

    return PeftModel.from_pretrained(base, directory)


@torch.no_grad()
def layout_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> float:
    """The parallelized model's eval loss on ``batch`` (the same batch on every rank; sequence-sharded under CP)."""
    mesh = mesh_of(hf_model_of(model))
    if mesh is not None and mesh["cp"].size() > 1:
        batch = context_parallel_batch(batch, mesh)
    model.eval()
    try:
        return model(**batch).loss.item()
    finally:
        model.train()


@torch.no_grad()
def plain_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> float:
    model.eval()
    return model(**batch).loss.item()


def moved(saved: str | Path, untrained: nn.Module) -> float:
    """The largest change of a saved tensor from the model before training (training moved what is saved)."""
    peft = hf_model_of(untrained) is not untrained
    before = {(k.replace(".default", "") if peft else k): v for k, v in untrained.state_dict().items()}
    return max((tensor - before[key]).abs().max().item() for key, tensor in weight_files(saved).items())


def check_saved(model: nn.Module, saved: str | Path, exported: str | Path, batch: dict[str, Any],
                untrained: nn.Module, base: nn.Module | None = None) -> dict[str, Any]:  # fmt: skip
    """What every case reports: bits that differ from ``export_hf``'s directory, the trained weights against the
    saved ones, the loss of the loaded directory against the trained model's (on every rank), and how far the
    saved weights moved from ``untrained`` (a copy of the model before training)."""
    diff, unheld = trained_vs_saved(model, saved)
    trained = layout_loss(model, batch)
    loaded = plain_loss(load_saved(saved, base), batch)
    return {
        "differing_from_export": differing(saved, exported),
        "weight_diff": diff,
        "saved_but_not_trained": unheld,
        "loss_diff": _max_over_ranks(abs(loaded - trained)),
        "loss": trained,
        "moved_from_untrained": moved(saved, untrained),
    }
