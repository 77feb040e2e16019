"""A tokenizer of single characters: enough of a Hugging Face tokenizer for prompt/completion records, and fast
enough to prepare a million of them in a test (the tiny BPE tokenizer spends ~70 us a record in transformers)."""

from __future__ import annotations

from typing import Any


class CharTokenizer:
    """Ids are byte values + 3; 0, 1, 2 are pad, BOS (added with ``add_special_tokens``) and EOS."""

    name_or_path = "char-tokenizer"
    chat_template = None
    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

    def __len__(self) -> int:
        return 259

    def get_vocab(self) -> dict[str, int]:
        return {"<pad>": 0, "<s>": 1, "</s>": 2, **{chr(i): i + 3 for i in range(256)}}

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, Any]:
        ids = [ord(c) + 3 for c in text]
        return {"input_ids": [self.bos_token_id, *ids] if add_special_tokens else ids}
