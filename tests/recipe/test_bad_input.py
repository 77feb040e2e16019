"""Bad input gets one clear error naming the file and what to do; nothing is written over, nothing is half-loaded,
nothing is unpickled beyond plain data, no remote code runs unasked. One process, no launched world."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_plugins.checkpoint.checks import check_resume_path, reads_checkpoint
from lightning_plugins.errors import CheckpointError
from lightning_plugins.checkpoint.load import checkpoint_index, load_sharded_safetensors
from lightning_plugins.recipe.schema import load_recipe
from lightning_plugins.errors import RecipeError

TINY = Path(__file__).parents[2] / "recipes" / "tiny"
RECIPE = TINY / "full_tp2.yaml"


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture
def checkpoints(tmp_path: Path) -> Path:
    """``checkpoints/step=2.ckpt`` (complete), ``step=4.ckpt.partial`` (an interrupted save)."""
    root = tmp_path / "checkpoints"
    dcp.save({"model": {"w": torch.randn(4, 4), "b": torch.randn(4)}}, checkpoint_id=root / "step=2.ckpt")
    shutil.copytree(root / "step=2.ckpt", root / "step=4.ckpt.partial")
    (root / "step=4.ckpt.partial" / ".metadata").unlink()
    return root


def test_resume_path_missing_partial_or_incomplete(checkpoints: Path) -> None:
    with pytest.raises(
        CheckpointError, match=r"step=9.ckpt: no such checkpoint\. Complete checkpoints next to it: step=2"
    ):
        check_resume_path(checkpoints / "step=9.ckpt")
    with pytest.raises(CheckpointError, match=r"step=4.ckpt.partial is an incomplete checkpoint.*step=2.ckpt"):
        check_resume_path(checkpoints / "step=4.ckpt.partial")
    (checkpoints / "step=6.ckpt").mkdir()
    with pytest.raises(CheckpointError, match=r"step=6.ckpt is not a complete distributed checkpoint.*no .metadata"):
        check_resume_path(checkpoints / "step=6.ckpt")
    assert check_resume_path(checkpoints / "step=2.ckpt") == checkpoints / "step=2.ckpt"


@pytest.mark.parametrize("door", ["lightning", "accelerate"])
def test_cli_refuses_a_bad_resume_before_starting(door: str, checkpoints: Path, capsys: pytest.CaptureFixture) -> None:
    if door == "lightning":
        from lightning_plugins.cli import main
    else:
        from lightning_plugins.accelerate.__main__ import main
    argv = ["finetune"] if door == "lightning" else ["--layout.tp_size=1"]  # in-process: a world of one
    with pytest.raises(SystemExit) as stop:
        main([*argv, str(RECIPE), "--resume", str(checkpoints / "step=4.ckpt.partial")])
    said = str(stop.value.code) if door == "lightning" else capsys.readouterr().err
    assert stop.value.code != 0 and "step=4.ckpt.partial is an incomplete checkpoint" in said, said


@reads_checkpoint
def _load(state: dict, path: Path) -> None:  # a door's loader: its second argument is the checkpoint
    dcp.load(state, checkpoint_id=path)


def test_truncated_checkpoint_is_named_and_left_alone(checkpoints: Path) -> None:
    path = checkpoints / "step=2.ckpt"
    data = next(path.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:40])
    before = _digest(path)
    with pytest.raises(CheckpointError, match=r"step=2.ckpt cannot be read: it is corrupted or truncated"):
        _load({"model": {"w": torch.zeros(4, 4), "b": torch.zeros(4)}}, path)
    assert _digest(path) == before


def test_checkpoint_of_another_shape_or_model(checkpoints: Path) -> None:
    path = checkpoints / "step=2.ckpt"
    with pytest.raises(CheckpointError, match=r"written for a different model or shape \(ValueError: Size mismatch"):
        _load({"model": {"w": torch.zeros(8, 4), "b": torch.zeros(4)}}, path)
    with pytest.raises(CheckpointError, match=r"different model or shape \(RuntimeError: Missing key.*model.lm_head"):
        _load({"model": {"w": torch.zeros(4, 4), "lm_head": torch.zeros(4)}}, path)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model saved in several safetensors shards with an index."""
    out = tmp_path_factory.mktemp("sharded")
    AutoModelForCausalLM.from_pretrained(TINY / "model").save_pretrained(out, max_shard_size="300KB")
    assert len(list(out.glob("*.safetensors"))) > 1
    return out


def _on_meta(config: AutoConfig) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_hf_directory_with_a_missing_shard(sharded: Path, tmp_path: Path) -> None:
    broken = shutil.copytree(sharded, tmp_path / "broken")
    shard = sorted(broken.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=rf"model.safetensors.index.json names 1 shard\(s\).*{shard.name}"):
        checkpoint_index(broken)


