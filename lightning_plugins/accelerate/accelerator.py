"""``ParallelAccelerator``: Accelerate's ``Accelerator`` with tensor, pipeline, context and FSDP2 parallelism.

A thin door over the engine: ``prepare`` hands the HF model to :func:`lightning_plugins.parallelize` and
Accelerate does the rest of what it always does, told about data-parallel ranks instead of processes.
"""

from __future__ import annotations

import contextlib
import math
import os
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.scheduler import AcceleratedScheduler
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_plugins.accelerate.context import position_whole_sequence
from lightning_plugins.accelerate.fsdp_plugin import check_wrap_classes, memory_settings, merge_settings, wrap_classes
from lightning_plugins.accelerate.gathering import all_tensors, gather_objects, gather_tensors
from lightning_plugins.accelerate.loaders import DataParallelScheduler, shard_over_data_ranks
from lightning_plugins.accelerate.parallelism import LayoutParallelismConfig, parallelism_config_of
from lightning_plugins.accelerate.repoint import parameter_names, repoint_optimizers
from lightning_plugins.accelerate.settings import (
    builtin_path,
    uses_fsdp2_plugin,
    check_builtin,
    describe_launch,
    join_slowly,
    parallelism_config_off,
    resolved_layout,
)
from lightning_plugins.accelerate.state import load_training_state, next_state_dir, numbered_states, save_training_state
from lightning_plugins.checkpoint.async_save import AsyncCheckpointer
from lightning_plugins.run.faults import set_collective_timeout
from lightning_plugins.errors import LayoutError
from lightning_plugins.parallel.moe.experts_balance import ExpertBalance
from lightning_plugins.parallel.layout import ParallelLayout, given_sizes
from lightning_plugins.checkpoint.load import is_on_meta, parallelize_and_load
from lightning_plugins.parallel.options import MemoryOptions, ParallelOptions, with_settings
from lightning_plugins.parallel import clip_grad_norm_, mesh_of, pipeline_of
from lightning_plugins.parallel.plan import ParallelPlan, resolve
from lightning_plugins.parallel.optim.optim_in_backward import check_step_in_backward, stepping_in_backward
from lightning_plugins.parallel.pipeline.runtime import GradHandOff
from lightning_plugins.parallel.teardown import release_at_exit, release_process_groups
from lightning_plugins.parallel.families import decoder_layers, family_for, find_hf_model

__all__ = ["ParallelAccelerator"]

_SETTINGS = {f.name for f in fields(ParallelOptions)} | {f.name for f in fields(MemoryOptions)}


