"""Export a parallelized model back to a plain HF checkpoint directory that `transformers` loads.

(Distributed save/resume during training is DCP through the doors, see the strategies.)
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict


def export_hf(model: nn.Module, out_dir: str | Path, tokenizer: object | None = None) -> Path:
    """Gather full weights on rank 0 and write ``out_dir`` with ``save_pretrained`` (safetensors).

    Collective: every rank must call it. The directory is written under a temporary name and moved
    into place when complete, so a crash never leaves a half-written checkpoint at ``out_dir``.

    Args:
        model: A (possibly parallelized) transformers model.
        out_dir: Destination directory; replaced if it exists.
        tokenizer: Optional tokenizer saved alongside.

    Returns:
        ``out_dir`` as a ``Path``.
    """
    out = Path(out_dir)
    distributed = dist.is_initialized()
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not distributed or dist.get_rank() == 0:
        partial = out.with_name(out.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(partial, state_dict=state, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(partial)
        if out.exists():
            shutil.rmtree(out)
        os.replace(partial, out)
    if distributed:
        dist.barrier()
    return out
