"""``TensorParallelStrategy``: tensor parallelism first, FSDP2 over the remaining ranks."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from typing_extensions import override

from lightning_plugins.strategies.parallelism import ParallelismStrategy


class TensorParallelStrategy(ParallelismStrategy):
    """Tensor parallelism with sequence and loss parallelism on; the other ranks shard data (FSDP2).

    Args:
        tp_size: Tensor-parallel ranks; ``"auto"`` uses every process of a node (TP stays inside the
            fast intra-node links) and shards data across nodes.
        **kwargs: Any option of :class:`ParallelismStrategy`.
    """

    strategy_name = "tensor_parallel"

    def __init__(self, *, tp_size: int | Literal["auto"] = "auto", **kwargs: Any) -> None:
        if tp_size == "auto" and kwargs.get("tensor_parallel_size") is not None:  # Lightning's name for it
            tp_size = kwargs.pop("tensor_parallel_size")
        super().__init__(tp_size=1 if tp_size == "auto" else tp_size, **kwargs)
        self._auto_tp = tp_size == "auto"

    @override
    def setup_environment(self) -> None:
        if self._auto_tp:
            self.layout = replace(self.layout, tp_size=self.num_processes)
        super().setup_environment()
