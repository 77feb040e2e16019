"""Real per-rank peak memory of small layouts on gloo: the ground truth the planner's dry run is checked against (by
the planner's tests and by ``benchmarks/planner.py`` and ``benchmarks/pp_cp_memory.py``).

One small Llama (fp32, fixed seed) where activations are a visible share of the peak, and the layouts of
issue 10's prediction test, run for real with :func:`lightning_plugins.planner.measure.measure_step_memory`.
Importable settings, so that a dry run can be asked about exactly the same thing:

* :data:`CONFIG` (the ``LlamaConfig`` keyword arguments), :data:`SEQ_LEN`, :data:`SEED`,
  :func:`make_config`, :func:`make_model` (seeded, LoRA applied when asked, not parallelized);
* :data:`LAYOUTS` (name -> :class:`MemoryLayout`: world size, ``ParallelLayout``, ``ParallelOptions``,
  ``MemoryOptions``, LoRA, rows per data rank), :func:`make_batch`; :data:`PREFERENCE_LAYOUTS`, more preference steps
  (KTO, a pipeline's DPO and KTO, a full fine-tune's DPO with its frozen copy), measured only when named;
* :func:`measure_layout` measures one layout on the calling rank of a running world;
* :func:`measure_all` runs them (one launched world per world size) and returns
  ``{layout name: {"rank0": measurement, ...}}``; :func:`measured` does it once per process (tests that
  compare predictions with these share one run).

``python -m lightning_plugins.testing.memory_layouts --out measured.json`` writes the same as JSON.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_plugins import MemoryOptions, ParallelLayout, ParallelOptions, parallelize
from lightning_plugins.adapters.lora import LoraOptions
from lightning_plugins.preference.options import PreferenceOptions
from lightning_plugins.testing.world import run_world

#: The model: 4 layers, GQA (8 heads, 4 kv heads), SwiGLU; ~2.9M parameters (11.4 MiB in fp32).
CONFIG: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 1024,
    "max_position_embeddings": 512,
    "attn_implementation": "sdpa",
    "use_cache": False,
}
#: Tokens per row (every token valid), and the seed of weights and adapters.
SEQ_LEN, SEED = 256, 0
#: AdamW over the trainable parameters.
LR = 1e-3


@dataclass(frozen=True)
class MemoryLayout:
    """One measured setting: a layout and its levers on ``world_size`` gloo ranks.

    Args:
        world_size: Ranks of the world it runs in.
        layout: The parallel sizes.
        options: How the dimensions are applied.
        memory: Activation checkpointing and the FSDP2 levers.
        lora: LoRA adapters (applied before ``parallelize``), or ``None`` for a full fine-tune.
        rows: Batch rows each data rank trains per step (under pipelining split into ``pp_microbatches``); under a
            preference objective the chosen rows then the rejected (two per pair).
        objective: SFT (the model's own loss), or a preference method run through its objective
            (:func:`~lightning_plugins.planner.objective_step.step_loss`).
        packed_pairs: Preference pairs packed into rows (``data.packing``): ``rows`` packed rows, one pair each
            (:func:`~lightning_plugins.data.packing.pairs_in_rows`).
    """

    world_size: int
    layout: ParallelLayout
    options: ParallelOptions = field(default_factory=ParallelOptions)
    memory: MemoryOptions = field(default_factory=MemoryOptions)
    lora: LoraOptions | None = None
    rows: int = 2
    objective: PreferenceOptions = field(default_factory=PreferenceOptions)
    packed_pairs: bool = False


_SP = ParallelOptions(sequence_parallel=True, loss_parallel=True)
#: The layouts, by name. 2 ranks: TP, FSDP2, PP 1F1B, CP (Ulysses, ring), LoRA, LoRA with the tiled MLP, DPO
#: with LoRA; 4 ranks: TP x FSDP2 with and without AC.
LAYOUTS: dict[str, MemoryLayout] = {
    "tp2": MemoryLayout(2, ParallelLayout(tp_size=2), _SP),
    "fsdp2": MemoryLayout(2, ParallelLayout(dp_shard_size=2)),
    "pp2_1f1b": MemoryLayout(2, ParallelLayout(pp_size=2), ParallelOptions(pp_schedule="1f1b", pp_microbatches=2)),
    "cp2_ulysses": MemoryLayout(2, ParallelLayout(cp_size=2), ParallelOptions(cp_backend="ulysses")),
    "cp2_ring": MemoryLayout(2, ParallelLayout(cp_size=2), ParallelOptions(cp_backend="ring")),
    "lora_fsdp2": MemoryLayout(2, ParallelLayout(dp_shard_size=2), lora=LoraOptions(r=8, alpha=16)),
    # The tiled MLP (8 tiles of 64 tokens) in checkpointed layers.
    "lora_fsdp2_tiled": MemoryLayout(
        2,
        ParallelLayout(dp_shard_size=2),
        memory=MemoryOptions(activation_checkpointing="full", mlp_chunk_tokens=64),
        lora=LoraOptions(r=8, alpha=16),
    ),
    # DPO: 2 pairs (4 rows), the reference a no-grad forward with the adapters disabled, then the policy's.
    "dpo_lora_fsdp2": MemoryLayout(
        2, ParallelLayout(dp_shard_size=2), lora=LoraOptions(r=8, alpha=16), rows=4, objective=PreferenceOptions("dpo")
    ),
    # The chunked default, with the embedding and the norm + head as FSDP2 units of their own. The dry run is compared
    # with the real run interval by interval (test_planner_dryrun.py): the fake process group holds a few MB more
    # than gloo around the loss-parallel head, so the two steps' overall peaks can fall at different moments.
    "tp2_fsdp2": MemoryLayout(4, ParallelLayout(tp_size=2, dp_shard_size=2), _SP),
    "tp2_fsdp2_ac_full": MemoryLayout(
        4, ParallelLayout(tp_size=2, dp_shard_size=2), _SP, MemoryOptions(activation_checkpointing="full")
    ),
}
_LORA = LoraOptions(r=8, alpha=16)
#: Preference steps beside LAYOUTS' DPO (tests/planner/test_planner_preference.py): KTO (4 rows, their KL rows: the
#: policy's no-grad forward of the KL rows, the reference's of both, the policy's); DPO under PP 1F1B (2 pairs in 2
#: pipeline micro-batches, the reference through the forward-only schedule); a full fine-tune's DPO (its frozen copy;
#: under PP split into the same stages).
PREFERENCE_LAYOUTS: dict[str, MemoryLayout] = {
    "kto_lora_fsdp2": MemoryLayout(2, ParallelLayout(dp_shard_size=2), lora=_LORA, rows=4,
                                   objective=PreferenceOptions("kto")),
    "dpo_lora_pp2_1f1b": MemoryLayout(2, ParallelLayout(pp_size=2), ParallelOptions(pp_schedule="1f1b",
                                      pp_microbatches=2), lora=_LORA, rows=4, objective=PreferenceOptions("dpo")),
    "dpo_full_fsdp2": MemoryLayout(2, ParallelLayout(dp_shard_size=2), rows=4, objective=PreferenceOptions("dpo")),
    "dpo_full_pp2_1f1b": MemoryLayout(2, ParallelLayout(pp_size=2), ParallelOptions(pp_schedule="1f1b",
                                      pp_microbatches=2), rows=4, objective=PreferenceOptions("dpo")),
    "kto_lora_pp2_1f1b": MemoryLayout(2, ParallelLayout(pp_size=2), ParallelOptions(pp_schedule="1f1b",
                                      pp_microbatches=2), lora=_LORA, rows=4, objective=PreferenceOptions("kto")),
    "dpo_lora_fsdp2_packed": MemoryLayout(2, ParallelLayout(dp_shard_size=2), lora=_LORA, rows=2,
                                          objective=PreferenceOptions("dpo"), packed_pairs=True),
}  # fmt: skip


def make_config() -> Any:
    """The ``LlamaConfig`` of :data:`CONFIG`."""
    from transformers import LlamaConfig

    return LlamaConfig(**CONFIG)


def make_model(lora: LoraOptions | None = None) -> torch.nn.Module:
    """The seeded fp32 model in training mode, with LoRA adapters when asked (seeded again, as recipes do)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(make_config(), dtype=torch.float32)
    model.train()
    if lora is not None:
        from lightning_plugins.adapters.lora import apply_lora

        torch.manual_seed(SEED)
        model = apply_lora(model, lora)
    return model


def make_batch(rows: int, data_rank: int = 0, packed_pairs: bool = False) -> dict[str, torch.Tensor]:
    """``rows`` x :data:`SEQ_LEN` random tokens, all valid, different per data rank (``packed_pairs``: as packed
    rows of preference pairs, one pair a row)."""
    gen = torch.Generator().manual_seed(1000 + data_rank)
    input_ids = torch.randint(0, CONFIG["vocab_size"], (rows, SEQ_LEN), generator=gen)
    if packed_pairs:
        from lightning_plugins.data.packing import pairs_in_rows

        return pairs_in_rows(input_ids)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids.clone()}


