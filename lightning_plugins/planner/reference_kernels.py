"""What a dry run measures of the layers whose fused kernels are not installed here: transformers' torch references.

Qwen3.5's and Qwen3-Next's Gated DeltaNet linear attention calls ``chunk_gated_delta_rule`` and ``causal_conv1d_fn``
through transformers' hub-kernel wrappers, which run flash-linear-attention's and causal-conv1d's fused kernels
where installed (GPUs) and the torch reference otherwise, saying so once per process. The dry run (CPU, fake
tensors) runs the reference on purpose; its report says so (:data:`LINEAR_ATTENTION_NOTE`) instead of the notice.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from typing_extensions import override

__all__ = ["LINEAR_ATTENTION_NOTE", "reference_kernels_quietly"]

#: What the dry run of a model with Gated DeltaNet linear attention (Qwen3.5, Qwen3-Next) measures of those layers.
LINEAR_ATTENTION_NOTE = (
    "linear-attention layers measured as transformers' torch reference runs them (chunked gated delta rule, causal"
    " conv1d, state in fp32); GPUs with flash-linear-attention and causal-conv1d run fused kernels that save other,"
    " usually fewer, tensors"
)


@contextmanager
def reference_kernels_quietly() -> Iterator[None]:
    """transformers' notice that a kernel falls back to its torch reference (Qwen3.5's linear attention without
    flash-linear-attention or causal-conv1d) left unprinted: the dry run measures that reference on purpose, and
    its report says so (:data:`LINEAR_ATTENTION_NOTE`)."""
    from transformers.utils import logging as hf_logging

    logger = hf_logging.get_logger("transformers.integrations.hub_kernels")
    quiet = _DroppedMessages("is falling back to its reference PyTorch implementation")
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


class _DroppedMessages(logging.Filter):
    """A logging filter that drops the records whose message contains ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    @override
    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()
