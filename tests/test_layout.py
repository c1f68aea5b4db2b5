"""The package's structure, read from its source: imports go down the floors and never round a
circle, node annotations are read through ``passes/meta.py`` only, no module holds mutable
state, and no function runs past 60 lines."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "dtensor_par"

FLOORS = [
    ("logs", "mesh", "symbolic"),
    ("placements",),
    ("ops",),
    ("params", "config"),
    ("passes",),
    ("dump",),
    ("backend",),
    ("runtime", "sharded"),
    ("explain", "api"),
    ("__init__", "__main__"),
]
"""Each module's floor, lowest first, by its path under dtensor_par/: a module imports only
from its own floor or below."""

MUTABLE_STATE_ALLOWED = {"passes/rules/registry.py": {"_KINDS", "_BY_FUNCTION", "_BY_METHOD"}}
"""Module-level objects the package may change: the op registry's tables (filled as each rule
module registers its ops)."""


def _modules() -> dict[str, ast.Module]:
    return {str(p.relative_to(PACKAGE)): ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}


def _name(path: str) -> str:
    """``passes/plan.py`` -> ``dtensor_par.passes.plan``; a package's ``__init__.py`` -> the package."""
    parts = ["dtensor_par", *path.removesuffix(".py").split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The package's modules that ``path`` imports (``from .x import y`` counts ``x`` and, if a
    module, ``x.y``), TYPE_CHECKING imports included."""
    package = _name(path) if path.endswith("__init__.py") else _name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("dtensor_par")):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            found |= {m for m in [target] + [f"{target}.{a.name}" for a in node.names] if m in known}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
    return found - {_name(path)}


def _floor(path: str) -> int:
    top = path.removesuffix(".py").split("/")[0]
    return next(i for i, names in enumerate(FLOORS) if top in names)


def test_imports_go_down_the_floors_and_form_no_circle():
    modules = _modules()
    by_name = {_name(p): p for p in modules}
    graph = {_name(p): _imports(p, tree, set(by_name)) for p, tree in modules.items()}
    upward = [f"{by_name[m]} -> {by_name[d]}" for m, deps in graph.items() for d in deps
              if _floor(by_name[d]) > _floor(by_name[m])]
    assert not upward, upward
    done, path = set(), []

    def visit(m):
        assert m not in path, f"import circle: {' -> '.join(path[path.index(m):] + [m])}"
        if m in done:
            return
        path.append(m)
        for d in sorted(graph[m]):
            visit(d)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)


def _meta_key(node: ast.AST) -> str | None:
    """The key of ``x.meta[KEY]``, ``x.meta.get(KEY)`` (or setdefault/pop) and ``KEY in x.meta``."""
    def is_meta(n):
        return isinstance(n, ast.Attribute) and n.attr == "meta"
    key = None
    if isinstance(node, ast.Subscript) and is_meta(node.value):
        key = node.slice
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_meta(node.func.value) \
            and node.func.attr in ("get", "setdefault", "pop") and node.args:
        key = node.args[0]
    elif isinstance(node, ast.Compare) and len(node.comparators) == 1 and is_meta(node.comparators[0]):
        key = node.left
    return key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else None


def test_node_annotations_are_read_through_their_accessors_only():
    direct = [(path, key) for path, tree in _modules().items() if path != "passes/meta.py"
              for node in ast.walk(tree) if (key := _meta_key(node) or "").startswith("dtensor_par")]
    assert not direct, direct


MUTATORS = {"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "setdefault", "add",
            "discard"}


def _changed_module_names(tree: ast.Module) -> set[str]:
    """Module-level names that the module's code changes: rebound under ``global``, written by
    subscript, changed by a mutating method, or advanced with ``next``."""
    names = {t.id for stmt in tree.body if isinstance(stmt, (ast.Assign, ast.AnnAssign))
             for t in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]) if isinstance(t, ast.Name)}
    changed = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            changed |= set(node.names)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            changed |= {t.value.id for t in targets if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)}
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in MUTATORS and isinstance(f.value, ast.Name):
                changed.add(f.value.id)
            if isinstance(f, ast.Name) and f.id == "next" and node.args and isinstance(node.args[0], ast.Name):
                changed.add(node.args[0].id)
    return names & changed


def test_no_module_holds_mutable_state():
    found = [f"{path}: {name}" for path, tree in _modules().items()
             for name in sorted(_changed_module_names(tree) - MUTABLE_STATE_ALLOWED.get(path, set()))]
    assert not found, found


def test_no_function_runs_past_60_lines():
    long = [f"{path}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for path, tree in _modules().items() for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 60]
    assert not long, long
