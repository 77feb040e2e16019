"""``ContextParallelStrategy``: each sample's sequence split over ranks (Ulysses or ring attention)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from typing_extensions import override

from lightning_plugins.errors import LayoutError
from lightning_plugins.strategies.parallelism import ParallelismStrategy


class ContextParallelStrategy(ParallelismStrategy):
    """Context (sequence) parallelism for long sequences; the other ranks shard data (FSDP2).

    The LightningModule stays unchanged: the strategy pads each batch to a multiple of ``2 * cp_size``
    (ignored labels), turns the labels into next-token targets on the full sequence, and hands every
    rank its load-balanced shard of ``input_ids``, ``position_ids`` and the targets. The model's loss
    is the exact global token mean; parameters are sharded over the data and context ranks together.

    Args:
        cp_size: Context-parallel ranks; ``"auto"`` uses every process of a node.
        cp_backend: ``"ulysses"`` (all-to-all from sequence- to head-sharded around attention; the query
            heads per tensor-parallel rank must divide by ``cp_size``) or ``"ring"`` (K/V passed around
            the ring with an online softmax; no head constraint).
        **kwargs: Any option of :class:`ParallelismStrategy` (``layout``, ``tp_size``, ``dp_shard_size``, ...).
    """

    strategy_name = "context_parallel"

    def __init__(self, *, cp_size: int | Literal["auto"] = "auto", cp_backend: str = "ulysses", **kwargs: Any) -> None:
        if cp_size != "auto" and (not isinstance(cp_size, int) or cp_size < 1):
            raise LayoutError(f"{type(self).__name__}: cp_size must be a positive integer or 'auto', got {cp_size!r}.")
        super().__init__(cp_size=1 if cp_size == "auto" else cp_size, cp_backend=cp_backend, **kwargs)
        self._auto_cp = cp_size == "auto"

    @override
    def setup_environment(self) -> None:
        if self._auto_cp:
            self.layout = replace(self.layout, cp_size=self.num_processes // self.layout.tp_size)
        super().setup_environment()
