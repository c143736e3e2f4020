"""The conditioning dependency graph: which patches condition on which chunks, what an eviction makes stale,
what a recall cascades into, and how far a context drifted from the one a patch was formed on.

    from windowkit.graph import DependencyGraph, divergence, reuse_decision
    g = DependencyGraph()
    g.add_patch("b", ctx_b, ["a"], tokens=64)
    g.on_evict("a")                        # -> [PatchRef('b', ctx_b)], stale now
    print(g.on_recall("a", ["a", "b"]))    # the cascade, costed, as a table

Pure Python + networkx; imports only windowkit.errors (torch only inside the optional ``embed`` hook).
See docs/graph.md.
"""
from windowkit.graph.dependency import (KINDS, Cascade, CascadeStep, CostModel, DependencyGraph, PatchNotFoundError,
                                        PatchRef, TokenCostModel, entry_is_stale, stale_indices)
from windowkit.graph.divergence import Embed, divergence, reuse_decision

# the public names (docs/api.md); the others imported above stay importable from here and from their modules
__all__ = ["DependencyGraph", "TokenCostModel", "divergence", "reuse_decision"]
