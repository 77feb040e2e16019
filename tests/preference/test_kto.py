"""KTO on unpaired examples: TRL's records to rows and mismatched KL rows, and :class:`KTOObjective`'s loss and
metrics against TRL's ``KTOTrainer._compute_loss`` on the same log-probabilities, and against a hand computation from
one process's full logits on a tiny LoRA model (its reference: the base, adapters disabled)."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from tiny_models import tiny_model
from transformers import AutoTokenizer

from lightning_plugins.adapters.lora import LoraOptions, apply_lora
from lightning_plugins.data import DataConfig, DataError
from lightning_plugins.data.preference import collate_unpaired, encode_unpaired, fit_unpaired_to_length
from lightning_plugins.data.tiny import TINY_DIR
from lightning_plugins.errors import OptionsError
from lightning_plugins.preference import PreferenceOptions, SequenceLogps
from lightning_plugins.preference.kto import KTOObjective

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]
KTO = PreferenceOptions(method="kto", beta=0.1, desirable_weight=1.3, undesirable_weight=0.7)
ROWS, SEQ = 12, 9


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_DIR / "model")


def _data():
    gen = torch.Generator().manual_seed(0)
    completion = torch.zeros(ROWS, SEQ, dtype=torch.long)
    for row in range(ROWS):
        completion[row, 2 + row % 3 : SEQ - row % 2] = 1
    shift = completion[:, 1:]
    per_token = -torch.rand(ROWS, SEQ - 1, generator=gen, dtype=torch.float64) * 3 * shift
    mean_logits = torch.randn(ROWS, SEQ - 1, generator=gen, dtype=torch.float64)
    policy = SequenceLogps(per_token.sum(1), shift.sum(1).double(), (mean_logits * shift).sum(1))
    reference = SequenceLogps(per_token.sum(1) + torch.randn(ROWS, generator=gen, dtype=torch.float64),
                              shift.sum(1).double(), torch.zeros(ROWS, dtype=torch.float64))  # fmt: skip
    return completion, per_token, mean_logits, policy, reference


def _as_logps(values: torch.Tensor) -> SequenceLogps:
    return SequenceLogps(values, torch.ones_like(values), torch.zeros_like(values))


def test_kto_objective_matches_trl() -> None:
    from trl.trainer.kto_trainer import KTOTrainer

    completion, per_token, mean_logits, policy, reference = _data()
    label = torch.tensor([1, 0, 1, 1, 0, 0, 1, 0, 1, 1, 0, 1]).bool()
    kl_logps, ref_kl_logps = policy.logps.flip(0) * 0.9, policy.logps.flip(0)
    outputs = SimpleNamespace(log_probs=per_token, entropy=torch.zeros_like(per_token), mean_logits=mean_logits)
    accelerator = SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x,
                                  unwrap_model=lambda m: m)  # fmt: skip
    stub = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=accelerator, aux_loss_enabled=False,
        precompute_ref_logps=True, calculate_KL=True, loss_type="kto", beta=KTO.beta,
        desirable_weight=KTO.desirable_weight, undesirable_weight=KTO.undesirable_weight, _total_train_tokens=0,
        _tp_size=1, _metrics=defaultdict(lambda: defaultdict(list)), _compute_kl_logps=lambda model, batch: kl_logps,
    )  # fmt: skip
    batch = {
        "input_ids": torch.zeros_like(completion),
        "attention_mask": torch.ones_like(completion),
        "completion_mask": completion,
        "label": label,
        "ref_logps": reference.logps,
        "ref_KL_logps": ref_kl_logps,
    }
    want = KTOTrainer._compute_loss(stub, lambda **kwargs: outputs, batch, False)
    loss, metrics = KTOObjective(KTO).from_kto_logps(policy, reference, _as_logps(kl_logps), _as_logps(ref_kl_logps),
                                                     label)  # fmt: skip
    assert metrics["kl"] > 0  # the KL term is live, not clamped away
    assert abs(loss.item() - want.item()) < 1e-12
    logged = {name: values[-1] for name, values in stub._metrics["train"].items()}
    names = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
             "logits/chosen", "logits/rejected")  # fmt: skip
    assert set(names) <= set(logged) and set(metrics) == set(names)
    for name in names:
        assert abs(metrics[name].item() - logged[name]) < 1e-9, name


def test_unpaired_records_give_rows_and_rotated_kl_rows(tokenizer) -> None:
    records = [{"prompt": "abc=", "completion": "cba", "label": True},
               {"prompt": "xy=", "completion": "yxx", "label": False},
               {"prompt": "q=", "completion": "q", "label": True}]  # fmt: skip
    examples = [encode_unpaired(record, tokenizer) for record in records]
    batch = collate_unpaired(examples, tokenizer.pad_token_id or 0)
    assert batch["label"].tolist() == [True, False, True]
    for i, example in enumerate(examples):
        for prefix, source in (("", example), ("kl_", examples[i - 1])):  # KL row: this prompt, the previous completion
            ids, labels = batch[f"{prefix}input_ids"][i], batch[f"{prefix}labels"][i]
            length = int(batch[f"{prefix}attention_mask"][i].sum())
            assert ids[:length].tolist() == example["prompt_ids"] + source["completion_ids"]
            assert [t for t in labels.tolist() if t != -100] == source["completion_ids"]  # the prompt masked
    assert examples[0]["completion_ids"][-1] == tokenizer.eos_token_id


def test_conversations_and_what_is_refused(tokenizer) -> None:
    prompt, completion = [{"role": "user", "content": "r abc"}], [{"role": "assistant", "content": "cba"}]
    example = encode_unpaired({"prompt": prompt, "completion": completion, "label": False}, tokenizer)
    whole = tokenizer.apply_chat_template(prompt + completion, tokenize=True, return_dict=True)["input_ids"]
    assert example["prompt_ids"] + example["completion_ids"] == list(whole) and not example["label"]
    with pytest.raises(DataError, match="field 'label' must be true"):
        encode_unpaired({"prompt": "a", "completion": "b", "label": "yes"}, tokenizer)
    with pytest.raises(DataError, match="leaves the completion no token"):
        fit_unpaired_to_length({**example, "prompt_ids": [1] * 40}, DataConfig(train="x.jsonl", max_seq_len=32,
                                                                               truncation="truncate"))  # fmt: skip
    with pytest.raises(OptionsError, match="KTOObjective trains on unpaired examples"):
        KTOObjective(PreferenceOptions(method="dpo"))
    with pytest.raises(OptionsError, match="undesirable_weight must be > 0"):
        PreferenceOptions(method="kto", undesirable_weight=0)


def _hand_logps(model, rows: dict) -> torch.Tensor:
    logits = model(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"]).logits[:, :-1].double()
    targets = rows["labels"][:, 1:]
    taken = logits.log_softmax(-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (taken * (targets != -100)).sum(-1)


def test_kto_on_a_model_is_trls_formula_on_its_log_probabilities(tokenizer) -> None:
    """One process, a tiny LoRA model (random non-zero lora_B, so policy and reference differ): the objective's loss
    equals KTO's formula on log-probabilities taken by hand from the full logits (the KL term too), and only the
    adapters get gradients."""
    model = apply_lora(tiny_model("llama"), LoraOptions(r=4, alpha=8))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(3)) * 0.3)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(5)
    examples = [{"prompt_ids": torch.randint(1, vocab, (2 + i % 3,), generator=gen).tolist(),
                 "completion_ids": (ids := torch.randint(1, vocab, (3 + i % 4,), generator=gen).tolist()),
                 "completion_labels": ids, "label": i % 3 != 1} for i in range(6)]  # fmt: skip
    batch = collate_unpaired(examples, 0)
    loss, metrics = KTOObjective(KTO)(model, batch)
    loss.backward()
    rows = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
    kl_rows = {k: batch[f"kl_{k}"] for k in rows}
    with torch.no_grad():
        policy, policy_kl = _hand_logps(model, rows), _hand_logps(model, kl_rows)
        with model.disable_adapter():
            reference, reference_kl = _hand_logps(model, rows), _hand_logps(model, kl_rows)
    kl = (policy_kl - reference_kl).mean().clamp(min=0)
    good = batch["label"]
    ratio = policy - reference
    want = torch.cat([KTO.desirable_weight * (1 - torch.sigmoid(KTO.beta * (ratio[good] - kl))),
                      KTO.undesirable_weight * (1 - torch.sigmoid(KTO.beta * (kl - ratio[~good])))])  # fmt: skip
    assert kl > 0
    assert abs(loss.item() - want.mean().item()) < 1e-5 and abs(metrics["kl"].item() - kl.item()) < 1e-5
    grads = {name for name, p in model.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in name for name in grads)
