#!/usr/bin/env python
"""(Re)creates the embedded default assets: a tiny Llama checkpoint and a toy task.

Outputs (under ``--out``, default: the directory of this script)::

    model/   config.json, generation_config.json, model.safetensors,
             tokenizer.json, tokenizer_config.json,
             chat_template.jinja                      (LlamaForCausalLM, random init)
    data/    train.jsonl, eval.jsonl                  ({"prompt", "completion"})
             chat_train.jsonl, chat_eval.jsonl        ({"messages": [{"role", "content"}, ...]})

Everything is deterministic (fixed seeds, no downloads). The prompt/completion task is string
reversal: ``{"prompt": "<letters>=", "completion": "<letters reversed>"}``. The chat task is a
multi-turn conversation of string commands: ``r abc`` (reverse) or ``s cab`` (sort), and a bare
``r`` / ``s`` in a later turn applies to the assistant's previous answer.

Usage::

    python recipes/tiny/make_tiny.py                  # regenerate in place
    python recipes/tiny/make_tiny.py --out /tmp/tiny  # elsewhere
    python recipes/tiny/make_tiny.py --data-only --out /tmp/tiny
    python recipes/tiny/make_tiny.py --verify         # fine-tune check (no files written)
    python recipes/tiny/make_tiny.py --verify --task chat
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

HERE = Path(__file__).resolve().parent

SEED = 1234
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
PAD, BOS, EOS, UNK = range(4)
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 =+-*/:,.>|"  # small char-level alphabet

# Task: reverse a string of 3-5 letters drawn from a-j.
TASK_ALPHABET = "abcdefghij"
TASK_MIN_LEN, TASK_MAX_LEN = 3, 5
N_TRAIN, N_EVAL = 4000, 200

# Chat task: 1-3 user/assistant exchanges of commands on strings of 3-5 letters from a-j.
CHAT_OPS = {"r": lambda s: s[::-1], "s": lambda s: "".join(sorted(s))}
CHAT_MAX_TURNS = 3

# The tiny tokenizer's chat template: "<s>u:<user>|a:<assistant></s>..." (every character is in CHARS).
# Assistant content and its EOS are inside {% generation %} so only they are trained.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "a:{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% elif message['role'] == 'user' %}u:{{ message['content'] }}|"
    "{% elif message['role'] == 'system' %}s:{{ message['content'] }}|"
    "{% else %}{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)

MODEL_CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    initializer_range=0.02,
    tie_word_embeddings=False,
    rope_theta=10000.0,
)

# Training settings used by --verify (and recommended for the demo); the chat task has its own steps.
VERIFY = dict(
    steps=400, batch_size=16, lr=3e-3, weight_decay=0.0, warmup=30, decay=True, max_length=32
)
VERIFY_CHAT = dict(VERIFY, steps=1000, max_length=64)


def vocab_size() -> int:
    """Tokenizer vocabulary rounded up to a multiple of 8."""
    n = len(SPECIAL_TOKENS) + len(CHARS)
    return -(-n // 8) * 8


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Builds a character-level WordLevel tokenizer (BOS prepended, Fuse decoder)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", BOS)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model() -> LlamaForCausalLM:
    """Builds the randomly initialised LlamaForCausalLM (seeded)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size(),
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        dtype="float32",
        **MODEL_CONFIG,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    model.generation_config.bos_token_id = BOS
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = PAD
    return model


def make_records(n: int, rng: random.Random, exclude: set[str]) -> list[dict[str, str]]:
    """Draws ``n`` distinct reversal records whose inputs are not in ``exclude``."""
    records: list[dict[str, str]] = []
    seen = set(exclude)
    while len(records) < n:
        length = rng.randint(TASK_MIN_LEN, TASK_MAX_LEN)
        s = "".join(rng.choice(TASK_ALPHABET) for _ in range(length))
        if s in seen:
            continue
        seen.add(s)
        records.append({"prompt": f"{s}=", "completion": s[::-1]})
    return records


def make_data() -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Returns (train, eval) records; eval inputs never appear in train."""
    rng = random.Random(SEED)
    eval_records = make_records(N_EVAL, rng, exclude=set())
    train_records = make_records(N_TRAIN, rng, exclude={r["prompt"][:-1] for r in eval_records})
    return train_records, eval_records


def _task_string(rng: random.Random) -> str:
    return "".join(rng.choice(TASK_ALPHABET) for _ in range(rng.randint(TASK_MIN_LEN, TASK_MAX_LEN)))


def make_conversation(rng: random.Random, strings: list[str]) -> dict[str, list[dict[str, str]]]:
    """One chat record: each turn is ``"<op> <string>"``, or (after the first) a bare ``"<op>"`` on the last answer."""
    messages: list[dict[str, str]] = []
    answer = ""
    for turn in range(rng.randint(1, CHAT_MAX_TURNS)):
        op = rng.choice(sorted(CHAT_OPS))
        if turn and rng.random() < 0.5:
            content, argument = op, answer
        else:
            argument = rng.choice(strings)
            content = f"{op} {argument}"
        answer = CHAT_OPS[op](argument)
        messages += [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def make_chat_data() -> tuple[list[dict], list[dict]]:
    """Returns (train, eval) conversations; no string given in an eval conversation appears in train."""
    rng = random.Random(SEED + 1)
    pool = sorted({_task_string(rng) for _ in range(20000)})
    rng.shuffle(pool)
    held_out, seen = pool[:300], pool[300:]
    evals = [make_conversation(rng, held_out) for _ in range(N_EVAL)]
    train = [make_conversation(rng, seen) for _ in range(N_TRAIN)]
    return train, evals


def write_jsonl(path: Path, records: list[dict]) -> None:
    """Writes one JSON object per line (ASCII, ``\\n`` line endings)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=True) + "\n")


