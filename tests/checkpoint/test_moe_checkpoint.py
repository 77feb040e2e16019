"""A mixture-of-experts model on disk (tiny Mixtral and Qwen3-MoE, fp32, 4 gloo ranks, one world).

* Loading: transformers 5 ``save_pretrained`` writes the hub's per-expert layout (``block_sparse_moe.experts.<e>.w1``,
  ``mlp.experts.<e>.gate_proj``, ...), not the model's fused 3-D ``experts.gate_up_proj``; ``from_pretrained`` under
  EP=2 x dp_shard=4 (experts Shard(0) over ep, then FSDP2 on the rest), EP=2 x TP=2, TP=2 and EP=4 reads each rank's
  experts from it and gives transformers' own logits (PP=2 x EP=2: loaded, exported, the same logits).
* Distributed checkpoints: EP=2 training state (model + optimizer) saved with the engine's DCP path resumes exactly
  under EP=2 and reshards to FSDP2=4 (no EP) and to EP=2 x TP=2, each continuing the uninterrupted run's losses.
* Export: the offline DCP checkpoint -> HF export of the EP=2 checkpoint (one layer's experts split over several
  files) writes the hub layout and loads in transformers with the logits at the save; ``export_hf`` and the collective ``save_pretrained`` of the EP-sharded model write what transformers'
  own ``save_pretrained`` writes, and transformers loads it with the trained model's logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _mxfp4 import write_mxfp4_checkpoint
from lightning_plugins.testing.world import run_world
from tiny_models import make_batch, tiny_model
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, Mxfp4Config

from lightning_plugins import ParallelLayout
from lightning_plugins.checkpoint.dcp import load_optimizer_state, load_tensors, optimizer_state, save_sharded
from lightning_plugins.checkpoint.export import export_checkpoint
from lightning_plugins.checkpoint.live_export import export_hf
from lightning_plugins.checkpoint.load import checkpoint_index, from_pretrained, is_on_meta

TOL = 1e-5
STEPS = 2  # before and after the checkpoint


def _logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    return logits.full_tensor() if isinstance(logits, DTensor) else logits


def _hf_logits(directory: Path, input_ids: torch.Tensor, **kwargs: object) -> torch.Tensor:
    return _logits(AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs), input_ids)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, first: int) -> list[float]:
    losses = []
    for step in range(first, first + STEPS):
        loss = model(**make_batch(4, 12, model.config.vocab_size, seed=step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {"model": get_model_state_dict(model), "optim": optimizer_state(model, optimizer)}


def _resume(hub: Path, layout: ParallelLayout, ckpt: Path) -> list[float]:
    model = from_pretrained(hub, layout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, 100)  # other batches: weights and optimizer state that only the checkpoint can replace
    state = _state(model, optimizer)
    load_tensors(state, ckpt)
    set_model_state_dict(model, state["model"])
    load_optimizer_state(model, optimizer, state["optim"])
    return _train(model, optimizer, STEPS)


def _hub_layout(directory: Path, expert_weight: str = "block_sparse_moe.experts.3.w1.weight") -> bool:
    keys = set(checkpoint_index(directory))
    return f"model.layers.0.{expert_weight}" in keys and not any("gate_up_proj" in k for k in keys)


def _world(rank: int, world_size: int, root: str) -> None:
    root = Path(root)
    hub, qwen, deep, mxfp4 = root / "hub", root / "qwen3_moe", root / "mixtral_4l", root / "gpt_oss_mxfp4"
    if rank == 0:
        tiny_model("mixtral").save_pretrained(hub)
        tiny_model("qwen3_moe").save_pretrained(qwen)
        tiny_model("mixtral_4l").save_pretrained(deep)
        write_mxfp4_checkpoint(mxfp4)
    dist.barrier()
    assert _hub_layout(hub) and _hub_layout(qwen, "mlp.experts.3.gate_proj.weight")
    ids = make_batch(2, 12, 64, seed=99)["input_ids"]
    for directory, layouts in (
        (hub, ({"ep_size": 2}, {"ep_size": 2, "tp_size": 2}, {"tp_size": 2})),
        (qwen, ({"ep_size": 4},)),
        (mxfp4, ({"ep_size": 4}, {"ep_size": 2, "tp_size": 2})),  # each rank dequantizes only its experts
    ):
        dense = {"quantization_config": Mxfp4Config(dequantize=True)} if directory == mxfp4 else {}
        expected = _hf_logits(directory, ids, **dense)
        for sizes in layouts:
            got = _logits(from_pretrained(directory, ParallelLayout(**sizes)), ids)
            assert (got - expected).abs().max().item() < TOL, (directory.name, sizes, (got - expected).abs().max().item())

    # Pipeline stages (no logits on every rank): loaded under PP=2 x EP=2 and exported, transformers' logits again.
    export_hf(from_pretrained(deep, ParallelLayout(pp_size=2, ep_size=2)), root / "deep_export")
    assert (_hf_logits(root / "deep_export", ids) - _hf_logits(deep, ids)).abs().max().item() < TOL

    ep2 = ParallelLayout(ep_size=2)  # x dp_shard=4: FSDP2 shards each rank's experts again (_StridedShard)
    model = from_pretrained(hub, ep2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, 0)
    ckpt = root / "ckpt"
    save_sharded(_state(model, optimizer), ckpt, rank=rank, barrier=dist.barrier, write_files=lambda _: None)
    at_save = _logits(model, ids)
    if rank == 0:  # the offline export: one process, no process group needed
        export_checkpoint(ckpt, root / "offline", model=hub, max_shard_size=20_000)  # experts split over files
    dist.barrier()
    assert _hub_layout(root / "offline") and (root / "offline" / "model.safetensors.index.json").is_file()
    assert (_hf_logits(root / "offline", ids) - at_save).abs().max().item() < TOL
    uninterrupted = _train(model, optimizer, STEPS)
    for layout in (ep2, ParallelLayout(dp_shard_size=4), ParallelLayout(ep_size=2, tp_size=2)):
        resumed = _resume(hub, layout, ckpt)
        assert max(abs(a - b) for a, b in zip(resumed, uninterrupted)) < TOL, (layout, resumed, uninterrupted)

    trained = _logits(model, ids)
    export_hf(model, root / "export")
    model.save_pretrained(root / "saved")
    dist.barrier()
    for directory in (root / "export", root / "saved"):
        assert _hub_layout(directory), directory
        assert (_hf_logits(directory, ids) - trained).abs().max().item() < TOL, directory


def test_moe_load_resume_reshard_export(tmp_path: Path) -> None:
    run_world(_world, 4, str(tmp_path))


def test_a_hub_checkpoint_missing_an_expert_is_named(tmp_path: Path) -> None:
    """One process: the per-expert hub layout loads into a plain meta-device model (transformers' logits), and a
    checkpoint without one expert's weight is refused before anything is loaded, naming that tensor."""
    from safetensors.torch import load_file, save_file

    from lightning_plugins.checkpoint.load import load_sharded_safetensors

    tiny_model("qwen2_moe").save_pretrained(tmp_path)  # shared expert, a dense layer
    ids = make_batch(2, 12, 64, seed=5)["input_ids"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path), dtype=torch.float32)
    load_sharded_safetensors(model, tmp_path)
    assert (_logits(model, ids) - _hf_logits(tmp_path, ids)).abs().max().item() < TOL

    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.0.mlp.experts.2.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path), dtype=torch.float32)
    with pytest.raises(KeyError, match=r"lacks 1 tensors.*model\.layers\.0\.mlp\.experts\.2\.up_proj\.weight"):
        load_sharded_safetensors(model, tmp_path)
    assert is_on_meta(model)  # refused before any storage was given
