"""The GPU speed levers' settings: typed, refused early with the fix named, and GPU-only levers refused on CPU."""

from __future__ import annotations

import pytest

from lightning_plugins.errors import OptionsError
from lightning_plugins.parallel.checks import check_settings
from lightning_plugins.parallel.compile import check_device
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
