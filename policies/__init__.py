"""Policies: pure functions of state + costs that decide what the window and the store do.

    from policies import make_eviction_policy
    store = ChunkStore(budget_bytes=1 << 30, policy=make_eviction_policy("lfu"))   # = ChunkStore(..., policy="lfu")

Layering: this package depends on windowkit and windowkit never imports it. The eviction protocol, the
store's default ``LRU`` and the registries live in windowkit (``windowkit.store.eviction``,
``windowkit.registry``); importing this package registers its policies there, so ``ChunkStore(policy="lfu")``
and windowkit's benchmarks find them by name. windowkit loads this package when asked for a name it does not
know, through the ``windowkit.policies`` entry point (pyproject.toml), or by importing ``policies`` in a
checkout without it. Placement, refresh and guess policies load lazily (PEP 562 ``__getattr__`` below), so
``import policies`` pulls in only the eviction policies.
"""

# ---------------------------------------------------------------- eviction
import importlib

from policies.eviction import (EVICTION_POLICIES, FIFO, LFU, LRU, Belady, EvictionPolicy, SizeAware,
                               make_eviction_policy)
from windowkit.registry import register_factory

_EVICTION_EXPORTS = ["EvictionPolicy", "LRU", "FIFO", "LFU", "SizeAware", "Belady", "EVICTION_POLICIES",
                     "make_eviction_policy"]
# ---------------------------------------------------------------- end of eviction block

# ---------------------------------------------------------------- placement, refresh and guess
# loaded lazily (PEP 562): ``from policies import OrbitSet`` imports policies.placement / policies.refresh on
# first use, so importing the eviction policies (e.g. when the store looks one up by name) never pulls them in
_LAZY = {**{n: "policies.placement" for n in ("PlacementPolicy", "Listed", "Arrival", "GreedyPatchHit", "OrbitSet",
                                               "OfflineOptimal", "Fixed", "PatchHitCost", "PLACEMENTS",
                                               "make_placement", "model_cost")},
         **{n: "policies.refresh" for n in ("RefreshPolicy", "Never", "Always", "DivergenceThreshold", "Budgeted",
                                             "REFRESH_POLICIES", "make_refresh")},
         **{n: "policies.guess" for n in ("GuessPolicy", "NoGuess", "SlideGuess", "GUESS_POLICIES", "make_guess")}}
_PLACEMENT_EXPORTS: list[str] = list(_LAZY)


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'policies' has no attribute {name!r}")
    return getattr(importlib.import_module(mod), name)
# ---------------------------------------------------------------- end of placement, refresh and guess block


# the makers registered below import their modules on first use, as __getattr__ does: `import policies` stays
# the eviction policies only
def _make_refresh(spec=None):
    from policies.refresh import make_refresh

    return make_refresh(spec)


def _make_placement(spec=None):
    from policies.placement import make_placement

    return make_placement(spec)


def _refresh_names() -> list:
    from policies.refresh import REFRESH_POLICIES

    return list(REFRESH_POLICIES)


def _make_guess(spec=None):
    from policies.guess import make_guess

    return make_guess(spec)


def _guess_names() -> list:
    from policies.guess import GUESS_POLICIES

    return list(GUESS_POLICIES)


def _placement_names() -> list:
    from policies.placement import PLACEMENTS

    return list(PLACEMENTS)


def _register() -> None:
    """windowkit finds the refresh and placement makers, and their names, by family (``windowkit.registry``:
    ``make_policy``, ``names``); the eviction policies registered themselves when ``policies.eviction`` was
    imported above."""
    register_factory("refresh", _make_refresh, names=_refresh_names)
    register_factory("placement", _make_placement, names=_placement_names)
    register_factory("guess", _make_guess, names=_guess_names)


_register()

# the public names (docs/api.md): the bases a policy author subclasses and the makers by name; every other name
# above (LRU, OrbitSet, PLACEMENTS, GuessPolicy, make_guess, ...) stays importable from here and from its module
__all__ = ["EvictionPolicy", "PlacementPolicy", "RefreshPolicy", "make_eviction_policy", "make_placement", "make_refresh"]
