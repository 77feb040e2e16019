"""Host memory of a node: what loading the weights and what training keep in its RAM, and whether that fits.

A run passes through two phases, and a node holds the larger of the two, not their sum:

* **loading**: every rank builds the model on the meta device, applies its layout and reads from the safetensors
  files only the slices it keeps, one tensor at a time (:mod:`lightning_plugins.checkpoint.load`). On the host a
  rank holds its resident state if that lives there while loading (CPU offload: the sharded parameters, pinned, from
  the start; on GPU runs the shards go to the GPU) plus the one tensor in flight (:func:`read_in_flight`).
* **training**: what the offload levers keep on the host (CPU offload: the sharded parameters, gradients and AdamW
  state; optimizer offload: AdamW's state, host copies of the trainable parameters and buffers for their gradients;
  activation offload: the most saved activations on the host at once, measured), plus what the pinned allocator
  rounds up (:func:`pinned_rounding`).

Why the larger and not the sum: gradients appear at the first backward and AdamW's state at the first optimizer step
(FSDP2's CPU offload and :class:`~lightning_plugins.parallel.optim.offload.HostOffloadOptimizer` create them lazily), the
activation copies during a step, all after the last tensor read was released. What lives through both (CPU
offload's parameters) is counted in each.

Per node: the ranks of a node load at once, in the same order (the same tensor at the same time), so a phase's
figure is the busiest kind of rank's times the ranks of a node, as the GPU report takes the busiest kind.

Not counted, and said so in the report: the page cache (the safetensors files and the dataset are memory-mapped; the
kernel drops clean mapped pages under pressure), and the tokenized dataset, memory-mapped Arrow prepared once per
node, whose size the planner does not know.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_plugins.planner.hardware import GIB, Cluster

__all__ = [
    "ASSUMED_CHECKPOINT_DTYPE",
    "HOST_TERMS",
    "HostMemory",
    "LargestRead",
    "checkpoint_dtype",
    "host_advice",
    "largest_read",
    "node_host_memory",
    "pinned_rounding",
    "read_in_flight",
]

#: What a phase keeps on a node's host, in report order.
HOST_TERMS = ("parameters", "gradients", "optimizer", "activations", "pinned rounding", "in flight")
#: The line the report gives for the data, which it does not count.
DATA_NOT_COUNTED = "memory-mapped once per node, not counted (the planner does not know the tokenized dataset's size)"


def pinned_rounding(nbytes: int) -> int:
    """Bytes the pinned allocator adds to an allocation of ``nbytes``.

    torch's CUDA host allocator (``at::getHostAllocator(kCUDA)``, behind ``Tensor.pin_memory()`` and non-blocking
    device-to-host copies) rounds every allocation up to a power of two (``ATen/core/CachingHostAllocator.h``,
    ``allocate``) unless ``PYTORCH_ALLOC_CONF=pinned_max_round_threshold_mb:N`` stops it above N MiB: a 112 MiB shard
    takes 128 MiB.
    """
    return (1 << (nbytes - 1).bit_length()) - nbytes if nbytes > 1 else 0


@dataclass(frozen=True)
class LargestRead:
    """The tensor of a rank whose load holds the most host bytes at once.

    Attributes:
        name: The parameter's name in the (parallelized) model.
        numel: Values of its local slice (for MXFP4 experts: of the held experts' whole matrices, which are
            dequantized before they are cut).
        nbytes: Host bytes in flight while it is loaded (:func:`read_in_flight`).
        how: What those bytes are, for the report (``"bf16 read + fp32 cast"``).
    """

    name: str = ""
    numel: int = 0
    nbytes: int = 0
    how: str = ""


#: The dtype a checkpoint whose config names none is taken to hold: what the hub's checkpoints of these models are
#: published in (gpt-oss's dense tensors, Gemma 3's weights, whose text config drops the multimodal one's dtype).
ASSUMED_CHECKPOINT_DTYPE = torch.bfloat16


def checkpoint_dtype(config: Any) -> tuple[torch.dtype, bool]:
    """The dtype of the checkpoint's tensors (its config's ``dtype``, which transformers reads from ``torch_dtype``
    too), and whether the config named it (else :data:`ASSUMED_CHECKPOINT_DTYPE`)."""
    named = getattr(config, "dtype", None)
    if isinstance(named, str):
        named = getattr(torch, named.removeprefix("torch."), None)
    if isinstance(named, torch.dtype):
        return named, True
    return ASSUMED_CHECKPOINT_DTYPE, False


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def read_in_flight(
    numel: int,
    *,
    checkpoint: torch.dtype,
    parameter: torch.dtype,
    nf4_bytes: int = 0,
    stacked: bool = False,
    mxfp4: bool = False,
) -> tuple[int, str]:
    """Host bytes alive while one tensor's local slice of ``numel`` values is loaded, and what they are.

    * **read**: safetensors copies the slice out of the memory-mapped file, in the checkpoint's dtype (the mapped
      pages themselves are page cache, not counted). Fused experts of a checkpoint in the hub's per-expert layout
      (``stacked``) are read expert by expert and concatenated: the pieces and their concatenation, twice the slice.
    * The read is cast as it is copied into the rank's shard (:func:`~lightning_plugins.checkpoint.safetensors_io.
      read_slice`), which is on the GPU or resident host state counted apart: no cast copy is in flight.
    * **NF4** (QLoRA): the rows are cast to the parameter dtype (a copy when the dtypes differ) and quantized: their
      NF4 result (``nf4_bytes``: codes, scalers, factors) next to the rows read.
    * **MXFP4** experts (gpt-oss): the held experts' packed blocks and scales (a half byte per value, a byte per 32
      values, and the scales again as int32) and transformers' dequantization (``_convert_moe_packed_tensors``): its
      output in the parameter dtype while the int32 indices of one half of the values (2 bytes per value) and their
      table lookup (half the output) are alive; its transposed contiguous copy at the end holds no more than that.
    """
    size, width = _itemsize(checkpoint), _itemsize(parameter)
    if mxfp4:
        packed = numel // 2 + numel // 32 + numel // 8  # blocks, scales, the scales as int32
        return packed + numel * width + 2 * numel + numel * width // 2, "MXFP4 read + dequantization"
    copies = 2 if stacked else 1
    nbytes = copies * numel * size
    how = f"{_name(checkpoint)} read" + (" of per-expert pieces + their concatenation" if stacked else "")
    if parameter != checkpoint and nf4_bytes:
        nbytes += numel * width
        how += f" + {_name(parameter)} cast"
    if nf4_bytes:
        nbytes += nf4_bytes
        how += " + its NF4"
    return nbytes, how


def _name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def largest_read(model: nn.Module, config: Any, model_dtype: torch.dtype) -> LargestRead:
    """The parameter of a parallelized (meta-device) model whose load holds the most host bytes at once.

    Only what the checkpoint holds is read: LoRA adapters are created, not loaded. A 3-D parameter is a fused
    experts weight, read from the hub's per-expert tensors, or dequantized from MXFP4 when the config says so.
    """
    from lightning_plugins.adapters.qlora import nf4_nbytes
    from lightning_plugins.parallel.quantized import is_nf4
    from lightning_plugins.checkpoint.mxfp4 import is_mxfp4

    checkpoint, _ = checkpoint_dtype(config)
    mxfp4 = is_mxfp4(config)
    largest = LargestRead()
    for name, param in model.named_parameters():
        if ".lora_" in name:
            continue
        local = param.to_local() if isinstance(param, DTensor) else param
        experts = param.dim() == 3
        numel = local.numel()
        if experts and mxfp4:  # each held expert's whole matrix is dequantized, then cut to the local slice
            numel = local.shape[0] * param.shape[1:].numel()
        dtype = model_dtype if is_nf4(local) else local.dtype
        nbytes, how = read_in_flight(
            numel,
            checkpoint=checkpoint,
            parameter=dtype,
            nf4_bytes=nf4_nbytes(local) if is_nf4(local) else 0,
            stacked=experts and not mxfp4,
            mxfp4=experts and mxfp4,
        )
        if nbytes > largest.nbytes:
            largest = LargestRead(name, numel, nbytes, how)
    return largest


@dataclass(frozen=True)
class HostMemory:
    """A node's host memory, by phase and term (:data:`HOST_TERMS`), against what the node has.

    Attributes:
        ranks_per_node: Ranks (GPUs) a node runs.
        loading: Bytes per node while the weights are read, by term.
        training: Bytes per node while training, by term.
        largest_read: The tensor in flight at the load peak (per rank).
        limit: The node's host memory.
        limit_source: Where :attr:`limit` comes from, for the report.
        notes: What is assumed or left out.
    """

    ranks_per_node: int
    loading: dict[str, int]
    training: dict[str, int]
    largest_read: LargestRead
    limit: int
    limit_source: str
    notes: list[str] = field(default_factory=list)

    @property
    def per_node(self) -> int:
        """The larger phase, not their sum: offloaded gradients and AdamW state are created at the first backward and
        optimizer step, after the last tensor read was released; what both hold (CPU offload's weights) is in each."""
        return max(sum(self.loading.values()), sum(self.training.values()))

    @property
    def fits(self) -> bool:
        return self.per_node <= self.limit

    def as_dict(self) -> dict[str, Any]:
        return {
            "per_node": self.per_node,
            "limit": self.limit,
            "limit_source": self.limit_source,
            "fits": self.fits,
            "ranks_per_node": self.ranks_per_node,
            "loading": dict(self.loading),
            "training": dict(self.training),
            "largest_read": {"name": self.largest_read.name, "numel": self.largest_read.numel,
                             "bytes_per_rank": self.largest_read.nbytes, "what": self.largest_read.how},  # fmt: skip
            "data": None,  # not counted: DATA_NOT_COUNTED
            "not_counted": [f"data: {DATA_NOT_COUNTED}", "page cache"],
            "notes": list(self.notes),
        }

    def describe(self) -> list[str]:
        """The report's lines: a row per phase, what is in flight, what is not counted, the verdict."""
        lines = [
            f"Host GiB per node ({self.ranks_per_node} rank(s); the larger phase counts, they never coexist):",
            f"{'phase':<10}" + "".join(f"{term[:15]:>16}" for term in HOST_TERMS) + f"{'total':>9}",
        ]
        for phase, terms in (("loading", self.loading), ("training", self.training)):
            lines.append(
                f"{phase:<10}"
                + "".join(f"{terms.get(term, 0) / GIB:>16.2f}" for term in HOST_TERMS)
                + f"{sum(terms.values()) / GIB:>9.2f}"
            )
        read = self.largest_read
        if read.name:
            lines.append(
                f"  in flight: {read.name}'s local slice ({read.numel / 1e6:,.1f}M values), {read.how}:"
                f" {read.nbytes / GIB:.2f} GiB per rank, one tensor at a time"
            )
        lines.append(f"  data: {DATA_NOT_COUNTED}; page cache not counted")
        lines += [f"  {note}" for note in self.notes]
        verdict = "fits" if self.fits else "DOES NOT FIT"
        lines.append(
            f"Host memory {verdict}: {self.per_node / GIB:.1f} GiB per node against {self.limit / GIB:.0f} GiB"
            f" ({self.limit_source})"
        )
        return lines


def node_host_memory(workload: Any, cluster: Cluster, ranks: list[Any]) -> HostMemory:
    """The node's host memory from the dry run's kinds of rank (their ``load_terms`` and ``host_terms``)."""
    per_node = min(cluster.gpus, cluster.gpus_per_node)
    loading_rank = max(ranks, key=lambda rank: sum(rank.load_terms.values()))
    training_rank = max(ranks, key=lambda rank: sum(rank.host_terms.values()))
    notes = []
    checkpoint, named = checkpoint_dtype(workload.config)
    if not named:
        notes.append(f"the model config names no dtype: its checkpoint is taken to hold {_name(checkpoint)}")
    if workload.memory.activation_offload:
        notes.append("activation offload's pinned copies counted as measured, without the allocator's rounding")
    return HostMemory(
        ranks_per_node=per_node,
        loading={term: nbytes * per_node for term, nbytes in loading_rank.load_terms.items()},
        training={term: nbytes * per_node for term, nbytes in training_rank.host_terms.items()},
        largest_read=loading_rank.largest_read,
        limit=cluster.host_memory,
        limit_source=cluster.host_memory_source,
        notes=notes,
    )


def host_advice(host: HostMemory, workload: Any, cluster: Cluster, gpu_room: int) -> list[tuple[int, str]]:
    """``(bytes saved per node, setting)`` of the levers that shrink the larger phase (estimates).

    ``gpu_room`` is what each GPU has left under its budget: a lever that brings offloaded state back to the GPUs is
    offered only when it fits there.
    """
    training, loading = host.training, host.loading
    levers: list[tuple[int, str]] = []
    layout, memory = workload.layout, workload.memory
    state = {term: training.get(term, 0) for term in ("parameters", "gradients", "optimizer")}
    offloaded = sum(state.values()) + training.get("pinned rounding", 0)
    ranks = host.ranks_per_node
    if sum(training.values()) >= sum(loading.values()):
        if offloaded and layout.dp_shard_size > 1:
            nodes, shards = cluster.nodes * 2, layout.dp_shard_size * 2
            setting = f"hardware.nodes: {nodes} with layout.dp_shard_size: {shards} (the state over twice the ranks)"
            levers.append((offloaded // 2, setting))
        if memory.cpu_offload:
            # Optimizer offload keeps AdamW's state, a copy of the trainable parameters and their gradients on the
            # host; the weights and gradients go back to the GPUs.
            back = state["parameters"] + state["gradients"]
            if state["parameters"] > state["gradients"] and back // ranks <= gpu_room:
                saved = state["parameters"] - state["gradients"]
                levers.append((saved, "memory.optimizer_offload: true instead of cpu_offload"))
            if sum(state.values()) // ranks <= gpu_room:
                levers.append((offloaded, "memory.cpu_offload: false"))
        if memory.optimizer_offload and state["optimizer"] // ranks <= gpu_room:  # AdamW's state back on the GPUs
            levers.append((offloaded, "memory.optimizer_offload: false"))
        if training.get("pinned rounding", 0):
            setting = (
                "PYTORCH_ALLOC_CONF=pinned_max_round_threshold_mb:1 in the launch environment (pinned blocks over 1 MiB"
                " not rounded up to a power of two)"
            )
            levers.append((training["pinned rounding"], setting))
        activations = training.get("activations", 0)
        if activations:
            levers.append((activations, "memory.activation_offload: false"))
            if workload.micro_batch_size > 1:
                levers.append((activations // 2, f"train.micro_batch_size: {workload.micro_batch_size // 2}"))
    else:
        in_flight = loading.get("in flight", 0)
        levers.append(
            (in_flight // 2, f"split {host.largest_read.name} over twice the ranks (layout.dp_shard_size or tp_size)")
        )
    return levers
