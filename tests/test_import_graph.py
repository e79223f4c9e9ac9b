"""The import graph of dsquant/ (issue 18): no circles, and no import running back up the data flow.

Every `import dsquant...` / `from dsquant... import` counts, at module level or inside a function
(a function-level import still ties the two modules together; it only hides the circle from Python).
Edges go between module files; a package's __init__ is its own node.
"""
import ast
from pathlib import Path

import dsquant

ROOT = Path(dsquant.__file__).resolve().parent
# package -> packages it must never import (the data flow of ../shared/design.md, lowest first)
BELOW = {"errors", "assets", "config", "formats", "data"}
NEVER = {
    **{p: {"models", "runtime", "calibrate", "export", "validate", "tune", "bench", "cli", "convert"} for p in BELOW},
    "models": {"runtime", "calibrate", "export", "validate", "tune", "bench", "cli"},
    "runtime": {"calibrate", "validate", "tune", "bench", "cli"},
    "export": {"validate", "tune", "bench", "cli", "runtime", "calibrate"},
    "calibrate": {"validate", "tune", "bench", "cli"},
    "validate": {"tune", "bench", "cli"},
}
KNOWN_UPWARD: set[tuple[str, str]] = set()  # (importer, imported) pairs allowed to run up the flow


def _modules() -> dict[str, Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = ("dsquant",) + f.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rsplit(".", 1)[0] if "." in name else ""
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        package = m if f.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(f.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                t = resolve(t) if t.startswith("dsquant") else None
                if t and t != m:
                    edges[m].add(t)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        x = stack.pop()
                        on.discard(x)
                        comp.append(x)
                        if x == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = counter[0]
                counter[0] += 1
                stack.append(w)
                on.add(w)
                work.append((w, iter(sorted(edges[w]))))
            elif w in on:
                low[v] = min(low[v], index[w])
    return out


def test_the_graph_sees_function_level_imports():
    edges = _graph()
    assert "dsquant.runtime.model_builder" in edges["dsquant.runtime.parallel.worker"]  # imported inside a function
    assert "dsquant.assets" in edges["dsquant.cli"]


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_cycle_finder_finds_a_planted_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_formats_import_nothing_of_dsquant_but_errors():
    """Writers and readers both use dsquant/formats/, so it sits at the bottom of the flow."""
    bad = sorted((a, b) for a, targets in _graph().items() if a.startswith("dsquant.formats")
                 for b in targets if not b.startswith("dsquant.formats") and b != "dsquant.errors")
    assert bad == []


def test_no_import_runs_back_up_the_data_flow():
    def package(m: str) -> str:
        return m.split(".")[1] if "." in m else "dsquant"

    bad = sorted((a, b) for a, targets in _graph().items() for b in targets
                 if package(b) in NEVER.get(package(a), set()) and (a, b) not in KNOWN_UPWARD
                 and not Path(a.replace(".", "/")).name.startswith("cli"))
    assert bad == []
