"""Every bad input is named, early (issue 23): the file and line of a data error, what truncation left, a dataset
smaller than one global batch, the closest valid key of a typo, a GPU recipe without a GPU, a model path that is
neither a directory nor cached while offline, a directory that is not a model, a damaged weight file, an output
directory that cannot be written, TP on a family without a plan. No launched world: the checks run where the doors
run them, before any rank starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from lightning_plugins.data import DataConfig, DataError, build_dataset
from lightning_plugins.recipe.schema import load_recipe
from lightning_plugins.errors import RecipeError

TINY = Path(__file__).parents[2] / "recipes" / "tiny"
RECIPE = TINY / "full_tp2.yaml"
GOOD = {"prompt": "abc=", "completion": "cba"}
CHAT = {"messages": [{"role": "user", "content": "r ab"}, {"role": "assistant", "content": "ba"}]}


@pytest.fixture(scope="module")
def tokenizer() -> object:
    return AutoTokenizer.from_pretrained(TINY / "model")


def _lines(path: Path, *lines: str | bytes) -> Path:
    path.write_bytes(b"".join((line if isinstance(line, bytes) else line.encode()) + b"\n" for line in lines))
    return path


@pytest.mark.parametrize(
    ("third", "fmt", "said"),
    [
        (b'{"prompt": "ab\xff=", "completion": "x"}', "auto", r"bad.jsonl:3: not valid UTF-8 \(byte 0xff at column 15\)"),
        ('{"prompt": "ab=", "completion": }', "auto", r"bad.jsonl:3: not valid JSON"),
        ('{"prompt": "ab="}', "auto", r"bad.jsonl:3: field 'completion' must be a string, but it is missing"),
        (
            json.dumps({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}),
            "chat",
            r"bad.jsonl:3: the tokenizer's chat template refused the conversation \(unknown role: robot\).*'robot'",
        ),
    ],
    ids=["not-utf8", "bad-json", "missing-field", "unknown-role"],
)
def test_data_errors_name_the_file_and_line(tmp_path: Path, tokenizer: object, third: str | bytes, fmt: str, said: str) -> None:
    good = json.dumps(CHAT if fmt == "chat" else GOOD)
    path = _lines(tmp_path / "bad.jsonl", good, good, third)
    with pytest.raises(DataError, match=said):
        build_dataset(DataConfig(train=str(path), format=fmt), tokenizer, "train")


def test_truncation_that_leaves_nothing_says_so(tmp_path: Path, tokenizer: object) -> None:
    path = _lines(tmp_path / "long.jsonl", *[json.dumps({"prompt": "abcdefgh=", "completion": "x"})] * 3)
    with pytest.raises(
        DataError,
        match=r"truncation at data.max_seq_len=4 left nothing to train on: all 3 train records of .*long.jsonl were"
        r" dropped \(\d+ tokens\).*Raise data.max_seq_len \(the longest record has \d+ tokens\)",
    ):
        build_dataset(DataConfig(train=str(path), max_seq_len=4), tokenizer, "train")


def test_a_dataset_smaller_than_one_global_batch_is_refused(tmp_path: Path, tokenizer: object) -> None:
    from lightning_plugins.recipe.build import build_loaders

    path = _lines(tmp_path / "few.jsonl", *[json.dumps(GOOD)] * 5)
    recipe = load_recipe(RECIPE, [f"data.train={path}", "data.eval=null", "layout.tp_size=1", "train.micro_batch_size=4",
                                  "train.global_batch_size=8"])  # fmt: skip
    with pytest.raises(
        DataError,
        match=r"holds 5 training samples.*fewer than one global batch of 8 \(train.micro_batch_size 4 x accumulation 1"
        r" x data-parallel ranks 2\).*Set train.micro_batch_size=2 and train.global_batch_size=4",
    ):
        build_loaders(recipe, tokenizer)


def test_a_typo_names_the_key_the_closest_valid_key_and_the_file(tmp_path: Path) -> None:
    from lightning_plugins.cli import main

    recipe = tmp_path / "typo.yaml"
    recipe.write_text(RECIPE.read_text().replace("  lr:", "  lrr:").replace("\ntrain:", "\ntrian:\n  max_steps: 3\ntrain:"))
    recipe.with_name("model").symlink_to(TINY / "model")
    recipe.with_name("data").symlink_to(TINY / "data")
    with pytest.raises(SystemExit) as stop:
        main(["finetune", str(recipe), "--train.max_stesp=3", "--layout.tp_sise=2", "--lora.rr=4"])
    said = str(stop.value.code)
    assert said.startswith(f"error: {recipe}: 5 problem(s)"), said
    for typo, meant in [("optim.lrr", "lr"), ("trian", "train"), ("train.max_stesp", "max_steps"),
                        ("layout.tp_sise", "tp_size"), ("lora.rr", "r")]:  # fmt: skip
        assert f"  {typo}: unknown key; did you mean `{meant}`?" in said, said


def test_a_gpu_recipe_without_a_gpu_is_refused_with_the_fix(capsys: pytest.CaptureFixture) -> None:
    from lightning_plugins.accelerate.__main__ import main

    with pytest.raises(SystemExit) as stop:  # the Accelerate door, in-process (a world of one)
        main([str(RECIPE), "--layout.tp_size=1", "--hardware.accelerator=gpu"])
    said = capsys.readouterr().err
    assert stop.value.code == 1 and "Traceback" not in said, said
    assert "hardware.accelerator: gpu, but this machine has no GPU torch can use" in said, said
    assert "Set hardware.accelerator: cpu (--hardware.accelerator=cpu)" in said, said


def test_a_model_path_neither_a_directory_nor_cached_is_refused_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_plugins.recipe.preflight import check_here

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    recipe = load_recipe(RECIPE, ["model.path=modle"])  # a hub id to the recipe: valid anywhere with a network
    with pytest.raises(RecipeError, match=rf"model.path='modle' is no directory.*not in the local Hugging Face cache.*"
                       rf"offline\)\. Did you mean {TINY / 'model'}\?"):  # fmt: skip
        check_here(recipe, RECIPE)
    with pytest.raises(RecipeError, match=rf"model.path='./modle' is not a directory.*Did you mean {TINY / 'model'}\?"):
        load_recipe(RECIPE, ["model.path=./modle"])


@pytest.mark.parametrize("damage", ["truncated", "header"])
def test_a_damaged_weight_file_names_the_file_and_the_directory(tmp_path: Path, damage: str) -> None:
    import shutil

    from lightning_plugins.recipe.preflight import check_here

    model = shutil.copytree(TINY / "model", tmp_path / "model")
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-100] if damage == "truncated" else data[:8] + b"\0" * 64 + data[72:])
    recipe = load_recipe(RECIPE, [f"model.path={model}", f"train.output_dir={tmp_path / 'out'}"])
    said = r"its header says \d+ bytes, the file has \d+ \(truncated\)" if damage == "truncated" else "header is not JSON"
    with pytest.raises(RecipeError, match=rf"model.path={model}: weight file model.safetensors is damaged.*{said}"):
        check_here(recipe, RECIPE)


def test_an_output_dir_that_cannot_be_written_is_refused(tmp_path: Path) -> None:
    from lightning_plugins.recipe.preflight import check_here

    (tmp_path / "file").write_text("")
    good = load_recipe(RECIPE, [f"train.output_dir={tmp_path / 'out'}"])
    check_here(good, RECIPE)  # created, written to and left clean
    assert (tmp_path / "out").is_dir() and not list((tmp_path / "out").iterdir())
    bad = load_recipe(RECIPE, [f"train.output_dir={tmp_path / 'file' / 'out'}"])
    with pytest.raises(RecipeError, match=r"train.output_dir='.*file/out' cannot be written \(Not a directory\).*writable"):
        check_here(bad, RECIPE)


def test_tensor_parallel_on_a_family_without_a_plan_is_refused_at_load(tmp_path: Path) -> None:
    from transformers import GPT2Config

    GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0).save_pretrained(tmp_path)
    with pytest.raises(RecipeError, match=r"Model type 'gpt2' has no registered family.*cannot be tensor-parallel\. Use"
                       r" tp_size=1"):  # fmt: skip
        load_recipe(RECIPE, [f"model.path={tmp_path}"])
    assert load_recipe(RECIPE, [f"model.path={tmp_path}", "layout.tp_size=1", "train.micro_batch_size=8"])


def test_a_model_path_that_is_a_directory_but_no_model_is_refused_at_load(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    for directory in (TINY / "data", tmp_path):  # no config.json; one without a model type
        with pytest.raises(RecipeError, match=rf"model.path='{directory}' is a directory but not a transformers model"
                           r" \(.*\)\. Point model.path at an HF checkpoint directory"):  # fmt: skip
            load_recipe(RECIPE, [f"model.path={directory}"])


def test_both_doors_stop_on_bad_data_with_one_line_before_any_collective(tmp_path: Path) -> None:
    """The one launched world: ``accelerate launch`` starts 2 ranks, which fail alike before any collective; the
    Lightning door's rank 0 reads the data before it starts rank 1, so no world starts at all."""
    import sys

    from lightning_plugins.testing.world import run_command
    from _launch import ROOT, accelerate_launch

    path = _lines(tmp_path / "bad.jsonl", json.dumps(GOOD), b'{"prompt": "\xe9=", "completion": "x"}')
    bad = [f"--data.train={path}", "--data.eval=null"]
    said = f"{path}:2: not valid UTF-8 (byte 0xe9 at column 13)"
    lightning = run_command([sys.executable, "-m", "lightning_plugins", "finetune", str(RECIPE),
                             f"--train.output_dir={tmp_path / 'l'}", *bad], cwd=ROOT, timeout=120, expected=1)  # fmt: skip
    assert said in lightning.stderr and "Traceback" not in lightning.stderr, lightning.stderr[-3000:]
    assert "Initializing distributed" not in lightning.stdout + lightning.stderr  # no rank was started
    accelerate = accelerate_launch(RECIPE, tmp_path / "a", *bad, expected=1)
    ours = f'File "{ROOT / "lightning_plugins"}'  # accelerate's launcher prints its own traceback, no frame of ours
    assert accelerate.stderr.count(said) == 1 and ours not in accelerate.stderr, accelerate.stderr[-3000:]
