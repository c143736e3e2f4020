"""Patch-refresh policies: when does a survivor whose antecedents changed get fresh conditioning?

After an edit (evict in front of it, an admit or recall ahead of it), a chunk kept in the window holds KV
conditioned on its *old* antecedents: keep-as-is (cheap: it only relocates, but cross-chunk binding is
stale). ``Window.plan()`` lists each such chunk as a ``refresh-patch`` edit with its ``divergence``
(how far its context drifted, ``windowkit.graph.divergence``), and ``Window.recondition(limit)`` refreshes
the ``limit`` most diverged ones (a stored patch for the new context, else one conditioned forward each).
A refresh policy picks how many, from those edits, using only these public Window methods.

Every policy has the same few methods:

    reset()                       fresh counters
    select(edits) -> edits        which refresh-patch edits to refresh (most diverged first)
    apply(win) -> ids             select from ``win.plan()`` and refresh them with ``win.recondition``

    pol = make_refresh("threshold:0.3")
    pol.apply(win)                # after win.assign(...), before win.forward(query)

Policies
  never       keep-as-is always (the Window's default behaviour)
  always      refresh every drifted survivor
  threshold   ``DivergenceThreshold(tau)``: refresh those with divergence >= tau
  budget      ``Budgeted(k)``: at most the k most diverged per step

Why select by count: ``recondition(limit=k)`` refreshes the k largest divergences, so picking every edit
with divergence >= tau and passing their number refreshes exactly that set (all of them outrank the rest).
A rebuild flag (strict-superset or disjoint context) with a divergence below tau is refreshed only if it
ranks among them: the Window exposes no per-id refresh (see docs/simulation.md).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from windowkit.errors import PolicyError, PolicyTypeError


def _refresh_edits(win: Any) -> list:
    return [e for e in win.plan() if e.op == "refresh-patch"]


class RefreshPolicy:
    """Base: ``select`` decides; ``apply`` runs it on a Window and counts what was refreshed."""

    name = "refresh"

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.counters = {"steps": 0, "stale": 0, "refreshed": 0}

    def select(self, edits: Sequence[Any]) -> list:
        raise NotImplementedError

    def apply(self, win: Any) -> list[str]:
        """Refresh the selected survivors of ``win``; returns their ids."""
        self.counters["steps"] += 1
        edits = _refresh_edits(win)
        self.counters["stale"] += len(edits)
        chosen = self.select(edits)
        if not chosen:
            return []
        done = win.recondition(limit=len(chosen)) if len(chosen) < len(edits) else win.recondition()
        self.counters["refreshed"] += len(done)
        return done

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Never(RefreshPolicy):
    """Keep-as-is: survivors only relocate (no forward, binding risk stays).

        Never().select(edits)   # []
    """

    name = "never"

    def select(self, edits):
        return []


class Always(RefreshPolicy):
    """Refresh every survivor whose antecedents changed (binding kept; one forward each unless a patch
    for the new context is stored).

        Always().select(edits)  # all of them
    """

    name = "always"

    def select(self, edits):
        return list(edits)


class DivergenceThreshold(RefreshPolicy):
    """Refresh survivors whose divergence is >= ``tau`` (0 < tau <= 1), most diverged first.

        DivergenceThreshold(0.3).select(edits)   # edits with divergence >= 0.3
    """

    name = "threshold"

    def __init__(self, tau: float = 0.3):
        if not 0.0 < float(tau) <= 1.0:
            raise PolicyError(f"tau must be in (0, 1], got {tau}")
        self.tau = float(tau)
        super().__init__()

    def select(self, edits):
        return sorted((e for e in edits if e.divergence >= self.tau), key=lambda e: -e.divergence)

    def __repr__(self) -> str:
        return f"DivergenceThreshold({self.tau})"


class Budgeted(RefreshPolicy):
    """At most ``k`` refreshes per step, the most diverged first (a time budget in forwards).

        Budgeted(2).select(edits)   # the two largest divergences
    """

    name = "budget"

    def __init__(self, k: int = 1):
        if int(k) < 0:
            raise PolicyError(f"k must be >= 0, got {k}")
        self.k = int(k)
        super().__init__()

    def select(self, edits):
        return sorted(edits, key=lambda e: -e.divergence)[:self.k]

    def __repr__(self) -> str:
        return f"Budgeted({self.k})"


REFRESH_POLICIES: dict[str, type[RefreshPolicy]] = {"never": Never, "always": Always,
                                                    "threshold": DivergenceThreshold, "budget": Budgeted}


def make_refresh(spec: Any = None) -> Optional[RefreshPolicy]:
    """A fresh policy from None (None: the Window's default, no refresh), a name ("never", "always",
    "threshold[:tau]", "budget[:k]"), a class or an instance.

        make_refresh("threshold:0.5")   # -> DivergenceThreshold(0.5)
    """
    if spec is None or isinstance(spec, RefreshPolicy):
        return spec
    if isinstance(spec, type) and issubclass(spec, RefreshPolicy):
        return spec()
    if isinstance(spec, str):
        name, _, arg = spec.lower().partition(":")
        cls = REFRESH_POLICIES.get(name)
        if cls is None:
            raise PolicyError(f"unknown refresh policy {spec!r}; known: {', '.join(REFRESH_POLICIES)}")
        if not arg:
            return cls()
        conv = {DivergenceThreshold: (float, "a number"), Budgeted: (int, "an integer")}.get(cls)
        if conv is not None:
            try:
                value = conv[0](arg)
            except ValueError:
                raise PolicyError(f"refresh policy {name!r} takes {conv[1]}, got {spec!r}") from None
            return cls(value)
        raise PolicyError(f"refresh policy {name!r} takes no argument, got {spec!r}")
    raise PolicyTypeError(f"cannot make a refresh policy from {spec!r}")


__all__ = ["RefreshPolicy", "Never", "Always", "DivergenceThreshold", "Budgeted", "REFRESH_POLICIES", "make_refresh"]
