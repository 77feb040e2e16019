"""The pipeline runtime (:class:`Pipeline`): this rank's stages, the schedule that runs them, one step per batch.

* **Shapes** are given to ``PipelineStage`` up front (static mode): no metadata-inference pass runs.
  A new (micro-batch, sequence) shape rebuilds the stages; padding to a fixed length avoids that. The last training
  and the last evaluation schedule are kept; a new one's first run would drop the gradients FSDP2 stages hold
  (torch's set-up cleans them), so they are held aside around it.
* **Tied embeddings.** When the first and last stage live on different ranks, each keeps a copy of the
  tied weight. After every step the gradient increments of the two copies are summed over the pair of
  ranks, so both copies take identical updates; :meth:`Pipeline.clip_grad_norm_` counts the weight once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.pipelining.schedules import (
    _Action,
    _add_send_recv,
    _add_unshard_reshard,
    _ComputationType,
    _PipelineScheduleRuntime,
)
from torch.distributed.tensor import DTensor

from lightning_plugins.errors import LayoutError
from lightning_plugins.parallel.fsdp import reshard_gathered
from lightning_plugins.parallel.grad import total_grad_norm
from lightning_plugins.parallel.image_text import language_config
from lightning_plugins.parallel.loss import IGNORE_INDEX, next_token_targets
from lightning_plugins.parallel.pipeline.options import PipelineOptions, stages_of_rank
from lightning_plugins.parallel.pipeline.stage import ReshardingStage, StageModule, identity_loss


@dataclass
class TiedEmbedding:
    """A tied input/output embedding whose two copies live on different ranks."""

    param_name: str
    group: dist.ProcessGroup
    counted: bool  # False on the rank holding the duplicate (last stage): the norm counts it once


class Pipeline:
    """This rank's stages, the schedule that runs them, and the step that drives a whole batch.

    Made by :func:`lightning_plugins.parallelize` for ``pp_size > 1``; reach it with :func:`pipeline_of`.

    Attributes:
        loss_scale: Multiplies the differentiated loss of :meth:`step` when called through the model's
            ``forward`` (the Lightning door sets ``1 / accumulate_grad_batches``).
    """

    def __init__(
        self,
        model: nn.Module,
        stages: dict[int, StageModule],
        options: PipelineOptions,
        mesh: DeviceMesh,
        tie: TiedEmbedding | None = None,
        param_dtype: torch.dtype | None = None,
        reshard_per_microbatch: bool = False,
    ) -> None:
        self.model = model
        self.reshard_per_microbatch = reshard_per_microbatch
        self.param_dtype = param_dtype
        self.stages = stages
        self.options = options
        self.mesh = mesh
        self.pp_mesh = mesh["pp"]
        self.num_stages = mesh["pp"].size() * (options.stages_per_rank or 1)
        self.tie = tie
        self.loss_scale = 1.0
        self._data_mesh = mesh["dp_cp"] if mesh["dp_cp"].size() > 1 else None
        self._sequence_shards = mesh["tp"].size() if any(s.sequence_mesh is not None for s in stages.values()) else 1
        self._schedule: Any = None
        self._schedule_key: tuple | None = None
        self._schedules: dict[bool, tuple[tuple, Any]] = {}  # the last training and evaluation schedules, by mode

    def step(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        labels: Tensor | None = None,
        *,
        shift_labels: Tensor | None = None,
        loss_scale: float | None = None,
    ) -> Tensor:
        """Forward and backward of this rank's part of the whole batch; gradients accumulate.

        Args:
            input_ids: ``[batch, seq]`` this data rank's batch (every pipeline rank passes the same).
            attention_mask: Optional ``[batch, seq]`` padding mask.
            position_ids: Optional ``[batch, seq]`` or ``[1, seq]`` positions.
            labels: ``[batch, seq]`` labels (``-100`` is ignored), as for the transformers model.
            shift_labels: ``[batch, seq]`` next-token targets, used instead of shifting ``labels`` (a
                context-parallel shard holds them: its sequence is not contiguous).
            loss_scale: Multiplies the differentiated loss (e.g. ``1 / accumulation_steps``);
                defaults to :attr:`loss_scale`.

        Returns:
            The batch's mean token loss over all data ranks (unscaled, detached), on every rank.
        """
        return self._run(True, input_ids, attention_mask, position_ids, labels, shift_labels, loss_scale)

    @torch.no_grad()
    def evaluate(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        labels: Tensor | None = None,
        *,
        shift_labels: Tensor | None = None,
    ) -> Tensor:
        """The batch's mean token loss over all data ranks, forward only, on every rank."""
        return self._run(False, input_ids, attention_mask, position_ids, labels, shift_labels, 1.0)

    def clip_grad_norm_(self, parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip by the global gradient norm over all stages, counting a tied embedding once."""
        parameters = [p for p in parameters if p.grad is not None]
        duplicate = None
        if self.tie is not None and not self.tie.counted:
            duplicate = self.model.get_parameter(self.tie.param_name)
        total = total_grad_norm([p for p in parameters if p is not duplicate], norm_type, self.pp_mesh)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for param in parameters:
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            grad.mul_(coef.to(grad.device))
        return total

    def _run(
        self,
        train: bool,
        input_ids: Tensor,
        attention_mask: Tensor | None,
        position_ids: Tensor | None,
        labels: Tensor | None,
        shift_labels: Tensor | None,
        loss_scale: float | None,
    ) -> Tensor:
        if labels is None and shift_labels is None:
            raise ValueError(
                "Under pipeline parallelism the model returns the loss only (the logits stay on the last stage, one"
                " micro-batch at a time): pass `labels`."
            )
        batch, seq = input_ids.shape
        m = self.options.microbatches or 1
        if batch % m and not train:
            # Evaluation takes every row (a short last batch too): whole micro-batches of copies of the last row
            # whose targets are all ignored, so the loss, a mean over the real targets, is unchanged.
            extra = -batch % m
            targets = next_token_targets(labels) if shift_labels is None else shift_labels
            input_ids, attention_mask, position_ids = (
                None if x is None else _with_copies_of_last_row(x.expand(batch, -1), extra)
                for x in (input_ids, attention_mask, position_ids)
            )
            labels, shift_labels = None, F.pad(targets, (0, 0, 0, extra), value=IGNORE_INDEX)
            batch += extra
        self._check_split(batch, seq)
        # Shift on whole rows before the schedule splits them into micro-batches (rows, never positions).
        targets = next_token_targets(labels) if shift_labels is None else shift_labels
        count = (targets != IGNORE_INDEX).sum()
        if self._data_mesh is not None:
            dist.all_reduce(count, group=self._data_mesh.get_group())
        ranks = 1 if self._data_mesh is None else self._data_mesh.size()
        scale = self.loss_scale if loss_scale is None else loss_scale
        factor = ranks * scale / count.clamp(min=1).to(torch.float32)
        for stage in self.stages.values():
            stage.loss_factor = factor
            stage.loss_sums.clear()

        self._execute(train, input_ids, attention_mask, position_ids, targets)
        loss_sum = torch.zeros((), dtype=torch.float32, device=input_ids.device)
        for stage in self.stages.values():
            if stage.is_last:
                loss_sum = torch.stack(stage.loss_sums).sum().float()
            stage.loss_sums.clear()
        dist.all_reduce(loss_sum, group=self.pp_mesh.get_group())  # from the last stage to every stage
        if self._data_mesh is not None:
            dist.all_reduce(loss_sum, group=self._data_mesh.get_group())
        return loss_sum / count.clamp(min=1)

    def run_sequences(
        self,
        head: Callable[[Tensor, Tensor, Any, Tensor], Tensor],
        input_ids: Tensor,
        attention_mask: Tensor | None,
        position_ids: Tensor | None,
        targets: Tensor,
        *,
        train: bool,
    ) -> None:
        """Run the whole batch with ``head`` in place of the last stage's token loss: for each micro-batch,
        ``head(logits, targets, chunked, rows)`` gets the logits (an empty tensor when the chunked head computed each
        token's loss: :meth:`~lightning_plugins.parallel.memory.chunked_loss.ChunkedHead.take_tokens`), the
        next-token targets, the chunked head (or ``None``) and the micro-batch's row indices in this batch, and
        returns the micro-batch's differentiable loss (a preference loss per pair needs the logits of whole rows,
        which only the last stage has). ``train``: forward and backward (the returned losses times
        :attr:`loss_scale` are differentiated; gradients accumulate), else forward only under ``no_grad``.

        Rows are never split: whatever must stay together (a preference pair) must be in one micro-batch, which
        holds ``batch / pp_microbatches`` consecutive rows.
        """
        batch, seq = input_ids.shape
        self._check_split(batch, seq)
        rows = torch.arange(batch, device=input_ids.device)
        for stage in self.stages.values():
            stage.loss_factor, stage.sequences = self.loss_scale if train else 1.0, head
        try:
            with contextlib.nullcontext() if train else torch.no_grad():
                self._execute(train, input_ids, attention_mask, position_ids, targets, rows=rows)
        finally:
            for stage in self.stages.values():
                stage.sequences = None
                stage.loss_sums.clear()

    def _check_split(self, batch: int, seq: int) -> None:
        m = self.options.microbatches or 1
        if batch % m:
            good = [d for d in range(1, batch + 1) if batch % d == 0]
            raise LayoutError(
                f"The batch of {batch} rows on this data rank does not split into pp_microbatches={m} equal"
                f" micro-batches. Use a per-rank batch size that is a multiple of {m}, or pp_microbatches in {good}"
                " (respecting the schedule's own constraint)."
            )
        if self._sequence_shards > 1 and seq % self._sequence_shards:
            raise LayoutError(
                f"Sequence length {seq} is not divisible by tp_size={self._sequence_shards}, which sequence"
                f" parallelism needs at the stage boundaries. Pad batches to a multiple of {self._sequence_shards}."
            )

    def _execute(
        self,
        train: bool,
        input_ids: Tensor,
        attention_mask: Tensor | None,
        position_ids: Tensor | None,
        targets: Tensor,
        rows: Tensor | None = None,
    ) -> None:
        """The schedule over the whole batch: ``step`` (forward and backward, a tied weight's copies kept equal) or
        ``eval``; every tensor is split into micro-batches along its rows."""
        batch, seq = input_ids.shape
        kwargs: dict[str, Tensor] = {"targets": targets}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if position_ids is not None:
            kwargs["position_ids"] = position_ids.expand(batch, -1) if position_ids.shape[0] == 1 else position_ids
        # Each micro-batch's rows of the batch: a sequence loss and an image-text model's images go by them.
        kwargs["rows"] = rows if rows is not None else torch.arange(batch, device=input_ids.device)
        # The decoder's tokens are the targets' (an image-text batch under context parallelism comes with its tokens
        # whole, for the first stage's model to place the images, and its targets sharded: see pipeline/image_text.py).
        micro = batch // (self.options.microbatches or 1)
        fresh = self._fresh_schedule(input_ids, micro, seq, targets.shape[-1], train)
        held = self._hold_grads() if fresh else None
        try:
            if train:
                before = self._tied_grad()
                before = None if before is None else before.clone()  # the step accumulates into the same storage
                self._schedule.step(input_ids, target=targets, return_outputs=False, **kwargs)
                self._sum_tied_grads(before)
            else:
                self._schedule.eval(input_ids, target=targets, return_outputs=False, **kwargs)
                self._reshard()
        finally:
            if held is not None:
                _add_grads(held)

    def _hold_grads(self) -> list[tuple[Tensor, Tensor | None]]:
        """Set the stages' gradients aside (now ``None``) around a new schedule's first run: torch sets up its stages
        then and drops every gradient an FSDP2 stage module holds (``_post_metadata_inference_cleanup``), which would
        lose the gradients accumulated so far (a DPO step's reference pass between two accumulated micro-batches, a
        new batch shape)."""
        held = []
        for stage in self.stages.values():
            for param in stage.parameters():  # frozen ones too: peft freezes disabled adapters (DPO's reference pass)
                if param.grad is not None:
                    held.append((param, param.grad))
                    param.grad = None
        return held

    def _reshard(self) -> None:
        """Free what FSDP2 still holds gathered after forward-only micro-batches (each stage is an FSDP2 root, which
        keeps its parameters after forward for a backward that never comes). Left gathered, the next training step
        starts from them and its gradients are not reduce-scattered into the shards (a DPO step's reference pass
        right before its policy pass trained wrong weights under PP x FSDP2 and PP x CP)."""
        for stage in self.stages.values():
            reshard_gathered(stage)

    def _fresh_schedule(self, input_ids: Tensor, micro: int, seq: int, hidden_seq: int, train: bool) -> bool:
        """Make :attr:`_schedule` the one for this shape and mode; whether it was built now.

        Stages of their own for every shape and for training and evaluation: the stages' receive buffers and
        send/receive plans belong to one schedule. The last training and the last evaluation schedule are kept, so
        a preference step (a forward-only reference pass, then the policy's training pass) builds none after its
        first.
        """
        dtype = self._activation_dtype()
        key = (micro, seq, hidden_seq, input_ids.dtype, dtype, train)
        kept = self._schedules.get(train)
        fresh = kept is None or kept[0] != key
        if fresh:
            kept = self._schedules[train] = (key, self._build_schedule(micro, (seq, hidden_seq), input_ids.dtype,
                                                                       dtype, input_ids.device, train))  # fmt: skip
        self._schedule_key, self._schedule = kept
        return fresh

    def _activation_dtype(self) -> torch.dtype:
        if self.param_dtype is not None:
            return self.param_dtype
        for param in self.model.parameters():
            if param.is_floating_point():
                return param.dtype
        return torch.get_default_dtype()

    def _build_schedule(
        self,
        micro: int,
        seqs: tuple[int, int],
        ids_dtype: torch.dtype,
        dtype: torch.dtype,
        device: torch.device,
        train: bool,
    ) -> Any:
        """``seqs``: the first stage's tokens and the decoder's (a stage boundary's, before sequence parallelism)."""
        hidden_size = language_config(self.model.config).hidden_size
        seq, hidden_seq = seqs

        def boundary(width: int) -> Tensor:
            shape = (micro, hidden_seq // self._sequence_shards, width)
            return torch.empty(shape, dtype=dtype, device=device, requires_grad=True)

        stages = []
        stage_cls = ReshardingStage if self.reshard_per_microbatch else PipelineStage
        for index, module in sorted(self.stages.items()):
            module.boundary_dtype = dtype
            # An image-text model's deepstack features travel beside the hidden states (pipeline/image_text.py).
            width_in, width_out = module.boundary_widths(hidden_size)
            inputs = torch.empty(micro, seq, dtype=ids_dtype, device=device) if index == 0 else boundary(width_in)
            last = index == self.num_stages - 1
            scalar = torch.empty((), dtype=torch.float32, device=device, requires_grad=True)
            outputs = scalar if last else boundary(width_out)
            stages.append(
                stage_cls(
                    module,
                    index,
                    self.num_stages,
                    device,
                    input_args=(inputs,),
                    output_args=(outputs,),
                    group=self.pp_mesh.get_group(),
                )
            )
        spec = self.options.spec
        m = self.options.microbatches
        if not spec.multi:
            return spec.cls(stages[0], n_microbatches=m, loss_fn=identity_loss, scale_grads=False)
        if not train:
            return _ForwardOnlyMulti(stages, m, self._stage_to_rank())
        return spec.cls(stages, n_microbatches=m, loss_fn=identity_loss, scale_grads=False)

    def _stage_to_rank(self) -> dict[int, int]:
        pp_size = self.pp_mesh.size()
        return {stage: rank for rank in range(pp_size) for stage in stages_of_rank(rank, pp_size, self.options)}

    def _tied_grad(self) -> Tensor | None:
        """This rank's shard of the tied weight's gradient, laid out like the weight."""
        if self.tie is None:
            return None
        param = self.model.get_parameter(self.tie.param_name)
        grad = param.grad
        if grad is None:
            return None
        if isinstance(grad, DTensor) and grad.placements != param.placements:
            # e.g. a vocab-parallel embedding's gradient comes back replicated; the head's is sharded.
            grad = param.grad = grad.redistribute(placements=param.placements)
        return grad.to_local() if isinstance(grad, DTensor) else grad

    def _sum_tied_grads(self, before: Tensor | None) -> None:
        """Add the other copy's gradient increment of this step: both copies end with the same gradient."""
        if self.tie is None or not self.model.get_parameter(self.tie.param_name).requires_grad:
            return  # a frozen tied weight (LoRA's base): no gradient, and both copies stay equal
        local = self._tied_grad()
        if local is None:
            raise RuntimeError(f"The tied weight {self.tie.param_name} got no gradient in this pipeline step.")
        increment = local - before if before is not None else local.clone()
        dist.all_reduce(increment, group=self.tie.group)
        local.copy_(increment if before is None else before + increment)


class _ForwardOnlyMulti(_PipelineScheduleRuntime):
    """Evaluation for several stages per rank, in any placement: each stage runs every micro-batch in turn.

    torch's zero-bubble and V-shaped runtimes still walk their backward actions in ``eval()``, which
    fails for stages adjacent on one rank; a forward-only plan (GPipe's fill) needs none of that.
    """

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, stage_to_rank: dict[int, int]) -> None:
        super().__init__(stages=stages, n_microbatches=n_microbatches, loss_fn=identity_loss, scale_grads=False)
        self.stage_index_to_group_rank = dict(stage_to_rank)
        for stage in self._stages:
            stage.stage_index_to_group_rank = self.stage_index_to_group_rank
        order: dict[int, list[_Action]] = {rank: [] for rank in sorted(set(stage_to_rank.values()))}
        for stage in sorted(stage_to_rank):
            forwards = [_Action(stage, _ComputationType.FORWARD, mb) for mb in range(n_microbatches)]
            order[stage_to_rank[stage]] += forwards
        # Lower to a plan with communication (and FSDP unshard/reshard), as `_prepare_schedule_with_comms`
        # does, minus its validation (which expects a backward for every forward).
        plan = _add_send_recv(
            {rank: _add_unshard_reshard(actions) for rank, actions in order.items()},
            stage_to_rank=lambda s: stage_to_rank[s],
            num_stages=self._num_stages,
        )
        # torch >= 2.15 retires every send through an explicit wait action (a send without one fails the step);
        # earlier releases waited for sends themselves and have no such pass.
        add_wait_send = getattr(schedules, "_add_wait_send", None)
        self.pipeline_order_with_comms = plan if add_wait_send is None else add_wait_send(plan)


def _add_grads(held: list[tuple[Tensor, Tensor | None]]) -> None:
    """Put held gradients back, adding what was computed meanwhile."""
    for param, grad in held:
        if grad is not None:
            param.grad = grad if param.grad is None else param.grad + grad


def _with_copies_of_last_row(x: Tensor, copies: int) -> Tensor:
    return torch.cat([x, x[-1:].expand(copies, *x.shape[1:])])


class GradHandOff:
    """The gradients one pipeline training call computed, kept apart until the door's ``backward`` adds them.

    Under pipeline parallelism the model call runs forward *and* backward of every micro-batch, but the doors'
    frameworks (Lightning, Accelerate) zero or scale gradients around their own ``backward``. Around the call,
    :meth:`hold` sets the gradients accumulated so far aside and :meth:`take` keeps the call's own and puts the
    earlier ones back; the door's ``backward`` then :meth:`add` s the call's gradients, as its own backward would.
    """

    def __init__(self) -> None:
        self._params: list[Tensor] | None = None
        self._held: list[Tensor | None] = []
        self._taken: list[tuple[Tensor, Tensor | None]] | None = None

    def hold(self, module: nn.Module) -> None:
        """Before a training call: set the gradients of ``module``'s trainable parameters aside (now ``None``)."""
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._held = [p.grad for p in self._params]
        for param in self._params:
            param.grad = None

    def take(self) -> None:
        """After the call (also a failed one): keep the call's gradients for :meth:`add`; restore the held ones.
        Nothing happens when nothing was held."""
        if self._params is None:
            return
        self._taken = [(p, p.grad) for p in self._params]
        for param, grad in zip(self._params, self._held):
            param.grad = grad
        self._params, self._held = None, []

    def add(self) -> bool:
        """Add the gradients :meth:`take` kept to the parameters' (accumulating); whether a call had kept any."""
        taken, self._taken = self._taken, None
        if taken is None:
            return False
        for param, grad in taken:
            if grad is not None:
                if param.grad is None:
                    param.grad = grad
                else:
                    param.grad += grad
        return True
