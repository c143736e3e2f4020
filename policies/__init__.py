"""Policies: pure functions of state + costs that decide what the window and the store do.

    from policies import LRU, make_eviction_policy
    store = ChunkStore(budget_bytes=1 << 30, policy=make_eviction_policy("lfu"))

Layering: ``windowkit.store`` imports this package for its eviction policies, so nothing imported
*eagerly* here may import ``windowkit.store`` or anything above it (``windowkit.window``,
``windowkit.graph``, backends). Placement policies that need those should load lazily (PEP 562
``__getattr__`` below the placement block), or the store's import of ``policies.eviction`` becomes a cycle.
"""

# ---------------------------------------------------------------- eviction (owned by the store work)
from policies.eviction import (EVICTION_POLICIES, FIFO, LFU, LRU, EvictionPolicy, SizeAware,
                               make_eviction_policy)

_EVICTION_EXPORTS = ["EvictionPolicy", "LRU", "FIFO", "LFU", "SizeAware", "EVICTION_POLICIES",
                     "make_eviction_policy"]
# ---------------------------------------------------------------- end of eviction block

# ---------------------------------------------------------------- placement (owned by the window work)
_PLACEMENT_EXPORTS: list[str] = []
# ---------------------------------------------------------------- end of placement block

__all__ = _EVICTION_EXPORTS + _PLACEMENT_EXPORTS
