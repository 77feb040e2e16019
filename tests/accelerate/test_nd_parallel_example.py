"""Accelerate's ND-parallel example (``examples/torch_native_parallelism/nd_parallel.py``), unchanged but for the class
name: ``ParallelAccelerator(parallelism_config=ParallelismConfig(...), fsdp_plugin=FullyShardedDataParallelPlugin(
fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
state_dict_type="SHARDED_STATE_DICT"))`` runs on this project's engine with the user's layout, and its loop (the
forward under ``maybe_context_parallel``, the loss averaged over ``torch_device_mesh["dp_cp"]`` when
``parallelism_config.dp_cp_dim_names``, ``save_state``, ``save_pretrained`` on every rank, ``end_training``) trains
what the plain one-process ``Accelerator`` trains: per-step losses and final weights, fp32 (the example's bf16 would
hide a wrong step), on a tiny Llama built in place of ``from_pretrained``.

The plugin's settings are the engine's FSDP2 settings (``reshard_after_forward``, ``cpu_offload``, mixed precision,
activation checkpointing); one without an equivalent is refused by name, in-process and before any collective.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning_plugins.testing.world import run_world
from tiny_models import tiny_model
from torch.distributed.tensor import DTensor

ROWS, BATCH, SEQ, LR, TOL, VOCAB = 16, 4, 16, 0.5, 1e-5, 64
#: The example's plugin (as its docs write it), and one that pulls the memory levers it maps.
EXAMPLE_PLUGIN = {"transformer_cls_names_to_wrap": ["LlamaDecoderLayer"], "state_dict_type": "SHARDED_STATE_DICT"}
LEVERS_PLUGIN = {
    **EXAMPLE_PLUGIN, "reshard_after_forward": False, "cpu_offload": True, "activation_checkpointing": True,
    "mixed_precision_policy": "fp32", "cpu_ram_efficient_loading": True,
}  # fmt: skip


def _rows() -> list[dict[str, torch.Tensor]]:
    """The example's packed rows: ``input_ids`` and their next tokens as ``shift_labels`` and ``labels`` alike."""
    full = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(5))
    return [{"input_ids": row[:-1], "shift_labels": row[1:], "labels": row[1:]} for row in full]


def forward(model: Any, batch: dict, optimizer: Any, accelerator: Any) -> torch.Tensor:
    """The example's ``forward``: one optimizer step, the loss averaged over the data and context ranks."""
    batch["position_ids"] = torch.arange(0, batch["input_ids"].size(1), device=batch["input_ids"].device).unsqueeze(0)
    buffers = [batch["input_ids"], batch["shift_labels"], batch["labels"], batch["position_ids"]]
    with accelerator.maybe_context_parallel(
        buffers=buffers, buffer_seq_dims=[1, 1, 1, 1], no_restore_buffers=set(buffers)
    ):
        loss_reduce_grp = (
            accelerator.torch_device_mesh["dp_cp"].get_group()
            if accelerator.parallelism_config.dp_cp_dim_names
            else None
        )
        outputs = model(**batch)
        loss = outputs.loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        if dist.is_initialized():  # the one-process reference runs without a process group: its average is itself
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=loss_reduce_grp)
    return loss


def train(accelerator_class: type, sizes: dict[str, int], plugin: dict[str, Any], out: Path | None) -> dict[str, Any]:
    """The example's ``train``: per-step losses and the final full weights."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import FullyShardedDataParallelPlugin

    parallelism_config = ParallelismConfig(**sizes)
    fsdp2_plugin = None
    if parallelism_config.dp_shard_enabled or parallelism_config.cp_enabled:
        fsdp2_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap", **plugin
        )
    accelerator = accelerator_class(parallelism_config=parallelism_config, fsdp_plugin=fsdp2_plugin, cpu=True)
    model = tiny_model("llama")  # the example: AutoModelForCausalLM.from_pretrained(...)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    dataloader = torch.utils.data.DataLoader(_rows(), batch_size=BATCH // parallelism_config.data_parallel_size)
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    losses = []
    for step, batch in enumerate(dataloader):
        losses.append(forward(model, batch, optimizer, accelerator).item())
        if out is not None and step == 1 and parallelism_config.dp_shard_enabled:
            accelerator.save_state(str(out / "checkpoint-1"))
    weights = {
        name: (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()
        for name, param in accelerator.unwrap_model(model).named_parameters()
    }
    if out is not None:
        model.save_pretrained(str(out / "model"))
    return {"loss": losses, "weights": weights, "accelerator": accelerator}


def reference() -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    try:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        result = train(Accelerator, {}, {}, None)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    return {"loss": result["loss"], "weights": result["weights"]}


def _check_accelerate_answers(accelerator: Any, sizes: dict[str, int]) -> None:
    """``parallelism_config`` answers as Accelerate's for these sizes, and every name it gives is a mesh dimension."""
    from accelerate.parallelism_config import ParallelismConfig

    theirs, ours, mesh = ParallelismConfig(**sizes), accelerator.parallelism_config, accelerator.torch_device_mesh
    for name in ("dp_dim_names", "non_dp_dim_names", "dp_shard_cp_dim_names", "dp_cp_dim_names", "fsdp_dim_names",
                 "total_size", "non_data_parallel_size", "data_parallel_size", "dp_replicate_enabled",
                 "dp_shard_enabled", "tp_enabled", "cp_enabled", "active_mesh_dims"):  # fmt: skip
        assert getattr(ours, name) == getattr(theirs, name), (name, getattr(ours, name), getattr(theirs, name))
    for name in ("dp_replicate", "dp_shard", "cp", "tp"):
        assert mesh[name].size() == theirs._sizes[name], name
    for name, dims in (("dp", theirs.dp_dim_names), ("dp_shard_cp", theirs.dp_shard_cp_dim_names),
                       ("dp_cp", theirs.dp_cp_dim_names)):  # fmt: skip
        assert mesh[name].size() == int(torch.tensor([theirs._sizes[d] for d in dims] or [1]).prod()), name