def measure_layout(spec: MemoryLayout) -> dict[str, Any]:
    """Build, parallelize and measure one layout on this rank, noting where the rank sits in the mesh."""
    from lightning_plugins.adapters.lora import trainable_parameters
    from lightning_plugins.parallel import context_parallel_batch, mesh_of
    from lightning_plugins.planner.measure import measure_step_memory
    from lightning_plugins.planner.objective_step import step_loss

    model = parallelize(make_model(spec.lora), spec.layout, spec.options, spec.memory)
    mesh = mesh_of(model)
    batch = make_batch(spec.rows, mesh["dp"].get_local_rank(), spec.packed_pairs)
    if mesh["cp"].size() > 1:
        batch = context_parallel_batch(batch, mesh)
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=LR)
    # A full fine-tune's DPO reference: a frozen copy laid out like the policy (the same starting weights).
    held = ()
    if spec.objective.frozen_copy(spec.lora):
        held = (parallelize(make_model(), spec.layout, spec.options, spec.memory).requires_grad_(False).eval(),)
    loss_fn = functools.partial(step_loss, spec.objective, reference=held[0] if held else None)
    loss_fn = loss_fn if spec.objective.method != "sft" else None
    result: dict[str, Any] = measure_step_memory(model, optimizer, batch, loss_fn=loss_fn, held=held)
    result["coords"] = {dim: mesh[dim].get_local_rank() for dim in ("pp", "dp", "cp", "tp")}
    result["tokens"] = list(batch["input_ids"].shape)
    del model, optimizer, batch
    gc.collect()
    return result


