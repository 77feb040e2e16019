"""lightning_plugins: tensor, pipeline, context and data parallelism for Hugging Face LLMs."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import warnings
from typing import TYPE_CHECKING, Any

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

#: The public API: each name, with the module that defines it. A name is imported when first asked for (PEP 562), so
#: ``import lightning_plugins`` (the console script's ``--version``, ``recipes``, ...) costs no torch, transformers or
#: engine import; ``from lightning_plugins import parallelize`` imports what it names.
_API = {
    "LayoutError": "lightning_plugins.errors",
    "LightningPluginsError": "lightning_plugins.errors",
    "OptionsError": "lightning_plugins.errors",
    "parallelize": "lightning_plugins.parallel",
    "ParallelLayout": "lightning_plugins.parallel.layout",
    "offload_optimizer": "lightning_plugins.parallel.optim.offload",
    "MemoryOptions": "lightning_plugins.parallel.options",
    "ParallelOptions": "lightning_plugins.parallel.options",
    "from_pretrained": "lightning_plugins.checkpoint.load",
    "export_hf": "lightning_plugins.checkpoint.live_export",
    "full_state_dict": "lightning_plugins.parallel.save_pretrained",
}
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

if TYPE_CHECKING:  # what the names are, for type checkers and the API reference (mkdocstrings reads this statically)
    from lightning_plugins.checkpoint.live_export import export_hf
    from lightning_plugins.checkpoint.load import from_pretrained
    from lightning_plugins.errors import LayoutError, LightningPluginsError, OptionsError
    from lightning_plugins.parallel import parallelize
    from lightning_plugins.parallel.layout import ParallelLayout
    from lightning_plugins.parallel.optim.offload import offload_optimizer
    from lightning_plugins.parallel.options import MemoryOptions, ParallelOptions
    from lightning_plugins.parallel.save_pretrained import full_state_dict


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})


#: The imports that read what :func:`_before_torchao_or_deepspeed` prepares: transformers imports torchao (and
#: DeepSpeed) whenever they are installed; the doors and peft import transformers; the engine imports torchao.
_PREPARED_FOR = ("torchao", "deepspeed", "transformers", "peft", "accelerate", "lightning", "lightning_fabric",
                 "pytorch_lightning")  # fmt: skip


def _torchao_logs_muted() -> Any:
    """A context in which torchao's import-time log noise is muted: on a machine without its CUDA kernels its import
    logs "Failed to load ..." lines and a torch deprecation notice, nothing a user can act on."""
    import contextlib
    import logging

    @contextlib.contextmanager
    def muted():
        loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
        levels = [logger.level for logger in loggers]
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)

    return muted()


def _before_torchao_or_deepspeed() -> None:
    """Set ``DS_ACCELERATOR=cpu`` on a machine without CUDA (DeepSpeed warns when it has to guess the CPU) and import
    torchao (QLoRA's NF4, and what transformers imports of it) with its log noise muted."""
    import importlib.util

    import torch

    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
    if "torchao" not in sys.modules and importlib.util.find_spec("torchao") is not None:
        with _torchao_logs_muted():
            import torchao
            import torchao.prototype.safetensors.safetensors_support  # noqa: F401  (what transformers imports)


class _FirstHeavyImport(importlib.abc.MetaPathFinder):
    """Runs :func:`_before_torchao_or_deepspeed` once, when the process first imports one of :data:`_PREPARED_FOR`
    (before it is loaded), then steps aside: the cost is paid only by processes that import them anyway. (It stays in
    ``sys.meta_path``, answering nothing: removing it while the import system walks that list would skip a finder.)"""

    done = False

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if self.done or name not in _PREPARED_FOR:
            return None
        self.done = True
        if name != "torchao":
            _before_torchao_or_deepspeed()
            return None
        # torchao itself, asked for first (the engine's float8): loaded here, muted, by the finders after this one.
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _MutedLoader(spec.loader)
        return spec


class _MutedLoader(importlib.abc.Loader):
    """torchao's loader, run with :func:`_torchao_logs_muted` after :func:`_before_torchao_or_deepspeed`'s setting."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> Any:  # the rest of the loader's interface (resources, code) is torchao's
        return getattr(self.loader, name)

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        _before_torchao_or_deepspeed()
        with _torchao_logs_muted():
            self.loader.exec_module(module)
            import torchao.prototype.safetensors.safetensors_support  # noqa: F401  (what transformers imports)


if any(name in sys.modules for name in _PREPARED_FOR):
    _before_torchao_or_deepspeed()
else:
    sys.meta_path.insert(0, _FirstHeavyImport())
