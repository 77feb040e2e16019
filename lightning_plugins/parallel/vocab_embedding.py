"""A vocab-parallel embedding whose weight gradient stays sharded over the tensor-parallel ranks.

torch's ``RowwiseParallel`` runs the embedding on the ``Shard(0)`` weight as a DTensor op; DTensor has no
row-sharded strategy for ``aten.embedding_dense_backward``, so the weight's gradient comes back ``Replicate`` (or
``Partial``): a full ``[vocab, hidden]`` gradient on every tensor-parallel rank (fp32: 7.8 GiB for Llama-3.1-405B's
128256 x 16384), computed redundantly and kept until the optimizer step. :func:`keep_embedding_grad_sharded` makes
the module look up its own rows on local tensors (ids outside them give zero rows) and return the ``Partial`` sum
that ``RowwiseParallel``'s output hook then reduces as before: autograd's gradient is the local rows', ``Shard(0)``.
"""

from __future__ import annotations

from types import MethodType
from typing import Any

from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def keep_embedding_grad_sharded(embed: nn.Module) -> None:
    """After ``parallelize_module(embed, RowwiseParallel(input_layouts=Replicate(), ...))`` on a 1-D mesh.

    The module's own ``forward`` still runs (scaled embeddings such as Gemma 3's keep their scale), on this rank's
    rows of the weight and the ids shifted into them; ``padding_idx`` is shifted too, or dropped where the row is
    another rank's.
    """
    forward = type(embed).forward

    def local_forward(self: nn.Module, input_ids: Any, *args: Any, **kwargs: Any) -> Any:
        weight = self.weight
        if not isinstance(weight, DTensor) or not isinstance(input_ids, DTensor):
            return forward(self, input_ids, *args, **kwargs)
        shape, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
        start, rows = offset[0], shape[0]
        ids = input_ids.to_local()
        outside = (ids < start) | (ids >= start + rows)
        padding = getattr(self, "padding_idx", None)
        local_padding = padding - start if padding is not None and start <= padding < start + rows else None
        del self._parameters["weight"]
        object.__setattr__(self, "weight", weight.to_local())
        self.padding_idx = local_padding
        try:
            out = forward(self, (ids - start).masked_fill(outside, 0), *args, **kwargs)
        finally:
            object.__delattr__(self, "weight")
            self._parameters["weight"] = weight
            self.padding_idx = padding
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return DTensor.from_local(out, weight.device_mesh, [Partial()], run_check=False)

    embed.forward = MethodType(local_forward, embed)
