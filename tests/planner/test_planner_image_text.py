"""The planner on image-text recipes: the whole model is counted (vision tower, projector, language model) and the
measured step holds images.

The tiny Qwen2.5-VL of ``tests/tiny_vlm.py`` (a 2-block vision tower of width 16, a 2-layer language model of width 32)
is saved with an image processor config; its vision tower's and merger's sizes are worked out by hand from the config
below, its language model's by the planner's text-only path (``model_stats`` of the text config), so the counted state
is checked against neither the image-text model the dry run builds nor its own arithmetic. The shipped recipes are
dry-run at real size in tests/recipe/test_recipes.py (slow).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_plugins import ParallelLayout
from lightning_plugins.adapters.vision import VisionOptions
from lightning_plugins.planner.dryrun import count_state, dry_runs
from lightning_plugins.planner.forked import forked
from lightning_plugins.planner.image_text import ImageInputs, image_batch
from lightning_plugins.planner.model_stats import load_model_config, model_stats
from lightning_plugins.planner.workload import Workload

ROWS, SEQ, SIDE = 2, 48, 8  # 8 x 8 px images: 4 x 4 patches of 2 px, merged 2 x 2: 4 image tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_vlm import MERGE, PATCH, tiny_vlm_config

    directory = tmp_path_factory.mktemp("tiny_qwen2_5_vl")
    tiny_vlm_config("qwen2_5_vl").save_pretrained(directory)
    processor = {
        "image_processor_type": "Qwen2VLImageProcessor", "patch_size": PATCH, "merge_size": MERGE,
        "temporal_patch_size": 1, "min_pixels": 4 * 4, "max_pixels": 64 * 64,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    }  # fmt: skip
    (directory / "preprocessor_config.json").write_text(json.dumps(processor))
    return directory


def _workload(model_dir: Path, vision: VisionOptions) -> Workload:
    return Workload(
        config=load_model_config(model_dir), layout=ParallelLayout().resolve(1), dtype="fp32", seq_len=SEQ,
        micro_batch_size=ROWS, images=ImageInputs.of(model_dir, vision),
    )  # fmt: skip


def _tower_by_hand(config) -> tuple[int, int]:
    """``(vision blocks and patch embedding, merger)`` parameters of a Qwen2.5-VL vision tower, from its config."""
    v = config.vision_config
    h, i = v.hidden_size, v.intermediate_size
    patch = v.in_channels * v.temporal_patch_size * v.patch_size**2 * h  # a Conv3d without bias
    block = 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + 2 * (h * i + i) + (i * h + h)  # norms, qkv, proj, gated MLP
    merged = h * v.spatial_merge_size**2
    merger = h + (merged * merged + merged) + (merged * v.out_hidden_size + v.out_hidden_size)  # norm and 2-layer MLP
    return patch + v.depth * block, merger


def test_counted_state_holds_the_vision_tower_and_the_projector(model_dir: Path) -> None:
    """A full fine-tune in fp32 on one GPU: every parameter is held (4 bytes), the projector's and the language model's
    take gradients and AdamW moments, the frozen tower's none; trained, the tower's too."""
    frozen, trained = (_workload(model_dir, VisionOptions(train_tower=tower)) for tower in (False, True))
    state, trained_state = forked([(count_state, (frozen, 0)), (count_state, (trained, 0))])  # one pool
    tower, merger = _tower_by_hand(frozen.images.config)
    language = model_stats(frozen.config).total_params  # the language model and its head, built as a text model
    assert state["parameters"] == 4 * (language + tower + merger)
    assert state["gradients"] == 4 * (language + merger)
    assert trained_state["parameters"] == state["parameters"]
    assert trained_state["gradients"] == 4 * (language + tower + merger)
    # AdamW: two fp32 moments per trained value and a float32 step per trained tensor (the tower: its patch embedding,
    # and per block 2 norms, qkv, proj and 3 MLP linears with their biases).
    tower_tensors = 1 + frozen.images.config.vision_config.depth * 12
    assert trained_state["optimizer"] - state["optimizer"] == 8 * tower + 4 * tower_tensors
    assert 0 < state["optimizer"] - 8 * (language + merger) < 4 * 1000


def test_tokens_per_image_of_the_shipped_configs_follow_their_patches() -> None:
    """Qwen2.5-VL resizes a side to a multiple of patch x merge (28 px) and merges 2 x 2 patches into one token;
    Qwen3-VL the same with 16 px patches; Gemma 3 has a fixed count per image."""
    from transformers import AutoConfig

    for name, patch in (("Qwen/Qwen2.5-VL-7B-Instruct", 14), ("Qwen/Qwen3-VL-30B-A3B-Instruct", 16)):
        images = ImageInputs.of(name, VisionOptions(image_size=1024))
        side = round(1024 / (2 * patch)) * 2  # patches per side
        assert images.tokens_per_image == side**2 // 4, name
        assert images.pixels == (side**2, 3 * 2 * patch**2)  # a row of 2 frames x 3 channels x patch^2 per patch
    gemma = ImageInputs.of("google/gemma-3-27b-it", VisionOptions())
    config = AutoConfig.from_pretrained("recipes/configs/gemma-3-27b-it")
    assert gemma.tokens_per_image == config.mm_tokens_per_image
    assert gemma.pixels == (1, 3, config.vision_config.image_size, config.vision_config.image_size)


def _one_and_three_images(model_dir: Path) -> tuple[Workload, Workload]:
    return tuple(_workload(model_dir, VisionOptions(images_per_sample=n, image_size=SIDE)) for n in (1, 3))


def test_measured_step_holds_the_images_and_their_tokens(model_dir: Path) -> None:
    """The step's rows hold every image's tokens (the model's own forward accepts them: it checks that the image tokens
    match its vision features), its pixel_values and the model's per-image inputs."""
    from transformers import AutoModelForImageTextToText

    for workload in _one_and_three_images(model_dir):
        images = workload.images
        assert images.tokens_per_image == (SIDE // 2) ** 2 // 4
        batch = image_batch(workload, None)
        image_token = images.config.image_token_id
        assert ((batch["input_ids"] == image_token).sum(dim=1) == images.per_sample * images.tokens_per_image).all()
        assert batch["pixel_values"].shape[0] == ROWS * images.per_sample * images.pixels[0]
        assert (batch["labels"][batch["input_ids"] == image_token] == -100).all()
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(images.config)
        loss = model(**{**batch, "pixel_values": torch.randn(batch["pixel_values"].shape)}).loss
        assert torch.isfinite(loss)


@pytest.mark.slow  # two forked dry runs: about 10 s of CPU, minutes on 2 shared cores
def test_measured_peak_grows_with_the_images(model_dir: Path) -> None:
    """The dry run measures the images: two more per row hold at least their pixel_values more at the peak."""
    one, three = _one_and_three_images(model_dir)
    small, large = (max(rank.total for rank in ranks) for ranks in dry_runs([one, three]))
    pixels = ROWS * 2 * one.images.pixels[0] * one.images.pixels[1] * 4  # two more images per row, fp32
    assert large - small >= pixels



@pytest.mark.slow  # four forked dry runs: minutes on 2 shared cores
def test_checkpointed_vision_blocks_hold_less_per_image(model_dir: Path) -> None:
    """With the tower trained, two more images per row add its blocks' saved activations to the peak; with activation
    checkpointing (of the vision blocks too) only the blocks' inputs: the growth is smaller. The decoder sees the same
    number of tokens either way (images replace text tokens), so only the tower can make the difference."""
    import dataclasses

    from lightning_plugins.parallel.options import MemoryOptions

    runs = []
    for mode in ("none", "full"):
        for n in (1, 3):
            workload = _workload(model_dir, VisionOptions(train_tower=True, images_per_sample=n, image_size=SIDE))
            runs.append(dataclasses.replace(workload, memory=MemoryOptions(activation_checkpointing=mode)))
    peaks = [max(rank.total for rank in ranks) for ranks in dry_runs(runs)]
    plain, checkpointed = peaks[1] - peaks[0], peaks[3] - peaks[2]
    assert 2 * checkpointed < plain, (plain, checkpointed)  # measured: 32,096 vs 181,600 bytes


def _image_flops_by_hand(config, patches: int) -> tuple[int, int, int]:
    """``(vision blocks, patch embedding, merger)`` forward FLOPs of one Qwen2.5-VL image of ``patches`` patches, from
    its config: 2 per multiply-add of each linear and of the Conv3d, attention ``4 x patches x attended x width`` (its
    scores and weighted values). The image (8 px) fits in one window (``window_size`` 8 px), so every block attends all
    of its patches."""
    v = config.vision_config
    h, i, merged = v.hidden_size, v.intermediate_size, v.hidden_size * v.spatial_merge_size**2
    assert v.window_size >= SIDE
    patch = 2 * patches * (v.in_channels * v.temporal_patch_size * v.patch_size**2) * h
    block = 2 * patches * (3 * h * h + h * h + 3 * h * i) + 4 * patches * patches * h  # qkv, proj, MLP; attention
    merger = 2 * (patches // v.spatial_merge_size**2) * (merged * merged + merged * v.out_hidden_size)
    return v.depth * block, patch, merger


def _step_times(model_dir: Path, vision: dict, **changes) -> tuple:
    """The step-time model's estimates of one and of three images per row (SIDE px) for one H100, changed by
    ``changes`` (e.g. activation checkpointing, LoRA)."""
    import dataclasses

    from lightning_plugins.planner.hardware import cluster_from
    from lightning_plugins.planner.report import step_time

    cluster = cluster_from("H100", gpus=changes["layout"].world_size if "layout" in changes else 1)
    times = []
    for n in (1, 3):
        options = VisionOptions(images_per_sample=n, image_size=SIDE, **vision)
        workload = dataclasses.replace(_workload(model_dir, options), **changes)
        times.append(step_time(workload, cluster))
    return cluster, *times


def test_step_time_counts_the_image_path(model_dir: Path) -> None:
    """Two more images per row add their image path's FLOPs to the step time, and nothing else does (the decoder
    sees as many tokens: images replace text tokens): per image the forward through the tower (only, when frozen),
    3 forwards through a trained projector, 3 through a trained tower and its blocks once more with activation
    checkpointing (under TP too: every TP rank runs the whole replicated tower), 1 each under LoRA. Counted by hand
    from the config above, against the planner's count of the model's own forward."""
    from lightning_plugins.adapters.lora import LoraOptions
    from lightning_plugins.parallel.options import MemoryOptions

    one = _workload(model_dir, VisionOptions(image_size=SIDE))
    patches = one.images.pixels[0]
    blocks, patch, merger = _image_flops_by_hand(one.images.config, patches)
    counted = one.images.compute(lora=False)
    assert (counted.block_flops, counted.tower_flops, counted.projector_flops) == (blocks, patch, merger)
    assert counted.blocks == one.images.config.vision_config.depth and (patches, blocks) == (16, 196_608)
    extra = 2 * ROWS  # images more per step (one data rank, no accumulation)
    ac, tp2 = MemoryOptions(activation_checkpointing="full"), ParallelLayout(tp_size=2).resolve(2)
    cases = {  # (vision: section, changes) -> (training FLOPs, recomputed FLOPs) per image
        "frozen tower": ({}, {}, blocks + patch + 3 * merger, 0),
        "trained tower": ({"train_tower": True}, {}, 3 * (blocks + patch + merger), 0),
        "trained tower, AC": ({"train_tower": True}, {"memory": ac}, 3 * (blocks + patch + merger), blocks),
        "frozen tower, AC": ({}, {"memory": ac}, blocks + patch + 3 * merger, 0),
        "trained tower, AC, TP=2": ({"train_tower": True}, {"memory": ac, "layout": tp2}, 3 * (blocks + patch + merger),
                                    blocks),  # fmt: skip
        "LoRA": ({}, {"lora": LoraOptions(r=4)}, blocks + patch + merger, 0),
    }
    for name, (vision, changes, train, again) in cases.items():
        cluster, small, large = _step_times(model_dir, vision, **changes)
        rate = cluster.gpu.peak_flops * small.efficiency
        assert large.compute_s - small.compute_s == pytest.approx(extra * train / rate, rel=1e-9), name
        assert large.recompute_s - small.recompute_s == pytest.approx(extra * again / rate, rel=1e-9, abs=1e-18), name
        assert large.vision_s == pytest.approx(3 * ROWS * (train + again) / rate, rel=1e-9), name
        assert large.step_s > small.step_s, name
    assert any(line.startswith("image path: 3 image(s) per row") for line in large.assumptions), large.assumptions


@pytest.mark.slow  # one forked dry run of two pipeline ranks: about 10 s of CPU, minutes on 2 shared cores
def test_pipeline_stages_are_dry_run_with_the_image_path_on_the_first(model_dir: Path) -> None:
    """Under PP=2 the first stage holds the vision tower and the merger and the second does not (it dropped them: the
    dry run's marks still find its language model's layers); together they hold the whole model once."""
    import dataclasses

    workload = dataclasses.replace(_workload(model_dir, VisionOptions(image_size=SIDE)),
                                   layout=ParallelLayout(pp_size=2).resolve(2))  # fmt: skip
    first, second = dry_runs([workload])[0]
    tower, merger = _tower_by_hand(workload.images.config)
    language = model_stats(workload.config).total_params
    assert first.state["parameters"] + second.state["parameters"] == 4 * (language + tower + merger)
    assert first.state["parameters"] > 4 * (tower + merger) and second.state["parameters"] < 4 * language
