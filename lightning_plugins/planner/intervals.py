"""The intervals a tracked training step is cut into, so that a real step and its dry run peak at the same moments.

:func:`mark_intervals` hooks the model so that each call of its ``mark`` records the tracker's peak since the last
one; :mod:`.measure` (a real step) and :mod:`.dryrun` (the fake copies) cut the step the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from lightning_plugins.planner.measure import StepMemTracker

__all__ = ["Intervals", "mark_intervals"]


class Intervals(list):
    """The peaks :func:`mark_intervals` records, in order, and which of them are *interior*: a backward through
    the decoder layers after the first two it runs and before the last two (see :func:`mark_intervals`)."""

    def __init__(self) -> None:
        super().__init__()
        self.interior: set[int] = set()

    def kept(self, *, interior: bool = True) -> list[dict[str, int]]:
        """The intervals that held anything (``interior=False``: less the interior ones)."""
        return [peak for index, peak in enumerate(self) if peak["total"] and (interior or index not in self.interior)]


def mark_intervals(
    tracker: StepMemTracker, model: nn.Module, peak: Callable[[], dict[str, int]]
) -> tuple[Intervals, Callable[..., None], list[Any]]:
    """Cut a tracked step into intervals where its structure changes, so that a real step and its dry run can be
    compared moment by moment: each pipeline stage's forward and backward, the head's logits and loss apart from the
    layers before and after them, and a backward through the decoder layers (without a pipeline) into the first
    layer it runs, the one after, the layers between, and the last two (the first two in the model). Call the
    returned ``mark`` after backward and after the optimizer step too.

    The layers' backward is cut (with 4 layers or more) so that each peak falls at the same moment whatever the
    number of layers: it holds the inputs of the layers still to run (checkpointing) and the gradients of those done,
    both linear in the layer index, so the peak of a backward through all of them may fall at its start or at its
    end, and copies of a model with more or fewer layers (the dry run's) may peak at different ends. The first and
    the last layer backward runs differ from the others (FSDP2: the first has no earlier layer still reduce-scattering
    its gradients, the last none to prefetch), so the cuts are: the first layer's backward, the second's, the
    interior, the one before the last's, and the last's. Each but the interior peaks inside one layer's backward;
    the interior's layers run as the second and the one before the last do, so its peak lies between theirs (linear
    in the layer index). With 4 layers the interior is empty. A pipeline's stages are left whole: the dry run's
    copies may hold fewer than 4 layers per stage in one copy and more in the other (interleaved stages).

    Returns:
        ``(intervals, mark, handles)``: the :class:`Intervals` each ``mark`` appends ``peak()`` to (then the tracker's
        peak starts again), the mark, and the hooks' handles (``remove()`` them when done).
    """
    from lightning_plugins.parallel.hf_model import hf_model_of
    from lightning_plugins.parallel import pipeline_of
    from lightning_plugins.parallel.families import decoder_layers, family_for

    intervals = Intervals()

    def mark(*_: Any) -> None:  # the peak since the last mark, then a new interval
        intervals.append(peak())
        tracker.restart_peak()

    def mark_interior(*_: Any) -> None:
        intervals.interior.add(len(intervals))
        mark()

    def on_input_gradient(then: Callable[..., None]) -> Callable[..., None]:
        """A forward pre-hook that calls ``then`` when backward has computed the gradient of the module's input (a
        recomputing forward, inside backward, is left alone)."""

        def hook(_: nn.Module, args: tuple[Any, ...]) -> None:
            first = args[0] if args else None
            if isinstance(first, torch.Tensor) and first.requires_grad and torch._C._current_graph_task_id() == -1:
                first.register_hook(then)

        return hook

    handles = []
    pipeline = pipeline_of(model)
    for stage in pipeline.stages.values() if pipeline is not None else ():
        handles += [stage.register_forward_pre_hook(mark), stage.register_full_backward_pre_hook(mark)]
    hf_model = hf_model_of(model)
    layers = set(decoder_layers(hf_model, family_for(hf_model, tensor_parallel=False)))
    own = [module for module in model.modules() if module in layers] if pipeline is None else []
    if len(own) >= 4:  # backward runs the last layer, the one before, the interior ones, the second, the first
        handles += [
            own[-1].register_forward_pre_hook(on_input_gradient(mark)),
            own[-2].register_forward_pre_hook(on_input_gradient(mark)),
            own[2].register_forward_pre_hook(on_input_gradient(mark_interior)),  # after the one above when 4
            own[1].register_forward_pre_hook(on_input_gradient(mark)),
        ]
    head = hf_model.get_output_embeddings()
    if head is not None:
        # The chunked loss computes inside the head and hands back empty logits: the head's own backward hook would
        # never fire. Its input's gradient marks the end of the loss's backward either way.
        mark_loss_backward = on_input_gradient(mark)

        def mark_forward_and_backward(module: nn.Module, args: tuple[Any, ...]) -> None:
            mark()
            mark_loss_backward(module, args)

        handles.append(head.register_forward_pre_hook(mark_forward_and_backward))
    return intervals, mark, handles