def _run_cases(rank: int, world_size: int, cases: dict[str, Any], want: dict[str, Any], out: str) -> None:
    import logging

    from lightning_plugins.accelerate import ParallelAccelerator

    warned: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("accelerate").addHandler(handler)
    for index, (name, (sizes, plugin, memory)) in enumerate(cases.items()):
        got = train(ParallelAccelerator, sizes, plugin, Path(out, name))
        accelerator = got["accelerator"]
        _check_accelerate_answers(accelerator, sizes)
        assert {k: getattr(accelerator.memory, k) for k in memory} == memory, (name, accelerator.memory)
        shown = f"{name} loss {got['loss']} want {want['loss']}"
        torch.testing.assert_close(
            torch.tensor(got["loss"]),
            torch.tensor(want["loss"]),
            rtol=TOL,
            atol=TOL,
            msg=lambda m, s=shown: f"{s}\n{m}",
        )
        for param_name, weight in got["weights"].items():
            torch.testing.assert_close(
                weight, want["weights"][param_name], rtol=TOL, atol=TOL, msg=f"{name} {param_name}"
            )
        assert set(got["weights"]) == set(want["weights"]), name
        if index == len(cases) - 1:
            accelerator.end_training()
    assert not warned, warned  # Accelerate's context-parallel warning among them: the engine shards the batches
    if rank == 0:
        for name, (sizes, _, _) in cases.items():
            assert Path(out, name, "model", "config.json").is_file(), name
            assert Path(out, name, "checkpoint-1").is_dir() == (sizes.get("dp_shard_size", 1) > 1), name


CASES = {
    "dp_shard2": ({"dp_shard_size": 2}, EXAMPLE_PLUGIN, {}),
    "tp2": ({"tp_size": 2}, EXAMPLE_PLUGIN, {}),
    "cp2": ({"cp_size": 2}, EXAMPLE_PLUGIN, {}),
    "dp_shard2_levers": (
        {"dp_shard_size": 2},
        LEVERS_PLUGIN,
        {
            "reshard_after_forward": False,
            "cpu_offload": True,
            "activation_checkpointing": "full",
            "param_dtype": "fp32",
        },
    ),
}


def test_accelerates_nd_parallel_example_on_two_ranks(tmp_path: Path) -> None:
    run_world(_run_cases, 2, CASES, reference(), str(tmp_path))


# ------------------------------------------------------------------------------------- in-process: refused settings


MIXED = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32, "output_dtype": torch.float32}


def _plugin(**settings: Any) -> Any:
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(fsdp_version=2, **settings)


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"auto_wrap_policy": "size_based_wrap", "min_num_params": 100}, "auto_wrap_policy='size_based_wrap'"),
        ({"state_dict_type": "FULL_STATE_DICT"}, "state_dict_type='FULL_STATE_DICT'"),
        ({"ignored_modules": "lm_head"}, "ignored_modules"),
        ({"mixed_precision_policy": "fp16"}, "mixed_precision_policy param_dtype=torch.float16"),
        ({"mixed_precision_policy": MIXED}, "mixed_precision_policy output_dtype=torch.float32"),
    ],
)
def test_a_plugin_setting_without_an_equivalent_is_refused_by_name(settings: dict[str, Any], named: str) -> None:
    from lightning_plugins.accelerate import ParallelAccelerator
    from lightning_plugins.errors import OptionsError

    with pytest.raises(OptionsError, match=re.escape(f"fsdp_plugin {named} has no equivalent")):
        ParallelAccelerator(fsdp_plugin=_plugin(**settings), cpu=True)


def test_a_plugin_setting_given_twice_must_agree() -> None:
    from lightning_plugins.accelerate import ParallelAccelerator
    from lightning_plugins.errors import OptionsError

    with pytest.raises(OptionsError, match=r"activation_checkpointing='selective' disagrees with the fsdp_plugin"):
        ParallelAccelerator(
            fsdp_plugin=_plugin(activation_checkpointing=True), activation_checkpointing="selective", cpu=True
        )


def test_wrapping_another_class_than_the_decoder_layer_is_refused_at_prepare() -> None:
    from accelerate.state import AcceleratorState, GradientState

    from lightning_plugins.accelerate import ParallelAccelerator
    from lightning_plugins.errors import OptionsError
    from lightning_plugins.parallel.teardown import release_process_groups

    plugin = _plugin(auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["LlamaMLP"])
    try:
        accelerator = ParallelAccelerator(fsdp_plugin=plugin, cpu=True)  # a world of one
        with pytest.raises(OptionsError, match=r"names \['LlamaMLP'\].*decoder layer class \['LlamaDecoderLayer'\]"):
            accelerator.prepare(tiny_model("llama"))
    finally:
        release_process_groups()
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
