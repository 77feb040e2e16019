"""peft's ``autocast_adapter_dtype`` (``lora.autocast_adapter_dtype``): adapters of a bf16 base in fp32 (peft's default)
or in bf16, as torchtune trains them; bf16 adapters train under FSDP2 and export an adapter plain peft loads.

One process: the adapters' dtype either way, and an fp32 base (FSDP2 mixed precision's master weights) unchanged.
One world of 2 gloo ranks: a bf16 model with bf16 adapters under FSDP2=2 trains with AdamW (loss falls, AdamW state
in bf16), and its exported adapter, loaded by plain peft on the bf16 base, gives the trained model's logits.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning_plugins.testing.world import run_world
from peft import PeftModel
from tiny_models import make_batch, tiny_model
from torch import nn

from lightning_plugins import ParallelLayout, parallelize
from lightning_plugins.adapters.lora import LoraOptions, apply_lora, trainable_parameters
from lightning_plugins.checkpoint.live_export import export_hf
from lightning_plugins.parallel import mesh_of

# peft's get_peft_model reads a transformers attribute deprecated in 5.x: third-party noise.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

BATCH, SEQ, RANK, ALPHA = 4, 15, 4, 8


def _logits(model: nn.Module) -> torch.Tensor:
    batch = make_batch(2, SEQ, model.config.vocab_size, seed=7)
    model.eval()
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def _local_rows(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    dp = mesh_of(model)["dp"]
    rows = BATCH // dp.size()
    return {k: v[dp.get_local_rank() * rows : (dp.get_local_rank() + 1) * rows] for k, v in batch.items()}


def _adapter_dtypes(model: nn.Module) -> set[torch.dtype]:
    return {p.dtype for n, p in model.named_parameters() if "lora_" in n}


@pytest.mark.parametrize("autocast,expected", [(True, torch.float32), (False, torch.bfloat16)])
def test_autocast_adapter_dtype_decides_the_adapters_dtype_of_a_bf16_base(
    autocast: bool, expected: torch.dtype
) -> None:
    model = apply_lora(tiny_model("llama").to(torch.bfloat16), LoraOptions(autocast_adapter_dtype=autocast))
    assert _adapter_dtypes(model) == {expected}
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    # An fp32 base (FSDP2 mixed precision keeps fp32 master weights): fp32 adapters either way.
    assert _adapter_dtypes(apply_lora(tiny_model("llama"), LoraOptions(autocast_adapter_dtype=autocast))) == {
        torch.float32
    }
    assert LoraOptions().autocast_adapter_dtype  # peft's default


STEPS_BF16 = 6


def _bf16_world(rank: int, world_size: int, out_dir: str) -> None:
    """LoRA with bf16 adapters next to a bf16 base under FSDP2: trains, and exports an adapter plain peft loads."""
    torch.manual_seed(1)
    options = LoraOptions(r=RANK, alpha=ALPHA, autocast_adapter_dtype=False)
    model = apply_lora(tiny_model("llama").to(torch.bfloat16), options)
    model.config.use_cache = False
    parallelize(model, ParallelLayout(dp_shard_size=world_size).resolve(world_size))
    batch = _local_rows(model, make_batch(BATCH, SEQ, model.config.vocab_size, seed=0))
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-2)
    losses = []
    model.train()
    for _ in range(STEPS_BF16):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    result = {
        "losses": losses,
        "adapter_dtypes": sorted({str(p.to_local().dtype) for p in trainable_parameters(model)}),
        "state_dtypes": sorted(
            {str(v.to_local().dtype) for state in optimizer.state.values() for k, v in state.items() if k != "step"}
        ),
    }
    trained = _logits(model)
    adapter_dir = export_hf(model, Path(out_dir) / "adapter")
    if rank == 0:
        from safetensors import safe_open

        with safe_open(str(adapter_dir / "adapter_model.safetensors"), "pt") as saved:
            result["saved_dtypes"] = sorted({str(saved.get_slice(k).get_dtype()) for k in saved.keys()})
        base = tiny_model("llama").to(torch.bfloat16)
        loaded = PeftModel.from_pretrained(base, adapter_dir, autocast_adapter_dtype=False)
        result["loaded_dtypes"] = sorted(str(d) for d in _adapter_dtypes(loaded))
        result["loaded_logits"] = (_logits(loaded).float() - trained.float()).abs().max().item()
        Path(out_dir, "result.json").write_text(json.dumps(result))
    dist.barrier()


def test_bf16_adapters_train_under_fsdp2_and_load_in_plain_peft() -> None:
    with tempfile.TemporaryDirectory() as out_dir:
        run_world(_bf16_world, 2, out_dir)
        result = json.loads(Path(out_dir, "result.json").read_text())
    assert result["adapter_dtypes"] == result["state_dtypes"] == ["torch.bfloat16"], result
    losses = result["losses"]
    assert losses[-1] < losses[0] - 0.1, losses  # it trains
    assert result["saved_dtypes"] == ["BF16"] and result["loaded_dtypes"] == ["torch.bfloat16"], result
    assert result["loaded_logits"] == 0.0, result  # the same bf16 computation on the gathered weights
