"""Chunked cross entropy in one process: the loss and every gradient of transformers' own, never the full logits.

Multi-rank layouts (FSDP2, TP with and without loss parallel, CP, PP, experts) run it in the parity tests
(``loss_chunk_tokens`` cases of tests/parallel/test_parallel_parity.py, test_context_parity.py,
test_pipeline_parity.py); by default every parity case goes through it.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import pytest
import torch
from tiny_models import CONFIGS, make_batch, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from lightning_plugins.errors import OptionsError
from lightning_plugins.parallel.memory.chunked_loss import chunked_token_loss_sum, install_chunked_loss
from lightning_plugins.parallel.loss import ParallelCausalLMLoss
from lightning_plugins.parallel.options import MemoryOptions
from lightning_plugins.parallel.pipeline.anatomy import DecoderAnatomy

STEPS, BATCH, SEQ, LR, MAX_NORM = 3, 4, 15, 1.0, 0.5


def _chunked(model: torch.nn.Module, chunk: int) -> torch.nn.Module:
    model.loss_function = ParallelCausalLMLoss(None, install_chunked_loss(model, chunk))
    assert model.loss_function.chunked is not None
    return model


def _train(model: torch.nn.Module) -> tuple[list[float], list[torch.Tensor]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        out = model(**make_batch(BATCH, SEQ, model.config.vocab_size, seed=step))
        out.loss.backward()
        losses.append(out.loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
    return losses, [p.detach() for p in model.parameters()]


# llama: plain head; gemma2: soft-capped logits; granite: scaled logits; llama_tied: the head is the embedding;
# mixtral_aux: the router's loss still added. 7 tokens a chunk: 60 tokens make 9 chunks, the last one short, one
# all-ignored chunk skipped (make_batch's padding).
@pytest.mark.parametrize("family", ["llama", "gemma2", "granite", "llama_tied", "mixtral_aux"])
def test_chunked_loss_trains_as_full_logits(family: str) -> None:
    reference = tiny_model(family)
    chunked = _chunked(copy.deepcopy(reference), 7)
    want_losses, want = _train(reference)
    got_losses, got = _train(chunked)
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(want_losses), atol=1e-6, rtol=0)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)


def test_logits_only_when_not_training_with_labels() -> None:
    model = _chunked(tiny_model("gemma2"), 7)
    batch = make_batch(2, SEQ, model.config.vocab_size, seed=0)
    out = model(**batch)
    assert out.logits.shape == (2, SEQ, 0), "a training forward with labels never builds the logits"
    with torch.no_grad():  # evaluation: full logits and the same loss
        evaluated = model(**batch)
        model.eval()
        plain = model(**batch)
    assert evaluated.logits.shape == plain.logits.shape == (2, SEQ, model.config.vocab_size)
    torch.testing.assert_close(evaluated.loss, out.loss.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(plain.loss, out.loss.detach(), atol=1e-6, rtol=0)


def test_the_full_logits_never_exist() -> None:
    """The largest tensor autograd saves is one chunk's, whatever the sequence length."""
    config = CONFIGS["llama"]()
    config.vocab_size = vocab = 96  # no other dimension of the tiny model is 96
    model = _chunked(AutoModelForCausalLM.from_config(config), 8)
    saved: list[tuple[int, ...]] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if vocab in tensor.shape:
            saved.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**make_batch(2, 32, vocab, seed=0)).loss
        assert saved == [(vocab, config.hidden_size)], f"forward keeps only the head weight, got {saved}"
        loss.backward()  # recomputes tiles of 8 tokens x 12 vocab rows (one of 8 blocks): nothing vocab-wide
    assert saved == [(vocab, config.hidden_size)], saved


def test_the_head_gradient_is_built_once() -> None:
    """Backward sums the head's gradient block by block in fp32 and casts it once: no chunk makes a whole
    [vocab, hidden] gradient of its own (2 GiB a chunk at Llama-3.1-70B's head in bf16)."""
    config = CONFIGS["llama"]()
    config.vocab_size = vocab = 96
    model = _chunked(AutoModelForCausalLM.from_config(config), 8)
    whole = (vocab, config.hidden_size)
    made: list[str] = []

    class Outputs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and tuple(out.shape) == whole and func._schema.name != "aten::t":
                made.append(func._schema.name)
            return out

    loss = model(**make_batch(2, 32, vocab, seed=0)).loss  # 64 tokens: 8 chunks
    with Outputs():
        loss.backward()
    assert len([name for name in made if name not in ("aten::view", "aten::detach", "aten::_unsafe_view")]) <= 2, made


class _LiveFp32(TorchDispatchMode):
    """The most fp32 bytes alive at once among the tensors built while it is on (freed: when their storage is)."""

    def __init__(self) -> None:
        super().__init__()
        self.live, self.peak, self._seen = 0, 0, set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float32:
                continue
            storage = tensor.untyped_storage()
            if id(storage) not in self._seen:  # a new storage (not an in-place result or a view of a known one)
                self._seen.add(id(storage))
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, id(storage), storage.nbytes())
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes


