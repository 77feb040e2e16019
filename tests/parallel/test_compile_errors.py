"""The GPU speed levers' settings: typed, refused early with the fix named, and GPU-only levers refused on CPU (a
real run on gloo), not on torch's fake process group (the planner's dry run, which simulates the GPU world)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from tiny_models import tiny_model
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

from lightning_plugins import parallelize
from lightning_plugins.errors import OptionsError
from lightning_plugins.parallel.checks import check_settings
from lightning_plugins.parallel.compile import check_device, simulated
from lightning_plugins.parallel.float8 import FrozenFloat8Linear
from lightning_plugins.parallel.layout import ParallelLayout
from lightning_plugins.parallel.options import ParallelOptions, with_settings


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"compile": "yes"}, "compile must be true or false"),
        ({"float8": True}, "float8=True needs compile=True"),
        ({"async_tp": True}, "async_tp=True needs compile=True"),
    ],
)
def test_bad_settings_name_the_fix(settings: dict, match: str) -> None:
    with pytest.raises(OptionsError, match=match):
        ParallelOptions(**settings)


@pytest.mark.parametrize(
    ("sizes", "settings", "match"),
    [
        ({"pp_size": 2}, {"compile": True}, r"not supported with pipeline parallelism \(pp_size=2\)"),
        ({"cp_size": 2}, {"compile": True}, r"not supported with context parallelism \(cp_size=2\)"),
        ({"ep_size": 2}, {"compile": True}, r"not supported with expert parallelism \(ep_size=2\)"),
        ({"dp_shard_size": 2}, {"compile": True, "async_tp": True}, "needs tp_size > 1"),
        ({"tp_size": 2}, {"compile": True, "activation_offload": True}, "not supported with activation_offload"),
        ({"tp_size": 2}, {"compile": True, "activation_checkpointing": "full"}, "DeviceMesh among the tensors saved"),
    ],
)
def test_layouts_the_levers_do_not_compose_with_are_refused_before_any_collective(
    sizes: dict, settings: dict, match: str
) -> None:
    options, memory = with_settings("test", **settings)
    with pytest.raises(OptionsError, match=match):
        check_settings(ParallelLayout(**sizes), options, memory)


def test_compile_composes_with_tp_fsdp_and_with_checkpointing_under_fsdp() -> None:
    options, memory = with_settings("test", compile=True, async_tp=True)
    check_settings(ParallelLayout(tp_size=2, dp_shard_size=2).resolve(4), options, memory)
    options, memory = with_settings("test", compile=True, activation_checkpointing="full")
    check_settings(ParallelLayout(dp_shard_size=4).resolve(4), options, memory)


@pytest.mark.parametrize(
    ("settings", "needs"),
    [({"compile": True, "float8": True}, "compute capability 8.9"), ({"compile": True, "async_tp": True}, "NCCL")],
)
def test_gpu_only_levers_are_refused_on_cpu(settings: dict, needs: str) -> None:
    options = ParallelOptions(**settings)
    with pytest.raises(OptionsError, match=needs) as err:
        check_device(options, "cpu")
    assert "on 'cpu'" in str(err.value) and "=False" in str(err.value)
    check_device(ParallelOptions(compile=True), "cpu")  # compile alone runs on CPU (inductor's C++ backend)


def test_compile_with_tp_is_refused_on_cpu() -> None:
    with pytest.raises(OptionsError, match=r"compile=True with tp_size=2 is not supported on 'cpu' \(gloo\)"):
        check_device(ParallelOptions(compile=True), "cpu", tp_size=2)


def test_a_real_cpu_run_still_refuses_float8_through_parallelize(tmp_path) -> None:
    """gloo is a real run on CPU: ``parallelize`` refuses float8 before converting anything, naming the fix."""
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path}/store")
    try:
        assert not simulated()
        model = tiny_model("llama_8bit_state")
        with pytest.raises(OptionsError, match=r"float8=True needs a CUDA GPU .* on 'cpu'\. Set float8=False"):
            parallelize(model, ParallelLayout(), ParallelOptions(compile=True, float8=True))
        assert not any(isinstance(m, Float8Linear) for m in model.modules())
    finally:
        dist.destroy_process_group()


def test_the_fake_process_group_simulates_a_gpu_run_float8_applied_compile_left_out() -> None:
    """On torch's fake process group (the planner's dry run) float8 converts the decoder's linears as on a GPU and
    FSDP2 holds their weights as torchao's float8-gathering tensors; no layer is compiled (the step time only)."""
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        assert simulated()
        model = tiny_model("llama_8bit_state")
        parallelize(model, ParallelLayout(), ParallelOptions(compile=True, float8=True))
        linears = [m for name, m in model.named_modules() if isinstance(m, nn.Linear) and "lm_head" not in name]
        assert linears and all(isinstance(m, Float8Linear) for m in linears)
        assert all(isinstance(m.weight.to_local(), WeightWithDynamicFloat8CastTensor) for m in linears)
        assert all(layer._compiled_call_impl is None for layer in model.model.layers)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sizes", [{"pp_size": 2}, {"cp_size": 2}, {"ep_size": 2}])
def test_float8_where_compile_is_refused_is_refused_by_name(sizes: dict) -> None:
    """float8 needs compile: with pipeline, context or expert parallelism the refusal names float8 too, so a run
    never drops it without a word."""
    options, memory = with_settings("test", compile=True, float8=True)
    with pytest.raises(OptionsError, match=r"compile=True and float8=True are not supported .* Set compile=False and"):
        check_settings(ParallelLayout(**sizes), options, memory)


def _fake_world(world_size: int = 2) -> None:
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())


def test_float8_converts_the_lora_base_projections_not_the_adapters() -> None:
    """Under peft, float8 converts each LoRA layer's ``base_layer`` (and the linears LoRA leaves alone), never the
    rank-sized ``lora_A``/``lora_B`` (here r=16, which the shape filter alone would let through), nor ``lm_head``."""
    from peft.tuners.lora import LoraLayer

    from lightning_plugins.adapters.lora import LoraOptions, apply_lora

    _fake_world()
    try:
        model = apply_lora(tiny_model("llama_8bit_state"), LoraOptions(r=16))
        parallelize(model, ParallelLayout(), ParallelOptions(compile=True, float8=True))
        lora = [m for m in model.modules() if isinstance(m, LoraLayer)]
        assert lora and all(type(m.base_layer) is FrozenFloat8Linear for m in lora)  # frozen: no input saved
        adapters = [a for m in lora for a in (*m.lora_A.values(), *m.lora_B.values())]
        assert adapters and all(type(a) is nn.Linear for a in adapters)
        assert not any(isinstance(m, Float8Linear) for name, m in model.named_modules() if "lm_head" in name)
    finally:
        dist.destroy_process_group()


def test_qlora_with_float8_is_refused_before_anything_is_applied() -> None:
    """An NF4 base cannot be a float8 linear: ``parallelize`` refuses the pair, naming the recipe keys and the fix."""
    from lightning_plugins.adapters.lora import LoraOptions, apply_lora

    _fake_world()
    try:
        model = apply_lora(tiny_model("llama_8bit_state"), LoraOptions(r=16, quantize="nf4"))
        with pytest.raises(OptionsError, match=r"float8=True \(parallel\.float8\) with NF4 base weights .* Set"):
            parallelize(model, ParallelLayout(), ParallelOptions(compile=True, float8=True))
        assert not any(isinstance(m, Float8Linear) for m in model.modules())
    finally:
        dist.destroy_process_group()
