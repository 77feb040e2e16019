"""Pipeline parallelism: decoder layers split into stages, micro-batches streamed by a torch schedule.

How a causal LM becomes a pipeline:

* **Split.** The layers are cut into ``pp_size x stages_per_rank`` contiguous stages. Each rank keeps
  only its stages' layers (under their original names, so ``model.layers.5`` stays ``model.layers.5``
  and checkpoints map across layouts), the embedding if it holds the first stage, the final norm and
  ``lm_head`` if it holds the last.
* **Stages.** A :class:`StageModule` runs one stage. It recomputes the causal mask and the rotary
  embeddings from the sequence length, attention mask and position ids. Those, and the labels, are
  chunked by the schedule and handed to every stage locally: all ranks of one pipeline read the same
  batch, so only hidden states (and their gradients) travel between ranks.
* **Loss.** The last stage turns each micro-batch's token-loss *sum* into its share of the global
  token mean: ``sum x data_ranks x loss_scale / valid tokens of the whole batch over all data ranks``.
  Schedules run with ``scale_grads=False``, so the accumulated gradient is exactly the one process
  averaging over the whole batch would get (FSDP2 then averages over the data ranks).
* **Shapes** are given to ``PipelineStage`` up front (static mode): no metadata-inference pass runs.
  A new (micro-batch, sequence) shape rebuilds the stages; padding to a fixed length avoids that.
* **Tied embeddings.** When the first and last stage live on different ranks, each keeps a copy of the
  tied weight. After every step the gradient increments of the two copies are summed over the pair of
  ranks, so both copies take identical updates; :meth:`Pipeline.clip_grad_norm_` counts the weight once.

Composition: tensor parallelism is applied to the rank's part of the model, FSDP2 to each stage module
(the stage is the FSDP root, which is what ``PipelineStage`` expects), activation checkpointing to the
kept layers. Context parallelism does not compose with the pipeline yet.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import (
    _Action,
    _add_send_recv,
    _add_unshard_reshard,
    _ComputationType,
    _PipelineScheduleRuntime,
)
from torch.distributed.tensor import DTensor, Shard

from lightning_plugins.layout import LayoutError, ParallelLayout
from lightning_plugins.models import FAMILIES, ModelFamily, decoder_layers
from lightning_plugins.parallel.grad import total_grad_norm
from lightning_plugins.parallel.loss import IGNORE_INDEX, next_token_targets, token_losses

__all__ = [
    "apply_pipeline_parallel",
    "check_pipeline_layout",
    "SCHEDULES",
    "Pipeline",
    "PipelineOptions",
    "StageModule",
    "layer_ranges",
    "pipeline_of",
    "split_into_stages",
    "stages_of_rank",
]

_PIPELINE_ATTR = "_lightning_plugins_pipeline"


@dataclass(frozen=True)
class _Schedule:
    cls: type
    multi: bool  # several stages per rank
    v_shape: bool  # stage s on rank s for s < pp, then back: rank 0 holds the first and the last stage
    split_backward: bool = False  # input and weight gradients in separate passes (zero bubble)


#: Schedule names accepted by ``pp_schedule``.
SCHEDULES: dict[str, _Schedule] = {
    "gpipe": _Schedule(ScheduleGPipe, multi=False, v_shape=False),
    "1f1b": _Schedule(Schedule1F1B, multi=False, v_shape=False),
    "interleaved_1f1b": _Schedule(ScheduleInterleaved1F1B, multi=True, v_shape=False),
    "looped_bfs": _Schedule(ScheduleLoopedBFS, multi=True, v_shape=False),
    "interleaved_zero_bubble": _Schedule(ScheduleInterleavedZeroBubble, multi=True, v_shape=False, split_backward=True),
    "zbv_zero_bubble": _Schedule(ScheduleZBVZeroBubble, multi=True, v_shape=True, split_backward=True),
    "dualpipev": _Schedule(ScheduleDualPipeV, multi=True, v_shape=True, split_backward=True),
}


@dataclass(frozen=True)
class PipelineOptions:
    """How the pipeline runs.

    Args:
        schedule: One of :data:`SCHEDULES` (``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ...).
        microbatches: Micro-batches per step; ``None`` takes the number of stages.
        stages_per_rank: Stages each rank holds; ``None`` takes 1 for single-stage schedules and 2
            for interleaved and V-shaped ones.
    """

    schedule: str = "1f1b"
    microbatches: int | None = None
    stages_per_rank: int | None = None

    def resolve(self, pp_size: int, num_layers: int | None = None) -> PipelineOptions:
        """Fill in the defaults and check every constraint; raises :class:`LayoutError` naming the fix."""
        name = self.schedule.lower() if isinstance(self.schedule, str) else self.schedule
        if name not in SCHEDULES:
            raise LayoutError(
                f"pp_schedule={self.schedule!r} is not a known pipeline schedule. Use one of {sorted(SCHEDULES)}"
                " (e.g. pp_schedule='1f1b')."
            )
        spec = SCHEDULES[name]
        v = self.stages_per_rank if self.stages_per_rank is not None else (2 if spec.multi else 1)
        if not isinstance(v, int) or v < 1:
            raise LayoutError(f"pp_stages_per_rank must be a positive integer, got {v!r}.")
        if not spec.multi and v != 1:
            raise LayoutError(
                f"pp_schedule={name!r} runs one stage per rank, but pp_stages_per_rank={v}. Use pp_stages_per_rank=1,"
                " or an interleaved schedule (e.g. pp_schedule='interleaved_1f1b') for several stages per rank."
            )
        if spec.v_shape and v != 2:
            raise LayoutError(
                f"pp_schedule={name!r} is V-shaped and needs exactly 2 stages per rank, got pp_stages_per_rank={v}."
                " Use pp_stages_per_rank=2."
            )
        if spec.multi and not spec.v_shape and v < 2:
            raise LayoutError(
                f"pp_schedule={name!r} interleaves several stages per rank, but pp_stages_per_rank={v}. Use"
                " pp_stages_per_rank >= 2, or pp_schedule='1f1b' for one stage per rank."
            )
        stages = pp_size * v
        if num_layers is not None and stages > num_layers:
            fewer = num_layers // pp_size
            fix = (
                f"pp_stages_per_rank={fewer}"
                if spec.multi and not spec.v_shape and fewer >= 2
                else "pp_schedule='1f1b' (one stage per rank)"
                if pp_size <= num_layers
                else f"pp_size <= {num_layers}"
            )
            raise LayoutError(
                f"pp_size={pp_size} x pp_stages_per_rank={v} = {stages} pipeline stages, but the model has only"
                f" num_hidden_layers={num_layers}: every stage needs at least one decoder layer. Use {fix}."
            )
        m = self.microbatches if self.microbatches is not None else stages
        if not isinstance(m, int) or m < 1:
            raise LayoutError(f"pp_microbatches must be a positive integer, got {m!r}.")
        if name in ("1f1b", "dualpipev") and m < stages:
            raise LayoutError(
                f"pp_schedule={name!r} needs at least as many micro-batches as pipeline stages: pp_microbatches={m} <"
                f" {stages} stages. Use pp_microbatches >= {stages} (more micro-batches also shrink the bubble)."
            )
        if spec.multi and name != "dualpipev" and (m < pp_size or m % pp_size):
            raise LayoutError(
                f"pp_schedule={name!r} runs micro-batches in rounds of pp_size={pp_size}: pp_microbatches={m} must be a"
                f" positive multiple of {pp_size}. Use e.g. pp_microbatches={max(1, m // pp_size) * pp_size}."
            )
        return replace(self, schedule=name, microbatches=m, stages_per_rank=v)

    @property
    def spec(self) -> _Schedule:
        return SCHEDULES[self.schedule]


def stages_of_rank(pp_rank: int, pp_size: int, options: PipelineOptions) -> list[int]:
    """The stage indices pipeline rank ``pp_rank`` runs (looped: r, r+p, ...; V-shaped: r and 2p-1-r)."""
    if options.spec.v_shape:
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + k * pp_size for k in range(options.stages_per_rank or 1)]


def layer_ranges(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous layer ranges per stage; the first ``num_layers % num_stages`` stages get one more.

    The last stage, which also runs the final norm, ``lm_head`` and the loss, is never the larger one.
    """
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for stage in range(num_stages):
        size = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def _attention_kind(config: Any, layer_index: int) -> str:
    """Which mask a layer uses, as the model's own forward decides it."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return layer_types[layer_index]
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"


class StageModule(nn.Module):
    """One pipeline stage of a transformers decoder: embedding (first), layers, norm + head + loss (last).

    The submodules are the causal LM's own (shared, not copied), so the LM keeps owning the parameters
    under their original names. The rotary embedding is referenced outside this module's tree: it holds
    buffers only and may be shared by two stages on one rank.

    Forward: ``input_ids`` (first stage) or the previous stage's hidden states, plus ``attention_mask``,
    ``position_ids`` and ``labels`` of the same micro-batch; returns hidden states, or on the last stage
    the micro-batch's share of the global mean token loss.
    """

    def __init__(
        self,
        config: Any,
        layers: dict[int, nn.Module],
        rotary: nn.Module,
        *,
        embed: nn.Module | None = None,
        norm: nn.Module | None = None,
        lm_head: nn.Module | None = None,
        sequence_mesh: DeviceMesh | None = None,
    ) -> None:
        super().__init__()
        self.embed = embed
        self.layers = nn.ModuleDict({str(index): layer for index, layer in layers.items()})
        self.norm = norm
        self.lm_head = lm_head
        self.__dict__["config"] = config
        self.__dict__["rotary"] = rotary
        # Under sequence parallelism the stage boundary carries this rank's sequence shard.
        self.__dict__["sequence_mesh"] = sequence_mesh
        self._kinds = {index: _attention_kind(config, index) for index in layers}
        #: Set by the pipeline before each step: data ranks x loss scale / global valid-token count.
        self.loss_factor: Tensor | float = 1.0
        #: Token-loss sums (detached) of the micro-batches this stage ran in the current step.
        self.loss_sums: list[Tensor] = []
        #: The dtype the next stage's receive buffer has (set with the schedule's static shapes).
        self.boundary_dtype: torch.dtype | None = None

    @property
    def is_last(self) -> bool:
        return self.lm_head is not None

    def forward(
        self,
        inputs: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        labels: Tensor | None = None,
    ) -> Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        if self.embed is not None:
            hidden = self.embed(inputs)
        elif self.sequence_mesh is not None:
            hidden = DTensor.from_local(inputs, self.sequence_mesh, [Shard(1)], run_check=False)
        else:
            hidden = inputs
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=inputs.device).unsqueeze(0)
        mask_fns = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        masks = {
            kind: mask_fns[kind](
                config=self.config,
                inputs_embeds=hidden,
                attention_mask=attention_mask,
                past_key_values=None,
                position_ids=position_ids,
            )
            for kind in set(self._kinds.values())
        }
        position_embeddings = self.rotary(hidden, position_ids)
        for key, layer in self.layers.items():
            hidden = layer(
                hidden,
                attention_mask=masks[self._kinds[int(key)]],
                position_embeddings=position_embeddings,
                position_ids=position_ids,
            )
        if self.lm_head is None:
            # A fresh tensor, not a view of the DTensor: zero-bubble schedules detach stage outputs in place.
            out = hidden.to_local().clone() if isinstance(hidden, DTensor) else hidden
            return out if self.boundary_dtype in (None, out.dtype) else out.to(self.boundary_dtype)
        logits = self.lm_head(self.norm(hidden))
        if labels is None:
            raise ValueError("The last pipeline stage needs `labels` to compute the loss.")
        loss_sum = token_losses(logits, next_token_targets(labels)).sum()
        self.loss_sums.append(loss_sum.detach())
        return loss_sum * self.loss_factor


def _identity_loss(output: Tensor, target: Tensor) -> Tensor:
    # The last stage already returns the scaled loss (it needs the labels and the global token count).
    return output


@dataclass
class _Tie:
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
        tie: _Tie | None = None,
        param_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
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

    def step(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        labels: Tensor | None = None,
        *,
        loss_scale: float | None = None,
    ) -> Tensor:
        """Forward and backward of this rank's part of the whole batch; gradients accumulate.

        Args:
            input_ids: ``[batch, seq]`` this data rank's batch (every pipeline rank passes the same).
            attention_mask: Optional ``[batch, seq]`` padding mask.
            position_ids: Optional ``[batch, seq]`` or ``[1, seq]`` positions.
            labels: ``[batch, seq]`` labels (``-100`` is ignored), as for the transformers model.
            loss_scale: Multiplies the differentiated loss (e.g. ``1 / accumulation_steps``);
                defaults to :attr:`loss_scale`.

        Returns:
            The batch's mean token loss over all data ranks (unscaled, detached), on every rank.
        """
        return self._run(True, input_ids, attention_mask, position_ids, labels, loss_scale)

    @torch.no_grad()
    def evaluate(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        labels: Tensor | None = None,
    ) -> Tensor:
        """The batch's mean token loss over all data ranks, forward only, on every rank."""
        return self._run(False, input_ids, attention_mask, position_ids, labels, 1.0)

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
        loss_scale: float | None,
    ) -> Tensor:
        if labels is None:
            raise ValueError(
                "Under pipeline parallelism the model returns the loss only (the logits stay on the last stage, one"
                " micro-batch at a time): pass `labels`."
            )
        batch, seq = input_ids.shape
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
        count = (next_token_targets(labels) != IGNORE_INDEX).sum()
        if self._data_mesh is not None:
            dist.all_reduce(count, group=self._data_mesh.get_group())
        ranks = 1 if self._data_mesh is None else self._data_mesh.size()
        scale = self.loss_scale if loss_scale is None else loss_scale
        factor = ranks * scale / count.clamp(min=1).to(torch.float32)
        for stage in self.stages.values():
            stage.loss_factor = factor
            stage.loss_sums.clear()

        kwargs: dict[str, Tensor] = {"labels": labels}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if position_ids is not None:
            kwargs["position_ids"] = position_ids.expand(batch, -1) if position_ids.shape[0] == 1 else position_ids
        schedule = self._schedule_for(input_ids, batch // m, seq, train)
        if train:
            before = self._tied_grad()
            before = None if before is None else before.clone()  # the step accumulates into the same storage
            schedule.step(input_ids, target=labels, return_outputs=False, **kwargs)
            self._sum_tied_grads(before)
        else:
            schedule.eval(input_ids, target=labels, return_outputs=False, **kwargs)

        loss_sum = torch.zeros((), dtype=torch.float32, device=input_ids.device)
        for stage in self.stages.values():
            if stage.is_last:
                loss_sum = torch.stack(stage.loss_sums).sum().float()
            stage.loss_sums.clear()
        dist.all_reduce(loss_sum, group=self.pp_mesh.get_group())  # from the last stage to every stage
        if self._data_mesh is not None:
            dist.all_reduce(loss_sum, group=self._data_mesh.get_group())
        return loss_sum / count.clamp(min=1)

    def _schedule_for(self, input_ids: Tensor, micro: int, seq: int, train: bool) -> Any:
        # Fresh stages for every new shape and every switch between training and evaluation: the
        # stages' receive buffers and send/receive plans belong to one schedule.
        dtype = self._activation_dtype()
        key = (micro, seq, input_ids.dtype, dtype, train)
        if key != self._schedule_key:
            self._schedule = self._build_schedule(micro, seq, input_ids.dtype, dtype, input_ids.device, train)
            self._schedule_key = key
        return self._schedule

    def _activation_dtype(self) -> torch.dtype:
        if self.param_dtype is not None:
            return self.param_dtype
        for param in self.model.parameters():
            if param.is_floating_point():
                return param.dtype
        return torch.get_default_dtype()

    def _build_schedule(
        self, micro: int, seq: int, ids_dtype: torch.dtype, dtype: torch.dtype, device: torch.device, train: bool
    ) -> Any:
        hidden = (micro, seq // self._sequence_shards, self.model.config.hidden_size)

        def boundary() -> Tensor:
            return torch.empty(hidden, dtype=dtype, device=device, requires_grad=True)

        stages = []
        for index, module in sorted(self.stages.items()):
            module.boundary_dtype = dtype
            inputs = torch.empty(micro, seq, dtype=ids_dtype, device=device) if index == 0 else boundary()
            last = index == self.num_stages - 1
            outputs = torch.empty((), dtype=torch.float32, device=device, requires_grad=True) if last else boundary()
            stages.append(
                PipelineStage(
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
            return spec.cls(stages[0], n_microbatches=m, loss_fn=_identity_loss, scale_grads=False)
        if not train:
            return _ForwardOnlyMulti(stages, m, self._stage_to_rank())
        return spec.cls(stages, n_microbatches=m, loss_fn=_identity_loss, scale_grads=False)

    def _stage_to_rank(self) -> dict[int, int]:
        pp_size = self.pp_mesh.size()
        return {
            stage: rank
            for rank in range(pp_size)
            for stage in stages_of_rank(rank, pp_size, self.options)
        }

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
        if self.tie is None:
            return
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
        super().__init__(stages=stages, n_microbatches=n_microbatches, loss_fn=_identity_loss, scale_grads=False)
        self.stage_index_to_group_rank = dict(stage_to_rank)
        for stage in self._stages:
            stage.stage_index_to_group_rank = self.stage_index_to_group_rank
        order: dict[int, list[_Action]] = {rank: [] for rank in sorted(set(stage_to_rank.values()))}
        for stage in sorted(stage_to_rank):
            forwards = [_Action(stage, _ComputationType.FORWARD, mb) for mb in range(n_microbatches)]
            order[stage_to_rank[stage]] += forwards
        # Lower to a plan with communication (and FSDP unshard/reshard), as `_prepare_schedule_with_comms`
        # does, minus its validation (which expects a backward for every forward).
        self.pipeline_order_with_comms = _add_send_recv(
            {rank: _add_unshard_reshard(actions) for rank, actions in order.items()},
            stage_to_rank=lambda s: stage_to_rank[s],
            num_stages=self._num_stages,
        )


def pipeline_of(model: nn.Module) -> Pipeline | None:
    """The :class:`Pipeline` ``parallelize`` attached to ``model`` (``None`` without pipeline parallelism)."""
    return getattr(model, _PIPELINE_ATTR, None)


def _parent_and_name(root: nn.Module, target: nn.Module) -> tuple[nn.Module, str]:
    for name, module in root.named_modules():
        for child_name, child in module.named_children():
            if child is target:
                return module, child_name
    raise LookupError(f"{type(target).__name__} is not a submodule of {type(root).__name__}")


def split_into_stages(
    model: nn.Module,
    family: ModelFamily,
    mesh: DeviceMesh,
    options: PipelineOptions,
    *,
    tensor_parallel: Callable[[nn.Module], None] | None = None,
    sequence_mesh: DeviceMesh | None = None,
) -> dict[int, StageModule]:
    """Prune ``model`` in place to this rank's stages and return their :class:`StageModule` s by index.

    Args:
        model: A transformers causal LM (materialised or on the meta device).
        family: Its module names.
        mesh: The full mesh (``pp`` and ``tp`` are read from it).
        options: Resolved pipeline options.
        tensor_parallel: Called as ``tensor_parallel(model)`` after the layers are pruned and before the
            embedding, final norm and head are dropped (tensor parallelism expects to find all three).
        sequence_mesh: The tensor-parallel mesh when sequence parallelism is on: stage boundaries then
            carry each rank's sequence shard.

    Returns:
        This rank's stages, keyed by stage index.
    """
    pp_size, pp_rank = mesh["pp"].size(), mesh["pp"].get_local_rank()
    local = stages_of_rank(pp_rank, pp_size, options)
    num_stages = pp_size * (options.stages_per_rank or 1)
    layers = decoder_layers(model, family)
    ranges = layer_ranges(len(layers), num_stages)
    kept = {index for stage in local for index in ranges[stage]}
    # Drop other stages' layers but keep the original keys (names): iteration, FSDP, activation
    # checkpointing and state dicts all go through `_modules`.
    all_layers = dict(layers._modules)
    for key in list(layers._modules):
        if int(key) not in kept:
            del layers._modules[key]
    if tensor_parallel is not None:
        tensor_parallel(model)

    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    norm = model.get_submodule(family.final_norm)
    rotary = model.get_submodule(family.layers.rpartition(".")[0]).rotary_emb
    first, last = 0 in local, num_stages - 1 in local
    tied = lm_head is not None and lm_head.weight is embed.weight
    # A tied head keeps the embedding module as its weight's first name: checkpoints (HF's and ours) know
    # the weight as the embedding's, and the embedding's forward is never run on this rank.
    if not first and not (tied and last):
        parent, name = _parent_and_name(model, embed)
        setattr(parent, name, None)
    if not last:
        parent, name = _parent_and_name(model, norm)
        setattr(parent, name, None)
        parent, name = _parent_and_name(model, lm_head)
        setattr(parent, name, None)

    stages = {}
    for stage in local:
        stages[stage] = StageModule(
            model.config,
            {index: all_layers[str(index)] for index in ranges[stage]},
            rotary,
            embed=embed if stage == 0 else None,
            norm=norm if stage == num_stages - 1 else None,
            lm_head=lm_head if stage == num_stages - 1 else None,
            sequence_mesh=sequence_mesh,
        )
    return stages


def tied_pair_group(mesh: DeviceMesh, options: PipelineOptions) -> dist.ProcessGroup | None:
    """The group of the two ranks holding the first and the last stage (same data/tensor coordinates).

    Every rank creates every pair's group (``new_group`` is collective); ``None`` when one rank holds
    both stages (V-shaped schedules), where the weight stays tied.
    """
    if options.spec.v_shape:
        return None
    grid = mesh.mesh.reshape(mesh.mesh.shape[0], -1)  # [pp, everything else]
    mine = None
    for column in range(grid.shape[1]):
        ranks = [int(grid[0, column]), int(grid[-1, column])]
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def check_pipeline_layout(layout: ParallelLayout, config: Any, options: PipelineOptions) -> PipelineOptions:
    """Validate ``options`` against a resolved layout and a model config before any collective."""
    if layout.cp_size > 1:
        raise LayoutError(
            f"pp_size={layout.pp_size} with cp_size={layout.cp_size}: pipeline and context parallelism do not compose"
            " in this version. Use cp_size=1 with pipeline parallelism, or pp_size=1 with context parallelism."
        )
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise LayoutError(
            f"pp_size={layout.pp_size}: pipeline parallelism re-runs the decoder stack stage by stage and is verified"
            f" for the registered families {sorted(FAMILIES)}, not model_type {model_type!r} (its forward may scale or"
            " transform embeddings in ways a stage would miss). Use pp_size=1 for this model."
        )
    resolved = options.resolve(layout.pp_size, getattr(config, "num_hidden_layers", None))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied and resolved.spec.v_shape and layout.fsdp_size > 1:
        raise LayoutError(
            f"pp_schedule={resolved.schedule!r} puts the first and the last stage on one rank, where a tied embedding"
            " would be one parameter in two FSDP2 stage modules. Use pp_schedule='interleaved_1f1b' (or another"
            " looped schedule) for this tied-embedding model with data parallelism."
        )
    return resolved


def apply_pipeline_parallel(
    model: nn.Module,
    family: ModelFamily,
    mesh: DeviceMesh,
    options: PipelineOptions,
    *,
    tensor_parallel: Callable[[nn.Module], None] | None = None,
    sequence_mesh: DeviceMesh | None = None,
    activation_checkpointing: Callable[[nn.ModuleList], None] | None = None,
    fully_shard_stage: Callable[..., None] | None = None,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
) -> Pipeline:
    """Split ``model`` into this rank's stages, compose the other dimensions per stage, attach the pipeline.

    Order: split (with tensor parallelism applied in between, see :func:`split_into_stages`) ->
    activation checkpointing of the kept layers -> FSDP2 per stage module (each stage is its own root),
    called as ``fully_shard_stage(stage, layers, reshard_after_forward=...)``.
    Afterwards ``model(**batch)`` runs the whole batch through the pipeline (see :class:`Pipeline`).

    Zero-bubble schedules (``interleaved_zero_bubble``, ``zbv_zero_bubble``, ``dualpipev``) compute weight
    gradients in a pass after the input gradients, from the parameters the forward used: FSDP2 must keep
    them gathered until then, so ``reshard_after_forward`` is off for them (with it on, the weight pass
    would see resharded parameters and the gradients would be wrong).
    """
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = lm_head is not None and lm_head.weight is embed.weight
    stages = split_into_stages(
        model, family, mesh, options, tensor_parallel=tensor_parallel, sequence_mesh=sequence_mesh
    )
    if activation_checkpointing is not None:
        activation_checkpointing(decoder_layers(model, family))
    if fully_shard_stage is not None:
        for stage in stages.values():
            fully_shard_stage(
                stage,
                list(stage.layers.values()),
                reshard_after_forward=reshard_after_forward and not options.spec.split_backward,
            )
        if tied and model.get_input_embeddings() is not None and model.get_output_embeddings() is not None:
            # FSDP2 gave the head a new (sharded) parameter; the kept embedding module names the same one.
            model.get_input_embeddings().weight = model.get_output_embeddings().weight

    tie = None
    group = tied_pair_group(mesh, options) if tied else None
    if group is not None:
        num_stages = mesh["pp"].size() * (options.stages_per_rank or 1)
        if 0 in stages and num_stages - 1 not in stages:
            tie = _Tie(_param_name(model, model.get_input_embeddings().weight), group, counted=True)
        elif num_stages - 1 in stages and 0 not in stages:
            tie = _Tie(_param_name(model, model.get_output_embeddings().weight), group, counted=False)
    pipeline = Pipeline(model, stages, options, mesh, tie=tie, param_dtype=param_dtype)
    setattr(model, _PIPELINE_ATTR, pipeline)
    model.__class__ = _pipelined_class(type(model))
    return pipeline


def _param_name(model: nn.Module, param: Tensor) -> str:
    return next(name for name, p in model.named_parameters() if p is param)


class _PipelinedCausalLM:
    """Put in front of a parallelized model's class: ``forward`` drives the pipeline for the whole batch.

    In training mode with gradients enabled, a call runs forward *and* backward of every micro-batch
    (the schedule interleaves them) and returns the loss detached: do not call ``backward`` on it. In
    eval mode or under ``no_grad`` it runs forward only. Either way the loss is the global mean token
    loss of the batch, identical on every rank; logits are not returned.
    """

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        labels: Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        unsupported = sorted(k for k in ("inputs_embeds", "past_key_values") if kwargs.get(k) is not None)
        if input_ids is None or unsupported or kwargs.get("use_cache"):
            raise ValueError(
                f"{type(self).__name__} runs a pipeline: pass `input_ids` (and `labels`); {unsupported or 'use_cache'}"
                " is not supported under pipeline parallelism."
            )
        pipeline = pipeline_of(self)  # type: ignore[arg-type]
        assert pipeline is not None
        if self.training and torch.is_grad_enabled():  # type: ignore[attr-defined]
            loss = pipeline.step(input_ids, attention_mask, position_ids, labels)
        else:
            loss = pipeline.evaluate(input_ids, attention_mask, position_ids, labels)
        return CausalLMOutputWithPast(loss=loss)


_PIPELINED_CLASSES: dict[type, type] = {}


def _pipelined_class(cls: type) -> type:
    if issubclass(cls, _PipelinedCausalLM):
        return cls
    if cls not in _PIPELINED_CLASSES:
        _PIPELINED_CLASSES[cls] = type(f"Pipelined{cls.__name__}", (_PipelinedCausalLM, cls), {})
    return _PIPELINED_CLASSES[cls]
