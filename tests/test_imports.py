"""The package's import graph, read from the source with ``ast``: no cycle, and nothing that shadows the reference.

Which imports count: **every** ``import`` and ``from ... import`` statement that names a ``bppsa`` module,
wherever it stands -- at module level, in a class body, under ``try`` or ``if TYPE_CHECKING``, and inside
functions.  A function-level import is deferred, not gone: it runs the first time the function does, and a
cycle through one is a circle in the design even where the import order happens to work (the torch backend
lazily importing the CPU backend, which imported the torch backend back, was one).

An edge goes to the module an import names: ``from .pkg import name`` to ``pkg.name`` where that is a
module, else to ``pkg`` (its ``__init__``).  Importing a submodule also runs the packages above it, but
that is no edge: a package's ``__init__`` may import its submodules, and they may import their siblings
(``bppsa.backends.cpu`` imports ``bppsa.backends.base``), as long as none imports the ``__init__`` back.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"


def modules(root: Path, top: str = "bppsa") -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (its file, whether it is a package's ``__init__``)."""
    out = {}
    for p in sorted((root / top).rglob("*.py")):
        parts = p.relative_to(root).with_suffix("").parts
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
    return out


def _known(name: str, mods) -> str | None:
    """``name`` or, for an attribute of a module (``from m import f``), the longest module prefix."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.Import | ast.ImportFrom, package: str, mods, top: str) -> set[str]:
    if isinstance(node, ast.Import):
        return {m for a in node.names if a.name.split(".")[0] == top and (m := _known(a.name, mods))}
    if node.level:
        parts = package.split(".")
        if node.level - 1 > len(parts) - 1:
            raise ValueError(f"relative import beyond the top package in {package}")
        base = ".".join(parts[:len(parts) - node.level + 1])
        base = f"{base}.{node.module}" if node.module else base
    else:
        base = node.module or ""
    if base.split(".")[0] != top:
        return set()
    return {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else _known(base, mods) for a in node.names} - {None}


def import_graph(root: Path = SRC, top: str = "bppsa") -> dict[str, set[str]]:
    """Module -> the ``top`` modules it imports (every import statement, function-level ones included)."""
    mods = modules(root, top)
    graph = {}
    for name, (path, is_pkg) in mods.items():
        package = name if is_pkg else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = set().union(*(_targets(n, package, mods, top) for n in ast.walk(tree)
                                    if isinstance(n, (ast.Import, ast.ImportFrom)))) - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its modules in import order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(u):
        state[u] = 1
        path.append(u)
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                return path[path.index(v):] + [v]
            if v not in state and (found := visit(v)):
                return found
        path.pop()
        state[u] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    # the reader sees the imports it must (else "no cycle" would prove nothing)
    assert "bppsa.backends.twin" in graph["bppsa.backends.cpu"]
    assert "bppsa.backends.base" in graph["bppsa.backends.cuda"]
    assert "bppsa.backends.cuda.runtime" in graph["bppsa.backends"]  # a function-level import
    assert "bppsa.scan" in graph["bppsa.backends.twin"]  # `from .. import scan`: the module, not bppsa/__init__
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle(tmp_path):
    pkg = tmp_path / "bppsa"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .sub import c\n")  # a deferred import counts
    (pkg / "sub" / "__init__.py").write_text("from .c import X\n")
    (pkg / "sub" / "c.py").write_text("from .. import a\nX = 1\n")
    graph = import_graph(tmp_path)
    assert graph["bppsa.b"] == {"bppsa.sub.c"} and graph["bppsa.sub"] == {"bppsa.sub.c"}
    assert find_cycle(graph) == ["bppsa.a", "bppsa.b", "bppsa.sub.c", "bppsa.a"]
    (pkg / "sub" / "c.py").write_text("X = 1\n")
    assert find_cycle(import_graph(tmp_path)) is None


def test_backends_import_down_the_tree():
    """No module below bppsa.backends imports the package's __init__ (which imports them, lazily or not)."""
    graph = import_graph()
    up = sorted(m for m, deps in graph.items() if m.startswith("bppsa.backends.") and "bppsa.backends" in deps)
    assert not up, f"these import bppsa.backends' __init__ from below it: {up}"


# The package's rooms, lowest first: a module imports only from its own layer or the layers below it
# (measure -> interpret -> render -> command).  A new room must be placed here.
LAYERS = (
    ("bppsa", "io", "precision", "process", "stats", "paper", "runlock", "device", "scan"),
    ("jacobians", "data"),
    ("flops", "backends", "distributed"),
    ("nn",),
    ("models",),
    ("verify",),
    ("bench",),
    ("analysis",),
    ("plots",),
    ("doctor", "commands"),
    ("cli",),
    ("__main__",),
)


def _room(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    rank = {room: i for i, rooms in enumerate(layers) for room in rooms}
    unplaced = sorted({_room(m) for m in graph} - set(rank))
    assert not unplaced, f"rooms missing from tests/test_imports.py LAYERS: {unplaced}"
    return sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if rank[_room(d)] > rank[_room(m)])


def test_no_module_imports_upward():
    graph = import_graph()
    assert "bppsa.paper" in graph["bppsa.bench.preflight"] | graph["bppsa.analysis.gpu_hours"]  # the reader sees
    up = upward_imports(graph)
    assert not up, "imports from a higher layer (tests/test_imports.py LAYERS):\n" + "\n".join(up)


def test_the_layer_check_finds_an_upward_import():
    graph = {"bppsa.bench.x": {"bppsa.analysis.y"}, "bppsa.analysis.y": {"bppsa.stats"}, "bppsa.stats": set()}
    assert upward_imports(graph) == ["bppsa.bench.x -> bppsa.analysis.y"]
    with pytest.raises(AssertionError, match="newroom"):
        upward_imports({"bppsa.newroom.z": set()})


def test_the_cpu_and_gpu_backends_import_neither_the_other():
    graph = import_graph()
    across = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                    for a, b in (("cpu", "cuda"), ("cuda", "cpu"))
                    if m.startswith(f"bppsa.backends.{a}") and d.startswith(f"bppsa.backends.{b}"))
    assert not across, across


def _top_level_names(path: Path, functions_only: bool) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif not functions_only and isinstance(node, ast.ClassDef):
            names.add(node.name)
        elif not functions_only and isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def test_no_backend_function_shadows_the_reference_scan():
    """bppsa.scan is the one reference tree; a backend's own function of one of its names would read as it."""
    reference = _top_level_names(SRC / "bppsa" / "scan.py", functions_only=False)
    assert {"blelloch_scan", "linear_scan", "reference_scan"} <= reference
    clashes = {name: sorted(_top_level_names(path, functions_only=True) & reference)
               for name, (path, _) in modules(SRC).items() if name.startswith("bppsa.backends")}
    assert not {k: v for k, v in clashes.items() if v}, clashes


def test_importing_backends_loads_neither_cpu_nor_cuda():
    code = ("import sys, bppsa.backends; "
            "print(sorted(m for m in sys.modules if m.startswith(('bppsa.backends.cpu', 'bppsa.backends.cuda', "
            "'cupy'))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
