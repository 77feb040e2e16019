"""Expert parallelism on gloo: the all-to-all bytes it sends against the analytic count, and memory per rank against
FSDP2 on the same ranks.

A small Mixtral (``--hidden`` 256, 8 experts, top-2, 4 layers; fp32) is parallelized as ``ParallelLayout(
dp_shard_size=W, ep_size=W)`` and as plain FSDP2 (``dp_shard_size=W``) on a world of ``W`` spawned CPU ranks (``W``
in ``--worlds``, 2 and 4 by default), every rank with its own ``--rows`` x ``--seq`` tokens, AdamW.

All-to-all bytes of one training step (forward + backward), per rank. The engine's two data all-to-alls per MoE layer
(:func:`torch.distributed._functional_collectives.all_to_all_single_autograd`, dispatch and combine) are wrapped:
in the forward each call's input rows are counted by its input splits; a hook on its output counts, in the backward,
the incoming gradient's rows by the output splits (the backward all-to-all sends exactly those). Rows that stay on
this rank (its own split) are not sent and not counted. The per-expert count exchange (``dist.all_to_all_single``
of ``experts`` int64s) is counted separately. The analytic count is ``tokens x top_k x hidden x 4 bytes x 2
(dispatch + combine) x 2 (forward + backward) x layers x (W - 1) / W``: uniform routing keeps ``1/W`` of the pairs
local. The count from the routing itself is also given: every rank's router choices (a forward pre-hook on the
experts modules, all-gathered after the step) say how many pairs each rank sends to each other one; this rank sends
its pairs bound elsewhere (dispatch) and the results of the pairs that came to it (combine), forward and backward.
Asserted: every pair is dispatched once (all rows, local included, add up to ``tokens x top_k`` per layer), and the
bytes counted at the all-to-alls equal the bytes the routing calls for, exactly.

Memory per rank: :func:`lightning_plugins.planner.measure.measure_step_memory` (one untracked step, then one tracked
by torch's memory tracker): parameters, gradients and AdamW state (from the local shards' storages) and the
step's peak. Both layouts must give the same loss on every rank (asserted to 1e-5: they train the same model).

Usage::

    python benchmarks/expert_parallel.py [--worlds 2 4 --hidden 256 --experts 8 --layers 4 --rows 2 --seq 256]
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_plugins.testing.bench import Timed, add_report_arguments, command, machine, write_report
from lightning_plugins.testing.world import spawn_world

BYTES = 4  # fp32


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """The small Mixtral, seeded (every rank builds the same weights)."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    config = MixtralConfig(
        hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=4, vocab_size=args.vocab, max_position_embeddings=args.seq,
        num_local_experts=args.experts, num_experts_per_tok=args.top_k, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