def test_hf_weights_of_another_shape_or_truncated_load_nothing(sharded: Path, tmp_path: Path) -> None:
    config = AutoConfig.from_pretrained(sharded)
    wider = AutoConfig.from_pretrained(sharded, intermediate_size=config.intermediate_size * 2)
    model = _on_meta(wider)
    with pytest.raises(ValueError, match=r"tensor\(s\) of another shape than the model.*mlp.*different model"):
        load_sharded_safetensors(model, sharded)
    assert all(p.is_meta for p in model.parameters())  # nothing half-loaded
    broken = shutil.copytree(sharded, tmp_path / "truncated")
    shard = sorted(broken.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    model = _on_meta(config)
    with pytest.raises(ValueError, match=rf"{shard.name} cannot be read as safetensors.*truncated or corrupted"):
        load_sharded_safetensors(model, broken)
    assert all(p.is_meta for p in model.parameters())


class _Payload:
    def __reduce__(self) -> tuple:
        return (Path.write_text, (Path(_Payload.target), "ran"))


def test_accelerate_state_is_not_unpickled(checkpoints: Path, tmp_path: Path) -> None:
    """A checkpoint's state file holding a pickled callable is refused, never run, named with what it holds and
    without torch's advice to load it anyway (issue 43; tests/checkpoint/test_untrusted.py covers every file)."""
    from lightning_plugins.accelerate.state import STATE_FILE, load_training_state

    _Payload.target = str(tmp_path / "marker")
    path = checkpoints / "step=2.ckpt"
    torch.save({"step": _Payload()}, path / STATE_FILE, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    said = rf"{STATE_FILE} was not loaded: it holds objects a checkpoint never holds \(pathlib\.Path\.write_text"
    with pytest.raises(CheckpointError, match=said) as err:
        load_training_state(None, path)
    assert "weights_only" not in str(err.value)
    assert not (tmp_path / "marker").exists()


def test_no_remote_code_unless_the_recipe_says_so(tmp_path: Path) -> None:
    from lightning_plugins.recipe.build import build_model

    model = shutil.copytree(TINY / "model", tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_custom.CustomConfig"}
    (model / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "ran"
    (model / "configuration_custom.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from transformers import LlamaConfig\n\n\nclass CustomConfig(LlamaConfig):\n    pass\n"
    )
    # A known architecture: transformers' own code builds it, the shipped code is ignored.
    built, _ = build_model(load_recipe(RECIPE, [f"model.path={model}"]))
    assert type(built.config).__name__ == "LlamaConfig" and not marker.exists()
    # An architecture only the shipped code knows: refused, naming the key that allows it.
    (model / "config.json").write_text(json.dumps({**config, "model_type": "custom-llama"}))
    with pytest.raises(RecipeError, match=r"ships its own Python code.*model.trust_remote_code: true"):
        load_recipe(RECIPE, [f"model.path={model}"])
    assert not marker.exists()


@pytest.mark.parametrize(
    ("lora", "match"),
    [
        ({"target_parameters": ["mlp.experts.w1"]}, r"target_parameters \['mlp.experts.w1'\] name no expert weight of"
         r" MixtralForCausalLM. Its expert weights are \['mlp.experts.down_proj', 'mlp.experts.gate_up_proj'\]"),
        ({"modules_to_save": ["router"]}, r"modules_to_save \['router'\] name no module of MixtralForCausalLM.*'mlp.gate'"),
        ({"target_parameters": ["q_proj.weight"]}, r"target_parameters \['q_proj.weight'\] name no expert weight"),
        ({"target_parameters": []}, r"lora target_parameters=\(\) must be a non-empty list of parameter names"),
        ({"modules_to_save": ["gate", ""]}, r"lora modules_to_save=.* must be a non-empty list of module names"),
        ({"target_parameters": ["mlp.experts.down_proj"], "dropout": 0.1}, r"lora dropout=0.1 with target_parameters"),
    ],
)
def test_lora_expert_and_router_names_are_checked_before_any_rank_starts(
    tmp_path: Path, lora: dict, match: str
) -> None:
    overrides = [f"lora.{key}={json.dumps(value)}" for key, value in lora.items()]
    with pytest.raises(RecipeError, match=r"lora: .*" + match):
        load_recipe(RECIPE, [*_moe_overrides(tmp_path), *overrides])


def test_merging_a_trained_router_is_refused_before_training(tmp_path: Path) -> None:
    """The merged export merges LoRA on linear layers only: refused at once, not after training."""
    overrides = [*_moe_overrides(tmp_path), "lora.modules_to_save=[gate]", "train.merge_lora=true"]
    with pytest.raises(RecipeError, match=r"train.merge_lora with lora.modules_to_save: .*merge_and_unload"):
        load_recipe(RECIPE, overrides)


def _moe_overrides(tmp_path: Path) -> list[str]:
    """The tiny recipe on a tiny Mixtral's config (all the checks read), LoRA on its attention."""
    from tiny_models import tiny_model

    tiny_model("mixtral").config.save_pretrained(tmp_path / "moe")
    return [f"model.path={tmp_path / 'moe'}", "lora.target_modules=[q_proj]"]


def test_packed_rows_under_context_parallelism_with_linear_attention_load(tmp_path: Path) -> None:
    """Gated DeltaNet layers restart their state at each document under CP (test_context_parity's world trains them
    packed against the unpacked samples), so a recipe packing rows for Qwen3.5 under cp=2 loads, as padded rows do."""
    from transformers import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=512, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    )  # fmt: skip
    config.save_pretrained(tmp_path / "model")
    cp2 = TINY / "full_cp2.yaml"
    for packing in ("true", "false"):
        recipe = load_recipe(cp2, [f"model.path={tmp_path / 'model'}", f"data.packing={packing}"])
        assert recipe.data.packing is (packing == "true") and recipe.layout.cp_size == 2
