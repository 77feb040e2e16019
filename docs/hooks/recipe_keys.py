"""MkDocs hook: the recipe key reference, generated from the typed schema (``lightning_plugins.recipe.schema``).

``{{ recipe_keys }}`` in a page becomes one table per section: every key, its type, default, constraints and what it
does (from the docstring under the field, as griffe and mkdocstrings read it). A key without a description fails the
build, so the reference cannot fall behind the schema (``tests/test_docs.py`` checks it too).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import re
import textwrap
import types
import typing
from typing import Any

PLACEHOLDER = "{{ recipe_keys }}"


def _attribute_docs(cls: type) -> dict[str, str]:
    """``name -> description`` from the docstring under each field (PEP 257 attribute docstrings, as griffe reads
    them), the section's bases included, each joined onto one line."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not klass.__module__.startswith("lightning_plugins"):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for field, after in itertools.pairwise(body):
            if (
                isinstance(field, ast.AnnAssign)
                and isinstance(field.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[field.target.id] = " ".join(line.strip() for line in after.value.value.splitlines() if line.strip())
    return docs


def _markdown(text: str) -> str:
    """A docstring's reStructuredText as Markdown: ``code`` and :role:`target` become `code`."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`").replace("|", "\\|")


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, str):
        return annotation
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(annotation)).replace("'", '"')
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _fields(cls: type) -> list[tuple[str, Any, str, str]]:
    """``(name, annotation, default, constraints)`` of a pydantic model or a dataclass."""
    rows = []
    if dataclasses.is_dataclass(cls):
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if not field.init or field.name.startswith("_"):
                continue
            if field.default is not dataclasses.MISSING:
                default = field.default
            elif field.default_factory is not dataclasses.MISSING:
                default = field.default_factory()
            else:
                default = "required"
            rows.append((field.name, hints.get(field.name, field.type), default, ""))
        return rows
    for name, info in cls.model_fields.items():
        if info.is_required():
            default: Any = "required"
        elif info.default_factory is not None:
            default = info.default_factory()
        else:
            default = info.default
        constraints = []
        for meta in info.metadata:
            for attr, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
                value = getattr(meta, attr, None)
                if value is not None:
                    constraints.append(f"{sign} {value}")
        rows.append((name, info.annotation, default, ", ".join(constraints)))
    return rows


def _default(value: Any) -> str:
    if value == "required":
        return "**required**"
    if dataclasses.is_dataclass(value) or hasattr(value, "model_fields"):
        return "see below" if value is not None else "`null`"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _nested(annotation: Any) -> type | None:
    """The section class inside ``annotation`` (``LoraOptions | None`` -> ``LoraOptions``), if any."""
    candidates = [annotation, *typing.get_args(annotation)]
    for candidate in candidates:
        if isinstance(candidate, type) and (dataclasses.is_dataclass(candidate) or hasattr(candidate, "model_fields")):
            return candidate
    return None


def sections() -> list[tuple[str, type]]:
    """``(dotted key, class)`` of every section of a recipe, nested ones (``train.profile``) included."""
    from lightning_plugins.recipe.schema import Recipe

    found = []

    def visit(prefix: str, cls: type) -> None:
        found.append((prefix, cls))
        for name, annotation, _, _ in _fields(cls):
            inner = _nested(annotation)
            if inner is not None:
                visit(f"{prefix}.{name}", inner)

    for name, info in Recipe.model_fields.items():
        cls = _nested(info.annotation)
        if cls is not None:
            visit(name, cls)
    return found


def undocumented() -> list[str]:
    """Every recipe key without a docstring under its field."""
    missing = []
    for prefix, cls in sections():
        docs = _attribute_docs(cls)
        missing += [f"{prefix}.{name}" for name, *_ in _fields(cls) if not docs.get(name)]
    return missing


def reference() -> str:
    """The key reference as Markdown: a table per section."""
    missing = undocumented()
    if missing:
        raise ValueError(f"recipe keys without a docstring under their field: {', '.join(missing)}")
    from lightning_plugins.recipe.schema import Recipe

    out = []
    for prefix, cls in sections():
        required = "" if "." in prefix or not Recipe.model_fields[prefix].is_required() else " (required)"
        out.append(f"### `{prefix}`{required}\n\n`{cls.__module__}.{cls.__qualname__}`\n")
        out.append("| key | type | default | constraints | what it does |\n|---|---|---|---|---|")
        docs = _attribute_docs(cls)
        for name, annotation, default, constraints in _fields(cls):
            text = _markdown(docs[name])
            out.append(f"| `{prefix}.{name}` | {_type_name(annotation)} | {_default(default)} | {constraints} | {text} |")
        out.append("")
    return "\n".join(out)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return markdown.replace(PLACEHOLDER, reference()) if PLACEHOLDER in markdown else markdown