class AllToAllCounter:
    """Counts the rows the engine's all-to-alls send from this rank, forward and backward, while installed."""

    def __init__(self, rank_in_group: int, row_bytes: int) -> None:
        self.rank, self.row_bytes = rank_in_group, row_bytes
        self.sent = {"forward": 0, "backward": 0}
        self.rows_dispatched = 0  # forward rows of the dispatch calls, local ones included
        self.count_bytes = 0
        self.calls = 0
        self.routed: torch.Tensor | None = None  # [destination rank] pairs of this rank's tokens, all layers

    def install(self, model: torch.nn.Module, ranks: int) -> None:
        import lightning_plugins.parallel.moe.experts as experts

        self._experts, self._original = experts, experts.all_to_all_single_autograd
        self._original_counts = experts.dist.all_to_all_single
        experts.all_to_all_single_autograd = self._data
        experts.dist.all_to_all_single = self._counts
        self.routed = torch.zeros(ranks, dtype=torch.int64)
        self._hooks = [
            module.register_forward_pre_hook(self._route, with_kwargs=True)
            for _, module in experts.expert_modules(model)
        ]

    def uninstall(self) -> None:
        self._experts.all_to_all_single_autograd = self._original
        self._experts.dist.all_to_all_single = self._original_counts
        for hook in self._hooks:
            hook.remove()

    def _route(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        index = args[1] if len(args) > 1 else kwargs["top_k_index"]
        per_rank = module.num_experts // len(self.routed)
        self.routed += torch.bincount(index.reshape(-1) // per_rank, minlength=len(self.routed))

    def routing_bytes(self) -> int:
        """What the routing says this rank sends, forward + backward: its pairs bound for other ranks (dispatch)
        and the other ranks' pairs bound for it (combine), from every rank's router choices (an all-gather)."""
        ranks = len(self.routed)
        matrix = [torch.zeros_like(self.routed) for _ in range(ranks)]
        dist.all_gather(matrix, self.routed)
        pairs = torch.stack(matrix)  # [source rank, destination rank]
        dispatch = pairs[self.rank].sum() - pairs[self.rank, self.rank]
        combine = pairs[:, self.rank].sum() - pairs[self.rank, self.rank]
        return int(dispatch + combine) * self.row_bytes * 2

    def _remote_bytes(self, splits: list[int]) -> int:
        return (sum(splits) - splits[self.rank]) * self.row_bytes

    def _data(self, tensor: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any) -> Any:
        self.calls += 1
        if self.calls % 2:  # dispatch, then combine, per layer
            self.rows_dispatched += sum(input_splits)
        assert tensor.shape[-1] * tensor.element_size() == self.row_bytes
        self.sent["forward"] += self._remote_bytes(input_splits)
        out = self._original(tensor, output_splits, input_splits, group)
        if out.requires_grad:
            out.register_hook(lambda grad: self._backward(grad, output_splits))
        return out

    def _backward(self, grad: torch.Tensor, splits: list[int]) -> None:
        assert grad.shape[0] == sum(splits)
        self.sent["backward"] += self._remote_bytes(splits)

    def _counts(self, output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        ranks = dist.get_world_size(kwargs.get("group"))
        self.count_bytes += input.numel() * input.element_size() * (ranks - 1) // ranks
        return self._original_counts(output, input, *args, **kwargs)


def make_batch(args: argparse.Namespace, rank: int) -> dict[str, torch.Tensor]:
    """This rank's own ``rows x seq`` random tokens (labels = inputs)."""
    gen = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(0, args.vocab, (args.rows, args.seq), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


def measure(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """On every rank: one counted step, then the memory of one step, under EP and under FSDP2."""
    from lightning_plugins import ParallelLayout, parallelize
    from lightning_plugins.planner.measure import measure_step_memory

    reference = build_model(args)
    batch = make_batch(args, rank)
    result: dict[str, Any] = {}
    for name, layout in {"ep": ParallelLayout(dp_shard_size=world, ep_size=world),
                         "fsdp2": ParallelLayout(dp_shard_size=world)}.items():  # fmt: skip
        model = parallelize(copy.deepcopy(reference), layout)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        counter = AllToAllCounter(rank, args.hidden * BYTES)
        counter.install(model, world)
        try:
            loss = model(**batch).loss
            loss.backward()
        finally:
            counter.uninstall()
        routing_bytes = counter.routing_bytes()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        memory = measure_step_memory(model, optimizer, batch, steps_before=1)
        result[name] = {
            "loss": loss.item(),
            "sent": counter.sent,
            "routing_bytes": routing_bytes,
            "count_bytes": counter.count_bytes,
            "rows_dispatched": counter.rows_dispatched,
            "calls": counter.calls,
            "state": memory["state"],
            "peak": memory["peak"]["total"],
        }
        del model, optimizer
    return result


def worker(rank: int, world: int, args: argparse.Namespace, outdir: str) -> None:
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(measure(rank, world, args)))


def check(world: int, ranks: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """What must hold whatever the machine: same losses, every pair dispatched once, all-to-alls only under EP."""
    pairs = args.rows * args.seq * args.top_k
    for rank, row in enumerate(ranks):
        ep, fsdp = row["ep"], row["fsdp2"]
        assert abs(ep["loss"] - fsdp["loss"]) <= 1e-5, f"W={world} rank {rank}: loss {ep['loss']} vs {fsdp['loss']}"
        assert ep["calls"] == 2 * args.layers, f"W={world} rank {rank}: {ep['calls']} all-to-alls"
        assert ep["rows_dispatched"] == pairs * args.layers, f"W={world} rank {rank}: {ep['rows_dispatched']} pairs"
        sent = ep["sent"]["forward"] + ep["sent"]["backward"]
        routed = ep["routing_bytes"]
        assert sent == routed, f"W={world} rank {rank}: sent {sent} B, the routing says {routed} B"
        assert fsdp["calls"] == 0 and fsdp["count_bytes"] == 0, f"W={world} rank {rank}: FSDP2 ran all-to-alls"


def report(results: dict[int, list[dict[str, Any]]], args: argparse.Namespace, command: str, elapsed: float,
           on: str) -> str:  # fmt: skip
    """The two markdown tables (bytes, memory) with the command and the machine (``on``)."""
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    tokens = args.rows * args.seq
    lines = [
        f"Command: `{command}` ({elapsed:.0f} s). Machine: {on}, fp32, 1 thread per rank. Model: Mixtral"
        f" h={args.hidden}, intermediate {2 * args.hidden}, {args.experts} experts, top-{args.top_k},"
        f" {args.layers} layers, vocab {args.vocab}; {args.rows} x {args.seq} = {tokens} tokens per rank; AdamW.",
        "",
        "All-to-all bytes per rank, one training step (forward + backward), remote rows only:",
        "",
        "| EP | rank | forward (MiB) | backward (MiB) | measured (MiB) | from the routing (MiB)"
        " | analytic, uniform routing (MiB) | measured / analytic | count exchange (B) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for world, ranks in results.items():
        analytic = tokens * args.top_k * args.hidden * BYTES * 2 * 2 * args.layers * (world - 1) / world
        for rank, row in enumerate(ranks):
            sent = row["ep"]["sent"]
            total = sent["forward"] + sent["backward"]
            lines.append(
                f"| {world} | {rank} | {mib(sent['forward'])} | {mib(sent['backward'])} | {mib(total)} |"
                f" {mib(row['ep']['routing_bytes'])} | {mib(analytic)} | {total / analytic:.3f} |"
                f" {row['ep']['count_bytes']} |"
            )
    lines += [
        "",
        "Memory per rank (MiB): parameters, gradients and AdamW state after the backward, and the step's peak:",
        "",
        "| world | layout | rank | parameters | gradients | AdamW state | peak | peak EP / FSDP2 |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for world, ranks in results.items():
        for name in ("ep", "fsdp2"):
            for rank, row in enumerate(ranks):
                state, peak = row[name]["state"], row[name]["peak"]
                ratio = f"{peak / row['fsdp2']['peak']:.3f}" if name == "ep" else ""
                label = f"EP={world} (dp_shard={world})" if name == "ep" else f"FSDP2={world}"
                lines.append(
                    f"| {world} | {label} | {rank} | {mib(state['parameters'])} | {mib(state['gradients'])} |"
                    f" {mib(state['optimizer'])} | {mib(peak)} | {ratio} |"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    add_report_arguments(parser, output=True)
    args = parser.parse_args(argv)
    results = {}
    with Timed() as run:
        for world in args.worlds:
            with tempfile.TemporaryDirectory() as outdir:
                spawn_world(worker, world, world, args, outdir, errors=outdir)
                results[world] = [json.loads(Path(outdir, f"rank{r}.json").read_text()) for r in range(world)]
            check(world, results[world], args)
    table = report(results, args, command(argv), run.elapsed, machine(run.load))
    print(table)
    write_report(args.output, table)


if __name__ == "__main__":
    main()
