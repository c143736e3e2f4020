"""The order each step of a trace is replayed in, by every strategy alike.

``resolve_orders``: each step's own order, except that an unordered step whose set equals the previous step's
keeps the previous order (nothing moves). ``resolve_placement``: the ``ordered: false`` steps ordered by a
placement policy (``policies.placement``, found by name through ``windowkit.registry``).

    orders = resolve_orders(trace)                               # [[ChunkRef, ...], ...] per step
    orders, pol = resolve_placement(list(trace), "greedy", load_profile("cpu-tiny"))
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from windowkit.registry import make_policy
from windowkit.trace.costs import CostProfile
from windowkit.trace.schema import ChunkRef, Step, Trace


def resolve_orders(trace: Union[Trace, Sequence[Step]]) -> list[list[ChunkRef]]:
    """The context order each step is replayed in. An unordered step whose set equals the previous step's
    keeps the previous order (nothing moves); otherwise the step's own order is used."""
    out: list[list[ChunkRef]] = []
    prev: Optional[list[ChunkRef]] = None
    for s in trace:
        ctx = list(s.context)
        if not s.ordered and prev is not None and len(prev) == len(ctx) and {x.id for x in prev} == set(s.ids):
            by = {x.id: x for x in ctx}
            ctx = [by[x.id] for x in prev]
        out.append(ctx)
        prev = ctx
    return out


def resolve_placement(steps: Sequence[Step], placement: Any = None,
                      profile: Optional[CostProfile] = None) -> tuple[list[list[ChunkRef]], Optional[Any]]:
    """Every step's order under ``placement`` (None: ``resolve_orders``, today's behaviour) and the fresh
    policy used (its ``counters`` say what it did). Ordered steps always keep their order."""
    if placement is None:
        return resolve_orders(steps), None
    pol = make_policy("placement", placement)
    pol.reset(profile)
    pol.prepare(steps)
    return pol.resolve(steps), pol


__all__ = ["resolve_orders", "resolve_placement"]
