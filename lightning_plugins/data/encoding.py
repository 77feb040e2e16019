"""Records -> token ids and labels.

* ``{"prompt", "completion"}``: ``prompt`` (with the tokenizer's special tokens, e.g. BOS) +
  ``completion`` + EOS; the prompt is masked from the loss (labels ``-100``).
* ``{"messages": [{"role", "content"}, ...]}``: rendered with the tokenizer's own chat template; only
  assistant turns are trained. A template with ``{% generation %}`` markers gives the assistant tokens
  directly; for one without, each assistant turn's characters are found by rendering the conversation's
  prefixes (checked to be prefixes of the whole rendering, else a clear error) and mapped to tokens
  through the tokenizer's offsets.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from lightning_plugins.data.config import IGNORE_INDEX, DataConfig, Example
from lightning_plugins.errors import DataError

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def text_field(record: Mapping[str, Any], key: str) -> str:
    """The string field ``key`` of ``record``, or a clear error naming it and what it holds instead."""
    value = record.get(key)
    if not isinstance(value, str):
        got = "missing (or null)" if value is None else f"a {type(value).__name__}"
        raise DataError(f"field {key!r} must be a string, but it is {got}.")
    return value


def encode_prompt_completion(record: Mapping[str, Any], tokenizer: Any) -> Example:
    """``prompt`` (with special tokens) + ``completion`` + EOS; labels ``-100`` on the prompt.

    Raises:
        DataError: if ``prompt`` or ``completion`` is not a string.
    """
    prompt, completion = text_field(record, "prompt"), text_field(record, "completion")
    prompt_ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    completion_ids = list(tokenizer(completion, add_special_tokens=False)["input_ids"]) + [require_eos_id(tokenizer)]
    return {"input_ids": prompt_ids + completion_ids, "labels": [IGNORE_INDEX] * len(prompt_ids) + completion_ids}


def require_eos_id(tokenizer: Any) -> int:
    """The tokenizer's ``eos_token_id``, or a clear error when it has none."""
    if tokenizer.eos_token_id is None:
        raise DataError(f"The tokenizer {tokenizer.name_or_path!r} has no eos_token_id; set one in its tokenizer_config.json.")
    return tokenizer.eos_token_id


def messages_field(record: Mapping[str, Any]) -> list[dict[str, str]]:
    """The ``messages`` of a chat record (a non-empty list of ``{'role', 'content'}``), or a clear error."""
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise DataError("field 'messages' must be a non-empty list of {'role', 'content'} objects.")
    clean = []
    for turn, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise DataError(f"messages[{turn}] must be an object with 'role' and 'content'.")
        for key in ("role", "content"):
            try:
                text_field(message, key)
            except DataError as err:
                raise DataError(f"messages[{turn}]: {err}") from None
        clean.append({k: v for k, v in message.items() if v is not None})  # arrow fills absent keys with null
    if not any(m["role"] == "assistant" for m in clean):
        raise DataError("the conversation has no 'assistant' message, so nothing in it would be trained.")
    return clean


def encode_chat(record: Mapping[str, Any], tokenizer: Any) -> Example:
    """Renders ``messages`` with the tokenizer's chat template; labels only on assistant turns.

    Raises:
        DataError: for malformed messages, a tokenizer without chat template, or a template whose
            rendering of a conversation's prefix is not a prefix of its full rendering.
    """
    messages = messages_field(record)
    template = tokenizer.chat_template
    if not template:
        raise DataError(
            f"The tokenizer {tokenizer.name_or_path!r} has no chat template, so chat records cannot be rendered. Add"
            " one to its tokenizer_config.json (or chat_template.jinja), or use prompt/completion records."
        )
    try:
        if isinstance(template, str) and _GENERATION_TAG.search(template):
            encoded = tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            ids, mask = list(encoded["input_ids"]), list(encoded["assistant_masks"])
        else:
            ids, mask = _assistant_mask_from_prefixes(messages, tokenizer)
    except Exception as err:
        if not type(err).__module__.startswith("jinja2"):  # the template's `raise_exception`: "unknown role: robot"
            raise
        roles = sorted({m["role"] for m in messages})
        raise DataError(
            f"the tokenizer's chat template refused the conversation ({err}); its roles are {roles}. Use roles the"
            " template knows (usually system, user, assistant), or change the template."
        ) from None
    return {"input_ids": ids, "labels": [i if m else IGNORE_INDEX for i, m in zip(ids, mask)]}


def _assistant_mask_from_prefixes(messages: list[dict[str, str]], tokenizer: Any) -> tuple[list[int], list[int]]:
    """Assistant tokens for a template without ``{% generation %}``: the characters each assistant turn adds."""

    def render(turns: list[dict[str, str]], prompt: bool) -> str:
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=prompt)

    text = render(messages, False)
    spans = []
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, upto = render(messages[:turn], True), render(messages[: turn + 1], False)
        if not (text.startswith(before) and text.startswith(upto) and len(before) <= len(upto)):
            raise DataError(
                f"the tokenizer's chat template renders the conversation up to messages[{turn}] differently"
                " from the start of the whole conversation (e.g. it rewrites earlier turns), so the assistant tokens"
                " cannot be located. Add {% generation %}...{% endgeneration %} around assistant content in the template."
            )
        spans.append((len(before), len(upto)))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(lo <= start < hi for lo, hi in spans)) for start, _ in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), mask


ENCODERS: dict[str, Callable[[Mapping[str, Any], Any], Example]] = {
    "prompt_completion": encode_prompt_completion,
    "chat": encode_chat,
}


def fit_to_length(example: Example, config: DataConfig) -> Example | None:
    """Applies ``max_seq_len``: truncate (``None`` if nothing supervised is left) or a clear error."""
    n = len(example["input_ids"])
    if n > config.max_seq_len:
        if config.truncation == "error":
            raise DataError(
                f"{n} tokens, longer than data.max_seq_len={config.max_seq_len}. Raise data.max_seq_len,"
                " shorten or drop the record, or set data.truncation: truncate."
            )
        example = {key: values[: config.max_seq_len] for key, values in example.items()}
    if all(label == IGNORE_INDEX for label in example["labels"]):
        return None
    return example
