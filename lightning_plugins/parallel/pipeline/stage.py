"""One pipeline stage of a transformers decoder (:class:`StageModule`) and the loss it returns.

* **Stages.** A :class:`StageModule` runs one stage. It recomputes the causal mask and the rotary
  embeddings from the sequence length, attention mask and position ids. Those, and the targets, are
  chunked by the schedule and handed to every stage locally: all ranks of one pipeline read the same
  batch, so only hidden states (and their gradients) travel between ranks.
* **Sharded stages.** :class:`ReshardingStage` is torch's ``PipelineStage`` with FSDP2 reducing and resharding
  after every micro-batch's backward (``pp_reshard_per_microbatch``), not once after the last one.
* **Loss.** The last stage turns each micro-batch's token-loss *sum* into its share of the global
  token mean: ``sum x data_ranks x loss_scale / valid tokens of the whole batch over all data ranks``.
  Schedules run with ``scale_grads=False``, so the accumulated gradient is exactly the one process
  averaging over the whole batch would get (FSDP2 then averages over the data ranks). Under a sequence loss
  (:meth:`~lightning_plugins.parallel.pipeline.runtime.Pipeline.run_sequences`: a preference loss, per pair) the
  last stage hands each micro-batch's token losses (or logits) to it instead and returns its loss.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import stage_backward
from torch.distributed.tensor import DTensor, Shard

from lightning_plugins.parallel.loss import token_losses
from lightning_plugins.parallel.pipeline.anatomy import DecoderAnatomy, attention_kinds
from lightning_plugins.parallel.varlen import packed_lengths


class StageModule(nn.Module):
    """One pipeline stage of a transformers decoder: embedding (first), layers, norm + head + loss (last).

    The submodules are the causal LM's own (shared, not copied), so the LM keeps owning the parameters
    under their original names; what the model's forward does between them (embedding multiplier, rotary
    embedding per attention type, logit scaling and soft-capping) comes from its :class:`DecoderAnatomy`.
    The rotary embedding is referenced outside this module's tree: it holds
    buffers only and may be shared by two stages on one rank.

    Forward: ``input_ids`` (first stage) or the previous stage's hidden states, plus ``attention_mask``,
    ``position_ids`` and next-token ``targets`` (labels shifted on the whole row) of the same micro-batch;
    returns hidden states, or on the last stage the micro-batch's share of the global mean token loss.
    """

    def __init__(
        self,
        config: Any,
        layers: dict[int, nn.Module],
        rotary: nn.Module,
        *,
        anatomy: DecoderAnatomy | None = None,
        embed: nn.Module | None = None,
        norm: nn.Module | None = None,
        lm_head: nn.Module | None = None,
        sequence_mesh: DeviceMesh | None = None,
        prelude: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.embed = embed
        #: An image-text model's forward up to its language model (:mod:`.image_text`): on the first stage it places the
        #: images into the embeddings, on every stage it gives the mask (mapping) and positions the language model gets.
        self.prelude = prelude
        self.layers = nn.ModuleDict({str(index): layer for index, layer in layers.items()})
        self.norm = norm
        self.lm_head = lm_head
        self.__dict__["config"] = config
        self.__dict__["rotary"] = rotary
        # Under sequence parallelism the stage boundary carries this rank's sequence shard.
        self.__dict__["sequence_mesh"] = sequence_mesh
        self.__dict__["anatomy"] = anatomy or DecoderAnatomy()
        kinds = attention_kinds(config)
        self._kinds = {index: kinds[index] for index in layers}
        #: Set by the pipeline before each step: data ranks x loss scale / global valid-token count.
        self.loss_factor: Tensor | float = 1.0
        #: Token-loss sums (detached) of the micro-batches this stage ran in the current step.
        self.loss_sums: list[Tensor] = []
        #: The dtype the next stage's receive buffer has (set with the schedule's static shapes).
        self.boundary_dtype: torch.dtype | None = None
        #: The last stage's chunked head (:mod:`lightning_plugins.parallel.memory.chunked_loss`), or ``None``: full logits.
        self.chunked: Any = None
        #: Set by :meth:`~lightning_plugins.parallel.pipeline.runtime.Pipeline.run_sequences` for one batch: the last
        #: stage returns ``sequences(logits, targets, chunked, rows) * loss_factor`` instead of the token loss.
        self.sequences: Any = None

    @property
    def is_last(self) -> bool:
        return self.lm_head is not None

    def boundary_widths(self, hidden_size: int) -> tuple[int, int]:
        """The last dimension of what this stage receives and sends (hidden states, and an image-text model's
        deepstack features beside them: :mod:`.image_text`)."""
        carried = (0, 0) if self.prelude is None else (self.prelude.carried_in, self.prelude.carried_out)
        return hidden_size * (1 + carried[0]), hidden_size * (1 + carried[1])

    def forward(
        self,
        inputs: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        targets: Tensor | None = None,
        rows: Tensor | None = None,
    ) -> Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        mapping = None
        if self.prelude is not None:
            hidden, attention_mask, position_ids = self.prelude(inputs, attention_mask, rows)
            hidden = hidden if self.embed is None else self.anatomy.embed(hidden, self.training)
            if isinstance(attention_mask, dict):  # masks the multimodal forward built (Gemma 3's image blocks)
                mapping, attention_mask = attention_mask, None
        elif self.embed is not None:
            hidden = self.anatomy.embed(self.embed(inputs), self.training)
        elif self.sequence_mesh is not None:
            hidden = DTensor.from_local(inputs, self.sequence_mesh, [Shard(1)], run_check=False)
        else:
            hidden = inputs
        lengths = {} if mapping is not None else packed_lengths(self.config, attention_mask, position_ids)
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=inputs.device).unsqueeze(0)
        rope_positions, position_ids = rope_and_text_positions(position_ids)
        mask_fns = {
            "full_attention": create_causal_mask,
            "sliding_attention": create_sliding_window_causal_mask,
            "linear_attention": recurrent_padding_mask,
        }
        masks = mapping or {
            # No cache: passed by position, since transformers 5.24 renamed the argument (past_key_values -> cache).
            kind: mask_fns[kind](self.config, hidden, attention_mask, None, position_ids=position_ids)
            for kind in set(self._kinds.values())
        }
        position_embeddings = self.anatomy.rotary(self.rotary, hidden, rope_positions, set(self._kinds.values()))
        for key, layer in self.layers.items():
            kind = self._kinds[int(key)]
            hidden = layer(
                hidden,
                attention_mask=masks[kind],
                position_embeddings=position_embeddings[kind],
                position_ids=position_ids,
                **lengths,
            )
            if self.prelude is not None:  # Qwen3-VL's deepstack features, added after the first layers
                hidden = self.prelude.after_layer(int(key), hidden)
        if self.lm_head is None:
            # A fresh tensor, not a view of the DTensor: zero-bubble schedules detach stage outputs in place.
            out = hidden.to_local().clone() if isinstance(hidden, DTensor) else hidden
            out = out if self.prelude is None else self.prelude.pack(out)
            return out if self.boundary_dtype in (None, out.dtype) else out.to(self.boundary_dtype)
        if targets is None:
            raise ValueError("The last pipeline stage needs the next-token `targets` to compute the loss.")
        if self.sequences is not None:
            return self._sequences_loss(hidden, targets, rows)
        if self.chunked is not None and torch.is_grad_enabled():
            self.chunked.arm(targets)  # the head computes the token-loss sum in chunks, never the logits
        logits = self.lm_head(self.norm(hidden))
        loss_sum = None if self.chunked is None else self.chunked.take()
        if loss_sum is None:
            loss_sum = token_losses(self.anatomy.logits(logits), targets).sum()
        self.loss_sums.append(loss_sum.detach())
        return loss_sum * self.loss_factor

    def _sequences_loss(self, hidden: Tensor, targets: Tensor, rows: Tensor | None) -> Tensor:
        """The last stage under :attr:`sequences`: each token's loss from the chunked head (in per-token mode, with or
        without gradients: never the logits) or from the transformed logits, handed over with the micro-batch's rows."""
        if rows is None:
            raise ValueError(
                "The last pipeline stage needs the micro-batch's `rows` to hand them to its sequence loss."
            )
        chunked = self.chunked
        if chunked is not None:
            chunked.per_sequence = True
            chunked.arm(targets)
        try:
            logits = self.anatomy.logits(self.lm_head(self.norm(hidden)))
        finally:
            if chunked is not None:
                chunked.per_sequence = False
        loss = self.sequences(logits, targets, chunked, rows)
        return loss * self.loss_factor