def test_backward_never_holds_a_whole_fp32_head_gradient() -> None:
    """A bf16 head's gradient is summed in fp32 one block of vocab rows at a time: the fp32 tensors alive at once in
    backward (a block's sum, its fp32 rows, the hidden states' fp32 sum, a tile) stay well under a whole fp32 head
    (1.96 GiB at Llama 3's head, on top of its bf16 gradient)."""
    torch.manual_seed(0)
    tokens, vocab, hidden = 64, 1024, 64
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(vocab, hidden, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    loss = chunked_token_loss_sum(x, weight, targets, DecoderAnatomy(final_logit_softcapping=3.0), 8)
    with _LiveFp32() as live:
        loss.backward()
    whole = vocab * hidden * 4
    assert live.peak < whole / 2, f"{live.peak} fp32 bytes alive at once in backward; a whole fp32 head is {whole}"


@pytest.mark.parametrize("head", [DecoderAnatomy(), DecoderAnatomy(final_logit_softcapping=3.0)], ids=["plain", "cap"])
def test_bf16_gradients_as_accurate_as_the_full_logits(head: DecoderAnatomy) -> None:
    """In bf16 both gradients are as close to the fp64 gradient of the same loss as the full-logits backward's are
    (one bf16 matmul each, summed in fp32); 64 chunks, so summing them in bf16 would show (1.3x to 2x the error here)."""
    torch.manual_seed(0)
    tokens, vocab, hidden = 512, 256, 32
    targets = torch.randint(0, vocab, (tokens,))
    targets[::5] = -100
    inputs = [(torch.randn(tokens, hidden) * 2).bfloat16(), (torch.randn(vocab, hidden) * 0.5).bfloat16()]

    def grads(dtype: torch.dtype, chunk: int | None) -> list[torch.Tensor]:
        x, weight = (t.to(dtype).requires_grad_() for t in inputs)
        if chunk is None:
            logits = head.logits(x @ weight.T)  # transformers' way: the logits in the weight's dtype, the loss in fp32+
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            torch.nn.functional.cross_entropy(logits, targets, reduction="sum").backward()
        else:
            chunked_token_loss_sum(x, weight, targets, head, chunk).backward()
        return [x.grad.double(), weight.grad.double()]

    exact = grads(torch.float64, None)
    for got, full, want in zip(grads(torch.bfloat16, 8), grads(torch.bfloat16, None), exact, strict=True):
        error, full_error = ((g - want).norm() / want.norm() for g in (got, full))
        assert error <= full_error * 1.01, (error, full_error)


def test_head_adapters_and_bias_keep_full_logits() -> None:
    """A head the chunks would not reproduce exactly keeps transformers' full logits (never a silently wrong loss)."""
    from lightning_plugins.adapters.lora import LoraOptions, apply_lora

    model = tiny_model("llama")
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.config.vocab_size))
    assert install_chunked_loss(model, 7) is None
    adapted = apply_lora(tiny_model("llama"), LoraOptions(r=2, target_modules=("q_proj", "lm_head")))
    assert install_chunked_loss(adapted.base_model.model, 7) is None  # a LoRA adapter on lm_head
    assert install_chunked_loss(tiny_model("llama"), 0) is None


@pytest.mark.parametrize("bad", [-1, 2.5, True, "1024"])
def test_bad_chunk_is_refused(bad: object) -> None:
    with pytest.raises(OptionsError, match="loss_chunk_tokens"):
        MemoryOptions(loss_chunk_tokens=bad)


def test_custom_ignore_index_chunked_as_transformers() -> None:
    """``ignore_index=`` (transformers' ``ForCausalLMLoss`` reads it) is honoured by the chunked loss, which still
    chunks: the same losses and weights as the plain model given the same batches, with ``labels`` and with
    ``shift_labels`` (the targets as given) alike."""
    reference = tiny_model("llama")
    chunked = _chunked(copy.deepcopy(reference), 7)
    batches = []
    for step in range(STEPS):
        batch = make_batch(BATCH, SEQ, reference.config.vocab_size, seed=step)
        labels = batch["labels"].masked_fill(batch["labels"] == -100, -1)  # the user's own ignored value
        shifted = torch.nn.functional.pad(labels, (0, 1), value=-1)[:, 1:].roll(1, dims=0)  # other targets
        batches.append({**batch, "labels": labels, "ignore_index": -1})
        batches.append({**batch, "labels": labels, "shift_labels": shifted, "ignore_index": -1})
    results = []
    for model in (reference, chunked):
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        losses = []
        for batch in batches:
            out = model(**batch)
            out.loss.backward()
            losses.append(out.loss.item())
            optimizer.step()
            optimizer.zero_grad()
        results.append((losses, [p.detach() for p in model.parameters()], out.logits.shape))
    (want_losses, want, full), (got_losses, got, chunk_logits) = results
    assert chunk_logits == (BATCH, SEQ, 0) and full[-1] == reference.config.vocab_size, "the loss was chunked"
    assert all(x == x for x in want_losses) and len(set(want_losses)) == len(want_losses)
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(want_losses), atol=1e-6, rtol=0)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)


def test_shift_labels_alone_give_logits_and_no_loss() -> None:
    """transformers computes a loss only when ``labels`` is given: with ``shift_labels`` alone the chunked model, too,
    returns the full logits and no loss (it would otherwise hand back empty logits)."""
    reference = tiny_model("llama")
    chunked = _chunked(copy.deepcopy(reference), 7)
    batch = make_batch(2, SEQ, reference.config.vocab_size, seed=0)
    shift = torch.nn.functional.pad(batch.pop("labels"), (0, 1), value=-100)[:, 1:]
    want, got = reference(**batch, shift_labels=shift), chunked(**batch, shift_labels=shift)
    assert want.loss is None and got.loss is None
    torch.testing.assert_close(got.logits, want.logits, atol=0, rtol=0)
