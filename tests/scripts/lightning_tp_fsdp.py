"""Run by tests/strategies/test_lightning_habits.py on 4 ranks: Lightning's TP guide module under data parallelism.

* ``tp guide + fsdp2 by the strategy``: the module's ``configure_model`` splits the HF model over
  ``self.device_mesh["tensor_parallel"]`` (Lightning's TP guide) and nothing more; ``ParallelismStrategy
  (data_parallel_size=2, tensor_parallel_size=2, activation_checkpointing="full")`` adds FSDP2 over the data ranks
  (per decoder layer and the root, on the same 2-D mesh) and activation checkpointing.
* ``tp + fsdp2 guide``: Lightning's FSDP2 + TP example: the module splits the model, then shards every decoder layer
  and the root itself with ``fully_shard(..., mesh=self.device_mesh["data_parallel"])``; the strategy keeps that.

Each trains like one process on the global batch (step losses, final weights). Rank 0 writes JSON.
"""

from __future__ import annotations

import copy
import logging
import sys
from pathlib import Path
from typing import Any

from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import (
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
from lightning_habits import TensorParallelGuide
from tiny_models import tiny_model

from lightning_plugins.strategies import ParallelismStrategy

STEPS, LOCAL_BATCH, DP = 3, 2, 2


class TensorAndDataParallelGuide(TensorParallelGuide):
    """Lightning's FSDP2 + TP example: TP first, then ``fully_shard`` of each decoder layer and the root over the data
    ranks of the same mesh."""

    def configure_model(self) -> None:
        super().configure_model()
        dp_mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(self.model, mesh=dp_mesh)


def main() -> None:
    args = script_args()
    # DTensor warns when the checks gather a TP x FSDP2 weight in two steps (full_weights below).
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    reference = tiny_model("llama")
    reference.config.use_cache = False  # training: no KV cache (transformers drops it under checkpointing, warning)
    data = dataset(LOCAL_BATCH * DP, reference.config.vocab_size)
    one = copy.deepcopy(reference)
    ref_losses = reference_fit(one, data, DP, STEPS, LOCAL_BATCH)
    ref_weights = full_weights(one)
    results: dict[str, Any] = {}
    cases = {
        "tp guide + fsdp2 by the strategy": (TensorParallelGuide, {"activation_checkpointing": "full"}),
        "tp + fsdp2 guide": (TensorAndDataParallelGuide, {}),
    }
    for name, (module_class, settings) in cases.items():
        module = module_class(copy.deepcopy(reference))
        strategy = ParallelismStrategy(data_parallel_size=DP, tensor_parallel_size=2, **settings)
        trainer = make_trainer(strategy, args.devices, STEPS, enable_checkpointing=False)
        trainer.fit(module, DataLoader(data, batch_size=LOCAL_BATCH, shuffle=False))
        q = module.model.model.layers[0].self_attn.q_proj.weight
        results[name] = {
            "loss_diff": max_diff(step_losses(module.micro_losses), ref_losses),
            "weight_diff": max_weight_diff(module.model, ref_weights),
            "steps": trainer.global_step,
            "q_proj_mesh": list(q.device_mesh.mesh_dim_names) if isinstance(q, DTensor) else None,
            "layers_sharded": all(isinstance(layer, FSDPModule) for layer in module.model.model.layers),
            "root_sharded": isinstance(module.model, FSDPModule),
            "checkpointed": all(layer.gradient_checkpointing for layer in module.model.model.layers),
        }
    write_results(results, args.out)


if __name__ == "__main__":
    main()
