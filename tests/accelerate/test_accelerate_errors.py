"""The shipped ``accelerate_configs/`` load with Accelerate's own loader (and DeepSpeed's, where installed), and
every misfit between the launch and the layout fails before any process group exists, with one message that
names both sides and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _launch import ROOT, TINY, accelerate_launch

from lightning_plugins.errors import LayoutError

CONFIGS = sorted((ROOT / "accelerate_configs").glob("*.yaml"))
DEEPSPEED_FILES = sorted((ROOT / "accelerate_configs" / "deepspeed").glob("*.json"))


def _launch_arguments() -> set[str]:
    from accelerate.commands.launch import launch_command_parser

    return {action.dest for action in launch_command_parser()._actions}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads_with_accelerates_loader(path: Path) -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(path))
    header = path.read_text().split("\ncompute_environment")[0]
    assert header.startswith("# Hardware:") and f"accelerate_configs/{path.name}" in header, header  # how to launch it
    assert "ecipes that fit" in header, f"{path.name}: the header names no recipes that fit"
    # Nested sections are copied onto launch arguments by name: a key with no argument would be ignored silently.
    known = _launch_arguments()
    for section, prefix in (("fsdp_config", "fsdp_"), ("deepspeed_config", ""), ("parallelism_config", "")):
        for key in getattr(config, section) or {}:
            name = key if key.startswith(prefix) else prefix + key
            assert name in known, f"{path.name}: {section}.{key} is no `accelerate launch` argument"
    ds_file = (config.deepspeed_config or {}).get("deepspeed_config_file")
    if ds_file is not None:
        from accelerate.utils import DeepSpeedPlugin

        assert (ROOT / ds_file).is_file(), ds_file
        plugin = DeepSpeedPlugin(hf_ds_config=str(ROOT / ds_file))  # Accelerate's own checks of the file
        assert plugin.zero_stage in (2, 3)


@pytest.mark.parametrize("path", DEEPSPEED_FILES, ids=lambda p: p.name)
def test_deepspeed_files_are_valid_for_deepspeed(path: Path) -> None:
    pytest.importorskip("deepspeed", reason="DeepSpeed is optional (pip install --no-build-isolation deepspeed)")
    from deepspeed.runtime.config import DeepSpeedConfig

    # What Accelerate fills in for "auto" from the Accelerator and the prepared objects.
    auto = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0, "enabled": True}  # fmt: skip

    def fill(node: object) -> object:
        return {k: auto[k] if v == "auto" else fill(v) for k, v in node.items()} if isinstance(node, dict) else node

    config = DeepSpeedConfig(fill(json.loads(path.read_text())))
    assert config.zero_enabled
    with pytest.raises(Exception, match="extra_forbidden|Extra inputs"):  # the parser does reject bad keys
        DeepSpeedConfig(fill({**json.loads(path.read_text()), "zero_optimization": {"stage": 2, "no_such_key": 1}}))


def _world(monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", str(size))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(size))


def test_layout_that_does_not_fit_the_world_fails_before_any_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from lightning_plugins.accelerate import ParallelAccelerator

    _world(monkeypatch, 2)
    with pytest.raises(LayoutError, match=r"does not fit the world started by .*2 processes.*tp_size=4"):
        ParallelAccelerator(tp_size=4, cpu=True)
    with pytest.raises(LayoutError, match=r"2 processes.*ep_size=4 does not divide dp_shard_size x cp_size = 2 x 1"):
        ParallelAccelerator(ep_size=4, cpu=True)  # expert-parallel ranks are drawn from the data ranks
    assert not dist.is_initialized()


def test_layout_and_settings_given_whole_are_checked_before_any_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from lightning_plugins import OptionsError, ParallelLayout
    from lightning_plugins.accelerate import ParallelAccelerator

    _world(monkeypatch, 2)
    with pytest.raises(LayoutError, match=r"does not fit the world started by .*2 processes.*tp_size=4"):
        ParallelAccelerator(layout=ParallelLayout(tp_size=4), cpu=True)
    with pytest.raises(OptionsError, match=r"'1f1b' needs at least as many micro-batches .*pp_microbatches=1 < 2"):
        ParallelAccelerator(layout=ParallelLayout(pp_size=2), pp_microbatches=1, cpu=True)
    with pytest.raises(TypeError, match="positional"):
        ParallelAccelerator(2)  # type: ignore[misc]
    assert not dist.is_initialized()


def test_recipe_that_does_not_fit_the_launch_names_both_files(tmp_path: Path) -> None:
    proc = accelerate_launch(TINY / "full_pp2.yaml", tmp_path / "out", "--layout.tp_size=2", expected=1)
    message = proc.stderr
    assert "full_pp2.yaml" in message and "accelerate_configs/cpu_2proc.yaml" in message, message[-3000:]
    assert "layout does not fit" in message and "World size 2" in message, message[-3000:]
    assert 'lightning_plugins/' not in message, message[-3000:]  # a message, not a traceback through our code
    assert message.count("error: ") == 1, message[-3000:]  # said once, by the first rank


def test_accelerates_fsdp_on_cpu_processes_is_refused_not_run_as_ddp(tmp_path: Path) -> None:
    """Accelerate's own FSDP needs GPUs: on CPU processes it quietly runs DDP; the door says so instead."""
    config = ROOT / "accelerate_configs" / "fsdp2_cpu_offload.yaml"
    launch = ("--num_processes", "2")
    proc = accelerate_launch(TINY / "lora_fsdp2_chat.yaml", tmp_path / "out", config=config, launch=launch, expected=1)
    expected = "selects Accelerate's FSDP, but Accelerate runs these processes as MULTI_CPU"
    assert expected in proc.stderr, proc.stderr[-3000:]
    assert "fsdp2_cpu_offload.yaml" in proc.stderr and "lightning_plugins/" not in proc.stderr, proc.stderr[-3000:]


