"""The package's structure, checked statically (every module parsed with ``ast``, nothing imported).

* The engine (``parallel/`` and ``adapters/``) imports nothing from the rest of the package but ``errors``; the
  adapters import ``parallel/``, never the reverse (lazy and type-only imports counted).
* The import graph between modules is acyclic, counting imports inside functions (``TYPE_CHECKING`` blocks,
  which never run, aside).
* The import graph between the package's parts (its sub-packages and top-level modules) is acyclic, counting every
  import: at module level, inside functions and in ``TYPE_CHECKING`` blocks.
* Only the doors (``strategies/``, ``accelerate/``, and ``demo.py``, the Lightning run the CLI's ``demo`` starts)
  import Lightning or Accelerate.
* No function is over 80 lines (one idea each).
* No module imports another module's private (``_name``) names.
* Every exception class of the package derives from :class:`lightning_plugins.errors.LightningPluginsError`
  (``Preempted`` aside: it is a ``SystemExit``).
* No file is over 500 lines.
* Nothing is unpickled outside ``checkpoint/safe_read.py`` (issue 43): no ``pickle.load(s)``, ``Unpickler``,
  ``torch.load`` or ``weights_only=False``, no torch reader that unpickles (``FileSystemReader``,
  ``DefaultLoadPlanner``, ``dcp.load``, ``_load_state_dict_from_keys``, ...), no ``allow_pickle=True``.
"""

from __future__ import annotations

import ast
import builtins
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_plugins"
ENGINE = ("lightning_plugins.parallel", "lightning_plugins.adapters")
ENGINE_MAY_IMPORT = ENGINE + ("lightning_plugins.errors",)
MAX_LINES = 500
#: The one module that unpickles (with allowlists): every other reader of a checkpoint goes through it.
SAFE_READER = "lightning_plugins.checkpoint.safe_read"
#: The test harness hands a world's arguments to its ranks through a file it wrote itself, in a temporary directory
#: only this user reads (through a pipe each tensor would take a file descriptor): it reads nothing else.
READS_ONLY_ITS_OWN_PICKLES = {"lightning_plugins.testing.world"}
#: Calls that unpickle what they read (``dcp``: torch.distributed.checkpoint, as the package imports it).
UNPICKLING_CALLS = {"pickle.load", "pickle.loads", "torch.load", "dcp.load", "dcp.load_state_dict",
                    "torch.distributed.checkpoint.load", "torch.distributed.checkpoint.load_state_dict",
                    "torch.serialization.load"}  # fmt: skip
#: torch's and the standard library's readers that unpickle (or load with ``weights_only=False``) by any name.
UNPICKLING_NAMES = {"Unpickler", "_Unpickler", "FileSystemReader", "DefaultLoadPlanner", "_EmptyStateDictLoadPlanner",
                    "_load_state_dict_from_keys", "dcp_to_torch_save", "BroadcastingTorchSaveReader", "read_pickle",
                    "load_sharded_optimizer_state_dict"}  # fmt: skip
NOT_OURS_TO_WRAP = {"lightning_plugins.run.preemption.Preempted"}  # a SystemExit: ends the process quietly
#: Package cycles known and being removed (an edge of each, as ``(from, to)``): none may be added.
KNOWN_PACKAGE_CYCLES: set[tuple[str, str]] = set()
#: The parts that may import Lightning or Accelerate: the doors, and the demo (a Lightning run the CLI starts).
DOORS = ("lightning_plugins.strategies", "lightning_plugins.accelerate", "lightning_plugins.demo")
#: The frameworks only the doors import.
FRAMEWORKS = ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities", "accelerate")
MAX_FUNCTION_LINES = 80