def _world(rank: int, world_size: int, names: list[str], out_dir: str) -> None:
    results = {name: measure_layout({**LAYOUTS, **PREFERENCE_LAYOUTS}[name]) for name in names}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def measure_all(names: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Run the layouts ``names`` (default: all), one world per world size; ``{name: {"rank0": ..., ...}}``."""
    names = list(LAYOUTS) if names is None else names
    layouts = {**LAYOUTS, **PREFERENCE_LAYOUTS}
    unknown = sorted(set(names) - set(layouts))
    if unknown:
        raise KeyError(f"Unknown layouts {unknown}; the measured layouts are {sorted(layouts)}.")
    results: dict[str, dict[str, Any]] = {name: {} for name in names}
    for world_size in sorted({layouts[name].world_size for name in names}):
        group = [name for name in names if layouts[name].world_size == world_size]
        with tempfile.TemporaryDirectory() as out_dir:
            run_world(_world, world_size, group, out_dir)
            for rank in range(world_size):
                for name, measured in json.loads(Path(out_dir, f"rank{rank}.json").read_text()).items():
                    results[name][f"rank{rank}"] = measured
    return results


@functools.cache
def measured() -> dict[str, dict[str, Any]]:
    """:func:`measure_all` of every layout, run once per process."""
    return measure_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write the measurements to")
    parser.add_argument("--layouts", nargs="*", default=None, help=f"subset of {sorted(LAYOUTS)}")
    args = parser.parse_args()
    args.out.write_text(json.dumps(measure_all(args.layouts), indent=1))


if __name__ == "__main__":
    main()
