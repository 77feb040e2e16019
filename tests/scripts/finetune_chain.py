"""Run by tests that chain several runs of the same world size: ``lightning-plugins finetune`` once per argument
list, one after another in one launched world, so the world starts (and imports) once for all of them.

    python tests/scripts/finetune_chain.py '[["RECIPE.yaml", "--train.output_dir=A", ...], [...]]'

The first run's Trainer starts the other ranks, which run the same chain. A run that resumes names its checkpoint
(``--resume PATH``): the ranks the first run started inherited that run's resume decision, not a later one's.
"""

from __future__ import annotations

import json
import sys

import lightning_plugins.testing.exit_report  # noqa: F401  (before any door: reports the process-group threads alive at exit)
from _door import run_door

if __name__ == "__main__":
    for argv in json.loads(sys.argv[1]):
        run_door("finetune", argv)
