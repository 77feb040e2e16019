"""lightning_plugins: tensor, pipeline, context and data parallelism for Hugging Face LLMs."""

import os
import warnings

import torch


def _import_torchao_quietly() -> None:
    """Import torchao (QLoRA's NF4) with its import-time log noise muted.

    transformers imports torchao whenever it is installed, and on a machine without its CUDA kernels
    that import logs "Failed to load ..." lines and a torch deprecation notice: nothing a user can act on.
    """
    import importlib.util
    import logging

    if importlib.util.find_spec("torchao") is None:
        return
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        import torchao  # noqa: F401
        import torchao.prototype.safetensors.safetensors_support  # noqa: F401  (what transformers imports)
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


_import_torchao_quietly()
if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
    # transformers imports DeepSpeed when it is installed, and DeepSpeed warns when it has to guess the CPU.
    os.environ["DS_ACCELERATOR"] = "cpu"
# The engine slices the flattened mesh dimensions it builds (`dp`, `dp_cp`, ...) from the root mesh on purpose.
warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh", category=UserWarning)
# An image-text model's output holds the vision tower's per-image embeddings as views of one tensor (Qwen2.5-VL's
# `image_outputs.pooler_output`); FSDP2 warns that an in-place op on such a view would skip its root's pre-backward
# hook, which the loss and logits (no views) trigger anyway.
warnings.filterwarnings(
    "ignore",
    message=r"FSDP2-wrapped module \(FSDP\w+ForConditionalGeneration\) returned a view tensor",
    category=UserWarning,
)

from lightning_plugins.errors import LayoutError, LightningPluginsError, OptionsError  # noqa: E402
from lightning_plugins.parallel import parallelize  # noqa: E402
from lightning_plugins.parallel.layout import ParallelLayout  # noqa: E402
from lightning_plugins.parallel.optim.offload import offload_optimizer  # noqa: E402
from lightning_plugins.parallel.options import MemoryOptions, ParallelOptions  # noqa: E402
from lightning_plugins.checkpoint.load import from_pretrained  # noqa: E402
from lightning_plugins.checkpoint.live_export import export_hf  # noqa: E402
from lightning_plugins.parallel.save_pretrained import full_state_dict  # noqa: E402

__all__ = [
    "LayoutError",
    "LightningPluginsError",
    "MemoryOptions",
    "OptionsError",
    "ParallelLayout",
    "ParallelOptions",
    "export_hf",
    "from_pretrained",
    "full_state_dict",
    "offload_optimizer",
    "parallelize",
]
__version__ = "0.1.0"