def test_conflicting_parallelism_config_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_plugins.accelerate import ParallelAccelerator
    from lightning_plugins.accelerate.settings import merge_sizes

    _world(monkeypatch, 4)
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "4")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "1")
    with pytest.raises(LayoutError, match=r"tp_size=2 was asked for, but the launch sets parallelism_config_tp_size=4"):
        ParallelAccelerator(tp_size=2, cpu=True)
    # Sizes given once (or twice, equal) are taken from wherever they are set.
    assert merge_sizes("test", {"tp_size": None, "pp_size": None}).tp_size == 4
    assert merge_sizes("test", {"tp_size": 4, "dp_shard_size": -1}).dp_shard_size == 1
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    with pytest.raises(LayoutError, match="cp_size and cp_backend='ulysses'"):
        ParallelAccelerator(cpu=True)


@pytest.mark.parametrize(
    ("variable", "sizes", "path"),
    [
        ("ACCELERATE_USE_DEEPSPEED", {"pp_size": 2}, "DeepSpeed"),
        ("ACCELERATE_USE_FSDP", {"tp_size": 2}, "FSDP"),
        ("ACCELERATE_USE_FSDP", {"ep_size": 2}, "FSDP"),
    ],
)
def test_model_parallel_sizes_under_a_builtin_sharding_config(
    monkeypatch: pytest.MonkeyPatch, variable: str, sizes: dict, path: str
) -> None:
    from lightning_plugins.accelerate import ParallelAccelerator

    _world(monkeypatch, 8)
    monkeypatch.setenv(variable, "true")
    name, value = next(iter(sizes.items()))
    with pytest.raises(LayoutError, match=rf"{name}={value} under Accelerate's built-in {path} path.*1node_8gpu.yaml"):
        ParallelAccelerator(**sizes, cpu=True)



@pytest.mark.parametrize("variable", ["ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP"])
def test_preference_recipe_under_a_builtin_sharding_config(monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    """A DPO recipe needs the engine's layouts (global means over the data ranks, the reference with the adapters
    disabled): under Accelerate's own DeepSpeed or FSDP it is refused before any process group or model."""
    from lightning_plugins.accelerate.runner import make_accelerator
    from lightning_plugins.errors import OptionsError
    from lightning_plugins.recipe.schema import load_recipe

    _world(monkeypatch, 8)
    monkeypatch.setenv(variable, "true")
    with pytest.raises(OptionsError, match=r"objective\.method=dpo: preference methods run on the engine's layouts"):
        make_accelerator(load_recipe(TINY / "dpo_lora_fsdp2.yaml"))
