"""Image-text models (tiny Qwen2.5-VL, Gemma 3, Gemma 4, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5) under FSDP2, TP, CP, EP, PP
and their combinations, through `parallelize`, train as one process does.

fp32, gloo, SGD with momentum (a wrong gradient scale shows in the weights), 3 optimizer steps of 2 micro-batches,
clipping that triggers, rows of different lengths, image sizes and image positions, right and left padding, Qwen's 3-D
multimodal RoPE positions (under FSDP2 each rank's rows carry their own images: ranks hold different numbers of image
patches and of valid tokens). What is trained: every weight; the vision tower frozen before `parallelize` and the
projector trained with the language model (the common recipe); LoRA with the default targets (the language model's
projections only); every weight with the MoE router's balance loss on. Per case: per-step losses and pre-clip gradient
norms, every trained weight (gathered) against the reference, each trained part moved (vision blocks, projector,
language model), frozen weights bit-identical and never given a gradient; under FSDP2 each vision block and each
projector module sharded as its own unit, under TP the language model's projections split and the vision tower and
projector replicated, identical on the tensor-parallel ranks after training; under EP the experts split; under CP
(batches through `context_parallel_batch`) the decoder layers see this rank's shard of each row, whose image tokens
straddle the shards (each 20-token row's image lies within tokens 2-9, once left padding is rolled to the end; the first
of 2 load-balanced shards holds tokens 0-4 and 15-19); with activation checkpointing the vision blocks are checkpointed
too (a trained block runs again in the backward); packed, each rank's rows are unpadded and packed into one
(`data.image_packing`: per-sample positions, no attention mask) against the reference's padded rows; under PP x TP
each pipeline stage's layers are split over its tensor-parallel ranks, the first stage's replicating the tower; under
PP x CP the first stage shards each row once its images are placed, the later stage takes its shard of the positions.
One world of 2 ranks runs the default cases and one of 4 the default PP=2 x TP=2 case; worlds of 2, 4 and 8 ranks
(slow) the others; the reference runs on each rank.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _launch import world_json
from tiny_vlm import IMAGE_TOKEN, collate, image_sample, tiny_vlm, tiny_vlm_config
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate

from lightning_plugins import ParallelLayout, parallelize
from lightning_plugins.adapters.lora import LoraOptions, apply_lora, trainable_parameters
from lightning_plugins.data.image_packing import RopeIndex, pack_image_text, prepare_model_for_image_packing
from lightning_plugins.parallel import clip_grad_norm_, context_parallel_batch, mesh_of, pipeline_of
from lightning_plugins.parallel.image_text import image_text_parts
from lightning_plugins.parallel.options import MemoryOptions, ParallelOptions

# peft's get_peft_model reads a transformers attribute deprecated in 5.x: third-party noise.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

STEPS, ACCUM, BATCH, SEQ, MAX_NORM, LR = 3, 2, 4, 20, 0.05, 0.5
TOL = 1e-5
#: world (its number of ranks, "slow" for -m slow) -> name -> (family, layout sizes (and the cp backend), what is
#: trained: "full", "frozen vision", "lora" or "router loss" (full, the router's balance loss on)).
CASES: dict[str, dict[str, tuple[str, dict, str]]] = {
    "2": {
        "qwen2_5_vl fsdp2 full": ("qwen2_5_vl", {"dp_shard_size": 2}, "full"),
        "qwen2_5_vl fsdp2 frozen vision": ("qwen2_5_vl", {"dp_shard_size": 2}, "frozen vision"),
        "qwen2_5_vl fsdp2 lora": ("qwen2_5_vl", {"dp_shard_size": 2}, "lora"),
        # Each rank's two rows unpadded and packed into one (ranks hold rows of different lengths), every weight
        # trained, against the reference's padded rows; Qwen3-VL-MoE: deepstack features and experts split too.
        "qwen3_vl_moe ep2 packed": ("qwen3_vl_moe", {"dp_shard_size": 2, "ep_size": 2}, "packed"),
        # The language model split, the vision tower replicated (and the loss computed on vocab shards).
        "qwen2_5_vl tp2 full": ("qwen2_5_vl", {"tp_size": 2}, "full"),
        "qwen2_5_vl tp2 frozen vision": ("qwen2_5_vl", {"tp_size": 2}, "frozen vision"),
        "qwen2_5_vl tp2 lora": ("qwen2_5_vl", {"tp_size": 2}, "lora"),
        # SigLIP tower, a projector next to it (pooling, a projection weight of its own), bidirectional image tokens.
        "gemma3 fsdp2 full": ("gemma3", {"dp_shard_size": 2}, "full"),
        "gemma3 fsdp2 lora": ("gemma3", {"dp_shard_size": 2}, "lora"),
        "gemma3 tp2 full": ("gemma3", {"tp_size": 2}, "full"),
        "gemma3 tp2 frozen vision": ("gemma3", {"tp_size": 2}, "frozen vision"),
        # The MoE language model's experts split over the ranks; the images placed into the whole sequence, then it
        # is sharded (image tokens straddle the shards; Qwen3-VL's deepstack features follow their tokens).
        "qwen3_vl_moe ep2 full": ("qwen3_vl_moe", {"dp_shard_size": 2, "ep_size": 2}, "full"),
        "qwen2_5_vl cp2 ring full": ("qwen2_5_vl", {"cp_size": 2, "cp_backend": "ring"}, "full"),
        "qwen3_vl_moe cp2 ulysses x ep2 full": ("qwen3_vl_moe", {"cp_size": 2, "ep_size": 2}, "full"),
        # Two pipeline stages (1F1B, 2 micro-batches of 2 rows): the first runs the vision tower and projector on its
        # micro-batch's rows' images and places them; Qwen's 3-D positions and Gemma 3's two-way image-token masks
        # reach the second stage.
        "qwen2_5_vl pp2 full": ("qwen2_5_vl", {"pp_size": 2}, "full"),
        "qwen2_5_vl pp2 frozen vision": ("qwen2_5_vl", {"pp_size": 2}, "frozen vision"),
        "gemma3 pp2 full": ("gemma3", {"pp_size": 2}, "full"),
        # Qwen3-VL's deepstack: the first stage adds the first two features after its two layers and sends the third,
        # computed from its micro-batch's images, beside the hidden states to the second stage, which adds it after its
        # first layer.
        "qwen3_vl pp2 full": ("qwen3_vl", {"pp_size": 2}, "full"),
        # Activation checkpointing of the vision blocks (with the decoder layers'): each trained block runs twice.
        "qwen2_5_vl fsdp2 full ac": ("qwen2_5_vl", {"dp_shard_size": 2, "ac": "full"}, "full"),
        # Qwen3.5: a Gated DeltaNet (linear-attention) layer in the language model, images placed by 3-D positions.
        "qwen3_5 tp2 full": ("qwen3_5", {"tp_size": 2}, "full"),
        # Gemma 4 (no per-layer inputs): a tower fed flattened patches and their positions, q/k/v RMS-normed heads and
        # unscaled attention, a global layer with its own rotary (why its tiny heads are narrow: tests/tiny_vlm.py).
        "gemma4 tp2 full": ("gemma4", {"tp_size": 2}, "full"),
    },
    "2 slow": {
        "gemma4 fsdp2 full": ("gemma4", {"dp_shard_size": 2}, "full"),
        "gemma4 fsdp2 lora": ("gemma4", {"dp_shard_size": 2}, "lora"),
        "gemma4 tp2 frozen vision": ("gemma4", {"tp_size": 2}, "frozen vision"),
        "gemma4 fsdp2 full ac": ("gemma4", {"dp_shard_size": 2, "ac": "full"}, "full"),
        "gemma4 cp2 ulysses full": ("gemma4", {"cp_size": 2}, "full"),
        "gemma4 cp2 ring full": ("gemma4", {"cp_size": 2, "cp_backend": "ring"}, "full"),
        # Gemma 4 with per-layer inputs: its forward reads the embedding's padding row, gathered with the root unit.
        "gemma4_ple fsdp2 full": ("gemma4_ple", {"dp_shard_size": 2}, "full"),
        "gemma4_ple fsdp2 lora": ("gemma4_ple", {"dp_shard_size": 2}, "lora"),
        # Qwen3-VL's q/k norms (one per head), which its text config's tensor-parallel plan leaves out.
        "qwen3_vl_moe tp2 full": ("qwen3_vl_moe", {"tp_size": 2}, "full"),
        # Qwen3-VL with dense layers (its text config's plan names no layer: a registered family splits them).
        "qwen3_vl tp2 full": ("qwen3_vl", {"tp_size": 2}, "full"),
        "qwen3_vl fsdp2 lora": ("qwen3_vl", {"dp_shard_size": 2}, "lora"),
        "qwen3_vl cp2 ulysses full": ("qwen3_vl", {"cp_size": 2}, "full"),
        "qwen3_vl_moe ep2 frozen vision": ("qwen3_vl_moe", {"dp_shard_size": 2, "ep_size": 2}, "frozen vision"),
        "qwen3_vl_moe ep2 lora": ("qwen3_vl_moe", {"dp_shard_size": 2, "ep_size": 2}, "lora"),
        "qwen3_vl_moe ep2 router loss": ("qwen3_vl_moe", {"dp_shard_size": 2, "ep_size": 2}, "router loss"),
        "qwen2_5_vl cp2 ulysses full": ("qwen2_5_vl", {"cp_size": 2}, "full"),
        "qwen2_5_vl cp2 ulysses frozen vision": ("qwen2_5_vl", {"cp_size": 2}, "frozen vision"),
        "qwen2_5_vl cp2 ring lora": ("qwen2_5_vl", {"cp_size": 2, "cp_backend": "ring"}, "lora"),
        "qwen2_5_vl pp2 lora": ("qwen2_5_vl", {"pp_size": 2}, "lora"),
        "gemma3 pp2 frozen vision": ("gemma3", {"pp_size": 2}, "frozen vision"),
        "gemma3 pp2 lora": ("gemma3", {"pp_size": 2}, "lora"),
        "qwen3_vl pp2 frozen vision": ("qwen3_vl", {"pp_size": 2}, "frozen vision"),
        "qwen3_vl pp2 lora": ("qwen3_vl", {"pp_size": 2}, "lora"),
        "qwen3_vl_moe pp2 full": ("qwen3_vl_moe", {"pp_size": 2}, "full"),  # its one feature added in the first stage
        "qwen3_vl pp2 full ac": ("qwen3_vl", {"pp_size": 2, "ac": "full"}, "full"),
        "gemma3 fsdp2 full ac": ("gemma3", {"dp_shard_size": 2, "ac": "full"}, "full"),
        "gemma3 tp2 full ac": ("gemma3", {"tp_size": 2, "ac": "full"}, "full"),  # the replicated tower checkpointed
        "qwen2_5_vl tp2 full ac": ("qwen2_5_vl", {"tp_size": 2, "ac": "full"}, "full"),
        "qwen3_vl_moe ep2 full selective ac": ("qwen3_vl_moe", {"dp_shard_size": 2, "ep_size": 2, "ac": "selective"},
                                               "full"),  # fmt: skip
        "qwen2_5_vl pp2 full ac": ("qwen2_5_vl", {"pp_size": 2, "ac": "full"}, "full"),
        "qwen3_5 fsdp2 full": ("qwen3_5", {"dp_shard_size": 2}, "full"),
        "qwen3_5 fsdp2 lora": ("qwen3_5", {"dp_shard_size": 2}, "lora"),
        "qwen3_5 cp2 ulysses full": ("qwen3_5", {"cp_size": 2}, "full"),  # the linear-attention layer on shards too
        "qwen3_5 cp2 ring full": ("qwen3_5", {"cp_size": 2, "cp_backend": "ring"}, "full"),
        "qwen3_5 pp2 full": ("qwen3_5", {"pp_size": 2}, "full"),  # one layer per stage: linear, then full attention
        "qwen3_5 pp2 frozen vision": ("qwen3_5", {"pp_size": 2}, "frozen vision"),
        # Each step's second batch text only: every stage counts its positions from 0 as one process does.
        "qwen2_5_vl pp2 mixed": ("qwen2_5_vl", {"pp_size": 2}, "mixed"),
        "qwen3_vl pp2 mixed": ("qwen3_vl", {"pp_size": 2}, "mixed"),
        "qwen3_vl_moe cp2 ring x ep2 lora": (
            "qwen3_vl_moe",
            {"cp_size": 2, "ep_size": 2, "cp_backend": "ring"},
            "lora",
        ),
    },
    "4": {
        # Two pipeline stages of two tensor-parallel ranks each: the first stage's ranks run the replicated tower on
        # the same micro-batch images and place them; the language model's layers are split within each stage.
        "qwen2_5_vl pp2 x tp2 full": ("qwen2_5_vl", {"pp_size": 2, "tp_size": 2}, "full"),
    },
    "4 slow": {
        "qwen2_5_vl pp2 x tp2 frozen vision": ("qwen2_5_vl", {"pp_size": 2, "tp_size": 2}, "frozen vision"),
        "qwen2_5_vl pp2 x tp2 lora": ("qwen2_5_vl", {"pp_size": 2, "tp_size": 2}, "lora"),
        "gemma3 pp2 x tp2 full": ("gemma3", {"pp_size": 2, "tp_size": 2}, "full"),  # its two-way image-token masks
        "gemma3 pp2 x tp2 lora": ("gemma3", {"pp_size": 2, "tp_size": 2}, "lora"),
        # Qwen3-VL's third deepstack feature crosses to the second stage beside the (replicated) hidden states.
        "qwen3_vl pp2 x tp2 full": ("qwen3_vl", {"pp_size": 2, "tp_size": 2}, "full"),
        "qwen3_vl_moe pp2 x tp2 full": ("qwen3_vl_moe", {"pp_size": 2, "tp_size": 2}, "full"),
        "qwen3_5 pp2 x tp2 full": ("qwen3_5", {"pp_size": 2, "tp_size": 2}, "full"),  # a linear-attention layer split
        "qwen2_5_vl pp2 x tp2 full ac": ("qwen2_5_vl", {"pp_size": 2, "tp_size": 2, "ac": "full"}, "full"),
        # The first stage's model shards each whole row once its images are placed; the second stage takes its shard
        # of the rows' positions (its hidden states come sharded).
        "qwen2_5_vl pp2 x cp2 ulysses full": ("qwen2_5_vl", {"pp_size": 2, "cp_size": 2}, "full"),
        "qwen2_5_vl pp2 x cp2 ring full": ("qwen2_5_vl", {"pp_size": 2, "cp_size": 2, "cp_backend": "ring"}, "full"),
        "qwen2_5_vl pp2 x cp2 ulysses frozen vision": ("qwen2_5_vl", {"pp_size": 2, "cp_size": 2}, "frozen vision"),
        "qwen2_5_vl pp2 x cp2 ulysses lora": ("qwen2_5_vl", {"pp_size": 2, "cp_size": 2}, "lora"),
        "qwen2_5_vl pp2 x cp2 ulysses full ac": ("qwen2_5_vl", {"pp_size": 2, "cp_size": 2, "ac": "full"}, "full"),
        # Qwen3-VL's third deepstack feature crosses to the second stage at this rank's image tokens of the shard.
        "qwen3_vl pp2 x cp2 ulysses full": ("qwen3_vl", {"pp_size": 2, "cp_size": 2}, "full"),
        "qwen3_vl pp2 x cp2 ring full": ("qwen3_vl", {"pp_size": 2, "cp_size": 2, "cp_backend": "ring"}, "full"),
        "qwen3_vl_moe pp2 x cp2 ulysses full": ("qwen3_vl_moe", {"pp_size": 2, "cp_size": 2}, "full"),
        "qwen3_5 pp2 x cp2 ulysses full": ("qwen3_5", {"pp_size": 2, "cp_size": 2}, "full"),
        "qwen3_5 pp2 x cp2 ring full": ("qwen3_5", {"pp_size": 2, "cp_size": 2, "cp_backend": "ring"}, "full"),
        # Each step's second batch text only: sharded as a text batch (its tokens and positions), no stage shards it.
        "qwen2_5_vl pp2 x cp2 ulysses mixed": ("qwen2_5_vl", {"pp_size": 2, "cp_size": 2}, "mixed"),
        "qwen3_vl pp2 x cp2 ring mixed": ("qwen3_vl", {"pp_size": 2, "cp_size": 2, "cp_backend": "ring"}, "mixed"),
        "qwen2_5_vl pp2 x tp2 mixed": ("qwen2_5_vl", {"pp_size": 2, "tp_size": 2}, "mixed"),
        "qwen2_5_vl tp2 x fsdp2 full": ("qwen2_5_vl", {"tp_size": 2, "dp_shard_size": 2}, "full"),
        "qwen2_5_vl tp2 x fsdp2 lora": ("qwen2_5_vl", {"tp_size": 2, "dp_shard_size": 2}, "lora"),
        "qwen2_5_vl tp2 x fsdp2 full ac": ("qwen2_5_vl", {"tp_size": 2, "dp_shard_size": 2, "ac": "full"}, "full"),
        "qwen2_5_vl cp2 ring x fsdp2 full": (
            "qwen2_5_vl",
            {"cp_size": 2, "dp_shard_size": 2, "cp_backend": "ring"},
            "full",
        ),
        "qwen2_5_vl cp2 ulysses x tp2 full": ("qwen2_5_vl", {"cp_size": 2, "tp_size": 2}, "full"),
        "qwen2_5_vl pp2 x fsdp2 full": ("qwen2_5_vl", {"pp_size": 2, "dp_shard_size": 2}, "full"),
        "gemma3 pp2 x fsdp2 lora": ("gemma3", {"pp_size": 2, "dp_shard_size": 2}, "lora"),
        "qwen3_vl pp2 x fsdp2 full": ("qwen3_vl", {"pp_size": 2, "dp_shard_size": 2}, "full"),
        "qwen3_vl_moe ep2 x tp2 full": ("qwen3_vl_moe", {"dp_shard_size": 2, "ep_size": 2, "tp_size": 2}, "full"),
        "qwen3_vl_moe cp2 x fsdp2 x ep4 full": (
            "qwen3_vl_moe",
            {"cp_size": 2, "dp_shard_size": 2, "ep_size": 4},
            "full",
        ),
    },
    "8 slow": {  # stages of tensor-parallel ranks, sharded by FSDP2 over the data or the context ranks
        "qwen2_5_vl pp2 x tp2 x fsdp2 full": ("qwen2_5_vl", {"pp_size": 2, "tp_size": 2, "dp_shard_size": 2}, "full"),
        "qwen2_5_vl pp2 x cp2 x tp2 full": ("qwen2_5_vl", {"pp_size": 2, "cp_size": 2, "tp_size": 2}, "full"),
        "qwen3_vl pp2 x cp2 x tp2 full": ("qwen3_vl", {"pp_size": 2, "cp_size": 2, "tp_size": 2}, "full"),
    },
}
#: How each part's weights are held: (FSDP2's ranks: dp_shard x cp, tp) -> part -> each mesh dimension's placement
#: (FSDP2 over a tensor-parallel split is torch's _StridedShard, counted as a Shard).
PLACEMENTS = {
    (1, 1): {part: ["plain"] for part in ("projection", "vision", "projector")},  # pipeline stages, unsharded
    **{(n, 1): {part: ["dp_shard_cp:Shard"] for part in ("projection", "vision", "projector")} for n in (2, 4)},
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
    if case == "router loss":  # the router's balance loss over the global batch, weighed so that it matters
        model.config.text_config.output_router_logits = True
        model.config.text_config.router_aux_loss_coef = 0.5
    if case == "packed":
        prepare_model_for_image_packing(model)
    if case == "lora":
        torch.manual_seed(1)
        model = apply_lora(model, LoraOptions(r=4, alpha=8))
        gen = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return model


def _train(model: nn.Module, family: str, rows: slice, clip, prepare=dict, case: str = "") -> list[float]:
    """STEPS optimizer steps of ACCUM micro-batches of ``rows`` of each batch (each ``prepare``d: sharded for context
    parallelism; under the "mixed" case each step's second micro-batch is text only); per-step losses then pre-clip
    norms."""
    params = trainable_parameters(model)
    optimizer = torch.optim.SGD(params, lr=LR, momentum=0.9)
    if (pipeline := pipeline_of(model)) is not None:
        pipeline.loss_scale = 1.0 / ACCUM
    model.train()
    losses, norms = [], []
    for step in range(STEPS):
        step_loss = 0.0
        for micro in range(ACCUM):
            samples = [image_sample(SEQ, 1000 * step + 10 * micro + row, family) for row in range(BATCH)]
            batch = collate(samples[rows])
            if case == "mixed" and micro == 1:  # a text-only batch of an image-text dataset: no images, text tokens
                batch = {key: value for key, value in batch.items() if key in ("input_ids", "attention_mask", "labels")}
                batch["input_ids"] = batch["input_ids"].where(batch["input_ids"] < IMAGE_TOKEN, 3)
            loss = model(**prepare(batch)).loss / ACCUM
            if pipeline is None:
                loss.backward()  # a pipeline's call ran the backward of every micro-batch
            step_loss += loss.item()
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad), "a frozen weight got a gradient"
        norm = clip(params, MAX_NORM) if pipeline is None else pipeline.clip_grad_norm_(params, MAX_NORM)
        assert norm > MAX_NORM, "the test must exercise clipping"
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_loss)
        norms.append(float(norm))
    return losses + norms


@functools.cache
def _reference(family: str, case: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model(family, case)
    history = _train(model, family, slice(None), torch.nn.utils.clip_grad_norm_, case=case)
    return history, {name: param.detach() for name, param in model.named_parameters()}


def _packed(batch: dict, family: str) -> dict:
    """The rows of a collated batch (one image each) unpadded and packed into rows of up to 2 x SEQ tokens."""
    samples, patches = [], 0
    for row, grid in enumerate(batch["image_grid_thw"]):
        keep = batch["attention_mask"][row].bool()
        sample = {key: batch[key][row][keep] for key in ("input_ids", "labels", "mm_token_type_ids")}
        count = int(grid.prod())
        sample.update(pixel_values=batch["pixel_values"][patches : patches + count], image_grid_thw=grid[None])
        samples.append(sample)
        patches += count
    return pack_image_text(samples, 2 * SEQ, 2, RopeIndex(tiny_vlm_config(family)))


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
    sizes = dict(sizes)
    options = ParallelOptions(cp_backend=sizes.pop("cp_backend", "ulysses"))
    memory = MemoryOptions(activation_checkpointing=sizes.pop("ac", "none"))
    assert parallelize(model, ParallelLayout(**sizes).resolve(world_size), options, memory) is model
    mesh = mesh_of(model)
    dp = mesh["dp"]
    rows = BATCH // dp.size()
    local = slice(dp.get_local_rank() * rows, (dp.get_local_rank() + 1) * rows)
    tokens: set[int] = set()  # the sequence lengths the first decoder layer sees
    first = next(iter(inner.get_submodule(f"{parts.language_path}.layers")))  # a later pipeline stage's first
    first.register_forward_pre_hook(lambda _, args, kwargs: tokens.add((args or [kwargs["hidden_states"]])[0].shape[1]),
                                    with_kwargs=True)  # fmt: skip
    calls = []  # the forwards of the first vision block's first part (a checkpointed block runs again in the backward)
    if _holds(inner, parts.vision_path):
        block = next(iter(inner.get_submodule(parts.blocks_path)))
        next(iter(block.children())).register_forward_hook(lambda *_: calls.append(1))
    shard = functools.partial(context_parallel_batch, mesh=mesh)
    prepare = (lambda batch: shard(_packed(batch, family))) if case == "packed" else shard
    history = _train(model, family, local, clip_grad_norm_, prepare, case)
    trained_diff, frozen_moved, moved = 0.0, 0.0, {}
    for name, param in model.named_parameters():
        full = _full(param)
        if param.requires_grad:
            trained_diff = max(trained_diff, (full - expected[name]).abs().max().item())
            part = _part(name, parts)
            moved[part] = max(moved.get(part, 0.0), (full - initial[name]).abs().max().item())
        else:
            frozen_moved = max(frozen_moved, (full - initial[name]).abs().max().item())
    # A later pipeline stage holds no vision tower, projector or first layers: each rank counts what it holds.
    image_path = _holds(inner, parts.vision_path)
    layers = list(inner.get_submodule(f"{parts.language_path}.layers"))
    units = [*(parts.vision_units(inner) if image_path else []), *layers]
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(history[:STEPS], ref_history[:STEPS])),
        "norm_diff": max(abs(a - b) for a, b in zip(history[STEPS:], ref_history[STEPS:])),
        "trained_diff": trained_diff,
        "frozen_moved": frozen_moved,
        "moved": moved,
        "frozen": sum(not p.requires_grad for p in model.parameters()),
        "adapters_outside_language_model": [
            n for n, _ in model.named_parameters() if "lora_" in n and f"{parts.language_path}." not in n
        ],
        "units": [isinstance(unit, FSDPModule) for unit in units],
        "vision_blocks": len(inner.get_submodule(parts.blocks_path)) if image_path else 0,
        "vision_calls": len(calls),
        "projector_units": len(parts.projector_paths) if image_path else 0,
        "layers": len(layers),
        "all_layers": inner.config.get_text_config().num_hidden_layers,
        "layer_tokens": sorted(tokens),
        "placements": _placements(model, parts),
        "tp_spread": _tp_spread(model),
    }


def _holds(model: nn.Module, path: str) -> bool:
    try:
        return isinstance(model.get_submodule(path), nn.Module)
    except AttributeError:
        return False


def _placements(model: nn.Module, parts) -> dict[str, list[str]]:
    """Each part's parameters' placements (``plain`` for a tensor that is not a DTensor), each once."""
    seen: dict[str, set[str]] = {}
    for name, param in model.named_parameters():
        part = _part(name, parts)
        if part == "language" and name.endswith(("q_proj.weight", "q_proj.base_layer.weight")):
            part = "projection"
        if part == "language" and ".experts." in name:
            part = "experts"
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


def _world(world: str, rank: int, world_size: int, out_dir: str) -> None:
    results = {name: _run_case(world_size, *case) for name, case in CASES[world].items()}
    dist.barrier()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@functools.cache
def _results(world: str) -> list[dict]:
    return world_json(functools.partial(_world, world), int(world.split()[0]))


@pytest.mark.parametrize(
    "world,name",
    [pytest.param(w, n, marks=[pytest.mark.slow] if "slow" in w else []) for w, cases in CASES.items() for n in cases],
    ids=str,
)
def test_image_text_model_matches_one_process(world: str, name: str) -> None:
    _, sizes, case = CASES[world][name]
    results = [results[name] for results in _results(world)]
    # What moved and how each part is held, over the ranks (a pipeline stage holds some parts only).
    moved: dict[str, float] = {}
    placements: dict[str, set[str]] = {}
    for result in results:
        for part, change in result["moved"].items():
            moved[part] = max(moved.get(part, 0.0), change)
        for part, kinds in result["placements"].items():
            placements.setdefault(part, set()).update(kinds)
    everything = {"vision", "projector", "language"}
    trained = {"full": everything, "router loss": everything, "frozen vision": everything - {"vision"}}
    trained["packed"] = trained["mixed"] = everything
    assert set(moved) == trained.get(case, {"language"}), (name, moved)
    # Parity means something only if each trained part moved (Gemma 3's SigLIP weights move ~6e-4 here).
    assert all(change > 10 * TOL for change in moved.values()), (name, moved)
    every_weight = ("full", "router loss", "packed", "mixed")
    assert any(result["frozen"] > 0 for result in results) == (case not in every_weight), name
    fsdp, cp = sizes.get("dp_shard_size", 1) * sizes.get("cp_size", 1), sizes.get("cp_size", 1)
    want = PLACEMENTS[(fsdp, sizes.get("tp_size", 1))]
    assert {part: sorted(placements[part]) for part in want} == want, (name, placements)
    for rank, result in enumerate(results):
        where = (name, rank, result)
        assert result["loss_diff"] <= TOL and result["norm_diff"] <= TOL, where
        assert result["trained_diff"] <= TOL, where
        assert result["frozen_moved"] == 0.0, where
        assert result["adapters_outside_language_model"] == [], where
        # Under FSDP2 each vision block, the projector and each decoder layer is its own unit; under TP the language
        # model's projections are split and the vision tower and projector replicated (identical on the tp ranks).
        pp = sizes.get("pp_size", 1)  # the first stage (first ranks: pp is the outermost dimension) holds the images'
        first = rank < len(results) // pp
        assert result["layers"] == result["all_layers"] // pp and (result["vision_blocks"] > 0) == first, where
        units = result["vision_blocks"] + result["projector_units"] + result["layers"]
        assert result["units"] == [fsdp > 1] * units, where
        assert result["tp_spread"] == 0.0, where
        # Checkpointed vision blocks run again in the backward where the tower trains (a frozen one has none); under TP
        # too (the replicated tower's blocks recompute on local copies of their weights).
        again = "ac" in sizes and case in ("full", "router loss")
        calls = STEPS * ACCUM * pp * (1 + again)  # a pipeline's first stage runs the tower per micro-batch (pp of them)
        calls //= 2 if case == "mixed" else 1  # a text-only micro-batch runs no tower
        assert result["vision_calls"] == (calls if result["vision_blocks"] else 0), where
        # Under EP each rank holds its experts; under CP the decoder layers see this rank's shard of each row.
        assert all(("ep:Shard" in p) == ("ep_size" in sizes) for p in result["placements"].get("experts", [])), where
        multiple = 2 * cp * sizes.get("tp_size", 1)  # a sharded row is padded for context (and sequence) parallelism
        tokens = [SEQ if cp == 1 else -(-SEQ // multiple) * multiple // cp]
        assert result["layer_tokens"][0] > SEQ if case == "packed" else result["layer_tokens"] == tokens, where
