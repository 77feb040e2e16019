"""``ParallelismStrategy``: the Lightning door to the engine (TP/SP/loss parallel + FSDP2/HSDP)."""

from __future__ import annotations

import math
import weakref
from dataclasses import replace
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_plugins.checkpoint.async_save import AsyncCheckpointer
from lightning_plugins.run.faults import join_timeout, set_collective_timeout
from lightning_plugins.parallel.layout import ParallelLayout, layout_of
from lightning_plugins.errors import LayoutError
from lightning_plugins.checkpoint.load import parallelize_and_load
from lightning_plugins.parallel import families as models
from lightning_plugins.parallel.families import check_supported
from lightning_plugins.run.nonfinite import NonFiniteGuard, Policy
from lightning_plugins.parallel.options import MemoryOptions, ParallelOptions, with_settings
from lightning_plugins.parallel import (
    check_parallelizable,
    check_settings,
    check_same_settings,
    clip_grad_norm_,
    mesh_of,
    pipeline_of,
)
from lightning_plugins.parallel.plan import ParallelPlan, resolve
from lightning_plugins.parallel.by_hand import complete_split_by_hand
from lightning_plugins.parallel.context import context_parallel_batch
from lightning_plugins.parallel.optim.optim_in_backward import check_step_in_backward, stepping_in_backward
from lightning_plugins.parallel.pipeline.runtime import GradHandOff
from lightning_plugins.strategies.checkpoint_io import ShardedCheckpoints
from lightning_plugins.strategies.balance import add_balance
from lightning_plugins.strategies.lightning_names import (
    add_lightning_names,
    check_parallelized_by_user,
    lightning_sizes,
    parallelized_by_user,
)
from lightning_plugins.strategies.perf import PerfCallback, add_perf
from lightning_plugins.strategies.preemption import add_preemption
from lightning_plugins.checkpoint.resume_choice import check_same_decision
from lightning_plugins.parallel.teardown import release_at_exit

if TYPE_CHECKING:
    import lightning.pytorch as pl