def rope_and_text_positions(position_ids: Tensor) -> tuple[Tensor, Tensor | None]:
    """``(rotary positions, text positions)`` as a multimodal-RoPE language model splits its ``position_ids`` (Qwen's
    ``[3, batch, seq]`` rotate and leave no text positions; ``[4, batch, seq]`` lead with the text positions of packed
    rows); 2-D positions are both."""
    if position_ids.ndim != 3:
        return position_ids, position_ids
    if position_ids.shape[0] == 4:
        return position_ids[1:], position_ids[0]
    return position_ids, None


def recurrent_padding_mask(
    config: Any, hidden: Tensor, attention_mask: Tensor | None, cache: Any = None, **kwargs: Any
) -> Tensor | None:
    """What Qwen3.5's and Qwen3-Next's decoders give a linear-attention layer as its mask: the 2-D padding mask (the
    layer zeroes padded positions before its recurrence), ``None`` without one (or for a custom 4-D mask).

    As transformers' ``create_recurrent_attention_mask`` without a cache, except that a mask without padding is passed
    too rather than checked on the host (multiplying by ones changes nothing; the check would stall every stage on
    the device once per micro-batch). Here, not imported: the floor (transformers 5.23) builds it inside the forward.
    """
    if attention_mask is None or attention_mask.ndim != 2:
        return None
    return attention_mask[:, -hidden.shape[1] :].contiguous()


