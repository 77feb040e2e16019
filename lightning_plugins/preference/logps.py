"""Each sequence's log-probability of its labels, summed over its tokens, without full logits where the model's
head is chunked.

A preference loss needs, per row of the batch, the sum of ``log p(label)`` over the completion's tokens. The model's
own forward computes it, with every layout's hooks in place: :func:`sequence_logps` calls the model with ``labels``
while its :class:`~lightning_plugins.parallel.loss.ParallelCausalLMLoss` hands the call to a collector, which takes
each token's loss from the chunked head (:mod:`lightning_plugins.parallel.memory.chunked_loss`, in per-token mode:
never the ``[batch, seq, vocab]`` logits) or, without one, from the logits the head returned: whole, or a
vocab-sharded DTensor under loss parallel (three small all-reduces per token, as the SFT loss). Both give the same
numbers as ``log_softmax(logits).gather(labels)`` of one process. Under context parallelism each rank holds a shard
of every row (the load-balanced chunks of :mod:`lightning_plugins.parallel.context.batch`): its per-row sums are
partial, and one all-reduce over the ``cp`` ranks completes them (:func:`sum_over_context`; its backward sums the
gradients too, which the preference loss's mean over the ``dp_cp`` ranks, counting each row once per cp rank, expects).

A mixture of experts whose config has ``output_router_logits`` on also returns its router's balance loss
(:attr:`SequenceLogps.aux_loss`, the global batch's under data parallelism:
:mod:`lightning_plugins.parallel.moe.router_loss`), which the preference loss adds as TRL's ``DPOTrainer`` does.

Packed preference pairs (``data.packing``): a row holds several pairs, each sequence a document of its own (positions
restarting at 0, so attention, masked or context-parallel, stays within it); the batch numbers each token's sequence
(``sequence_ids``, sharded with the tokens under context parallelism), and the statistics are summed per sequence
(:class:`Sequences`) in the unpacked batch's order (chosen sequences, then rejected), the same numbers as unpacked.

A model the engine did not parallelize (one process, no :class:`ParallelCausalLMLoss`) gets the same statistics
from its full logits. A model split into pipeline stages is refused: its schedule runs the whole batch, and
:mod:`lightning_plugins.preference.pipeline` computes the rows' log-probabilities on its last stage instead.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_plugins.data.preference import ROW_PAIRS
from lightning_plugins.errors import OptionsError
from lightning_plugins.parallel.context.batch import SEQUENCE_IDS
from lightning_plugins.parallel.loss import IGNORE_INDEX, ParallelCausalLMLoss, next_token_targets, token_losses
from lightning_plugins.parallel.mesh import mesh_of
from lightning_plugins.parallel.pipeline.apply import pipeline_of

__all__ = ["SequenceLogps", "context_mesh", "find_parallel_loss", "head_logps", "sequence_logps", "sum_over_context"]


@dataclass(frozen=True)
class SequenceLogps:
    """Per row: the summed log-probability of its labels (differentiable), how many labels it has, and the sum over
    them of each token's mean logit (TRL's ``logits/*`` metric; no gradient)."""

    logps: Tensor
    tokens: Tensor
    logit_sums: Tensor
    #: The ranks that hold other rows (``dp_cp`` of the layout), or ``None``.
    data_mesh: DeviceMesh | None = None
    #: The router's load-balancing loss of the forward (its value the global batch's), or ``None`` (a dense model, or
    #: ``output_router_logits`` off), and the config's ``router_aux_loss_coef`` that weighs it.
    aux_loss: Tensor | None = None
    aux_coef: float = 0.0


def _mean_logits(logits: Tensor) -> Tensor:
    """Each token's mean logit over the whole vocabulary (a vocab-sharded DTensor: local sums, one all-reduce)."""
    with torch.no_grad():
        if isinstance(logits, DTensor) and logits.placements[-1].is_shard():
            local = logits.to_local().float()
            sums = local.sum(dim=-1)
            dist.all_reduce(sums, group=logits.device_mesh.get_group())
            return sums / logits.shape[-1]
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        return logits.float().mean(dim=-1)


@dataclass(frozen=True)
class Sequences:
    """Packed rows' sequences (preference pairs packed with ``data.packing``): each token's sequence (``-1``: none),
    as many columns as the targets (this rank's shard under context parallelism), and how many sequences there are."""

    ids: Tensor
    count: int

    @staticmethod
    def of(batch: dict[str, Tensor]) -> Sequences | None:
        """The sequences of a batch of packed pairs (:func:`~lightning_plugins.data.packing.collate_packed_pairs`),
        ``None`` for one whose every row is a sequence."""
        ids = batch.get(SEQUENCE_IDS)
        return None if ids is None else Sequences(ids, 2 * int(batch[ROW_PAIRS].sum()))

    def sums(self, values: Tensor) -> Tensor:
        """``values`` (one per token) summed per sequence (``[count]``)."""
        slots = torch.where(self.ids < 0, self.count, self.ids).reshape(-1).to(values.device)
        return values.new_zeros(self.count + 1).index_add(0, slots, values.reshape(-1))[: self.count]


def without_sequences(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """The model's inputs of a batch: without the keys that number packed pairs' sequences."""
    return {key: value for key, value in batch.items() if key not in (SEQUENCE_IDS, ROW_PAIRS)}


def _per_row(
    losses: Tensor, mean_logits: Tensor, targets: Tensor, data_mesh: DeviceMesh | None,
    sequences: Sequences | None = None,
) -> SequenceLogps:  # fmt: skip
    valid = targets != IGNORE_INDEX
    logps = -(losses.view(targets.shape).masked_fill(~valid, 0.0))
    logits = mean_logits.view(targets.shape).masked_fill(~valid, 0.0).detach()
    tokens = valid.to(torch.float32)
    if sequences is None:
        return SequenceLogps(logps.sum(dim=-1), tokens.sum(dim=-1), logits.sum(dim=-1), data_mesh=data_mesh)
    return SequenceLogps(sequences.sums(logps), sequences.sums(tokens), sequences.sums(logits), data_mesh=data_mesh)


class _Collector:
    """Stands in for the loss during one forward: keeps the rows' statistics, returns their summed loss."""

    def __init__(self, data_mesh: DeviceMesh | None, sequences: Sequences | None) -> None:
        self.data_mesh, self.sequences = data_mesh, sequences
        self.result: SequenceLogps | None = None

    def __call__(self, logits: Tensor, targets: Tensor, chunked: Any) -> Tensor:
        self.result = head_logps(logits, targets, chunked, self.data_mesh, self.sequences)
        return -self.result.logps.sum()


def head_logps(
    logits: Tensor, targets: Tensor, chunked: Any, data_mesh: DeviceMesh | None = None,
    sequences: Sequences | None = None,
) -> SequenceLogps:  # fmt: skip
    """Each row's statistics from what a causal LM's head computed: each token's loss and logit sum from the chunked
    head in per-token mode (``chunked.take_tokens()``), or else from the ``logits`` (whole, or vocab-sharded).

    Args:
        logits: The head's output, after the model's logit transforms (empty when the chunked head computed).
        targets: The next-token targets (``-100``: not counted).
        chunked: The model's chunked head, or ``None``.
        data_mesh: The ranks holding other rows (kept on the result).
        sequences: Packed rows' sequences: the statistics per sequence, not per row.
    """
    taken = None if chunked is None else chunked.take_tokens()
    if taken is None:
        losses, means = token_losses(logits, targets), _mean_logits(logits)
    else:
        losses, sums = taken
        means = sums / chunked.lm_head.weight.shape[0]  # the whole vocabulary's rows (a DTensor's global shape)
    return _per_row(losses, means, targets, data_mesh, sequences)


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) whose backward all-reduces the gradients too: every rank computes the same loss from the sums,
    so each partial's gradient is the sum of those ranks' (their mean over ``dp_cp`` then scales it back)."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        total = local.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def context_mesh(model: nn.Module) -> DeviceMesh | None:
    """The ``cp`` ranks holding shards of the same rows, when the engine split ``model``'s sequences (else ``None``)."""
    for module in model.modules():
        mesh = mesh_of(module)
        if mesh is not None:
            return mesh["cp"] if "cp" in (mesh.mesh_dim_names or ()) and mesh["cp"].size() > 1 else None
    return None


def sum_over_context(rows: SequenceLogps, mesh: DeviceMesh | None) -> SequenceLogps:
    """Each row's statistics summed over the context-parallel shards of its sequence (one differentiable all-reduce,
    one without gradient)."""
    if mesh is None:
        return rows
    group = mesh.get_group()
    counts = torch.stack([rows.tokens, rows.logit_sums.to(rows.tokens.dtype)])
    dist.all_reduce(counts, group=group)
    return replace(rows, logps=_SumOverRanks.apply(rows.logps, group), tokens=counts[0], logit_sums=counts[1])


def find_parallel_loss(model: nn.Module) -> ParallelCausalLMLoss | None:
    """The :class:`ParallelCausalLMLoss` the engine installed on ``model`` (or on the causal LM inside a peft model)."""
    for module in model.modules():
        loss = module.__dict__.get("_loss_function")
        if isinstance(loss, ParallelCausalLMLoss):
            return loss
    return None


def sequence_logps(model: nn.Module, batch: dict[str, Tensor], *, router_loss: bool = True) -> SequenceLogps:
    """The model's summed log-probability of each row's ``labels`` (``-100``: not counted), shifted as a causal LM's.

    Args:
        model: A transformers causal LM (or peft model), parallelized by the engine or not.
        batch: ``input_ids``, ``labels`` and optionally ``attention_mask`` / ``position_ids`` (under context
            parallelism: this rank's shard, with ``shift_labels``, as ``context_parallel_batch`` makes it). Packed
            pairs' rows (:func:`~lightning_plugins.data.packing.collate_packed_pairs`) carry ``sequence_ids`` and
            ``row_pairs``: then the result has one entry per sequence (the chosen ones, then the rejected ones),
            not per row.
        router_loss: ``False``: a mixture of experts computes no router balance loss in this forward (TRL's
            reference forward), whatever its config says.
    """
    _refuse_pipeline(model)
    sequences = Sequences.of(batch)
    inputs = {key: value for key, value in without_sequences(batch).items() if key != "labels"}
    if not router_loss and getattr(model.config, "output_router_logits", False):
        inputs["output_router_logits"] = False
    loss = find_parallel_loss(model)
    if loss is None:  # one process, plain model: the full logits
        output = model(**inputs, use_cache=False)
        targets = next_token_targets(batch["labels"]).to(output.logits.device)
        rows = _per_row(token_losses(output.logits, targets), _mean_logits(output.logits), targets, None, sequences)
        return _with_router_loss(rows, output, model)
    collector = _Collector(loss.data_mesh, sequences)
    chunked = loss.chunked
    loss.sequences = collector
    if chunked is not None:
        chunked.per_sequence = True
    try:
        output = model(**inputs, labels=batch["labels"], use_cache=False)
    finally:
        loss.sequences = None
        if chunked is not None:
            chunked.per_sequence = False
    if collector.result is None:
        raise RuntimeError(f"{type(model).__name__}'s forward did not call its loss function: no log-probabilities.")
    return _with_router_loss(sum_over_context(collector.result, context_mesh(model)), output, model)


def _refuse_pipeline(model: nn.Module) -> None:
    """A pipeline-parallel model's forward runs its schedule over the whole batch: only the last stage sees logits,
    one micro-batch at a time, so no per-row log-probabilities come back from one forward."""
    for module in model.modules():
        if pipeline_of(module) is not None:
            raise OptionsError(
                f"sequence_logps needs one forward of the whole model, but {type(module).__name__} is split into"
                " pipeline stages (its last stage sees the logits one micro-batch at a time). Call PreferenceObjective"
                " (objective(model, batch)) or KTOObjective, which run DPO, SimPO, ORPO and KTO through the pipeline's"
                " schedule (lightning_plugins.preference.pipeline)."
            )


def _with_router_loss(rows: SequenceLogps, output: Any, model: nn.Module) -> SequenceLogps:
    aux = getattr(output, "aux_loss", None)
    if aux is None:
        return rows
    return replace(rows, aux_loss=aux, aux_coef=float(getattr(model.config, "router_aux_loss_coef", 0.0)))
