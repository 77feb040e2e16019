"""An image-text model (tiny Qwen2.5-VL) under FSDP2, TP and both, through `parallelize`, trains as one process does.

fp32, gloo, SGD with momentum (a wrong gradient scale shows in the weights), 3 optimizer steps of 2
micro-batches, clipping that triggers, rows of different lengths, image sizes and image positions (under FSDP2 each
rank's rows carry their own images: ranks hold different numbers of image patches and of valid tokens). What is
trained: every weight; the vision tower frozen before `parallelize` and the projector trained with the language model
(the common recipe); LoRA with the default targets (the language model's projections only). Per case: per-step losses
and pre-clip gradient norms, every trained weight (gathered) against the reference, each trained part moved (vision
blocks, projector, language model), frozen weights bit-identical and never given a gradient; under FSDP2 each vision
block and the projector sharded as its own unit, under TP the language model's projections split and the vision tower
and projector replicated, identical on the tensor-parallel ranks after training. One world of 2 ranks runs the FSDP2
and TP cases; one of 4 (slow) runs TP x FSDP2; the reference runs on each rank.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _launch import world_json
from tiny_vlm import collate, image_sample, tiny_vlm
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate

from lightning_plugins import ParallelLayout, parallelize
from lightning_plugins.adapters.lora import LoraOptions, apply_lora, trainable_parameters
from lightning_plugins.parallel import clip_grad_norm_, mesh_of
from lightning_plugins.parallel.image_text import image_text_parts

# peft's get_peft_model reads a transformers attribute deprecated in 5.x: third-party noise.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

STEPS, ACCUM, BATCH, SEQ, MAX_NORM, LR = 3, 2, 4, 20, 0.05, 0.5
TOL = 1e-5
#: world size -> name -> (family, layout sizes, what is trained: "full", "frozen vision" or "lora").
CASES: dict[int, dict[str, tuple[str, dict, str]]] = {
    2: {
        "qwen2_5_vl fsdp2 full": ("qwen2_5_vl", {"dp_shard_size": 2}, "full"),
        "qwen2_5_vl fsdp2 frozen vision": ("qwen2_5_vl", {"dp_shard_size": 2}, "frozen vision"),
        "qwen2_5_vl fsdp2 lora": ("qwen2_5_vl", {"dp_shard_size": 2}, "lora"),
        # The language model split, the vision tower replicated (and the loss computed on vocab shards).
        "qwen2_5_vl tp2 full": ("qwen2_5_vl", {"tp_size": 2}, "full"),
        "qwen2_5_vl tp2 frozen vision": ("qwen2_5_vl", {"tp_size": 2}, "frozen vision"),
        "qwen2_5_vl tp2 lora": ("qwen2_5_vl", {"tp_size": 2}, "lora"),
        # SigLIP tower, a projector next to it (pooling, a projection weight of its own), bidirectional image tokens.
        "gemma3 fsdp2 full": ("gemma3", {"dp_shard_size": 2}, "full"),
        "gemma3 fsdp2 lora": ("gemma3", {"dp_shard_size": 2}, "lora"),
        "gemma3 tp2 full": ("gemma3", {"tp_size": 2}, "full"),
        "gemma3 tp2 frozen vision": ("gemma3", {"tp_size": 2}, "frozen vision"),
    },
    4: {
        "qwen2_5_vl tp2 x fsdp2 full": ("qwen2_5_vl", {"tp_size": 2, "dp_shard_size": 2}, "full"),
        "qwen2_5_vl tp2 x fsdp2 lora": ("qwen2_5_vl", {"tp_size": 2, "dp_shard_size": 2}, "lora"),
    },
}
#: How each part's weights are held: (dp_shard, tp) -> part -> each mesh dimension's placement (FSDP2 over a
#: tensor-parallel split is torch's _StridedShard, counted as a Shard).
PLACEMENTS = {
    (2, 1): {part: ["dp_shard_cp:Shard"] for part in ("projection", "vision", "projector")},
    (1, 2): {"projection": ["tp:Shard"], "vision": ["tp:Replicate"], "projector": ["tp:Replicate"]},
    (2, 2): {
        "projection": ["dp_shard_cp:Shard tp:Shard"],
        "vision": ["dp_shard_cp:Shard tp:Replicate"],
        "projector": ["dp_shard_cp:Shard tp:Replicate"],
    },
}


def _model(family: str, case: str) -> nn.Module:
    """The tiny VLM as the case trains it: whole, its vision tower frozen but for the projector, or under LoRA (with
    random non-zero ``lora_B``, so every adapter half gets a gradient)."""
    model = tiny_vlm(family)
    parts = image_text_parts(model)
    if case == "frozen vision":
        projector = tuple(f"{path}." for path in parts.projector_paths)
        for name, param in model.named_parameters():
            if name.startswith(f"{parts.vision_path}.") and not name.startswith(projector):
                param.requires_grad_(False)
    if case == "lora":
        torch.manual_seed(1)
        model = apply_lora(model, LoraOptions(r=4, alpha=8))
        gen = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return model


def _train(model: nn.Module, family: str, rows: slice, clip) -> list[float]:
    """STEPS optimizer steps of ACCUM micro-batches of ``rows`` of each batch; per-step losses then pre-clip norms."""
    params = trainable_parameters(model)
    optimizer = torch.optim.SGD(params, lr=LR, momentum=0.9)
    model.train()
    losses, norms = [], []
    for step in range(STEPS):
        step_loss = 0.0
        for micro in range(ACCUM):
            samples = [image_sample(SEQ, 1000 * step + 10 * micro + row, family) for row in range(BATCH)]
            loss = model(**collate(samples[rows])).loss / ACCUM
            loss.backward()
            step_loss += loss.item()
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad), "a frozen weight got a gradient"
        norm = clip(params, MAX_NORM)
        assert norm > MAX_NORM, "the test must exercise clipping"
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_loss)
        norms.append(float(norm))
    return losses + norms


@functools.cache
def _reference(family: str, case: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model(family, case)
    history = _train(model, family, slice(None), torch.nn.utils.clip_grad_norm_)
    return history, {name: param.detach() for name, param in model.named_parameters()}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def _part(name: str, parts) -> str:
    if any(name.startswith(f"{path}.") or f".{path}." in name for path in parts.projector_paths):
        return "projector"
    return "vision" if f"{parts.vision_path}." in name else "language"


def _run_case(world_size: int, family: str, sizes: dict, case: str) -> dict:
    ref_history, expected = _reference(family, case)
    model = _model(family, case)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    parts = image_text_parts(inner)
    initial = {name: param.detach().clone() for name, param in model.named_parameters()}
    assert parallelize(model, ParallelLayout(**sizes).resolve(world_size)) is model
    dp = mesh_of(model)["dp"]
    rows = BATCH // dp.size()
    local = slice(dp.get_local_rank() * rows, (dp.get_local_rank() + 1) * rows)
    history = _train(model, family, local, clip_grad_norm_)
    trained_diff, frozen_moved, moved = 0.0, 0.0, {}
    for name, param in model.named_parameters():
        full = _full(param)
        if param.requires_grad:
            trained_diff = max(trained_diff, (full - expected[name]).abs().max().item())
            part = _part(name, parts)
            moved[part] = max(moved.get(part, 0.0), (full - initial[name]).abs().max().item())
        else:
            frozen_moved = max(frozen_moved, (full - initial[name]).abs().max().item())
    units = [*parts.vision_units(inner), *inner.get_submodule(f"{parts.language_path}.layers")]
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(history[:STEPS], ref_history[:STEPS])),
        "norm_diff": max(abs(a - b) for a, b in zip(history[STEPS:], ref_history[STEPS:])),
        "trained_diff": trained_diff,
        "frozen_moved": frozen_moved,
        "moved": moved,
        "frozen": sum(not p.requires_grad for p in model.parameters()),
        "adapters_outside_language_model": [n for n, _ in model.named_parameters() if "lora_" in n and
                                            f"{parts.language_path}." not in n],  # fmt: skip
        "units": [isinstance(unit, FSDPModule) for unit in units],
        "vision_blocks": len(inner.get_submodule(parts.blocks_path)),
        "placements": _placements(model, parts),
        "tp_spread": _tp_spread(model),
    }


def _placements(model: nn.Module, parts) -> dict[str, list[str]]:
    """Each part's parameters' placements (``plain`` for a tensor that is not a DTensor), each once."""
    seen: dict[str, set[str]] = {}
    for name, param in model.named_parameters():
        part = _part(name, parts)
        if part == "language" and name.endswith(("q_proj.weight", "q_proj.base_layer.weight")):
            part = "projection"
        if not isinstance(param, DTensor):
            seen.setdefault(part, set()).add("plain")
            continue
        kinds = ("Shard" if "Shard" in type(p).__name__ else type(p).__name__ for p in param.placements)
        seen.setdefault(part, set()).add(" ".join(f"{d}:{k}" for d, k in zip(param.device_mesh.mesh_dim_names, kinds)))
    return {part: sorted(placements) for part, placements in seen.items()}


def _tp_spread(model: nn.Module) -> float:
    """The largest difference between tensor-parallel peers' copies of a replicated parameter (must be 0)."""
    spread = 0.0
    for param in model.parameters():
        names = param.device_mesh.mesh_dim_names or () if isinstance(param, DTensor) else ()
        if "tp" in names and isinstance(param.placements[names.index("tp")], Replicate):
            local = param.to_local().detach().contiguous()
            copies = [torch.empty_like(local) for _ in range(param.device_mesh["tp"].size())]
            dist.all_gather(copies, local, group=param.device_mesh.get_group("tp"))
            spread = max(spread, max((c - local).abs().max().item() for c in copies))
    return spread


