"""Run several Trainer test scripts one after another in one launched world, so the world starts (and every rank
imports torch, transformers and Lightning) once for all of them (``tests/_launch.py``'s :func:`shared_script`).

    python tests/scripts/script_chain.py '[["trainer_parity.py", "--devices", "2", "--out", "A/results.json"], ...]'

Each script's ``main`` runs with its own arguments (``_common.ARGV``); the command line stays the chain's, so the ranks
that the first script's Trainer starts run the same chain. Each script writes its own results; the first that fails
ends the chain (those before it have written theirs).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import _common  # tests/scripts is on sys.path (the script's own folder)

if __name__ == "__main__":
    for script, *argv in json.loads(sys.argv[1]):
        path = Path(__file__).parent / script
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None, path
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _common.ARGV = argv
        try:
            module.main()
        finally:
            _common.ARGV = None
