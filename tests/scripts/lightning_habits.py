"""Run by tests/strategies/test_lightning_habits.py: a module written for Lightning's ``ModelParallelStrategy``, with
one changed name.

* Lightning's TP guide: ``configure_model`` calls ``parallelize_module(self.model, self.device_mesh["tensor_parallel"],
  plan)`` with a column/row-wise plan of the HF model's projections, under ``TensorParallelStrategy(tp_size=2)``; the
  strategy keeps the model as the module parallelized it.
* ``ParallelismStrategy(data_parallel_size=1, tensor_parallel_size=2)``: ``ModelParallelStrategy``'s arguments.

* The TP guide's module on 2 data ranks: the strategy adds FSDP2 over them and activation checkpointing.

Each trains like one process (step losses, final weights); the mesh carries Lightning's names next to the engine's.
A layout the strategy cannot add to a model parallelized by hand (pp_size=2) is refused by name. Rank 0 writes JSON.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import (
    FineTune,
    dataset,
    full_weights,
    make_trainer,
    max_diff,
    max_weight_diff,
    reference_fit,
    script_args,
    step_losses,
    write_results,
)
from tiny_models import tiny_model

from lightning_plugins import LayoutError
from lightning_plugins.strategies import ParallelismStrategy, TensorParallelStrategy

STEPS, LOCAL_BATCH = 3, 2


class TensorParallelGuide(FineTune):
    """Lightning's TP guide, on an HF model: the module parallelizes it over ``self.device_mesh["tensor_parallel"]``."""

    def configure_model(self) -> None:
        tp_mesh = self.device_mesh["tensor_parallel"]
        self.mesh_sizes = {name: self.device_mesh[name].size() for name in ("data_parallel", "tensor_parallel")}
        plan = {}
        for i in range(len(self.model.model.layers)):
            layer = f"model.layers.{i}"
            plan.update({
                f"{layer}.self_attn.q_proj": ColwiseParallel(), f"{layer}.self_attn.k_proj": ColwiseParallel(),
                f"{layer}.self_attn.v_proj": ColwiseParallel(), f"{layer}.self_attn.o_proj": RowwiseParallel(),
                f"{layer}.mlp.gate_proj": ColwiseParallel(), f"{layer}.mlp.up_proj": ColwiseParallel(),
                f"{layer}.mlp.down_proj": RowwiseParallel(),
            })  # fmt: skip
        parallelize_module(self.model, tp_mesh, plan)


def fit(module: FineTune, strategy: Any, data: list) -> Any:
    trainer = make_trainer(strategy, 2, STEPS, enable_checkpointing=False)
    trainer.fit(module, DataLoader(data, batch_size=LOCAL_BATCH, shuffle=False))
    return trainer


def main() -> None:
    args = script_args()
    reference = tiny_model("llama")
    data = dataset(LOCAL_BATCH, reference.config.vocab_size)
    one = copy.deepcopy(reference)
    ref_losses = reference_fit(one, data, 1, STEPS, LOCAL_BATCH)
    ref_weights = full_weights(one)
    results: dict[str, Any] = {}
    cases = {
        "tp guide": (TensorParallelGuide, lambda: TensorParallelStrategy(tp_size=2)),
        "lightning sizes": (FineTune, lambda: ParallelismStrategy(data_parallel_size=1, tensor_parallel_size=2)),
    }
    for name, (module_class, make_strategy) in cases.items():
        module = module_class(copy.deepcopy(reference))
        trainer = fit(module, make_strategy(), data)
        mesh = trainer.strategy.device_mesh
        results[name] = {
            "loss_diff": max_diff(step_losses(module.micro_losses), ref_losses),
            "weight_diff": max_weight_diff(module.model, ref_weights),
            "steps": trainer.global_step,
            "mesh": {n: mesh[n].size() for n in ("data_parallel", "tensor_parallel", "dp", "tp")},
            "configure_model_saw": getattr(module, "mesh_sizes", None),
            "tp_size": trainer.strategy.layout.tp_size,
        }
    # The TP guide's module on 2 data ranks (its tensor_parallel mesh of 1 rank): the strategy adds FSDP2 over them and
    # activation checkpointing (4 ranks, dp 2 x tp 2: tests/scripts/lightning_tp_fsdp.py).
    reference.config.use_cache = False  # training: no KV cache (transformers drops it under checkpointing, warning)
    data2 = dataset(2 * LOCAL_BATCH, reference.config.vocab_size)
    one = copy.deepcopy(reference)
    ref_losses2 = reference_fit(one, data2, 2, STEPS, LOCAL_BATCH)
    module = TensorParallelGuide(copy.deepcopy(reference))
    strategy = ParallelismStrategy(data_parallel_size=2, tensor_parallel_size=1, activation_checkpointing="full")
    trainer = fit(module, strategy, data2)
    layers = module.model.model.layers
    results["fsdp2 added"] = {
        "loss_diff": max_diff(step_losses(module.micro_losses), ref_losses2),
        "weight_diff": max_weight_diff(module.model, full_weights(one)),
        "steps": trainer.global_step,
        "sharded": all(isinstance(m, FSDPModule) for m in (*layers, module.model)),
        "q_proj_mesh": list(layers[0].self_attn.q_proj.weight.device_mesh.mesh_dim_names),
        "checkpointed": all(layer.gradient_checkpointing for layer in layers),
    }
    try:
        fit(TensorParallelGuide(copy.deepcopy(reference)), ParallelismStrategy(tp_size=1, pp_size=2), data)
        results["pp refused"] = ""
    except LayoutError as err:
        results["pp refused"] = str(err)
    write_results(results, args.out)


if __name__ == "__main__":
    main()
