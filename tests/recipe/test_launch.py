"""The doors' shared prelude (:mod:`lightning_plugins.recipe.launch`): a refused claim leaves the output directory free."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_plugins.errors import RecipeError, RunLockError
from lightning_plugins.recipe.launch import claim_run
from lightning_plugins.recipe.schema import load_recipe
from lightning_plugins.run.lock import LOCK_NAME

TINY = Path(__file__).parents[2] / "recipes" / "tiny" / "full_tp2.yaml"


def test_a_refused_claim_releases_the_lock_and_a_held_directory_is_refused(tmp_path: Path) -> None:
    recipe = load_recipe(TINY, [f"train.output_dir={tmp_path}"])

    def refuse() -> None:
        assert (tmp_path / LOCK_NAME).exists()  # decided under the lock
        raise RecipeError("refused")

    with pytest.raises(RecipeError, match="refused"):
        claim_run(recipe, TINY, None, take_lock=True, decide=refuse, say=None)
    assert not (tmp_path / LOCK_NAME).exists()
    claimed, resume, lock = claim_run(recipe, TINY, None, take_lock=True, decide=lambda: None, say=None)
    assert lock is not None and resume is None and claimed.train.output_dir == recipe.train.output_dir
    try:
        with pytest.raises(RunLockError):
            claim_run(recipe, TINY, None, take_lock=True, decide=lambda: None, say=None)
    finally:
        lock.release()
    assert not (tmp_path / LOCK_NAME).exists()
