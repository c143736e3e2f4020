"""One-way layers: windowkit never imports ``policies`` or ``agents``, and the import graph of windowkit,
policies and agents has no cycle between packages (``windowkit.kv``, ``windowkit.store``, ``windowkit.backends``,
``windowkit.models``, ..., ``policies``, ``agents``). Every import counts, function-level ones included.

No module is exempt: ``PENDING_POLICY_IMPORTERS`` is empty, and no import cycle is allowed at all (the simulator
is split by concept in ``windowkit/trace``: strategies, floor, orders, result, run, placement, cli, and nothing
there imports ``simulate.py``, the module that gathers their names).
"""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PENDING_POLICY_IMPORTERS: set[str] = set()


def _modules() -> dict[str, Path]:
    mods = {}
    for top in ("windowkit", "policies", "agents"):
        for p in sorted((ROOT / top).rglob("*.py")):
            name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = p
    return mods


def _graph() -> nx.DiGraph:
    mods = _modules()

    def resolve(name: str):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    g = nx.DiGraph()
    for m, p in mods.items():
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for n in names:
                t = resolve(n)
                if t and t != m and not m.startswith(t + "."):  # a package's own __init__ is not an edge
                    g.add_edge(m, t)
    return g


def _package(m: str) -> str:
    parts = m.split(".")
    return ".".join(parts[:2]) if parts[0] == "windowkit" else parts[0]


def test_windowkit_never_imports_policies_or_agents():
    bad = [(a, b) for a, b in _graph().edges
           if a.split(".")[0] == "windowkit" and b.split(".")[0] in ("policies", "agents")
           and a not in PENDING_POLICY_IMPORTERS]
    assert not bad, bad


def test_no_import_cycles():
    g = _graph()
    cycles = list(nx.simple_cycles(g))
    assert not cycles, cycles[:5]
    pkg = nx.DiGraph()
    for a, b in g.edges:
        if _package(a) != _package(b) and a not in PENDING_POLICY_IMPORTERS:
            pkg.add_edge(_package(a), _package(b))
    assert nx.is_directed_acyclic_graph(pkg), list(nx.simple_cycles(pkg))[:5]
    assert not pkg.has_edge("windowkit.backends", "windowkit.models")
    assert not pkg.has_edge("windowkit.store", "policies")


def test_nothing_in_trace_imports_the_simulate_module_back():
    """``windowkit.trace.simulate`` only gathers names; the package's ``__init__`` is its one importer there."""
    g = _graph()
    back = [m for m in g.predecessors("windowkit.trace.simulate") if m.startswith("windowkit.trace")]
    assert back == ["windowkit.trace"], back
