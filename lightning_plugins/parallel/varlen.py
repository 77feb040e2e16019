"""Flash attention's variable-length path for packed rows: each sample's length, as transformers' flash attention takes
it (``cu_seq_lens_*``, ``max_length_*``), found from the rows' ``position_ids`` (a sample begins at position 0). The data
path puts them in each batch (``make_collator(..., varlen=True)``); a pipeline's stages find each micro-batch's."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

#: Flash attention, which keeps packed samples apart in any batch given their lengths (:func:`varlen_lengths`).
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3")


def varlen_lengths(position_ids: Tensor) -> dict[str, Any]:
    """A packed batch's samples as transformers' flash attention takes them for its variable-length kernel
    (``FlashAttentionKwargs``, ``modeling_flash_attention_utils._flash_attention_forward``): ``cu_seq_lens_q`` and
    ``cu_seq_lens_k``, where each sample begins in the batch's rows flattened into one (``int32``, its total length
    last), and ``max_length_q`` / ``max_length_k``, the longest sample. A sample begins where its position is 0: the
    documents the masked path finds (``masking_utils.find_packed_sequence_indices``), row by row. Given these,
    transformers runs ``flash_attn_varlen_func`` over any number of rows, with no host sync to find them."""
    flat = position_ids.reshape(-1)
    starts = (flat == 0).nonzero().flatten()
    cu_seq_lens = torch.cat([starts, torch.tensor([flat.numel()], device=flat.device)]).to(torch.int32)
    longest = int(cu_seq_lens.diff().max())
    return {"cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens, "max_length_q": longest,
            "max_length_k": longest}  # fmt: skip


def packed_lengths(config: Any, attention_mask: Tensor | None, position_ids: Tensor | None) -> dict[str, Any]:
    """Flash attention's per-sample lengths of a packed micro-batch (``cu_seq_lens_*``, ``max_length_*``:
    :func:`varlen_lengths`), found from its ``position_ids`` as the variable-length
    collator finds them for a whole batch: the schedule chunks the batch's per-row inputs into micro-batches, not a
    flattened batch's lengths, so each stage derives its micro-batch's (one host sync per stage and micro-batch).
    Empty unless the model attends with flash attention 2/3 and the rows come with positions and no padding mask (packed
    rows: every sample restarts at position 0); under context parallelism the model's attention is the context-parallel
    one, which keeps the documents apart itself."""
    flash = getattr(config, "_attn_implementation", None) in VARLEN_ATTENTION
    if not flash or attention_mask is not None or position_ids is None or position_ids.ndim != 2:
        return {}
    return varlen_lengths(position_ids)