#: HF models a strategy parallelized: a later entry point must ask for the same settings (a model that the module's
#: own ``configure_model`` parallelized keeps the settings it chose).
_PARALLELIZED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class ParallelismStrategy(ShardedCheckpoints, ModelParallelStrategy):
    """Tensor (with sequence and loss parallel) and fully-sharded data parallelism for HF models.

    The strategy finds the ``transformers.PreTrainedModel`` (or peft ``PeftModel``) inside the LightningModule and
    applies the layout to it after the module's ``configure_model`` (if any) has run: the model may be built in
    ``__init__`` or in ``configure_model``, also on the meta device (each rank then reads only its slices of the
    checkpoint, see ``load_from``). A ``configure_model`` that calls ``parallelize(self.model, self.device_mesh, ...)``
    itself keeps the settings it chose; one that parallelized the model by hand, as Lightning's TP guide does
    (``parallelize_module(self.model, self.device_mesh["tensor_parallel"], plan)``), keeps it as it is and adds FSDP2
    over the data ranks and activation checkpointing (:mod:`~lightning_plugins.parallel.by_hand`).
    ``self.device_mesh`` carries Lightning's dimension names (``data_parallel``, ``tensor_parallel``) next to the
    engine's.

    Args:
        layout: The parallel sizes as one :class:`~lightning_plugins.ParallelLayout`; the size keywords below
            override its fields (each is 1 when given nowhere, ``dp_shard_size`` -1).
        tp_size: Tensor-parallel ranks.
        pp_size: Pipeline ranks. With ``pp_size > 1`` the model's forward in ``training_step`` runs
            forward and backward of the whole batch through the pipeline (Lightning's backward is then
            skipped); see :class:`~lightning_plugins.strategies.PipelineParallelStrategy` for the schedule.
        cp_size: Context-parallel ranks: each sample's sequence is split over them (batches are sharded
            along the sequence in ``batch_to_device``; the LightningModule sees its shard).
        dp_shard_size: FSDP2 shard ranks; ``-1`` takes whatever the world size leaves.
        dp_replicate_size: Data-parallel replicas (HSDP when combined with ``dp_shard_size > 1``).
        ep_size: Expert-parallel ranks of a mixture-of-experts model: its routed experts are split over them and
            tokens travel to their experts. Drawn from the ``dp_shard x cp`` ranks (no mesh dimension of its own): it
            must divide ``dp_shard_size x cp_size`` and the model's number of experts.
        options: How each dimension is applied (:class:`~lightning_plugins.ParallelOptions`).
        memory: Activation checkpointing, FSDP2 mixed precision, CPU offload
            (:class:`~lightning_plugins.MemoryOptions`).
        load_from: HF checkpoint directory to read this rank's weight slices from when the model was
            built on the meta device; defaults to the model config's ``name_or_path``.
        save_distributed_checkpoint: DCP sharded checkpoints (``True``) or one full file on rank 0.
        process_group_backend: ``"nccl"`` / ``"gloo"``; chosen from the device when ``None``.
        timeout: Collective timeout: a collective that waits longer fails, naming this setting, and the job ends
            (recipe key ``train.collective_timeout_s``).
        async_checkpoint: Write sharded checkpoints in the background (``dcp.async_save``) while training goes on;
            each is moved into place only once complete, and the last is waited for before ``fit`` returns
            (recipe key ``train.async_checkpoint``).
        on_nonfinite: What a NaN or infinite loss or global gradient norm on any rank does, seen by every rank in the
            same optimizer step (:mod:`lightning_plugins.run.nonfinite`): ``"stop"`` raises
            :class:`~lightning_plugins.run.nonfinite.NonFiniteError` before the weights take the step; ``"skip"`` skips
            that optimizer step. A checkpoint whose trainable weights or optimizer state are not finite is refused
            (recipe key ``train.on_nonfinite``).
        max_skipped_steps: With ``on_nonfinite="skip"``: stop after this many consecutive skipped steps (recipe key
            ``train.max_skipped_steps``).
        recipe_record: The resolved recipe (YAML) to record in every checkpoint, so that a resume can compare it with
            its own (:mod:`lightning_plugins.recipe.diff`); ``None``: none is recorded.
        preempt_signals: Signals that preempt ``fit``: every rank finishes its optimizer step, the
            ``ModelCheckpoint`` writes ``step=N.ckpt`` and the process exits with status 75 (recipe key
            ``train.preempt_signals``; see :class:`~lightning_plugins.strategies.preemption.PreemptionCallback`).
        perf: A :class:`~lightning_plugins.strategies.perf.PerfCallback` (``train.profile``, ``train.perf_sample``,
            ``train.straggler_ratio``) to add to every ``fit``; ``None``: no profiling.
        data_parallel_size: ``ModelParallelStrategy``'s name for ``dp_shard_size`` (``"auto"``: what the world
            leaves).
        tensor_parallel_size: ``ModelParallelStrategy``'s name for ``tp_size`` (``"auto"``: every process of a node).
        **settings: Any field of ``ParallelOptions`` or ``MemoryOptions`` by name (``sequence_parallel``,
            ``loss_parallel``, ``cp_backend``, ``activation_checkpointing``, ``every_n_layers``,
            ``param_dtype``, ``reduce_dtype``, ``cpu_offload``, ``reshard_after_forward``, ...), overriding
            ``options``/``memory``.
    """

    strategy_name = "parallelism"

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
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        async_checkpoint: bool = False,
        on_nonfinite: Policy = "stop",
        max_skipped_steps: int = 10,
        recipe_record: str | None = None,
        preempt_signals: Sequence[str] = ("SIGTERM", "SIGUSR1"),
        perf: PerfCallback | None = None,
        data_parallel_size: int | str | None = None,
        tensor_parallel_size: int | str | None = None,
        **settings: Any,
    ) -> None:
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        sizes = lightning_sizes(
            type(self).__name__, {"tp_size": tp_size, "dp_shard_size": dp_shard_size}, data_parallel_size,
            tensor_parallel_size,
        )  # fmt: skip
        #: ``tensor_parallel_size="auto"``: every process of a node, resolved in ``setup_environment``.
        self._auto_tensor_parallel = sizes["tp_size"] == "auto"
        self.layout = layout_of(
            layout, tp_size=None if self._auto_tensor_parallel else sizes["tp_size"], pp_size=pp_size,
            cp_size=cp_size, dp_shard_size=sizes["dp_shard_size"], dp_replicate_size=dp_replicate_size,
            ep_size=ep_size,
        )  # fmt: skip
        if self.layout.pp_size > 1 and not save_distributed_checkpoint:
            raise LayoutError(
                f"{type(self).__name__} writes sharded (DCP) checkpoints only under pipeline parallelism: each rank"
                " holds different stages, so no rank can write the full model. Keep save_distributed_checkpoint=True"
                " and export to HF format from the sharded checkpoint."
            )
        self.options, self.memory = with_settings(type(self).__name__, options, memory, **settings)
        # What needs no world size and no model fails now, before Trainer(...) launches any process; the rest when
        # the plan is resolved (`setup_environment`), once.
        check_settings(self.layout, self.options, self.memory)
        #: This run's :class:`~lightning_plugins.parallel.plan.ParallelPlan`: resolved once in ``setup_environment``
        #: (against the world, and the model's config when the module holds the model then; else its config is checked
        #: when the model is parallelized), owning ``device_mesh``.
        self.plan: ParallelPlan | None = None
        self.load_from = load_from
        self.async_checkpoint = async_checkpoint
        self.recipe_record = recipe_record
        self.preempt_signals = list(preempt_signals)
        self.perf = perf
        self._saver = AsyncCheckpointer()
        self._grads = GradHandOff()  # under pipeline parallelism: the gradients the model call computed
        #: The global gradient norm of the last optimizer step, before clipping (``None`` before the first).
        self.grad_norm: torch.Tensor | None = None
        self._norm_step = -1  # the optimizer step (1-based) `grad_norm` belongs to
        #: The last checkpoint this strategy wrote or resumed from (named when the non-finite guard stops the run).
        self.last_checkpoint: Path | None = None
        self.nonfinite = NonFiniteGuard(
            on_nonfinite, max_skipped_steps, lambda: self.last_checkpoint, self.memory.optimizer_in_backward
        )

    @override
    def _configure_launcher(self) -> None:
        # Lightning's launcher, but a failed or stuck rank ends the job with a message naming it.
        from lightning_plugins.strategies.launcher import SupervisedLauncher

        # Also where another launcher started the ranks (torchrun, SLURM, Lightning's re-run children): each
        # rank then records its failure and explains a collective timeout.
        assert self.cluster_environment is not None
        self._launcher = SupervisedLauncher(self.cluster_environment, self.num_processes, self.num_nodes, self._timeout)

    @override
    def _setup_distributed(self) -> None:
        # Joining may take long (ranks import and start at their own pace): wait at least torch's default for it.
        timeout, self._timeout = self._timeout, join_timeout(self._timeout)
        try:
            super()._setup_distributed()
        finally:
            self._timeout = timeout
        # The script may still run collectives after `fit`: the groups are released when the interpreter exits.
        release_at_exit()

    @override
    def setup_environment(self) -> None:
        assert self.lightning_module is not None
        if self._auto_tensor_parallel:
            self.layout = replace(self.layout, tp_size=self.num_processes)
        # Resolve the plan against the world size, and against the model where the LightningModule already holds it,
        # before any process group exists (a model that `configure_model` builds is checked in `setup`, before
        # parallelizing).
        model = self._hf_model(built=False)
        # A model parallelized by an earlier entry point (fit, then test; a second Trainer) keeps its mesh.
        existing = None if model is None else mesh_of(model)
        if self.plan is None or (existing is not None and self.plan.built and self.plan.mesh() is not existing):
            config = None if model is None else getattr(model, "config", None)
            world = self.num_nodes * self.num_processes
            self.plan = resolve(self.layout, self.options, self.memory, config, world, self.root_device.type)
        self.layout = self.plan.layout
        if model is not None:
            self._check_model(model)
        if existing is not None and not self.plan.built:
            self.plan.adopt(existing)  # its layout and settings are this plan's (checked above)
        self._setup_distributed()
        set_collective_timeout(self._timeout)  # joined: from now on every collective is bounded by `timeout`
        check_same_decision(self._all_gather_object)  # a node that resumes what another does not would hang
        # The plan's mesh (a user's `parallelize(model, self.device_mesh)` finds the plan from it), with Lightning's
        # dimension names too (`data_parallel`, `tensor_parallel`), for modules written for ModelParallelStrategy.
        self._device_mesh = add_lightning_names(self.plan.mesh())
        self.lightning_module._device_mesh = self._device_mesh

    def _all_gather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, obj)
        return gathered

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Tensor- and context-parallel peers must see the same samples: shard over `dp` only.
        dp = self.device_mesh["dp"]
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Move the batch, then give each context-parallel rank its shard of the sequence.

        The LightningModule receives ``input_ids``, ``position_ids``, ``labels`` and the next-token
        ``shift_labels`` of its load-balanced shard (see
        :func:`lightning_plugins.parallel.context.shard_batch_for_context_parallel`).
        """
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if self.layout.cp_size == 1:
            return batch
        try:
            return context_parallel_batch(batch, self.device_mesh)
        except ValueError as err:
            raise ValueError(f"{type(self).__name__} (cp_size={self.layout.cp_size}): {err}") from None

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        assert self.lightning_module is not None
        self.accelerator.setup(trainer)
        self._parallelize_model()
        check_supported(self.model)
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            launched = self.cluster_environment.creates_processes_externally or self.local_rank > 0
            add_preemption(trainer, self.preempt_signals, launched)
            add_perf(trainer, self.perf)
            add_balance(trainer, self._hf_model(built=True))
        self.setup_precision_plugin()
        # Lightning's clipping calls torch's clip_grad_norm_, which fails on DTensors of several meshes
        # and would miss pipeline stages: route it to the engine's true global norm.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]
        _check_after_closure(self.precision_plugin, self._check_step)
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _hf_model(self, *, built: bool) -> nn.Module | None:
        """The LightningModule's HF model; ``None`` before ``configure_model`` (``built=False``) when that builds it."""
        assert self.lightning_module is not None
        if not built and is_overridden("configure_model", self.lightning_module):
            if not models.hf_models(self.lightning_module):
                return None
        return find_hf_model(self.lightning_module, type(self).__name__)

    def _check_model(self, model: nn.Module) -> None:
        """Check the layout against ``model`` before any collective touches it (no collective runs here).

        A model that is not parallelized yet gets the checks :func:`~lightning_plugins.parallelize` starts with; one
        that is (by an earlier entry point, or by the module's own ``configure_model``) must have this strategy's
        layout, and, when this strategy parallelized it, its settings.
        """
        assert self.plan is not None
        if parallelized_by_user(model):  # by `parallelize_module` in the module's configure_model: kept as it is
            check_parallelized_by_user(type(self).__name__, model, self.plan.layout, self.plan.options)
            return
        if mesh_of(model) is not None:
            if model in _PARALLELIZED:
                check_same_settings(model, self.plan)
            else:  # the module's `configure_model` called `parallelize` itself, with settings of its own
                check_same_settings(model, self.plan.layout)
            return
        check_parallelizable(model, self.plan)  # the plan's checks against the model's config run here, once

    def _parallelize_model(self) -> None:
        """Apply the layout to the HF model once the LightningModule's ``configure_model`` has run.

        The model may have been built in ``__init__`` or in ``configure_model`` (on the meta device too, then each rank
        reads its slices of the checkpoint here), or parallelized by ``configure_model`` itself: every layout takes the
        same path.
        """
        model = self._hf_model(built=True)
        assert model is not None and self.plan is not None
        apply = mesh_of(model) is None and not parallelized_by_user(model)
        if not apply:  # parallelized already: its layout (and settings) must be this plan's; else `parallelize` checks
            self._check_model(model)
        if parallelized_by_user(model):  # by hand: kept as it is, with FSDP2 over the data ranks and AC added
            complete_split_by_hand(model, self.plan)
            _PARALLELIZED.add(model)
        # Else the module's `configure_model` parallelized it (by `parallelize`): only load.
        parallelize_and_load(
            self.lightning_module, model, self.plan, None, None,
            load_from=self.load_from, owner=type(self).__name__, device=self.root_device, apply=apply,
        )  # fmt: skip
        if apply:
            _PARALLELIZED.add(model)

    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if stepping_in_backward(optimizer) is not None:  # Trainer(gradient_clip_val=...): the gradients are gone
            check_step_in_backward(clip_val, 1, "stop")
        parameters = self.precision_plugin.main_params(optimizer)
        assert self.lightning_module is not None
        self._norm_step = self.lightning_module.trainer.global_step + 1
        pipeline = self._pipeline()
        self.grad_norm = clip_grad_norm_(parameters, clip_val, pp_mesh=self.device_mesh["pp"], pipeline=pipeline)

    def _check_step(self, optimizer: Optimizer) -> None:
        """After the gradients are reduced and clipped, before the optimizer steps: the non-finite guard's decision.

        With clipping off, the global norm is computed by the same path with no limit (gradients scaled by exactly 1).
        Where the optimizer steps in backward (``memory.optimizer_in_backward``) no gradient is left: the norm is the
        one its hooks accumulated before applying each gradient.
        """
        assert self.lightning_module is not None
        step = self.lightning_module.trainer.global_step + 1
        fused = stepping_in_backward(optimizer)
        if fused is not None:
            self._norm_step, self.grad_norm = step, fused.grad_norm()
        elif self._norm_step != step:
            self._clip_grad_by_norm(optimizer, math.inf)
        self.nonfinite.check(step, self.grad_norm, optimizer)

    def _pipeline(self) -> Any:
        """The engine's pipeline when ``pp_size > 1`` (found on the LightningModule's HF model), else ``None``."""
        if self.layout.pp_size == 1 or self.lightning_module is None:
            return None
        cached = getattr(self, "_found_pipeline", None)
        if cached is not None and cached[0] is self.lightning_module:
            return cached[1]
        for module in self.lightning_module.modules():
            pipeline = pipeline_of(module)
            if pipeline is not None:
                self._found_pipeline = (self.lightning_module, pipeline)
                return pipeline
        raise LayoutError(
            f"{type(self).__name__}: pp_size={self.layout.pp_size} but the LightningModule holds no pipeline: the HF"
            " model it parallelized was replaced after setup. Build the model in `__init__` or `configure_model` only."
        )

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = self._training_step(*args, **kwargs)
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if isinstance(loss, torch.Tensor):  # noted on this rank; checked by every rank at the optimizer step
            self.nonfinite.observe_loss(loss)
        return output

    def _training_step(self, *args: Any, **kwargs: Any) -> Any:
        pipeline = self._pipeline()
        if pipeline is None:
            return super().training_step(*args, **kwargs)
        # Under pipeline parallelism the model's forward runs forward *and* backward of every micro-batch.
        # Lightning would divide the loss by the accumulation steps before its backward: scale inside.
        assert self.lightning_module is not None
        pipeline.loss_scale = 1.0 / self.lightning_module.trainer.accumulate_grad_batches
        # Lightning zeroes gradients *after* training_step (before backward) at the start of an
        # accumulation window: keep this batch's gradients aside and add them in `backward`, as
        # Lightning's own backward would.
        self._grads.hold(self.lightning_module)
        try:
            return super().training_step(*args, **kwargs)
        finally:
            self._grads.take()

    @override
    def backward(
        self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        if self._pipeline() is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # The pipeline ran backward inside training_step: accumulate its gradients, run the hooks.
        assert self.lightning_module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self._grads.add()
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss


def find_hf_model(module: nn.Module, owner: str) -> nn.Module:
    """The LightningModule's HF model (see :func:`lightning_plugins.parallel.families.find_hf_model`)."""
    return models.find_hf_model(
        module, owner, "built in `__init__` or in `configure_model`"
    )


def _check_after_closure(precision: Any, check: Callable[[Optimizer], None]) -> None:
    """Run ``check(optimizer)`` where Lightning's precision plugin ends an optimizer step's closure: after the backward,
    the ``on_before_optimizer_step`` hooks and the clipping, before the optimizer updates the weights (once per plugin:
    ``setup`` runs again for every entry point)."""
    if getattr(precision, "_lightning_plugins_checked", False):
        return
    after_closure = precision._after_closure

    def checked(model: Any, optimizer: Optimizer) -> None:
        after_closure(model, optimizer)
        check(optimizer)

    precision._after_closure = checked
    precision._lightning_plugins_checked = True