def write_data(out: Path) -> None:
    """Writes ``data/train.jsonl`` and ``data/eval.jsonl`` under ``out``."""
    train, evals = make_data()
    write_jsonl(out / "data" / "train.jsonl", train)
    write_jsonl(out / "data" / "eval.jsonl", evals)
    chat_train, chat_evals = make_chat_data()
    write_jsonl(out / "data" / "chat_train.jsonl", chat_train)
    write_jsonl(out / "data" / "chat_eval.jsonl", chat_evals)


def write_model(out: Path) -> None:
    """Writes the checkpoint and tokenizer to ``out/model``."""
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    build_model().save_pretrained(model_dir, safe_serialization=True)
    build_tokenizer().save_pretrained(model_dir)
    # Name the generic fast-tokenizer class (loads on transformers 4.x and 5.x alike).
    tok_config_path = model_dir / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text(encoding="utf-8"))
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_config_path.write_text(json.dumps(tok_config, indent=2) + "\n", encoding="utf-8")
    for path in model_dir.iterdir():
        path.chmod(0o644)


def verify(root: Path, threads: int = 1, train_seed: int = SEED, task: str = "reverse") -> None:
    """Fine-tunes the shipped checkpoint in memory and prints eval exact match.

    Plain PyTorch loop (1 process, ``threads`` CPU threads) with the settings in
    ``VERIFY`` (``VERIFY_CHAT`` for ``task="chat"``): AdamW, linear warmup then
    linear decay to 0, grad-norm clip 1.0, batches drawn by epoch-wise shuffling
    seeded with ``train_seed``. The chat task is scored on each eval conversation's
    last assistant turn. Nothing is written to disk.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(HERE.parents[1]))
    from lightning_plugins.data import (
        DataConfig,
        build_dataset,
        collate_causal_lm,
        exact_match,
        load_prompt_completion,
        tiny_assets,
    )

    settings = VERIFY_CHAT if task == "chat" else VERIFY
    torch.set_num_threads(threads)
    assets = tiny_assets(root)
    tokenizer = AutoTokenizer.from_pretrained(assets.model_dir)
    model = AutoModelForCausalLM.from_pretrained(assets.model_dir)
    if task == "chat":
        config = DataConfig(train=str(assets.chat_train_file), max_seq_len=settings["max_length"])
        train, eval_file = list(build_dataset(config, tokenizer, "train")), assets.chat_eval_file
    else:
        train, eval_file = load_prompt_completion(assets.train_file, tokenizer, settings["max_length"]), assets.eval_file
    t0 = time.perf_counter()
    before = exact_match(model, tokenizer, eval_file)
    print(f"before: exact_match={before:.3f} ({time.perf_counter() - t0:.1f}s eval)", flush=True)

    torch.manual_seed(train_seed)
    optim = torch.optim.AdamW(
        model.parameters(), lr=settings["lr"], weight_decay=settings["weight_decay"]
    )
    steps, warmup = settings["steps"], settings["warmup"]
    def lr_factor(s: int) -> float:  # linear warmup, then constant or linear decay to 0
        if s < warmup:
            return (s + 1) / warmup
        return (steps - s) / (steps - warmup) if settings["decay"] else 1.0

    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_factor)
    gen = torch.Generator().manual_seed(train_seed)
    model.train()
    t0 = time.perf_counter()
    order: list[int] = []
    batch_size = settings["batch_size"]
    for step in range(1, steps + 1):
        if len(order) < batch_size:
            order += torch.randperm(len(train), generator=gen).tolist()
        idx, order = order[:batch_size], order[batch_size:]
        batch = collate_causal_lm([train[i] for i in idx], tokenizer.pad_token_id)
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        sched.step()
        optim.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == 1:
            print(f"step {step:4d} loss {loss.item():.4f} ({time.perf_counter() - t0:.1f}s)", flush=True)
    train_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    after = exact_match(model, tokenizer, eval_file)
    print(
        f"after:  exact_match={after:.3f} ({time.perf_counter() - t0:.1f}s eval); "
        f"train {steps} steps in {train_s:.1f}s",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE, help="output root (default: %(default)s)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--data-only", action="store_true", help="only write data/")
    group.add_argument("--model-only", action="store_true", help="only write model/")
    group.add_argument("--verify", action="store_true", help="fine-tune check, writes nothing")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for --verify")
    parser.add_argument("--train-seed", type=int, default=SEED, help="batch-order seed for --verify")
    parser.add_argument("--task", choices=("reverse", "chat"), default="reverse", help="dataset for --verify")
    parser.add_argument("--steps", type=int, help="optimizer steps for --verify (default: 400, chat 1000)")
    parser.add_argument("--lr", type=float, help="peak learning rate for --verify (default: 3e-3)")
    args = parser.parse_args(argv)
    if args.verify:
        settings = VERIFY_CHAT if args.task == "chat" else VERIFY
        settings.update({k: v for k, v in (("steps", args.steps), ("lr", args.lr)) if v is not None})
        verify(args.out, args.threads, args.train_seed, args.task)
        return
    if not args.model_only:
        write_data(args.out)
    if not args.data_only:
        write_model(args.out)
    print(f"wrote tiny assets to {args.out}")


if __name__ == "__main__":
    main()
