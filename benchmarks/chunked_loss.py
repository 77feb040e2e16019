"""Peak memory of the loss step with and without chunked cross entropy (CPU, fp32, a real run).

One decoder layer with a small hidden size and Llama 3's vocabulary (128256), one row of 4096 tokens: forward and
backward of ``model(**batch).loss``, the peak of live tensors measured by torch's ``MemTracker`` over the whole step.

    PYTHONPATH=. python benchmarks/chunked_loss.py
    PYTHONPATH=. python benchmarks/chunked_loss.py --chunks 4096 --out rows.json   # one row
"""

from __future__ import annotations

import argparse

import torch
from torch.distributed._tools.mem_tracker import MemTracker
from transformers import AutoModelForCausalLM, LlamaConfig

from lightning_plugins.parallel.loss import ParallelCausalLMLoss
from lightning_plugins.parallel.memory.chunked_loss import install_chunked_loss
from lightning_plugins.testing.bench import Timed, add_report_arguments, machine, print_run, write_rows

TOKENS, VOCAB, HIDDEN = 4096, 128256, 64
GIB = 2**30


def peak(chunk_tokens: int) -> tuple[float, float, float]:
    """(peak GiB over the step, the same less the parameters, seconds) with ``chunk_tokens`` (0: full logits)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=TOKENS, attn_implementation="sdpa",
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    model.loss_function = ParallelCausalLMLoss(None, install_chunked_loss(model, chunk_tokens))
    ids = torch.randint(0, VOCAB, (1, TOKENS))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    tracker = MemTracker()
    tracker.track_external(model)
    with Timed() as step, tracker:
        model(input_ids=ids, labels=ids).loss.backward()
    total = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return total / GIB, (total - params) / GIB, step.elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 4096, 1024, 256], help="loss_chunk_tokens (0: off)")
    add_report_arguments(parser, out=True)
    args = parser.parse_args()
    print(f"1 x {TOKENS} tokens, vocab {VOCAB}, hidden {HIDDEN}, fp32, CPU: forward + backward of the loss step")
    print("| loss_chunk_tokens | peak GiB | peak less parameters GiB | seconds |\n|---:|---:|---:|---:|")
    rows = []
    with Timed() as run:
        for chunk in args.chunks:
            total, less, seconds = peak(chunk)
            print(f"| {chunk or 'off (full logits)'} | {total:.2f} | {less:.2f} | {seconds:.1f} |", flush=True)
            rows.append({"loss_chunk_tokens": chunk, "peak_gib": total, "less_params_gib": less, "seconds": seconds})
    on = machine(run.load)
    print_run(run.elapsed, on)
    write_rows(args.out, args, on, rows)


if __name__ == "__main__":
    main()