class ParallelAccelerator(Accelerator):
    """An ``accelerate.Accelerator`` that trains HF causal LMs with any layout of the engine.

    Replace ``Accelerator(...)`` by ``ParallelAccelerator(tp_size=2, ...)``; the loop stays the same.
    ``prepare`` parallelizes the model (an HF ``PreTrainedModel``, a peft ``PeftModel``, or a module holding
    one), loads this rank's weight slices when it was built on the meta device, points the optimizer at the
    new parameters, shards data loaders over data-parallel ranks only (and gives context-parallel ranks
    their sequence shard of every batch). Under pipeline parallelism the model call runs forward and
    backward of the whole batch through the schedule and returns the loss; ``backward(loss)`` then adds
    the gradients it computed. ``clip_grad_norm_`` clips by the true global norm, ``save_state`` /
    ``load_state`` write and read one atomic distributed checkpoint (model, optimizer, schedulers, random
    states, data position), ``save_model`` exports an HF directory (or a peft adapter), and so does the model's own
    ``save_pretrained`` called on every rank (with ``state_dict=get_state_dict(model)`` too: the full state dict on
    the main process).

    Under a launch config that selects Accelerate's own DeepSpeed or FSDP, those stay in charge (only
    data-parallel layouts are then valid) and every method is Accelerate's.

    Args:
        layout: The parallel sizes as one :class:`~lightning_plugins.ParallelLayout`; the size keywords below
            override its fields.
        tp_size: Tensor-parallel ranks.
        pp_size: Pipeline stages.
        cp_size: Context-parallel ranks.
        dp_shard_size: FSDP2 shard ranks; ``-1`` (or ``None``) takes what the world leaves.
        dp_replicate_size: Data-parallel replicas (HSDP with ``dp_shard_size > 1``).
        ep_size: Expert-parallel ranks of a mixture-of-experts model, drawn from ``dp_shard x cp`` (a divisor of
            ``dp_shard_size x cp_size`` and of the number of experts); Accelerate's ``ParallelismConfig`` has none.
        options: How each dimension is applied (:class:`~lightning_plugins.ParallelOptions`).
        memory: Activation checkpointing, FSDP2 mixed precision, CPU offload
            (:class:`~lightning_plugins.MemoryOptions`).
        load_from: HF checkpoint directory for a model built on the meta device (default: its ``name_or_path``).
        async_checkpoint: ``save_state`` writes the sharded tensors in the background (``dcp.async_save``) and
            returns once they are copied; the checkpoint is moved into place when complete. Call
            :meth:`wait_for_checkpoint` (or ``end_training``) before the script ends (recipe key
            ``train.async_checkpoint``).
        recipe_record: The resolved recipe (YAML) to record in every checkpoint, so that a resume can compare it with
            its own (:mod:`lightning_plugins.recipe.diff`); ``None``: none is recorded.
        **kwargs: Fields of ``ParallelOptions``/``MemoryOptions`` by name (``sequence_parallel``, ``cp_backend``,
            ``pp_schedule``, ``activation_checkpointing``, ...), and every ``accelerate.Accelerator`` argument.
            ``kwargs_handlers=[InitProcessGroupKwargs(timeout=...)]`` bounds every collective (a stuck rank then
            fails its peers after that long); joining the process group still waits at least 30 min.
            Sizes left at ``None`` come from ``parallelism_config=ParallelismConfig(...)`` or the launch config's
            ``parallelism_config_*`` keys; an FSDP2 ``fsdp_plugin`` sets the engine's FSDP2 settings
            (:mod:`~lightning_plugins.accelerate.fsdp_plugin`); an FSDP1 plugin selects Accelerate's own FSDP.

    Raises:
        LayoutError: before any process group exists, when the layout does not fit the launched world,
            disagrees with the launch config's sizes, or is not data-parallel under DeepSpeed/FSDP.
    """

    def __init__(
        self,
        *,
        layout: ParallelLayout | None = None,
        tp_size: int | None = None,
        pp_size: int | None = None,
        cp_size: int | None = None,
        dp_shard_size: int | None = None,
        dp_replicate_size: int | None = None,
        ep_size: int | None = None,
        options: ParallelOptions | None = None,
        memory: MemoryOptions | None = None,
        load_from: str | Path | None = None,
        async_checkpoint: bool = False,
        recipe_record: str | None = None,
        **kwargs: Any,
    ) -> None:
        owner = type(self).__name__
        settings = {name: kwargs.pop(name) for name in list(kwargs) if name in _SETTINGS}
        deepspeed = kwargs.get("deepspeed_plugin") or kwargs.get("deepspeed_plugins")
        # Accelerate's FSDP2 plugin configures what the engine's dp_shard does: its settings join the others.
        fsdp2_plugin = kwargs.pop("fsdp_plugin") if uses_fsdp2_plugin(kwargs, deepspeed) else None
        settings = merge_settings(owner, memory_settings(owner, fsdp2_plugin), settings, memory)
        #: Layer classes the FSDP2 plugin wraps, checked against the model's decoder layers at ``prepare``.
        self.wrap_classes = wrap_classes(fsdp2_plugin)
        self.options, self.memory = with_settings(owner, options, memory, **settings)
        sizes = given_sizes(
            layout, tp_size=tp_size, pp_size=pp_size, cp_size=cp_size, dp_shard_size=dp_shard_size,
            dp_replicate_size=dp_replicate_size, ep_size=ep_size,
        )
        self.builtin = None if fsdp2_plugin is not None else builtin_path(deepspeed, kwargs.get("fsdp_plugin"))
        parallelism_config = None if self.builtin else kwargs.pop("parallelism_config", None)
        self.layout, world_size = resolved_layout(owner, sizes, parallelism_config)
        #: The run's plan, resolved once before any process group exists (``prepare`` checks the model's config against
        #: it, once); ``None`` under Accelerate's own DeepSpeed/FSDP (checked by ``check_builtin``).
        self.plan: ParallelPlan | None = None
        if self.builtin:
            check_builtin(owner, self.layout, self.builtin)
        else:
            self.plan = resolve(self.layout, self.options, self.memory, world_size=world_size)
        self.load_from = load_from
        self.async_checkpoint = async_checkpoint
        self.recipe_record = recipe_record
        self._saver = AsyncCheckpointer()
        self.device_mesh = None
        self._parallelism_config: LayoutParallelismConfig | None = None  # once the mesh exists
        self._accelerate_prepares = False  # while Accelerate's own `prepare` runs (see `parallelism_config`)
        self._grads = GradHandOff()  # under pipeline parallelism: the gradients the model call computed
        #: The routing balance of a prepared mixture-of-experts model (``None``: dense); see :meth:`moe_balance`.
        self.balance: ExpertBalance | None = None
        # Parameters that parallelizing replaced (id -> parameter): an optimizer still holding one would train nothing.
        self._replaced: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()
        if self.builtin:
            self._start_builtin(owner, kwargs)
        else:
            self._start_engine(owner, kwargs, fsdp2=fsdp2_plugin is not None)

    def _start_builtin(self, owner: str, kwargs: dict[str, Any]) -> None:
        """Accelerate's own DeepSpeed/FSDP: its ``__init__`` as it is, refused where it would fall back silently."""
        super().__init__(**kwargs)
        if self.distributed_type.value != self.builtin.upper():
            raise LayoutError(
                f"{owner}: {describe_launch()} selects Accelerate's {self.builtin}, but Accelerate runs these"
                f" processes as {self.distributed_type.value} (its {self.builtin} needs GPUs; on CPU processes it"
                " falls back silently). On CPU, launch with accelerate_configs/cpu_2proc.yaml and shard with the"
                " engine's FSDP2 (dp_shard_size, memory.cpu_offload)."
            )

    def _start_engine(self, owner: str, kwargs: dict[str, Any], *, fsdp2: bool) -> None:
        """Join the process group (slowly; from then on every collective is bounded), as a world of one without a
        launcher, and build the plan's mesh."""
        timeout = join_slowly(kwargs)
        # Accelerate's parallelism config refuses MULTI_CPU and would build a second mesh; a launch config's FSDP would
        # select Accelerate's FSDP over the plugin mapped above.
        with parallelism_config_off(fsdp=fsdp2):
            super().__init__(**kwargs)
        set_collective_timeout(timeout)  # joined: from now on every collective is bounded by it
        if not dist.is_initialized():  # one process: a world of one, so the engine's path is the same
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        release_at_exit()  # unless `end_training` released them first
        if self.layout.pp_size > 1 and self.scaler is not None:
            raise LayoutError(
                f"{owner}: mixed_precision='fp16' scales the loss before backward, which the pipeline schedule runs"
                " inside the model call; use mixed_precision='bf16' (or 'no') with pp_size > 1."
            )
        assert self.plan is not None  # not Accelerate's own DeepSpeed/FSDP (returned above)
        self.device_mesh = self.plan.build(self.device.type)
        self._parallelism_config = parallelism_config_of(self.plan.layout, self.device_mesh)

    @property
    @override
    def parallelism_config(self) -> Any:
        """Accelerate's ``ParallelismConfig`` answering for the layout (``dp_cp_dim_names``, ``non_data_parallel_size``,
        ...; :class:`~lightning_plugins.accelerate.parallelism.LayoutParallelismConfig`). ``None`` to Accelerate's own
        ``prepare``, whose tensor and context parallelism would redo the engine's."""
        if self.builtin or self._accelerate_prepares:
            return super().parallelism_config
        return self._parallelism_config

    @property
    @override
    def torch_device_mesh(self) -> Any:
        """The engine's mesh: Accelerate's dimension names (``dp_replicate``, ``dp_shard``, ``cp``, ``tp``) and flattened
        views (``dp``, ``dp_shard_cp``, ``dp_cp``), plus ``pp``."""
        return super().torch_device_mesh if self.builtin else self.device_mesh

    # ----------------------------------------------------------------------------------------------------- prepare

    @override
    def prepare(self, *args: Any, device_placement: list[bool | None] | None = None) -> Any:
        if not self.builtin:
            optimizers = [obj for obj in args if isinstance(obj, Optimizer)]
            for obj in args:
                if isinstance(obj, nn.Module):
                    self._parallelize(obj, optimizers)
        self._accelerate_prepares = not self.builtin
        try:
            return super().prepare(*args, device_placement=device_placement)
        finally:
            self._accelerate_prepares = False

    @override
    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        if self.builtin:
            return super().prepare_model(model, device_placement, evaluation_mode)
        self._parallelize(model, [])
        # Accelerate's evaluation mode applies autocast and compile only: no DDP around a parallelized model.
        prepared = super().prepare_model(model, device_placement=False, evaluation_mode=True)
        if self.layout.pp_size > 1 and not getattr(prepared, "_lightning_plugins_hooked", False):
            prepared.register_forward_pre_hook(self._hold_grads, with_kwargs=True)
            prepared.register_forward_hook(self._take_pipeline_grads, with_kwargs=True, always_call=True)
            prepared._lightning_plugins_hooked = True
        return prepared

    def _parallelize(self, model: nn.Module, optimizers: list[Optimizer]) -> None:
        """Apply the layout to the HF model inside ``model`` and point ``optimizers`` at its new parameters."""
        owner = type(self).__name__
        hf_model = find_hf_model(model, owner)
        if mesh_of(hf_model) is not None:  # prepared before (or by the user): parallelize checks the settings
            parallelize_and_load(model, hf_model, self.plan, None, None,
                                 load_from=self.load_from, owner=owner, device=self.device)  # fmt: skip
            return
        if self.wrap_classes:
            layers = decoder_layers(hf_model, family_for(hf_model, tensor_parallel=False))
            check_wrap_classes(owner, self.wrap_classes, layers)
        if any(opt.state for opt in optimizers):
            raise LayoutError(
                f"{owner}.prepare: the optimizer has already stepped; its state belongs to the unsharded parameters."
                " Prepare the model and optimizer before training."
            )
        names = parameter_names(model)
        if not is_on_meta(hf_model) and not all(_on(p.device, self.device) for p in model.parameters()):
            model.to(self.device)  # only when needed: `.to` on torchao NF4 weights leaves views FSDP2 cannot shard
        parallelize_and_load(
            model, hf_model, self.plan, None, None, load_from=self.load_from, owner=owner, device=self.device
        )  # the plan's checks against the model's config run here, once
        self.balance = ExpertBalance.of(hf_model)
        pipeline = self.layout.pp_size > 1
        self._replaced.update(repoint_optimizers(owner, model, names, optimizers, pipeline=pipeline))

    def moe_balance(self) -> dict[str, float]:
        """The ``moe/*`` routing figures of the steps since the last call, over every rank (a collective: every rank
        calls it at the same step); ``{}`` for a dense model (:mod:`~lightning_plugins.parallel.moe.experts_balance`)."""
        return {} if self.balance is None else self.balance.read()

    @override
    def prepare_optimizer(self, optimizer: Optimizer, device_placement: bool | None = None) -> Any:
        stale = [p for group in optimizer.param_groups for p in group["params"] if self._replaced.get(id(p)) is p]
        if stale:
            raise LayoutError(
                f"{type(self).__name__}.prepare: the optimizer holds {len(stale)} parameters that preparing the model"
                " replaced (sharded or moved to pipeline stages), so it would update nothing. Prepare the model and"
                " its optimizer in one call (`accelerator.prepare(model, optimizer, ...)`), or build the optimizer"
                " after `prepare(model)`."
            )
        return super().prepare_optimizer(optimizer, device_placement)

    @override
    def prepare_data_loader(
        self,
        data_loader: torch.utils.data.DataLoader,
        device_placement: bool | None = None,
        slice_fn_for_dispatch: Any = None,
    ) -> Any:
        """Shard over the ``dp`` mesh dimension only; a loader whose sampler is a ``DistributedSampler`` is
        already sharded and is only placed on the device (and context-sharded)."""
        if self.builtin or getattr(data_loader, "_is_accelerate_prepared", False):
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        if self.dispatch_batches:
            raise LayoutError(
                f"{type(self).__name__}: dispatch_batches=True sends slices to every process, but tensor, context and"
                " pipeline ranks must see the same samples. Leave DataLoaderConfiguration(dispatch_batches=None)."
            )
        loader = shard_over_data_ranks(self, data_loader, device_placement)
        self._dataloaders.append(loader)
        return loader

    @override
    def prepare_scheduler(self, scheduler: Any) -> Any:
        prepared = super().prepare_scheduler(scheduler)
        if self.builtin or type(prepared) is not AcceleratedScheduler:  # ours already, or not Accelerate's wrapper
            return prepared
        wrapped = DataParallelScheduler(
            prepared.scheduler, prepared.optimizers, replicas=self.device_mesh["dp"].size(),
            step_with_optimizer=prepared.step_with_optimizer, split_batches=prepared.split_batches,
        )  # fmt: skip
        self._schedulers[self._schedulers.index(prepared)] = wrapped
        return wrapped

    @override
    @contextlib.contextmanager
    def maybe_context_parallel(
        self,
        buffers: list[Tensor] | None = None,
        buffer_seq_dims: list[int] | None = None,
        no_restore_buffers: set[Tensor] | None = None,
    ) -> Iterator[None]:
        """Accelerate's context-parallel context, kept for loops written for it: the prepared data loaders already hand
        each context-parallel rank its sequence shard (Accelerate's would shard the buffers a second time, and without
        context parallelism only warns); position ids built from a shard's length are made the whole sequence's
        (:mod:`~lightning_plugins.accelerate.context`)."""
        if self.builtin:
            with super().maybe_context_parallel(buffers, buffer_seq_dims, no_restore_buffers):
                yield
            return
        if self.layout.cp_size > 1 and buffers:
            position_whole_sequence(self._dataloaders, buffers, buffer_seq_dims or [1] * len(buffers))
        yield

    # ---------------------------------------------------------------------------------------- pipeline and clipping

    def _pipeline(self) -> Any:
        for model in self._models:
            pipeline = pipeline_of(find_hf_model(model, type(self).__name__))
            if pipeline is not None:
                return pipeline
        return None

    def _hold_grads(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Before a training call under PP: set earlier gradients aside, so the call's own can be taken."""
        if not (module.training and torch.is_grad_enabled()):
            return
        pipeline = self._pipeline()
        # Accelerate's backward divides the loss by the accumulation steps; the schedule differentiates inside.
        pipeline.loss_scale = 1.0 / self.gradient_accumulation_steps
        self._grads.hold(module)

    def _take_pipeline_grads(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """After a training call under PP: keep the schedule's gradients for ``backward``; restore the earlier ones."""
        self._grads.take()

    @override
    def backward(self, loss: Tensor, **kwargs: Any) -> None:
        """Backward of ``loss``; under pipeline parallelism, add the gradients the model call already computed."""
        if self.builtin or self.layout.pp_size == 1:
            return super().backward(loss, **kwargs)
        if not self._grads.add():
            raise RuntimeError(
                f"{type(self).__name__}.backward under pipeline parallelism adds the gradients that the model call"
                " computed (the schedule runs forward and backward together): call it once after each training-mode"
                " model call, with that call's loss."
            )
        return None

    @override
    def clip_grad_norm_(self, parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2) -> Tensor:
        """Clip by the norm of all gradients of every rank (sharded, replicated, and across pipeline stages).

        Where an optimizer steps in backward (``step_in_backward``) its gradients are applied and gone: a finite
        ``max_norm`` is refused, and ``max_norm=math.inf`` returns the step's global norm its hooks summed."""
        fused = next(filter(None, (stepping_in_backward(getattr(o, "optimizer", o)) for o in self._optimizers)), None)
        if fused is not None:
            check_step_in_backward(None if math.isinf(max_norm) else max_norm, 1, "stop")
            return fused.grad_norm()
        if self.builtin:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        self.unscale_gradients()
        pp_mesh = self.device_mesh["pp"]
        return clip_grad_norm_(parameters, max_norm, norm_type, pp_mesh=pp_mesh, pipeline=self._pipeline())

    # ----------------------------------------------------------------------------------------------- gathering

    def _dp_only(self) -> bool:
        return not self.builtin and self.device_mesh["dp"].size() != dist.get_world_size()

    @override
    def gather(self, tensor: Any) -> Any:
        """Gather over data-parallel ranks (tensor, context and pipeline peers hold the same samples)."""
        if not self._dp_only():
            return super().gather(tensor)
        return gather_tensors(tensor, self.device_mesh["dp"].get_group())

    @override
    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather over data-parallel ranks; the last batch's duplicated samples are dropped, as in Accelerate."""
        if not self._dp_only() or (all_tensors(input_data) and not use_gather_object):
            return super().gather_for_metrics(input_data, use_gather_object)
        return gather_objects(input_data, self.device_mesh["dp"].get_group(), self.gradient_state)

    # -------------------------------------------------------------------------------------------- saving, loading

    @override
    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """The full state dict under one-process names on the main process, every pipeline stage included (``{}`` on
        the others, as Accelerate's FSDP gives); every rank calls it. For ``save_pretrained(..., state_dict=...)``."""
        if self.builtin:
            return super().get_state_dict(model, unwrap)
        from lightning_plugins.parallel.save_pretrained import full_state_dict

        return full_state_dict(self.unwrap_model(model) if unwrap else model)

    @override
    def save_model(self, model: nn.Module, save_directory: str | os.PathLike, max_shard_size: int | str = "10GB",
                   safe_serialization: bool = True) -> None:  # fmt: skip
        """Write an HF directory (a peft adapter directory for a ``PeftModel``) that plain transformers/peft load."""
        if self.builtin:
            return super().save_model(model, save_directory, max_shard_size, safe_serialization)
        from lightning_plugins.checkpoint.live_export import export_hf

        export_hf(self.unwrap_model(model), save_directory)
        return None

    @override
    def save_state(
        self, output_dir: str | os.PathLike | None = None, safe_serialization: bool = True, **kwargs: Any
    ) -> Path:
        """One atomic distributed checkpoint of every prepared object, random states and data positions."""
        if self.builtin:
            return super().save_state(output_dir, safe_serialization, **kwargs)
        path = next_state_dir(self) if self.project_configuration.automatic_checkpoint_naming else output_dir
        if path is None:
            raise ValueError(f"{type(self).__name__}.save_state needs output_dir (or automatic_checkpoint_naming).")
        saved = save_training_state(self, path, self._saver if self.async_checkpoint else None)
        self.project_configuration.iteration += 1
        return saved

    def wait_for_checkpoint(self, *, failed: bool = False) -> None:
        """Wait until the checkpoint an asynchronous :meth:`save_state` is writing is complete and in place (nothing
        to do after a synchronous one). With ``failed`` (the run is ending on an error) a save that cannot complete
        is left unpublished, and its own error is not raised."""
        self._saver.close(failed=failed)

    @override
    def end_training(self) -> None:
        """Wait for an asynchronous checkpoint, release the process groups
        (:func:`~lightning_plugins.parallel.teardown.release_process_groups`) and finish the trackers."""
        self.wait_for_checkpoint()
        release_process_groups()  # then Accelerate's own destroy finds nothing left to do
        super().end_training()

    @override
    def load_state(
        self, input_dir: str | os.PathLike | None = None, load_kwargs: dict | None = None, **kwargs: Any
    ) -> None:
        """Restore what :meth:`save_state` wrote (under this or another layout: DCP reshards)."""
        if self.builtin:
            return super().load_state(input_dir, load_kwargs, **kwargs)
        if input_dir is None:
            if not self.project_configuration.automatic_checkpoint_naming:
                raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
            saved = numbered_states(Path(self.project_dir) / "checkpoints")
            if not saved:
                raise FileNotFoundError(f"No checkpoint in {Path(self.project_dir) / 'checkpoints'}.")
            input_dir = saved[-1]
        load_training_state(self, input_dir)
        return None


def _on(device: torch.device, target: torch.device) -> bool:
    """Whether ``device`` is ``target`` (Accelerate names the CPU ``cpu:0``; parameters live on ``cpu``)."""
    return device.type == target.type and (device.type == "cpu" or device.index == target.index)
