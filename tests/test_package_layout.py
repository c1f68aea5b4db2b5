"""The package's layout, read from its source: imports run downward, without cycles; node
annotations go through passes/meta.py; no module holds state the package changes; functions
stay short."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dtensor_par"

# Lowest first: a module may import its own floor and those below, never one above.
FLOORS = (
    ("errors", "gcpause", "logs", "machines", "mesh", "model_folders", "placements", "same_inputs", "symbolic"),
    ("ops",),
    ("params", "config", "kv_cache", "pieces", "sequence_pieces"),
    ("passes.nodes", "passes.meta"),
    ("passes.rules",),
    ("passes.context",),
    ("passes",),  # the passes themselves
    ("dump", "planning", "plancache", "routing", "pipeline_plan"),
    ("sharded", "checkpoint_keys", "checkpoints", "runtime", "api", "explain", "choose", "calibrate", "pipelining",
     "__init__", "__main__"),
    ("_testing",),  # what the tests and benchmarks share: above the public API, which no module imports it from
)


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _packages(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports: every import statement (``TYPE_CHECKING`` and
    function-local ones too), each with the packages whose ``__init__`` it runs on the way."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names}
        reached = {t for target in targets for t in (target, *_packages(target)) if t in files}
        graph[name] = reached - {name} - set(_packages(name))  # its own packages are already running
    return graph


def floor_of(module: str) -> int:
    name = module.removeprefix("dtensor_par").removeprefix(".") or "__init__"
    matches = [(len(prefix), i) for i, floor in enumerate(FLOORS) for prefix in floor
               if name == prefix or name.startswith(prefix + ".")]
    assert matches, f"{module} is on no floor of FLOORS"
    return max(matches)[1]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One import path that returns to its start, for each module on a cycle."""
    found = []
    for start in graph:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    found.append(path + [start])
                    stack = []
                    break
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
    return found


def test_imports_form_no_cycle():
    graph = import_graph()
    assert "dtensor_par.passes.rules.registry" in graph["dtensor_par.passes.detect"]
    assert "dtensor_par.passes.rules" in graph["dtensor_par.passes.detect"]  # its __init__ runs too
    assert cycles(graph) == []


def test_imports_point_down_the_floors():
    upward = [f"{m} -> {t}" for m, targets in import_graph().items() for t in sorted(targets)
              if floor_of(t) > floor_of(m)]
    assert upward == []


def test_node_annotations_only_through_passes_meta():
    sources = [p for folder in ("dtensor_par", "tests", "benchmarks", "examples") for p in (ROOT / folder).rglob("*.py")]
    spelled = re.compile(r"""meta(\[|\.get\(|\.setdefault\(|\.pop\()\s*["']dtensor_par|["']dtensor_par_?\w*["']\s+in\s""")
    found = [f"{path.relative_to(ROOT)}:{i}" for path in sources if path != PACKAGE / "passes" / "meta.py"
             for i, line in enumerate(path.read_text().splitlines(), 1) if spelled.search(line)]
    assert found == []


def test_modules_are_short():
    """A module over 700 lines is a catalogue to split by family (as passes/canonicalize/ is)."""
    long = [f"{path.relative_to(ROOT)} ({n} lines)" for path in PACKAGE.rglob("*.py")
            if (n := len(path.read_text().splitlines())) > 700]
    assert long == []


def test_benchmarks_and_examples_import_no_test_module():
    """What both need lives in dtensor_par/_testing: tests/ is no library."""
    found = [f"{path.relative_to(ROOT)}:{node.lineno}" for folder in ("benchmarks", "examples")
             for path in (ROOT / folder).rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, (ast.Import, ast.ImportFrom))
             and any(name == "tests" or name.startswith("tests.") for name in
                     ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]))]
    assert found == []


def test_functions_are_short():
    long = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in PACKAGE.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60]
    assert long == []


MUTABLE_STATE_ALLOWED = {"passes/rules/registry.py": {"_KINDS", "_BY_FUNCTION", "_BY_METHOD"},
                         "passes/capture.py": {"_FRAMES", "_AT_FRAME_START"}}
"""Module-level objects the package may change: the op registry's tables (filled as each rule
module registers its ops); the frames Dynamo compiled and the graph breaks each counted (its
counters and callbacks are process-wide)."""


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
    found = [f"{path.relative_to(PACKAGE)}: {name}" for path in sorted(PACKAGE.rglob("*.py"))
             for name in sorted(_changed_module_names(ast.parse(path.read_text()))
                                - MUTABLE_STATE_ALLOWED.get(str(path.relative_to(PACKAGE)), set()))]
    assert found == []
