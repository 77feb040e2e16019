"""The process groups are released while the interpreter is whole (:mod:`lightning_plugins.parallel.teardown`).

A gloo group's worker thread still running when the interpreter finalizes can take the GIL then and abort a run that
had finished (``terminate called without an active exception``, exit code 134; issue 22). Every launched world of the
suite checks that no process-group thread is left by then (lightning_plugins/testing/world.py: ``run_world`` after the release,
``run_command`` from the end of each process's exit handlers); this checks the release where a script still holds its
parallelized models, as module-level variables would at exit.
"""

from __future__ import annotations


import torch.distributed as dist
from lightning_plugins.testing.world import run_world
from tiny_models import make_batch, tiny_model

from lightning_plugins import ParallelLayout, parallelize
from lightning_plugins.parallel.options import with_settings
from lightning_plugins.parallel import context_parallel_batch, mesh_of
from lightning_plugins.parallel.teardown import release_process_groups

from lightning_plugins.testing.exit_report import backend_threads

_KEPT: list = []


def _release_with_the_models_kept(rank: int, world_size: int) -> None:
    """Models of three layouts, each trained a step and kept: their DTensors keep their mesh (and the mesh its
    groups), FSDP2 keeps its shard group, ring attention its cp mesh, the pipeline its stages' group."""
    batch = make_batch(4, 16, 64, seed=0)
    tp = parallelize(tiny_model("llama"), ParallelLayout(tp_size=2).resolve(world_size))
    tp(**batch).loss.backward()
    ring = parallelize(tiny_model("gemma"), ParallelLayout(cp_size=2).resolve(world_size), *with_settings("test", cp_backend="ring"))  # fmt: skip
    ring(**context_parallel_batch(batch, mesh_of(ring))).loss.backward()
    pipelined = parallelize(tiny_model("llama_4l"), ParallelLayout(pp_size=2).resolve(world_size))
    pipelined(**batch)  # forward and backward through the schedule
    _KEPT.extend([tp, ring, pipelined])
    assert "pt_gloo_runloop" in backend_threads()
    assert release_process_groups() == 0  # no group survives: what still referred to one refers to None
    assert backend_threads() == [] and not dist.is_initialized()
    _KEPT.clear()


def test_release_frees_the_groups_of_models_the_script_keeps() -> None:
    run_world(_release_with_the_models_kept, 2)
