"""Gemma 4's layouts are exact with its real head width: in float64, with transformers' default 512-wide heads on its
global layer, FSDP2=2 and TP=2 train as one process does to 1e-10 (per-step losses, pre-clip gradient norms, every
trained weight after the parity test's 3 steps: `test_image_text_parity._run_case`, whose reference runs on each rank).

Why float64 and not the fp32 parity test (which runs Gemma 4 with 8-wide heads): Gemma 4's attention is unscaled (q
and k RMS-normed, scaling 1.0), so over 512-wide heads a random tiny model's scores spread ~23 (a near one-hot
softmax) and its fp32 gradients are accurate to ~1e-5 only, one process's too: its pre-clip norm (~14) is 2e-5 from
the float64 value at the first step and 4e-4 after three, so fp32 cannot tell a layout's error from rounding at the
parity test's 1e-5 (there FSDP2 differed by 2.6e-5 and TP by 2e-4). In float64 rounding is ~1e-16 a step: these
layouts match to ~3e-13, and a gradient counted twice, missed or averaged wrongly would show at its own size. Every
step is float64: the model's own float32 upcasts (`.float()` in its RMSNorms and pooler, ``softmax(dtype=float32)``)
run in float64 in these ranks, and the loss comes from whole logits (``loss_chunk_tokens=None``: the chunked loss sums
its value in float32).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import test_image_text_parity as parity
import tiny_vlm as vlm
import torch
from _launch import world_json

from lightning_plugins.parallel.options import MemoryOptions

TOL = 1e-10
LAYOUTS = {"fsdp2": {"dp_shard_size": 2}, "tp2": {"tp_size": 2}}


def _wide(config):
    """Gemma 4's tiny config with transformers' default 512-wide heads on its global layer."""
    text = config.text_config.to_dict()
    text.pop("per_layer_config")  # derived again from global_head_dim
    config.text_config = type(config.text_config)(**text, global_head_dim=512)
    return config


def _in_float64() -> None:
    """This rank's parity machinery as the module doc says (a process of its own: nothing else runs in it)."""
    narrow, collate, softmax = vlm.tiny_vlm_config, vlm.collate, torch.nn.functional.softmax
    vlm.tiny_vlm_config = lambda family: _wide(narrow(family))
    parity.tiny_vlm = lambda family, seed=0: vlm.tiny_vlm(family, seed).double()
    parity.collate = lambda samples: {
        k: v.double() if v.is_floating_point() else v for k, v in collate(samples).items()
    }
    parity.MemoryOptions = functools.partial(MemoryOptions, loss_chunk_tokens=None)
    torch.Tensor.float = lambda self, *args, **kwargs: self.double()
    torch.nn.functional.softmax = lambda x, *args, dtype=None, **kwargs: softmax(
        x, *args, dtype=torch.float64 if dtype is torch.float32 else dtype, **kwargs
    )


def _world(rank: int, world_size: int, out_dir: str) -> None:
    _in_float64()
    results = {name: parity._run_case(world_size, "gemma4", sizes, "full") for name, sizes in LAYOUTS.items()}
    history, weights = parity._reference("gemma4", "full")
    results["reference"] = {
        "norms": history[parity.STEPS :],
        "dtypes": sorted({str(w.dtype) for w in weights.values()}),
    }
    results["reference"]["global_head"] = weights["model.language_model.layers.1.self_attn.q_proj.weight"].shape[0] // 4
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@functools.cache
def _results() -> list[dict]:
    return world_json(_world, 2)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gemma4_with_512_wide_heads_matches_one_process_in_float64(layout: str) -> None:
    for rank, results in enumerate(_results()):
        reference, result = results["reference"], results[layout]
        # What ran: float64 weights, the 512-wide heads, a pre-clip norm of their size (~14; ~4 with 8-wide heads).
        assert reference["dtypes"] == ["torch.float64"] and reference["global_head"] == 512, reference
        assert min(reference["norms"]) > 10, reference
        assert all(change > 1e-4 for change in result["moved"].values()), (layout, rank, result["moved"])
        where = (layout, rank, {key: result[key] for key in ("loss_diff", "norm_diff", "trained_diff")})
        assert result["loss_diff"] <= TOL and result["norm_diff"] <= TOL and result["trained_diff"] <= TOL, where
