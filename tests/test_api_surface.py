"""The public surface (issue 17): the top level plus at most 40 documented names in the subpackages and
``policies``; every public name documented (a docstring, a call in docs/api.md); docs/api.md exactly what
``scripts/gen_api.py`` writes. The rest stays importable from its module: ``from windowkit.X import Y`` keeps
working for every such import in the repository."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gen_api():
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "scripts" / "gen_api.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _packages() -> list[str]:
    """Every package of windowkit (a folder with an ``__init__.py`` all the way up)."""
    out = []
    for init in sorted((ROOT / "windowkit").rglob("__init__.py")):
        parts = init.parent.relative_to(ROOT).parts
        if all((ROOT.joinpath(*parts[:i + 1]) / "__init__.py").is_file() for i in range(len(parts))):
            out.append(".".join(parts))
    return out


def test_the_subpackages_hold_at_most_40_public_names(gen_api):
    surface = gen_api.surface()
    sub = {m: names for m, names in surface.items() if m != "windowkit"}
    count = sum(len(v) for v in sub.values())
    assert gen_api.SUBPACKAGE_LIMIT == 40
    assert count <= gen_api.SUBPACKAGE_LIMIT, {m: len(v) for m, v in sub.items()}
    assert surface["windowkit"] == list(importlib.import_module("windowkit").__all__)
    # a name is public in one place: no two documented names are the same object
    objs = [(m, n, getattr(importlib.import_module(m), n)) for m, names in surface.items() for n in names]
    for i, (m, n, o) in enumerate(objs):
        if callable(o):
            dup = [f"{m2}.{n2}" for m2, n2, o2 in objs[i + 1:] if o2 is o]
            assert not dup, f"{m}.{n} is also public as {dup}"


def test_every_package_with_public_names_is_documented(gen_api):
    """A windowkit package whose ``__all__`` has names of its own is a section of docs/api.md (and counts)."""
    for pkg in _packages():
        mod = importlib.import_module(pkg)
        names = getattr(mod, "__all__", None)
        if not names:
            continue
        assert pkg in gen_api.MODULES, f"{pkg}.__all__ = {names}: add it to MODULES in scripts/gen_api.py"
        for n in names:
            assert hasattr(mod, n), f"{pkg}.__all__ names {n!r}, which it does not bind"


def test_every_public_name_has_a_docstring(gen_api):
    missing = []
    for mod, names in gen_api.surface().items():
        m = importlib.import_module(mod)
        for n in names:
            obj = getattr(m, n)
            if inspect.isclass(obj) or inspect.isroutine(obj):
                doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
                # a dataclass without a docstring gets its signature as __doc__: that is not one
                if not doc or not doc.strip() or doc.startswith(f"{obj.__name__}("):
                    missing.append(f"{mod}.{n}")
            elif f"{mod}.{n}" not in gen_api.DESCRIPTIONS:  # a constant or registry: described in gen_api
                missing.append(f"{mod}.{n}")
    assert not missing, missing


def test_every_public_name_has_a_call_and_no_call_is_left_over(gen_api):
    text, missing = gen_api.render()
    assert not missing, f"no example in scripts/gen_api.py EXAMPLES for {missing}"
    surface = gen_api.surface()
    extra = [f"{m}.{n}" for m, ex in gen_api.EXAMPLES.items() for n in ex if n not in surface.get(m, [])]
    assert not extra, f"EXAMPLES for names that are not public: {extra}"
    assert set(gen_api.SETUP) == {m for m, names in surface.items() if names}


def test_api_md_is_what_gen_api_writes(gen_api):
    text, _ = gen_api.render()
    current = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    assert current == text, "docs/api.md is stale: run PYTHONPATH=. .venv/bin/python scripts/gen_api.py"
    for mod, names in gen_api.surface().items():
        for n in names:
            assert f"### `{mod}.{n}`" in text


def test_every_import_from_a_package_still_resolves():
    """Dropping a name from ``__all__`` leaves it bound: ``from windowkit.X import Y`` in tests, bench, agents,
    examples, scripts, policies and windowkit itself still finds Y."""
    packages = set(_packages()) | {"policies"}
    bad = []
    for top in ("windowkit", "policies", "agents", "examples", "bench", "tests", "scripts"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in packages:
                    mod = importlib.import_module(node.module)
                    for a in node.names:
                        if a.name == "*" or hasattr(mod, a.name):
                            continue
                        try:  # a submodule: ``from windowkit.trace import cli``
                            importlib.import_module(f"{node.module}.{a.name}")
                        except ModuleNotFoundError:
                            bad.append(f"{path.relative_to(ROOT)}: from {node.module} import {a.name}")
    assert not bad, bad
