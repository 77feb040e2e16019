"""Resuming with a changed recipe (lightning_plugins.recipe.diff): each difference is applied, refused or needs
--resume-reset-optimizer, never ignored. Pure Python here; through both doors in test_resume_changed.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lightning_plugins.recipe.schema import Recipe, load_recipe
from lightning_plugins.recipe.diff import (
    RECIPE_FILE,
    RESET_FLAG,
    RULES,
    ResumeMismatch,
    check_resume,
    diff_recipes,
    record_recipe,
    rule_for,
)

TINY = Path(__file__).parents[2] / "recipes" / "tiny" / "full_tp2.yaml"


def _recipe(tmp_path: Path, *overrides: str) -> Recipe:
    return load_recipe(TINY, [f"train.output_dir={tmp_path / 'out'}", *overrides])


def _checkpoint(tmp_path: Path, recipe: Recipe | None, step: int = 4) -> Path:
    path = tmp_path / "out" / "checkpoints" / f"step={step}.ckpt"
    path.mkdir(parents=True)
    if recipe is not None:
        record_recipe(path, recipe.to_yaml())
    return path


def test_every_section_and_key_has_a_rule() -> None:
    """A new recipe key falls under its section's rule; every top-level section has one, and the table's keys exist."""
    assert set(Recipe.model_fields) <= set(RULES)
    keys = {".".join(parts) for parts in _paths(yaml.safe_load(load_recipe(TINY).to_yaml()))}
    keys |= {"lora"}
    for key in RULES:
        assert key in keys or any(k.startswith(key + ".") for k in keys), key
    assert rule_for("train.max_steps")[0] == "applied"
    assert rule_for("train.seed")[0] == "refused"
    assert rule_for("optim.betas")[0] == "optimizer"
    assert rule_for("data.eval")[0] == "applied"
    assert rule_for("data.train")[0] == "refused"


def _paths(tree: object, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(tree, dict):
        return [p for key, value in tree.items() for p in _paths(value, (*prefix, key))] + [prefix]
    return [prefix]


def test_diff_classifies_each_difference() -> None:
    old = {"model": {"path": "/a"}, "optim": {"lr": 0.1}, "train": {"max_steps": 6, "seed": 0}, "lora": None,
           "layout": {"tp_size": 2}}  # fmt: skip
    new = {"model": {"path": "/b"}, "optim": {"lr": 0.2}, "train": {"max_steps": 10, "seed": 0},
           "lora": {"r": 8}, "layout": {"tp_size": 1}}  # fmt: skip
    found = {(c.key, c.kind): (c.old, c.new) for c in diff_recipes(old, new)}
    assert found == {
        ("model.path", "refused"): ("/a", "/b"),
        ("optim.lr", "optimizer"): (0.1, 0.2),
        ("train.max_steps", "applied"): (6, 10),
        ("lora", "refused"): (None, {"r": 8}),  # a section that appears is one difference, not one per key
        ("layout.tp_size", "applied"): (2, 1),
    }
    assert diff_recipes(old, old) == []
    assert diff_recipes({"train": {"resume_reset_optimizer": False}}, {"train": {"resume_reset_optimizer": True}}) == []


def test_a_checkpoint_from_before_a_section_resumes_under_its_defaults(tmp_path: Path) -> None:
    """A checkpoint whose recipe predates the ``objective`` and ``vision`` sections trained as their defaults say: no
    difference; a run that sets either differently is refused."""
    written = yaml.safe_load(_recipe(tmp_path).to_yaml())
    before = {key: value for key, value in written.items() if key not in ("objective", "vision")}
    assert diff_recipes(before, written) == []
    changed = {**written, "vision": {**written["vision"], "train_tower": True}}
    assert [(c.key, c.kind) for c in diff_recipes(before, changed)] == [("vision", "refused")]

def test_applied_changes_get_one_line_each(tmp_path: Path) -> None:
    checkpoint = _checkpoint(tmp_path, _recipe(tmp_path, "train.max_steps=6"))
    said: list[str] = []
    recipe = _recipe(tmp_path, "train.max_steps=10", "train.checkpoint_every=5", "layout.tp_size=1",
                     "hardware.devices=1")  # fmt: skip
    assert check_resume(recipe, checkpoint, said.append) is recipe
    assert said == [
        "resuming step=4 with hardware.devices 2 -> 1",
        "resuming step=4 with layout.tp_size 2 -> 1",
        "resuming step=4 with train.checkpoint_every 200 -> 5",
        "resuming step=4 with train.max_steps 6 -> 10",
    ]
    said.clear()
    assert check_resume(_recipe(tmp_path, "train.max_steps=6"), str(checkpoint), said.append).train.max_steps == 6
    assert said == []  # the same recipe: nothing to say


@pytest.mark.parametrize(
    ("override", "key", "old", "new"),
    [
        ("model.dtype=bf16", "model.dtype", "fp32", '"bf16"'),
        ("data.max_seq_len=32", "data.max_seq_len", "64", "32"),
        ("train.global_batch_size=32", "train.global_batch_size", "16", "32"),
    ],
)
def test_refused_changes_name_key_values_and_the_fix(tmp_path: Path, override: str, key: str, old: str, new: str) -> None:
    checkpoint = _checkpoint(tmp_path, _recipe(tmp_path))
    with pytest.raises(ResumeMismatch) as caught:
        check_resume(_recipe(tmp_path, override, "train.max_steps=10"), checkpoint)
    message = str(caught.value)
    assert f"cannot resume {checkpoint}" in message
    assert f"{key} " in message and f" -> {new}" in message and old in message
    assert "another train.output_dir" in message and "train.max_steps" not in message  # applied ones are not refused
    assert RESET_FLAG not in message


def test_optimizer_changes_need_the_flag(tmp_path: Path) -> None:
    checkpoint = _checkpoint(tmp_path, _recipe(tmp_path))
    with pytest.raises(ResumeMismatch, match=rf"(?s)optim.lr 0.003 -> 0.001.*pass {RESET_FLAG}") as caught:
        check_resume(_recipe(tmp_path, "optim.lr=1e-3", "optim.warmup_steps=0"), checkpoint)
    assert "optim.warmup_steps 30 -> 0" in str(caught.value) and "another train.output_dir" not in str(caught.value)
    said: list[str] = []
    recipe = _recipe(tmp_path, "optim.lr=1e-3", "train.resume_reset_optimizer=true")
    recipe = check_resume(recipe, checkpoint, said.append)
    assert recipe.train.resume_reset_optimizer
    assert said == ["resuming step=4 with optim.lr 0.003 -> 0.001",
                    f"resuming step=4 with a new AdamW state and schedule ({RESET_FLAG}), positioned at step=4"]  # fmt: skip
    # The flag kept on a later resume whose optim is the checkpoint's resets nothing (a requeued job stays exact).
    said.clear()
    recipe = check_resume(_recipe(tmp_path, "train.resume_reset_optimizer=true"), checkpoint, said.append)
    assert not recipe.train.resume_reset_optimizer
    assert said == [f"resuming step=4: {RESET_FLAG} has nothing to reset (optim is the checkpoint's); AdamW's state is kept"]


def test_old_checkpoints_and_fresh_starts(tmp_path: Path) -> None:
    said: list[str] = []
    fresh = _recipe(tmp_path, "train.resume_reset_optimizer=true")
    assert not check_resume(fresh, None, said.append).train.resume_reset_optimizer and said == []  # nothing to resume
    checkpoint = _checkpoint(tmp_path, None)
    assert not (checkpoint / RECIPE_FILE).exists()
    assert check_resume(_recipe(tmp_path, "optim.lr=1e-3"), checkpoint, said.append).optim.lr == 1e-3
    assert said == [f"resuming step=4: {checkpoint} records no recipe (written by an older version), so nothing can be"
                    " compared with this run's."]  # fmt: skip


@pytest.mark.parametrize("offload", [False, True])
def test_reset_optimizer_starts_adamw_over_at_the_resumed_step(tmp_path: Path, offload: bool) -> None:
    """A new AdamW state (no moments, no step count) with the new hyperparameters, and the new schedule positioned at
    the resumed step; the same for an optimizer whose state lives in host memory (memory.optimizer_offload)."""
    import torch

    from lightning_plugins.recipe.diff import reset_optimizer
    from lightning_plugins.recipe.build import lr_lambda, make_optimizer

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    old = _recipe(tmp_path, "optim.scheduler=constant", f"memory.optimizer_offload={str(offload).lower()}")
    optimizer, schedule = make_optimizer(model, old, 6)
    for _ in range(4):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    new = old.model_copy(update={"optim": old.optim.model_copy(update={"lr": 1e-3, "scheduler": "linear",
                                                                       "weight_decay": 0.1})})  # fmt: skip
    state = reset_optimizer(optimizer, schedule, model, new, 6, 4)
    assert state == schedule.state_dict() and schedule.last_epoch == 4
    assert not optimizer.state_dict()["state"]
    group = optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(1e-3 * lr_lambda(4, 6, 30, "linear", 0.0)) and group["weight_decay"] == 0.1
    weights = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(2, 4)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    rate = group["lr"]
    optimizer.step()
    schedule.step()
    assert group["lr"] == pytest.approx(1e-3 * lr_lambda(5, 6, 30, "linear", 0.0))
    # AdamW's first step from zero moments: decay, then lr x the gradient's sign (the old moments would give other steps).
    for param, weight, grad in zip(model.parameters(), weights, grads):
        expected = weight * (1 - rate * 0.1) - rate * grad / (grad.abs() + 1e-8)
        torch.testing.assert_close(param.detach(), expected, rtol=0, atol=1e-7)


def test_a_refused_explicit_resume_says_to_drop_it(tmp_path: Path) -> None:
    checkpoint = _checkpoint(tmp_path, _recipe(tmp_path))
    elsewhere = load_recipe(TINY, [f"train.output_dir={tmp_path / 'other'}", "train.seed=1"])
    with pytest.raises(ResumeMismatch, match="(?s)train.seed 0 -> 1: .*drop --resume "):
        check_resume(elsewhere, checkpoint)
