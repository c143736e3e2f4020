"""One-way layers: windowkit never imports ``policies`` or ``agents``, and the import graph of windowkit,
policies and agents has no cycle between packages (``windowkit.kv``, ``windowkit.store``, ``windowkit.backends``,
``windowkit.models``, ..., ``policies``, ``agents``). Every import counts, function-level ones included.

No module is exempt: ``PENDING_POLICY_IMPORTERS`` is empty, and no import cycle is allowed at all (the simulator
is split by concept in ``windowkit/trace``: strategies, floor, orders, result, run, placement, cli, and nothing
there imports ``simulate.py``, the module that gathers their names).
"""
from __future__ import annotations

import ast
import re
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


# ---------------------------------------------------------------- no import inside a function (issue 17)
# Modules that may be imported inside a function: optional heavy dependencies, none of them an install
# requirement in pyproject.toml ([project] dependencies), so windowkit imports without them.
LAZY_DEPENDENCIES = {
    "sglang", "sgl_kernel",  # the SGLang engine (requirements-sglang*.txt), loaded only where an engine runs
    "mooncake",              # Mooncake Store (requirements-mooncake.txt), loaded only by a connecting backend
    "matplotlib",            # the "plot" extra: figures only
    "cv2", "PIL", "torchvision", "qwen_vl_utils",  # the "vision" extra and Qwen's video reader
}
# (importing module, imported module): the named exceptions, each lazy on purpose
LAZY_IMPORTS = {
    # PEP 562 __getattr__: `import windowkit` stays cheap (no transformers) until HFBackend, Window, ... are used
    ("windowkit", "windowkit.backends.hf"), ("windowkit", "windowkit.window"),
    ("windowkit", "windowkit.backends.sglang.backend"), ("windowkit", "windowkit.store"),
    # the CLI's lazy dispatch: each subcommand imports its module on use (`windowkit simulate` loads no model code)
    ("windowkit.cli", "windowkit.verify"), ("windowkit.cli", "windowkit.trace.cli"),
    ("windowkit.cli", "windowkit.trace.calibrate"), ("windowkit.cli", "windowkit.models.binding.eval"),
    ("windowkit.cli", "windowkit.models.binding.train"), ("windowkit.cli", "windowkit.benchmarks.real"),
    ("windowkit.cli", "windowkit.benchmarks.kv"),
    # the registry lookup, policies' side: `import policies` loads only the eviction policies; the refresh,
    # placement and guess makers (registered with windowkit.registry) import their modules on first use. (windowkit's
    # side, windowkit.registry.load_providers, loads `policies` through importlib / entry points: no import statement.)
    ("policies", "policies.refresh"), ("policies", "policies.placement"), ("policies", "policies.guess"),
    # the linker imports sglang at module level: the plugin, loaded by SGLang's plugin loader, imports it on use
    ("windowkit.backends.sglang.plugin", "windowkit.backends.sglang.linker"),
    # scaled RoPE types only: keeps windowkit.kv, and so windowkit.store, graph and policies, free of transformers
    ("windowkit.kv.rope", "transformers.modeling_rope_utils"),
    # transformers' Qwen-VL processors need the vision extra (PIL, torchvision) to import
    ("agents.long_video", "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"),
    ("agents.long_video", "transformers.models.qwen2_vl.video_processing_qwen2_vl"),
    ("agents.long_video", "transformers.models.qwen3_vl.video_processing_qwen3_vl"),
}


def _function_imports() -> list[tuple[str, str, int]]:
    """(module, imported module, line) of every import statement inside a function."""
    found = []
    for m, p in _modules().items():
        def walk(node, in_function: bool):
            for ch in ast.iter_child_nodes(node):
                if in_function and isinstance(ch, ast.Import):
                    found.extend((m, a.name, ch.lineno) for a in ch.names)
                elif in_function and isinstance(ch, ast.ImportFrom):
                    found.append((m, "." * ch.level + (ch.module or ""), ch.lineno))
                walk(ch, in_function or isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef)))
        walk(ast.parse(p.read_text(encoding="utf-8")), False)
    return found


def test_no_import_inside_a_function():
    allowed = LAZY_IMPORTS
    bad = [f"{m}:{line} imports {t}" for m, t, line in _function_imports()
           if t.split(".")[0] not in LAZY_DEPENDENCIES and (m, t) not in allowed]
    assert not bad, "hoist these to module level (or add a commented entry to LAZY_IMPORTS):\n" + "\n".join(bad)
    # every named exception is still needed: a hoisted one leaves the list
    used = {(m, t) for m, t, _ in _function_imports()}
    assert not allowed - used, sorted(allowed - used)
    # no install requirement is lazy: they are imported at module level
    deps = re.search(r"^dependencies = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(encoding="utf-8"), re.S | re.M)
    required = {re.match(r"[A-Za-z0-9_.-]+", d).group(0) for d in re.findall(r'"([^"]+)"', deps.group(1))}
    assert "transformers" in required and not LAZY_DEPENDENCIES & required, LAZY_DEPENDENCIES & required
