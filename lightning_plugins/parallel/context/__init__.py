"""Context parallelism: the sequence split across ranks inside attention, and its wiring into HF models.

Two mechanisms, both pure torch (matmul + exp) so they run on CPU/gloo as well as on GPUs:

* **Ring attention** (:mod:`.ring`, :func:`ring_attention`): K/V blocks travel a ring of ``cp`` ranks and
  are merged with an online softmax; the backward recomputes each block and sends dK/dV home.
* **Ulysses** (:mod:`.ulysses`, :func:`ulysses_attention`): an all-to-all from sequence shards to head
  shards, any ordinary attention on the full sequence, and the inverse all-to-all.

The other parts:

* :mod:`.sharding`: the load-balanced layout (rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r`` of every
  segment of ``2 * cp`` chunks) and padding, on plain tensors.
* :mod:`.tiles`: which query/key pairs ring attention computes (active blocks, query-row tiles, document tiles).
* :mod:`.pieces`, :mod:`.fused`, :mod:`.bands`: how ring attention computes a block's pieces: fused kernel calls,
  a sliding window's band batched in one masked call (CPU), the pure-torch tiles.
* :mod:`.batch`: a causal-LM batch sharded along the sequence (labels shifted on the full sequence first).
* :mod:`.wiring`: the attention of a transformers model routed through the two kernels.
* :mod:`.checks`: errors before any collective when a model or layout cannot run context parallel.
"""

from lightning_plugins.parallel.context.batch import context_parallel_batch, shard_batch_for_context_parallel
from lightning_plugins.parallel.context.checks import BACKENDS, check_context_parallel, check_ulysses_heads
from lightning_plugins.parallel.context.ring import ring_attention
from lightning_plugins.parallel.context.sharding import (
    ContextParallelBatch,
    load_balanced_indices,
    pad_for_context_parallel,
    reorder_sequence_load_balanced,
    shard_sequence_load_balanced,
    unshard_sequence_load_balanced,
)
from lightning_plugins.parallel.context.ulysses import AttentionFn, head_to_seq, seq_to_head, ulysses_attention
from lightning_plugins.parallel.context.wiring import (
    ATTENTION_IMPLEMENTATION,
    apply_context_parallel,
    context_parallel_attention,
)

__all__ = [
    "ATTENTION_IMPLEMENTATION",
    "AttentionFn",
    "BACKENDS",
    "ContextParallelBatch",
    "apply_context_parallel",
    "check_context_parallel",
    "check_ulysses_heads",
    "context_parallel_attention",
    "context_parallel_batch",
    "head_to_seq",
    "load_balanced_indices",
    "pad_for_context_parallel",
    "reorder_sequence_load_balanced",
    "ring_attention",
    "seq_to_head",
    "shard_batch_for_context_parallel",
    "shard_sequence_load_balanced",
    "ulysses_attention",
    "unshard_sequence_load_balanced",
]
