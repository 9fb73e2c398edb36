"""The package's import structure: no import cycles (module-level or deferred imports inside
functions), no private name imported from another module, and every module importable first
in a fresh interpreter."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Set

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "txl_kernels"


def _modules() -> Dict[str, Path]:
    """Dotted name -> file of every module of the package (packages by their __init__)."""
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _type_checking_only(tree: ast.AST) -> Set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (never executed)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _imports(name: str):
    """(imported module, imported names) for every import statement of module ``name``
    anywhere in it (a deferred import inside a function closes a cycle too), resolved to
    modules of the package."""
    tree = ast.parse(MODULES[name].read_text())
    skip = _type_checking_only(tree)
    here = name if _is_package(name) else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target not in MODULES:
                continue
            names = []
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in MODULES:  # `from . import _build`: the submodule itself
                    yield sub, []
                else:
                    names.append(alias.name)
            if names:
                yield target, names


def _graph() -> Dict[str, Set[str]]:
    return {m: {t for t, _ in _imports(m) if t != m} for m in MODULES}


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan), each
    listed along its edges."""
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for comp in comps:  # walk from the first module back to itself inside the component
        members, start = set(comp), min(comp)
        path, seen = [start], {start}
        while True:
            nxt = sorted(w for w in graph[path[-1]] if w in members)
            back = [w for w in nxt if w == start]
            if back and len(path) > 1:
                break
            step = next((w for w in nxt if w not in seen), None)
            if step is None:
                break
            path.append(step)
            seen.add(step)
        cycles.append(path + [start])
    return cycles


def _edges_into_packages(graph: Dict[str, Set[str]]) -> Dict[str, Set[str]]:
    """The graph without edges from a package's own submodules back to it (``from .. import
    x`` inside ``txl_kernels.models`` reads the parent package, which Python has already
    started; a cycle through a package's __init__ and its own children is how packages
    work, not a cycle between modules)."""
    return {m: {t for t in ts if not (_is_package(t) and m.startswith(t + "."))}
            for m, ts in graph.items()}


def test_import_graph_is_read():
    """The walker sees the package's real edges (a broken resolver would find no cycle)."""
    graph = _graph()
    assert "txl_kernels.memory" in graph["txl_kernels.models.mem_transformer"]
    assert "txl_kernels.cached_attention" in graph["txl_kernels.models.mem_transformer"]
    assert "txl_kernels._build" in graph["txl_kernels.memory"] | graph["txl_kernels._cpp_ops"]
    assert "txl_kernels.modules._dropin" in graph["txl_kernels.modules.conformer"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_import_cycles():
    cycles = _cycles(_edges_into_packages(_graph()))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_private_names_imported_across_modules():
    """A module uses another module's public names only (private modules such as _utils are
    fine; a leading underscore on a function or class means it is that module's own)."""
    bad = [f"{m} imports {t}.{n}" for m in MODULES for t, names in _imports(m) for n in names
           if n.startswith("_") and not n.startswith("__")]
    assert not bad, bad


@pytest.mark.slow
def test_every_module_imports_first_in_a_fresh_interpreter():
    """Each module imported first, alone, in its own interpreter: an import cycle that works
    from one entry point but not another shows up here."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("TRITON_INTERPRET", "1")

    def run(name):
        r = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
        return name, r.returncode, r.stderr[-2000:]

    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        failed = [(n, err) for n, rc, err in pool.map(run, MODULES) if rc != 0]
    assert not failed, "\n\n".join(f"import {n} failed:\n{err}" for n, err in failed)


def test_importing_the_package_leaves_triton_unimported():
    """``python -m txl_kernels`` sets TRITON_INTERPRET after ``import txl_kernels``; triton's own
    jit helpers read it when triton is imported, so the package import must not import triton
    (nor torch._dynamo, which imports it); nor the LM's attention dispatch, which imports the
    decode kernel only where that route runs."""
    code = ("import sys, txl_kernels, txl_kernels.cached_attention; "
            "print(sorted(m for m in ('triton', 'torch._dynamo') if m in sys.modules))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
