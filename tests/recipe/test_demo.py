"""The README's first command: the demo runs end to end (shortened), exports an HF checkpoint."""

from __future__ import annotations

import sys
from pathlib import Path

from lightning_plugins.testing.world import run_command
from transformers import AutoModelForCausalLM, AutoTokenizer


def test_demo_runs_and_exports(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = run_command(
        [sys.executable, "-m", "lightning_plugins", "demo", "--max-steps", "8", "--eval-limit", "8", "--out", str(out)],
        cwd=tmp_path,
    )
    assert "exact match before:" in proc.stdout and "after:" in proc.stdout, proc.stdout[-2000:]
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("abc=", return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape[1] > ids.shape[1]
