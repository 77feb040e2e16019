"""The planner: will this layout fit, how fast will it run, and which layout is best?

* :func:`dry_run` builds a model at real size on the meta device, applies a layout on a fake process
  group of the real world size, and measures each kind of rank's memory (``dryrun``).
* :func:`estimate_step_time` models a step from FLOPs, links and the pipeline bubble, calibrated against
  published runs (``timing``).
* :func:`plan` puts both against a :class:`Cluster`; :func:`search` finds the fastest layouts that fit.

The command line is ``lightning-plugins plan`` (``command``). Nothing here imports lightning or accelerate.
"""

from lightning_plugins.planner.dryrun import dry_run
from lightning_plugins.planner.rank_memory import RankMemory
from lightning_plugins.planner.hardware import GPUS, Cluster, cluster_from, parse_bytes
from lightning_plugins.planner.model_stats import load_model_config, model_stats
from lightning_plugins.errors import PlannerError
from lightning_plugins.planner.report import Plan, plan
from lightning_plugins.planner.search import search
from lightning_plugins.planner.timing import StepTime, estimate_step_time
from lightning_plugins.planner.workload import Workload

__all__ = [
    "GPUS",
    "Cluster",
    "Plan",
    "PlannerError",
    "RankMemory",
    "StepTime",
    "Workload",
    "cluster_from",
    "dry_run",
    "estimate_step_time",
    "load_model_config",
    "model_stats",
    "parse_bytes",
    "plan",
    "search",
]
