"""lightning_plugins: tensor, pipeline, context and data parallelism for Hugging Face LLMs."""

from lightning_plugins.layout import LayoutError, ParallelLayout
from lightning_plugins.options import MemoryOptions, ParallelOptions
from lightning_plugins.parallel import parallelize

__all__ = ["LayoutError", "MemoryOptions", "ParallelLayout", "ParallelOptions", "parallelize"]
__version__ = "0.1.0"
