"""The README's first command: the demo runs end to end (shortened), exports an HF checkpoint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from _world import script_env
from transformers import AutoModelForCausalLM, AutoTokenizer


def test_demo_runs_and_exports(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_plugins", "demo", "--max-steps", "8", "--eval-limit", "8", "--out", str(out)],
        cwd=tmp_path, env=script_env(), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "exact match before:" in proc.stdout and "after:" in proc.stdout, proc.stdout[-2000:]
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("abc=", return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape[1] > ids.shape[1]
