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
from torch.distributed.tensor import DTensor, Partial, Shard


def keep_embedding_grad_sharded(embed: nn.Module) -> None:
    """After ``parallelize_module(embed, RowwiseParallel(input_layouts=Replicate(), ...))`` on a 1-D mesh (a weight
    laid out otherwise runs the module's own DTensor forward).

    The module's own ``forward`` still runs (scaled embeddings such as Gemma's keep their scale), on this rank's
    rows of the weight and the ids shifted into them, its replicated DTensor buffers as local tensors;
    ``padding_idx`` is shifted too, or dropped where the row is another rank's.
    """
    forward = type(embed).forward

    def local_forward(self: nn.Module, input_ids: Any, *args: Any, **kwargs: Any) -> Any:
        weight = self.weight
        if not (isinstance(weight, DTensor) and isinstance(input_ids, DTensor) and weight.placements == (Shard(0),)):
            return forward(self, input_ids, *args, **kwargs)
        # torch.chunk's rows: ceil(vocab / ranks) each, the last ones fewer (or none).
        local = weight.to_local()
        start = min(weight.device_mesh.get_local_rank() * -(-weight.shape[0] // weight.device_mesh.size()), weight.shape[0])
        rows = local.shape[0]
        ids = input_ids.to_local()
        outside = (ids < start) | (ids >= start + rows)
        padding = getattr(self, "padding_idx", None)
        local_padding = padding - start if padding is not None and start <= padding < start + rows else None
        # Replicated DTensor buffers (Gemma's embed_scale) as their local values for the call.
        buffers = {name: b for name, b in self._buffers.items() if isinstance(b, DTensor)}
        del self._parameters["weight"]
        object.__setattr__(self, "weight", local)
        self._buffers.update({name: b.to_local() for name, b in buffers.items()})
        self.padding_idx = local_padding
        try:
            out = forward(self, (ids - start).masked_fill(outside, 0), *args, **kwargs)
        finally:
            object.__delattr__(self, "weight")
            self._parameters["weight"] = weight
            self._buffers.update(buffers)
            self.padding_idx = padding
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return DTensor.from_local(out, weight.device_mesh, [Partial()], run_check=False)

    embed.forward = MethodType(local_forward, embed)