def _world(rank: int, world_size: int, out_dir: str) -> None:
    results = {name: _run_case(world_size, *case) for name, case in CASES[world_size].items()}
    dist.barrier()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@functools.cache
def _results(world_size: int) -> list[dict]:
    return world_json(_world, world_size)


@pytest.mark.parametrize(
    "world_size,name",
    [pytest.param(w, n, marks=[pytest.mark.slow] if w > 2 else []) for w, cases in CASES.items() for n in cases],
    ids=str,
)
def test_image_text_model_matches_one_process(world_size: int, name: str) -> None:
    _, sizes, case = CASES[world_size][name]
    for rank, result in enumerate(results[name] for results in _results(world_size)):
        where = (name, rank, result)
        assert result["loss_diff"] <= TOL and result["norm_diff"] <= TOL, where
        assert result["trained_diff"] <= TOL, where
        assert result["frozen_moved"] == 0.0, where
        trained = {"full": {"vision", "projector", "language"}, "frozen vision": {"projector", "language"}}
        assert set(result["moved"]) == trained.get(case, {"language"}), where
        # Parity means something only if each trained part moved (Gemma 3's SigLIP weights move ~6e-4 here).
        assert all(change > 10 * TOL for change in result["moved"].values()), where
        assert (result["frozen"] > 0) == (case != "full"), where
        assert result["adapters_outside_language_model"] == [], where
        # Under FSDP2 each vision block, the projector and each decoder layer is its own unit; under TP the language
        # model's projections are split and the vision tower and projector replicated (identical on the tp ranks).
        assert result["units"] == [bool(sizes.get("dp_shard_size"))] * (result["vision_blocks"] + 1 + 2), where
        want = PLACEMENTS[(sizes.get("dp_shard_size", 1), sizes.get("tp_size", 1))]
        assert {part: result["placements"][part] for part in want} == want, where
        assert result["tp_spread"] == 0.0, where
