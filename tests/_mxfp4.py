"""The tiny gpt-oss saved as the hub stores gpt-oss: its experts as MXFP4 ``*_blocks`` / ``*_scales`` and an mxfp4
``quantization_config`` (shared by tests/checkpoint/test_mxfp4.py and the world of test_moe_checkpoint.py).

The experts are random MXFP4 bytes (every FP4 code, scales around 2^0): the bytes are the weights, so no packer is
needed and every code of the format is read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tiny_models import tiny_model

NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def write_mxfp4_checkpoint(directory: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Write the checkpoint into ``directory``; return each expert weight's ``(blocks, scales)`` by model name."""
    model = tiny_model("gpt_oss")
    model.save_pretrained(directory)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    packed = {}
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, rows_in, cols_out = state.pop(name).shape
        blocks = torch.randint(0, 256, (experts, cols_out, rows_in // 32, 16), dtype=torch.uint8, generator=gen)
        scales = torch.randint(124, 130, (experts, cols_out, rows_in // 32), dtype=torch.uint8, generator=gen)
        state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
        packed[name] = blocks, scales
    for file in directory.glob("*.safetensors"):
        file.unlink()
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    (directory / "config.json").write_text(json.dumps(config))
    return packed
