"""Saving the way users already save, from a parallelized model: the trained weights, whole, under every layout.

* Lightning: after ``trainer.fit``, ``module.model.save_pretrained(out_dir, is_main_process=trainer.is_global_zero)``
  on every rank (a transformers model or a peft ``PeftModel``): tests/scripts/save_habits_trainer.py, one launch
  that fits under TP, PP (tied embeddings), CP and FSDP2, and LoRA under PP.
* Accelerate: ``accelerator.unwrap_model(model).save_pretrained(out_dir, state_dict=accelerator.get_state_dict(model))``
  with ``ParallelAccelerator``, in one world for TP, PP, CP, FSDP2 and LoRA (TP, FSDP2); ``get_state_dict`` is the
  full state dict under one-process names on the main process, nothing on the other.

Each written directory holds, bit for bit, what ``export_hf`` writes for the same trained model and exactly the
trained parameters; it loads in plain transformers / peft with every weight read from it, and gives the trained
model's loss. Then the refusals: a state dict that is one stage's part, local shards (refused by the rank that would
write it, with no collective), DTensors on one rank only (a collective save the other rank never joins fails within
seconds), a process group that is gone; and what is gathered when the writer is not rank 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _saved import check_saved, differing
from _launch import shared_script
from lightning_plugins.testing.world import run_world
from _accelerate_loop import ACCUM, build, prepared, run_loop
from tiny_models import make_batch, tiny_model
from torch.distributed.tensor import DTensor

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

SCRIPT = Path(__file__).parents[1] / "scripts" / "save_habits_trainer.py"
TOL = 1e-5


def _check(name: str, case: dict[str, Any]) -> None:
    assert case["differing_from_export"] == [], (name, case)
    assert case["weight_diff"] == 0.0 and case["saved_but_not_trained"] == 0, (name, case)
    assert case["loss_diff"] <= TOL, (name, case)
    assert case["moved_from_untrained"] > 1e-3, (name, case)  # the trained weights differ from the initial ones


def test_lightning_save_pretrained_after_fit(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> None:
    results = shared_script(request, tmp_path_factory, SCRIPT.name, 2)  # in one world with the strategies' scripts
    assert set(results) == {"tp2", "pp2 tied", "cp2 ring", "fsdp2", "lora pp2"}, results
    for name, case in results.items():
        _check(name, case)
        files = {"adapter_config.json", "adapter_model.safetensors", "README.md"} if "lora" in name else {"config.json"}
        assert files <= set(case["written"]), (name, case["written"])


ACCELERATE = {
    "tp2": {"tp_size": 2},
    "pp2": {"pp_size": 2, "settings": {"pp_microbatches": 2}},
    "cp2 ulysses": {"cp_size": 2, "settings": {"cp_backend": "ulysses"}, "documented": True},
    "fsdp2": {"dp_shard_size": 2},
    "lora tp2": {"tp_size": 2, "lora": True},
    "lora fsdp2": {"dp_shard_size": 2, "lora": True, "documented": True},
}


def _accelerate_cases(rank: int, world_size: int, root: str) -> None:
    from lightning_plugins.accelerate import ParallelAccelerator

    batch = make_batch(4, 16, 64, seed=99)
    for name, case in ACCELERATE.items():
        sizes = {k: case[k] for k in ("tp_size", "pp_size", "cp_size", "dp_shard_size") if k in case}
        settings = {**sizes, **case.get("settings", {})}
        accelerator = ParallelAccelerator(**settings, cpu=True, gradient_accumulation_steps=ACCUM)
        model, optimizer, loader, scheduler = prepared(accelerator, build(case), shuffle=False)
        run_loop(accelerator, model, optimizer, loader, scheduler)
        saved, exported = f"{root}/{name} saved", f"{root}/{name} exported"
        state = accelerator.get_state_dict(model)
        if accelerator.is_main_process:  # the full state dict, every stage, under the names of one process
            one_process = list(build(case).state_dict())
            assert list(state) == one_process, (name, sorted(set(state) ^ set(one_process)))
            assert all(type(t) is torch.Tensor and t.device.type == "cpu" for t in state.values()), name
        else:
            assert state == {}, name
        unwrapped = accelerator.unwrap_model(model)
        if case.get("documented"):  # Accelerate's documented form
            unwrapped.save_pretrained(
                saved, is_main_process=accelerator.is_main_process, save_function=accelerator.save, state_dict=state
            )
        else:
            unwrapped.save_pretrained(saved, state_dict=state)
        accelerator.save_model(model, exported)
        base = tiny_model("llama") if case.get("lora") else None
        measured = check_saved(unwrapped, saved, exported, batch, build(case), base)
        _check(name, measured)


def test_accelerate_save_pretrained_with_get_state_dict(tmp_path: Path) -> None:
    run_world(_accelerate_cases, 2, str(tmp_path))


def _refusals(rank: int, world_size: int, root: str) -> None:
    from lightning_plugins import ParallelLayout, ParallelOptions, parallelize
    from lightning_plugins.checkpoint.live_export import export_hf
    from lightning_plugins.parallel.save_pretrained import full_state_dict

    import lightning_plugins.parallel.save_pretrained as saving

    pipelined = parallelize(tiny_model("llama"), ParallelLayout(pp_size=2), ParallelOptions(pp_microbatches=2))
    # A state dict of plain tensors is checked and written by the rank that writes it (rank 0, as transformers, when
    # is_main_process is left at its default), with no collective.
    if rank == 0:
        with pytest.raises(ValueError, match=r"on rank 0 lacks 11 of the model's 21 entries \(under pipeline parallelism"):
            pipelined.save_pretrained(f"{root}/stage", state_dict=pipelined.state_dict())
    else:
        pipelined.save_pretrained(f"{root}/stage", state_dict=pipelined.state_dict())  # writes nothing
    with pytest.raises(ValueError, match=rf"on rank {rank} lacks {11 if rank == 0 else 10} of the model's 21 entries"):
        pipelined.save_pretrained(f"{root}/stage", is_main_process=True, state_dict=pipelined.state_dict())
    full = full_state_dict(pipelined)  # on rank 0 only: rank 1 cannot write it
    if rank == 1:
        with pytest.raises(ValueError, match=r"on rank 1 lacks 21 of the model's 21 entries, e.g. \['model.embed_tokens"):
            pipelined.save_pretrained(f"{root}/stage", is_main_process=True, state_dict=full)
    else:
        pipelined.save_pretrained(f"{root}/stage", is_main_process=False, state_dict=full)  # writes nothing
    dist.barrier()
    assert not Path(f"{root}/stage").exists()
    # Without a state dict, rank 1 writes what rank 0 gathered from both stages.
    pipelined.save_pretrained(f"{root}/pp by rank 1", is_main_process=rank == 1)
    export_hf(pipelined, f"{root}/pp exported")
    if rank == 1:
        assert differing(f"{root}/pp by rank 1", f"{root}/pp exported") == []

    sharded = parallelize(tiny_model("llama"), ParallelLayout(tp_size=2))
    local = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in sharded.state_dict().items()}
    shard = rf"on rank {rank} holds '[\w.]+' of shape \[\d+, \d+\] where the model's is \[\d+, \d+\] \(a shard\)"
    with pytest.raises(ValueError, match=shard):
        sharded.save_pretrained(f"{root}/local", is_main_process=True, state_dict=local)
    # DTensors on rank 0 only: a collective save that rank 1 never joins (its `{}` is the main process's to write).
    saving.ARRIVAL_TIMEOUT_S = 2.0
    if rank == 0:
        with pytest.raises(RuntimeError, match=r"every rank must call it .* only 1 of 2 ranks did within 2 s"):
            sharded.save_pretrained(f"{root}/local", state_dict=sharded.state_dict())
    else:
        sharded.save_pretrained(f"{root}/local", state_dict={})
    dist.barrier()
    assert not Path(f"{root}/local").exists()
    # The model's own sharded state_dict() on every rank is gathered; rank 1 writes.
    sharded.save_pretrained(f"{root}/tp by rank 1", is_main_process=rank == 1, state_dict=sharded.state_dict())
    export_hf(sharded, f"{root}/tp exported")
    if rank == 1:
        assert differing(f"{root}/tp by rank 1", f"{root}/tp exported") == []


def test_refusals_and_other_writers(tmp_path: Path) -> None:
    run_world(_refusals, 2, str(tmp_path))


def _compositions(rank: int, world_size: int, root: str) -> None:
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    from lightning_plugins import ParallelLayout, ParallelOptions, parallelize
    from lightning_plugins.checkpoint.live_export import export_hf
    from lightning_plugins.parallel.save_pretrained import full_state_dict

    options = ParallelOptions(pp_microbatches=2)
    cases = {  # name: (model, layout, who writes)
        "tp2 x fsdp2": ("llama", ParallelLayout(tp_size=2, dp_shard_size=2), 3),
        "pp2 x fsdp2 tied": ("llama_tied", ParallelLayout(pp_size=2, dp_shard_size=2), None),
        "lora pp2 x tp2": ("llama", ParallelLayout(pp_size=2, tp_size=2), 0),
    }
    for name, (family, layout, writer) in cases.items():
        model = tiny_model(family)
        if "lora" in name:
            torch.manual_seed(1)
            targets = ["q_proj", "o_proj", "up_proj"]  # column- and row-parallel bases; random non-zero lora_B
            model = get_peft_model(model, LoraConfig(r=4, target_modules=targets, init_lora_weights=False))
        one_process = {k: v.clone() for k, v in model.state_dict().items()}
        parallelize(model, layout, options)
        full = full_state_dict(model)
        if rank == 0:  # every entry, bit for bit, in one process's order
            assert list(full) == list(one_process), name
            assert all(torch.equal(full[k], v) for k, v in one_process.items()), name
        saved, exported = Path(root) / f"{name} saved", Path(root) / f"{name} exported"
        model.save_pretrained(saved, **({} if writer is None else {"is_main_process": rank == writer}))
        export_hf(model, exported)
        if rank == (writer or 0):
            assert differing(saved, exported) == [], name
            tensors = {k: v for p in saved.glob("*.safetensors") for k, v in load_file(str(p)).items()}
            named = {k.replace(".default", ""): v for k, v in one_process.items()}
            assert tensors and all(torch.equal(v, named[k]) for k, v in tensors.items()), name


def test_compositions_on_four_ranks(tmp_path: Path) -> None:
    """TP x FSDP2 (rank 3 writes), PP x FSDP2 with tied embeddings, LoRA under PP x TP: what is written and
    ``full_state_dict`` are the model's weights bit for bit (here untrained: the one-process copy is exact)."""
    run_world(_compositions, 4, str(tmp_path))


def test_refusals_in_one_process(tmp_path: Path) -> None:
    """A world of one: an empty state dict, peft's weight conversion, a process group that is gone."""
    from lightning_plugins import ParallelLayout, parallelize
    from lightning_plugins.adapters.lora import LoraOptions, apply_lora

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = parallelize(tiny_model("llama"), ParallelLayout())
        refusal = r"LlamaForCausalLM.save_pretrained\(state_dict=...\): the state dict on rank 0 lacks 21 of the"
        with pytest.raises(ValueError, match=refusal + r" model's 21 entries.*Leave state_dict out"):
            model.save_pretrained(tmp_path / "empty", state_dict={})
        adapted = parallelize(apply_lora(tiny_model("llama"), LoraOptions(r=2)), ParallelLayout())
        with pytest.raises(ValueError, match="path_initial_model_for_weight_conversion=...\\) is not available"):
            adapted.save_pretrained(tmp_path / "pissa", path_initial_model_for_weight_conversion=tmp_path / "init")
    finally:
        dist.destroy_process_group()
    with pytest.raises(RuntimeError, match="the process group was destroyed"):
        model.save_pretrained(tmp_path / "late")
    assert not any(tmp_path.iterdir())