def identity_loss(output: Tensor, target: Tensor) -> Tensor:
    """The pipeline schedule's loss function: the last stage's output already is the scaled loss."""
    # The last stage already returns the scaled loss (it needs the targets and the global token count).
    return output


class ReshardingStage(PipelineStage):
    """A ``PipelineStage`` whose FSDP2 stage module stays sharded between micro-batches.

    torch's stage runs every micro-batch's backward but the last with ``set_reshard_after_backward(False)`` and
    ``set_requires_gradient_sync(False)``: the stage's parameters stay gathered and its gradients accumulate
    unsharded (in fp32 under mixed precision) until the schedule's final gradient reduction. Here each
    micro-batch's backward reshards and reduce-scatters, and FSDP2 adds the reduced shards into the sharded
    gradients; the final reduction then finds nothing left to reduce. Only the single-pass backward
    (``"full"``) is changed: zero-bubble schedules are refused with this option
    (:func:`~lightning_plugins.parallel.pipeline.options.check_pp_reshard`).

    torch >= 2.15 runs FSDP2 stages in manual backward finalization: a parameter group whose post-backward hook
    never fires (the first stage's root, whose inputs are token ids: the embedding) is only marked pending until the
    schedule's final reduction, its whole gradient kept unsharded across the micro-batches. Each micro-batch's
    backward here therefore ends with ``finalize_backward()``, which reduces that group too (as torch 2.13's
    post-backward callback did) and ends FSDP2's backward iteration; the next forward starts a new one.
    """

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
    ) -> tuple[tuple[Tensor | None, ...], list[dict[str, Any]] | None]:
        if backward_type != "full" or not isinstance(self.submod, FSDPModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
        self.submod.set_is_last_backward(False)  # the schedule's gradient reduction finalizes, as for torch's
        self.submod.set_reshard_after_backward(True)
        self.submod.set_requires_gradient_sync(True)
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        if hasattr(self.submod, "finalize_backward"):  # torch >= 2.15 (manual backward finalization)
            self.submod.finalize_backward()
        return grads, None
