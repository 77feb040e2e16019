"""Suite-wide fixtures."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Tests live in folders that mirror the packages; the shared helpers (tiny_models, ...) sit in tests/. The world
# harness is lightning_plugins.testing; its fork server imports the tiny models once for every world. The scripts the
# tests launch (tests/scripts) are importable too, for the names a test shares with its script (kill_run.ENV).
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent / "scripts"))

from lightning_plugins.testing.world import PRELOAD  # noqa: E402

PRELOAD.append("tiny_models")


def pytest_collection_finish(session: pytest.Session) -> None:
    """The runs that test modules declared (``_launch.declare_finetune_run``) are made when a collected test reads
    them."""
    import _launch

    _launch.SESSION_ITEMS[:] = session.items


@pytest.fixture(autouse=True)
def _restore_environment():
    """Undo environment changes a test makes.

    Lightning's launcher writes LOCAL_RANK, WORLD_SIZE, MASTER_PORT... into ``os.environ`` even for one
    in-process device; a later test that launches a script would inherit them, and Lightning would then
    believe the ranks were created externally, start none, and wait forever for the missing peers.
    """
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
