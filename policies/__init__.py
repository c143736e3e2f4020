"""Policies: pure functions of state + costs that decide what the window and the store do.

    from policies import LRU, make_eviction_policy
    store = ChunkStore(budget_bytes=1 << 30, policy=make_eviction_policy("lfu"))

Layering: ``windowkit.store`` imports this package for its eviction policies, so nothing imported
*eagerly* here may import ``windowkit.store`` or anything above it (``windowkit.window``,
``windowkit.graph``, backends). Placement policies that need those should load lazily (PEP 562
``__getattr__`` below the placement block), or the store's import of ``policies.eviction`` becomes a cycle.
"""

# ---------------------------------------------------------------- eviction (owned by the store work)
from policies.eviction import (EVICTION_POLICIES, FIFO, LFU, LRU, Belady, EvictionPolicy, SizeAware,
                               make_eviction_policy)

_EVICTION_EXPORTS = ["EvictionPolicy", "LRU", "FIFO", "LFU", "SizeAware", "Belady", "EVICTION_POLICIES",
                     "make_eviction_policy"]
# ---------------------------------------------------------------- end of eviction block

# ---------------------------------------------------------------- placement (owned by the window work)
# loaded lazily (PEP 562): ``from policies import OrbitSet`` imports policies.placement / policies.refresh on
# first use, so the store's import of policies.eviction never pulls them in
_LAZY = {**{n: "policies.placement" for n in ("PlacementPolicy", "Listed", "Arrival", "GreedyPatchHit", "OrbitSet",
                                               "OfflineOptimal", "Fixed", "PatchHitCost", "PLACEMENTS",
                                               "make_placement", "model_cost")},
         **{n: "policies.refresh" for n in ("RefreshPolicy", "Never", "Always", "DivergenceThreshold", "Budgeted",
                                             "REFRESH_POLICIES", "make_refresh")}}
_PLACEMENT_EXPORTS: list[str] = list(_LAZY)


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'policies' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(mod), name)
# ---------------------------------------------------------------- end of placement block

__all__ = _EVICTION_EXPORTS + _PLACEMENT_EXPORTS
