"""Dtype names, defined once: the recipe's and planner's weight dtypes, and the spellings mixed precision takes."""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "DTYPE_ALIASES", "MIXED_PRECISION_DTYPES"]

#: The dtypes a model's weights are built in, by the name a recipe or workload gives (``model.dtype``).
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: torch's own spellings, accepted next to the short names where a mixed-precision dtype is named.
DTYPE_ALIASES: dict[str, str] = {"float32": "fp32", "bfloat16": "bf16"}
#: The names FSDP2's mixed precision takes (``param_dtype``, ``reduce_dtype``): fp32 and bf16 in either spelling
#: (fp16 is not offered: it needs a loss scaler, which FSDP2 does not have).
MIXED_PRECISION_DTYPES: dict[str, torch.dtype] = {
    name: DTYPES[DTYPE_ALIASES.get(name, name)] for name in ("fp32", "float32", "bf16", "bfloat16")
}
