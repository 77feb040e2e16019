"""MkDocs hook: the pages generated from the repository when the site is built, so they cannot drift from it.

* ``{{ recipe_gallery }}`` in a page becomes the recipe gallery: every shipped recipe (``recipes/<model>/<name>.yaml``,
  read as YAML, nothing run), grouped by model, with its method, hardware, layout and sequence length, and the
  planner's peak memory per GPU and tokens/s per GPU where the recipe table of ``docs/recipes.md`` records them (the
  figures ``tests/recipe/test_recipes.py`` checks against the dry run; the planner is not run at build time).
* ``gallery-memory.png``: the same figures drawn, each recipe's planned memory per GPU by part.
* ``benchmarks.md``: ``benchmarks/RESULTS.md`` as a page, with every picture under ``benchmarks/`` beside it
  (``benchmarks/<name>.png`` is ``<name>.png`` next to the page), read from the repository when the site is built.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
PLACEHOLDER = "{{ recipe_gallery }}"
PICTURES = (".png", ".svg", ".jpg", ".jpeg", ".gif", ".webp")
#: A row of the recipe table in docs/recipes.md: recipe, hardware, layout, method, **peak**, breakdown, host, tok/s.
ROW = re.compile(r"^\| \[?`([\w.\-/]+)`(?:\]\([^)]*\))? \|[^|]*\|[^|]*\|[^|]*\| \*\*([\d.]+)\*\* \|([^|]*)\|[^|]*\| ([\d,]+) \|",
                 re.MULTILINE)  # fmt: skip
#: The breakdown column of that table, in order.
PARTS = ("parameters", "gradients", "optimizer", "activations", "temporaries")
PLOT = "gallery-memory.png"


def planned() -> dict[str, tuple[str, str]]:
    """``recipe id -> (peak GiB per GPU, tokens/s per GPU)`` from the recipe table of ``docs/recipes.md``."""
    text = (ROOT / "docs" / "recipes.md").read_text()
    return {name: (peak, rate) for name, peak, _, rate in ROW.findall(text)}


def memory_plot() -> bytes:
    """The recipe table's planned memory per GPU, by part, one bar per recipe (a PNG, drawn with matplotlib)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(name, [float(x) for x in parts.split("/")]) for name, _, parts, _ in
            ROW.findall((ROOT / "docs" / "recipes.md").read_text())]  # fmt: skip
    rows.sort(key=lambda row: row[0])
    figure, axes = plt.subplots(figsize=(9, 0.22 * len(rows) + 1.2))
    left = [0.0] * len(rows)
    for index, part in enumerate(PARTS):
        values = [parts[index] for _, parts in rows]
        axes.barh([name for name, _ in rows], values, left=left, label=part)
        left = [a + b for a, b in zip(left, values)]
    axes.axvline(80, color="black", linewidth=0.8, linestyle="--", label="H100 80 GB")
    axes.invert_yaxis()
    axes.set_xlabel("planned GiB per GPU at the step's peak (the planner's dry run)")
    axes.tick_params(axis="y", labelsize=7)
    axes.legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    return buffer.getvalue()


def _method(raw: dict[str, Any]) -> str:
    lora = raw.get("lora") or {}
    if not lora:
        return "full"
    return "qlora" if lora.get("quantize", "none") not in (None, "none") else f"lora r={lora.get('r', 16)}"


def _hardware(raw: dict[str, Any]) -> str:
    hardware = raw.get("hardware") or {}
    devices, nodes = hardware.get("devices", 1), hardware.get("nodes", 1)
    if hardware.get("accelerator", "gpu") == "cpu":
        return f"{devices} CPU processes"
    return f"{nodes} x {devices} {hardware.get('gpu') or 'GPU'}"


def _layout(raw: dict[str, Any]) -> str:
    layout = raw.get("layout") or {}
    parts = [f"{key[:-5]}{value}" for key, value in layout.items()
             if key.endswith("_size") and isinstance(value, int) and value > 1]  # fmt: skip
    return " ".join(parts).replace("dp_shard", "fsdp").replace("dp_replicate", "hsdp") or "one rank"


def recipes() -> list[dict[str, str]]:
    """Every shipped recipe, as the gallery shows it."""
    figures = planned()
    rows = []
    for path in sorted((ROOT / "recipes").glob("*/*.yaml")):
        recipe = f"{path.parent.name}/{path.stem}"
        text = path.read_text()
        raw = yaml.safe_load(text) or {}
        peak, rate = figures.get(recipe, ("", ""))
        comment = [line.lstrip("# ").strip() for line in text.splitlines() if line.startswith("#")]
        rows.append({
            "id": recipe,
            "model": str((raw.get("model") or {}).get("path", "")),
            "method": _method(raw),
            "hardware": _hardware(raw),
            "layout": _layout(raw),
            "seq": str((raw.get("data") or {}).get("max_seq_len", "")),
            "peak": peak,
            "rate": rate,
            "what": comment[0] if comment else "",
        })  # fmt: skip
    return rows


def gallery() -> str:
    """The gallery as Markdown: a table per model directory."""
    out: list[str] = []
    rows = recipes()
    for folder in sorted({row["id"].split("/")[0] for row in rows}, key=lambda f: (f == "tiny", f)):
        group = [row for row in rows if row["id"].startswith(folder + "/")]
        out.append(f"### {folder}\n\n{group[0]['what'].split(':')[0].split(',')[0]}\n")
        out.append("| recipe | model | method | hardware | layout | seq | planned peak GiB/GPU | planned tok/s/GPU |")
        out.append("|---|---|---|---|---|---|---|---|")
        for row in group:
            out.append(f"| `{row['id']}` | `{row['model']}` | {row['method']} | {row['hardware']} | {row['layout']} |"
                       f" {row['seq']} | {row['peak'] or '-'} | {row['rate'] or '-'} |")  # fmt: skip
        out.append("")
    return "\n".join(out)


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    text += ("\n\n---\n\n*This page is `benchmarks/RESULTS.md`, read when the site is built; the scripts that measured"
             " each figure are in `benchmarks/`.*\n")  # fmt: skip
    files.append(File.generated(config, "benchmarks.md", content=text))
    files.append(File.generated(config, PLOT, content=memory_plot()))
    for picture in sorted((ROOT / "benchmarks").rglob("*")):
        if picture.suffix.lower() in PICTURES:
            name = picture.relative_to(ROOT / "benchmarks").as_posix()
            files.append(File.generated(config, name, content=picture.read_bytes()))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return markdown.replace(PLACEHOLDER, gallery()) if PLACEHOLDER in markdown else markdown
