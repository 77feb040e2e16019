"""Recipes with packed rows and flash attention (issue 48): ``data.packing: true`` with ``model.attn_implementation:
flash_attention_2/3`` builds the variable-length collator and prepares the model with ``varlen=True``, through the
code both doors run (:mod:`lightning_plugins.recipe.build`); on CPU both doors refuse it before any process starts;
the dry run plans it, charged on the flash kernel.

Nothing here runs flash attention (CUDA and flash-attn only): the collator's lengths are checked against the documents
the masked path finds, and the model preparation with the device it would train on named.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.masking_utils import find_packed_sequence_indices

from lightning_plugins.cli import main
from lightning_plugins.data import DataError
from lightning_plugins.errors import RecipeError
from lightning_plugins.recipe import build
from lightning_plugins.recipe.preflight import check_here
from lightning_plugins.recipe.schema import load_recipe
from lightning_plugins.recipe.sections import HardwareSection

TINY = Path(__file__).parents[2] / "recipes" / "tiny"
FLASH = "model.attn_implementation=flash_attention_2"


def _recipe(tmp_path: Path, *overrides: str):
    """The tiny packed chat recipe (LoRA, FSDP2 on 2 CPU processes), its rows prepared in a fresh cache."""
    return load_recipe(TINY / "lora_fsdp2_chat.yaml", [f"data.cache_dir={tmp_path / 'cache'}",
                                                       f"train.output_dir={tmp_path / 'out'}", *overrides])  # fmt: skip


def _documents(position_ids: torch.Tensor) -> torch.Tensor:
    """The lengths of the documents the masked path (sdpa's block-diagonal mask) finds, rows one after another."""
    index = find_packed_sequence_indices(position_ids)
    offsets = torch.arange(index.shape[0])[:, None] * (int(index.max()) + 1)
    return torch.unique_consecutive((index + offsets).flatten(), return_counts=True)[1]


def test_flash_recipe_batches_carry_the_masked_paths_documents(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    masked, flash = _recipe(tmp_path), _recipe(tmp_path, FLASH)
    assert not build.varlen_packing(masked) and build.varlen_packing(flash)
    tokenizer = AutoTokenizer.from_pretrained(flash.model.path)
    (masked_train, _), (flash_train, flash_eval) = (build.build_loaders(r, tokenizer) for r in (masked, flash))
    assert flash_eval is not None
    for plain, varlen in [*zip(masked_train, flash_train), (next(iter(flash_eval)), next(iter(flash_eval)))][:3]:
        assert "cu_seq_lens_q" not in plain or plain is varlen
        assert all(torch.equal(varlen[key], plain[key]) for key in ("input_ids", "labels", "position_ids"))
        cu = varlen["cu_seq_lens_q"]
        assert cu.dtype == torch.int32 and torch.equal(cu, varlen["cu_seq_lens_k"]) and int(cu[0]) == 0
        assert int(cu[-1]) == varlen["input_ids"].numel()
        assert torch.equal(cu.diff().long(), _documents(varlen["position_ids"]))
        assert varlen["max_length_q"] == varlen["max_length_k"] == int(cu.diff().max())
    # Under pipeline parallelism each stage finds its micro-batch's lengths (tests/parallel/test_pipeline_varlen.py):
    # the batches are the masked path's, of fixed length.
    pp = [_recipe(tmp_path, *extra, "layout.pp_size=2", "layout.dp_shard_size=1") for extra in ((), (FLASH,))]
    assert build.varlen_packing(pp[1])  # accepted (the recipe checks refused it before), the model prepared for it
    for plain, varlen in zip(*(build.build_loaders(r, tokenizer)[0] for r in pp)):
        assert varlen.keys() == plain.keys() and "cu_seq_lens_q" not in varlen
        assert all(torch.equal(varlen[key], plain[key]) for key in plain)
    # Under context parallelism its attention keeps the documents apart itself: no lengths in the batch.
    cp = load_recipe(TINY / "full_cp2.yaml", [f"data.cache_dir={tmp_path / 'cache'}", FLASH])
    assert cp.data.packing and not build.varlen_packing(cp)


def test_flash_recipe_model_is_prepared_for_varlen_on_cuda_only(tmp_path: Path, monkeypatch) -> None:
    """build_model prepares the model with varlen=True for the device it will train on (built on meta, the model is
    not there yet). flash-attn is not installed here: the model is built with sdpa, then named flash_attention_2."""
    from_config = AutoModelForCausalLM.from_config

    def built_as_flash(config, **kwargs):
        flash = kwargs.get("attn_implementation") == "flash_attention_2"
        model = from_config(config, **{**kwargs, "attn_implementation": "sdpa"} if flash else kwargs)
        if flash:
            model.config._attn_implementation = "flash_attention_2"
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", built_as_flash)
    recipe = _recipe(tmp_path, FLASH)
    monkeypatch.setattr(HardwareSection, "device_type", lambda self: "cuda")
    model, _ = build.build_model(recipe)
    assert model.config._attn_implementation == "flash_attention_2" and model.config.use_cache is False
    monkeypatch.setattr(HardwareSection, "device_type", lambda self: "cpu")
    with pytest.raises(DataError, match=r"CUDA only.*'cpu'.*attn_implementation='sdpa'"):
        build.build_model(recipe)


def test_flash_recipe_is_refused_on_cpu_before_any_process(tmp_path: Path, capsys) -> None:
    recipe = _recipe(tmp_path, FLASH)
    with pytest.raises(RecipeError) as err:
        check_here(recipe, "recipe.yaml")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("recipe.yaml: model.attn_implementation: flash_attention_2 runs on CUDA GPUs only")
    assert "hardware.accelerator: cpu" in message and "Set model.attn_implementation: sdpa" in message
    # Both doors stop there: no process is launched, no process group made (the Accelerate door in-process: a world of
    # one).
    args = [str(TINY / "lora_fsdp2_chat.yaml"), f"--{FLASH}", f"--train.output_dir={tmp_path / 'out'}"]
    from lightning_plugins.accelerate.__main__ import main as accelerate_main

    for door in (lambda: main(["finetune", *args]), lambda: accelerate_main([*args, "--layout.dp_shard_size=-1"])):
        with pytest.raises(SystemExit) as exited:
            door()
        said = str(exited.value.code) + capsys.readouterr().err
        assert "model.attn_implementation: flash_attention_2 runs on CUDA GPUs only" in said
    assert not torch.distributed.is_initialized()


def test_dry_run_builds_sdpa_in_flash_attentions_place(tmp_path: Path) -> None:
    """The dry run's model (fake tensors on CPU: flash-attn cannot run) takes sdpa, whose CPU kernel is a flash kernel
    too; the step time charges the flash kernel (no CP)."""
    from lightning_plugins.planner.attention_kernels import attention_lines
    from lightning_plugins.planner.meta_model import meta_model
    from lightning_plugins.planner.model_stats import model_stats
    from lightning_plugins.planner.workload import Workload

    workload = Workload.from_recipe(_recipe(tmp_path, FLASH, "hardware.accelerator=gpu"))
    assert workload.attn_implementation == "flash_attention_2"
    assert meta_model(workload).config._attn_implementation == "sdpa"
    assert attention_lines(model_stats(workload.config), "ring", 1) == ["attention (no CP): 2 layer(s) on flash"]


@pytest.mark.slow
def test_plan_accepts_packed_flash_recipe(tmp_path: Path, capsys) -> None:
    """``lightning-plugins plan`` of a packed flash recipe: it fits, charged on the flash kernel."""
    path = tmp_path / "flash.yaml"
    text = (TINY / "lora_fsdp2_chat.yaml").read_text().replace("accelerator: cpu", "accelerator: gpu")
    path.write_text(text.replace("attn_implementation: sdpa", "attn_implementation: flash_attention_2"))
    for name in ("model", "data"):
        (tmp_path / name).symlink_to(TINY / name)
    with pytest.raises(SystemExit) as exited:
        main(["plan", str(path)])
    out = capsys.readouterr().out
    assert exited.value.code == 0, out
    assert "FITS" in out and "attention (no CP): 2 layer(s) on flash" in out