def _name_of(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _modules() -> dict[str, tuple[Path, ast.Module]]:
    return {_name_of(path): (path, ast.parse(path.read_text(), str(path))) for path in sorted(PACKAGE.rglob("*.py"))}


def _runtime_nodes(tree: ast.AST):
    """Every node that can run: the bodies of ``if TYPE_CHECKING:`` blocks left out."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                yield child
                yield from _runtime_nodes(child)
            continue
        yield node
        yield from _runtime_nodes(node)


@cache
def _imports() -> dict[str, list[tuple[str, str | None, int]]]:
    """Per module: (imported module, imported name or None, line) of every import of the package's own modules."""
    modules = _modules()
    found: dict[str, list[tuple[str, str | None, int]]] = {}
    for module, (path, tree) in modules.items():
        rows = found.setdefault(module, [])
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in _runtime_nodes(tree):
            if isinstance(node, ast.Import):
                rows += [(alias.name, None, node.lineno) for alias in node.names if alias.name in modules]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target not in modules:
                    continue
                for alias in node.names:
                    submodule = f"{target}.{alias.name}"
                    rows.append((submodule, None, node.lineno) if submodule in modules else (target, alias.name, node.lineno))
    return found


def test_the_engine_imports_nothing_outside_it():
    wrong = [
        f"{module}:{line} imports {target}"
        for module, rows in _imports().items()
        if module.startswith(ENGINE)
        for target, _, line in rows
        if not target.startswith(ENGINE_MAY_IMPORT)
    ]
    assert not wrong, "The engine (parallel/, adapters/) must not import the rest of the package:\n" + "\n".join(wrong)


def test_the_import_graph_is_acyclic():
    graph = {module: sorted({target for target, _, _ in rows if target != module}) for module, rows in _imports().items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in graph.get(module, []):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in graph:
        if module not in state:
            visit(module, [module])
    assert not cycles, "Import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_no_private_names_are_imported_across_modules():
    wrong = [
        f"{module}:{line} imports {name} from {target}"
        for module, rows in _imports().items()
        for target, name, line in rows
        if name is not None and name.startswith("_") and not name.startswith("__") and target != module
    ]
    assert not wrong, "Give these a public name (and a docstring), or move them to where they are used:\n" + "\n".join(wrong)


def _is_builtin_exception(name: str) -> bool:
    value = getattr(builtins, name, None)
    return isinstance(value, type) and issubclass(value, BaseException)


def test_every_exception_derives_from_the_package_base():
    classes: dict[str, list[str]] = {}  # class name -> names of its bases (the last part of a dotted base)
    where: dict[str, str] = {}
    for module, (_, tree) in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = [ast.unparse(base).rpartition(".")[2] for base in node.bases]
                where[node.name] = f"{module}.{node.name}"

    @cache
    def is_exception(name: str) -> bool:
        if _is_builtin_exception(name) or name.endswith(("Error", "Exception")) and name not in classes:
            return True
        return any(is_exception(base) for base in classes.get(name, []) if base != name)

    @cache
    def is_ours(name: str) -> bool:
        return name == "LightningPluginsError" or any(is_ours(base) for base in classes.get(name, []) if base != name)

    wrong = [
        where[name]
        for name in classes
        if is_exception(name) and not is_ours(name) and where[name] not in NOT_OURS_TO_WRAP
    ]
    assert "LightningPluginsError" in classes
    assert not wrong, "Exceptions must derive from lightning_plugins.errors.LightningPluginsError:\n" + "\n".join(wrong)


def test_no_file_is_over_the_limit():
    long = {
        str(path.relative_to(PACKAGE.parent)): n
        for path, _ in _modules().values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"Files over {MAX_LINES} lines (split them, one idea each): {long}"


def unpickling_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of every use of an unpickling reader in ``tree``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            callee = ast.unparse(node.func)
            if callee in UNPICKLING_CALLS:
                found.append((node.lineno, f"{callee}("))
            for keyword in node.keywords:
                value = keyword.value
                if keyword.arg == "weights_only" and not (isinstance(value, ast.Constant) and value.value is True):
                    found.append((node.lineno, f"weights_only={ast.unparse(value)}"))
                if keyword.arg == "allow_pickle" and not (isinstance(value, ast.Constant) and value.value is False):
                    found.append((node.lineno, f"allow_pickle={ast.unparse(value)}"))
        names = {
            ast.Name: lambda n: [n.id],
            ast.Attribute: lambda n: [n.attr],
            ast.alias: lambda n: [n.name.rpartition(".")[2]],
        }.get(type(node), lambda n: [])(node)
        found += [(getattr(node, "lineno", 0), name) for name in names if name in UNPICKLING_NAMES]
        if isinstance(node, ast.ImportFrom) and node.module in ("torch.distributed.checkpoint", "pickle"):
            found += [(node.lineno, f"from {node.module} import {a.name}") for a in node.names
                      if a.name in ("load", "loads", "load_state_dict")]  # fmt: skip
    return sorted(set(found))


def test_the_rule_against_unpickling_finds_each_form():
    """The rule below can fail: each form it forbids, written as code would write it, is found."""
    bad = """
import pickle, torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, load
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
pickle.load(f); pickle.loads(b); pickle.Unpickler(f).load()
torch.load(p); torch.load(p, weights_only=False)
dcp.load(state, checkpoint_id=p)
class R(FileSystemReader): pass
np.load(p, allow_pickle=True)
torch.distributed.checkpoint.state_dict_loader._load_state_dict_from_keys(keys, checkpoint_id=p)
"""
    found = {what for _, what in unpickling_uses(ast.parse(bad))}
    expected = {"pickle.load(", "pickle.loads(", "Unpickler", "torch.load(", "weights_only=False", "dcp.load(",
                "FileSystemReader", "DefaultLoadPlanner", "allow_pickle=True", "_load_state_dict_from_keys",
                "from torch.distributed.checkpoint import load"}  # fmt: skip
    assert expected <= found, expected - found
    assert not unpickling_uses(ast.parse("load_torch_file(p)\nyaml.safe_load(t)\njson.loads(t)"))


def test_nothing_is_unpickled_outside_the_safe_reader():
    assert SAFE_READER in _modules(), f"{SAFE_READER} is gone: update this rule with the module that replaced it"
    wrong = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
        for module, (path, tree) in _modules().items()
        if module != SAFE_READER and module not in READS_ONLY_ITS_OWN_PICKLES
        for line, what in unpickling_uses(tree)
    ]
    assert not wrong, (
        "These unpickle a file (a checkpoint, a model, a dataset may come from anyone: unpickling runs its code)."
        f" Read it through {SAFE_READER} (load_torch_file, load_dcp, SafeReader), which admits only what the file"
        " holds, by name:\n" + "\n".join(wrong)
    )


def test_the_adapters_import_the_engine_never_the_reverse():
    """``adapters -> parallel``, never back: what the adapters need from the engine lives in the engine. Every import
    counts here, those inside functions and ``TYPE_CHECKING`` blocks included, so no lazy import hides a cycle."""
    wrong = [
        f"{module}:{node.lineno} imports {ast.unparse(node)}"
        for module, (_, tree) in _modules().items()
        if module.startswith("lightning_plugins.parallel")
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        and any(
            name.startswith("lightning_plugins.adapters")
            for name in ([node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names])
        )
    ]
    assert not wrong, "The engine (parallel/) must not import the adapters:\n" + "\n".join(wrong)


def _every_import(module: str, path: Path, tree: ast.AST) -> list[tuple[str, int]]:
    """(absolute module name, line) of every import in ``tree``: inside functions and ``TYPE_CHECKING`` too."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.append((".".join(base + ([node.module] if node.module else [])), node.lineno))
            else:
                found.append((node.module or "", node.lineno))
    return found


def _part(module: str) -> str:
    """The part of the package ``module`` belongs to: ``lightning_plugins.recipe`` for
    ``lightning_plugins.recipe.schema``, ``lightning_plugins.cli`` for itself, the package for its ``__init__``."""
    return ".".join(module.split(".")[:2])


@cache
def _package_graph() -> dict[str, dict[str, list[str]]]:
    """Part -> imported part -> where (``path:line``), every import counted (lazy and type-only ones too)."""
    graph: dict[str, dict[str, list[str]]] = {}
    for module, (path, tree) in _modules().items():
        edges = graph.setdefault(_part(module), {})
        for target, line in _every_import(module, path, tree):
            if target.split(".")[0] == PACKAGE.name and _part(target) != _part(module):
                edges.setdefault(_part(target), []).append(f"{path.relative_to(PACKAGE.parent)}:{line}")
    return graph


def _cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph.get(node, {})):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def test_the_package_graph_is_acyclic():
    """``recipe -> run`` and never back, and so on: between the package's parts every import counts (those inside
    functions and ``TYPE_CHECKING`` blocks too), so no lazy or type-only import hides a cycle."""
    graph = {
        part: {target: where for target, where in edges.items() if (part, target) not in KNOWN_PACKAGE_CYCLES}
        for part, edges in _package_graph().items()
    }
    cycles = _cycles(graph)
    assert not cycles, "Package cycles (move what one part needs from the other to the part that owns the idea):\n" + (
        "\n".join(
            " -> ".join(cycle) + "\n" + "\n".join(f"  {a} -> {b}: {', '.join(graph[a][b])}" for a, b in zip(cycle, cycle[1:]))
            for cycle in cycles
        )
    )
    still = {(a, b) for a, b in KNOWN_PACKAGE_CYCLES if b in _package_graph().get(a, {})}
    assert still == KNOWN_PACKAGE_CYCLES, f"Gone from the code, so drop from KNOWN_PACKAGE_CYCLES: {KNOWN_PACKAGE_CYCLES - still}"


def test_the_package_cycle_rule_finds_a_lazy_and_a_type_only_cycle():
    """The rule above can fail: a cycle closed only by a lazy import, or only by a ``TYPE_CHECKING`` one, is found."""
    lazy = "def f():\n    from lightning_plugins.b.y import g\n"
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a.x import f\n"
    graph: dict[str, dict[str, list[str]]] = {}
    for module, path, text in (("lightning_plugins.a.x", Path("a/x.py"), lazy), ("lightning_plugins.b.y", Path("b/y.py"), typed)):
        for target, _ in _every_import(module, path, ast.parse(text)):
            if target.startswith("lightning_plugins."):
                graph.setdefault(_part(module), {}).setdefault(_part(target), []).append("")
    assert _cycles(graph) == [["lightning_plugins.a", "lightning_plugins.b", "lightning_plugins.a"]]


def test_only_the_doors_import_lightning_or_accelerate():
    wrong = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"
        for module, (path, tree) in _modules().items()
        if not module.startswith(DOORS)
        for target, line in _every_import(module, path, tree)
        if target.split(".")[0] in FRAMEWORKS
    ]
    assert not wrong, (
        "Only the doors (strategies/, accelerate/, demo.py) import Lightning or Accelerate; the engine serves both"
        " doors:\n" + "\n".join(wrong)
    )


def test_no_function_is_over_the_limit():
    long = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines"
        for module, (path, tree) in _modules().items()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"Functions over {MAX_FUNCTION_LINES} lines (split them, one idea each):\n" + "\n".join(long)
