"""The run: replay a trace through several reuse strategies side by side and account their modeled cost.

Every strategy (``windowkit.trace.strategies``, by name in ``STRATEGIES``) sees the same resolved order of every
step (``windowkit.trace.orders``); the query is prefilled by all. ``simulate`` returns a ``SimResult``
(``windowkit.trace.result``).

    from windowkit.trace import simulate, sliding_window
    res = simulate(sliding_window(steps=50), "h100-kamera")
    res.summary()["ratios"]            # {"windowkit/radix": ..., "windowkit/recompute": ...}
    print(res.table())

Options: ``placement=`` orders the ``ordered: false`` steps (``policies.placement``: listed, arrival, greedy,
orbit, optimal; ``windowkit.trace.placement.compare_placements`` runs several), ``store_budget_bytes=`` /
``store_policy=`` bound windowkit's store (lru, size/gds, belady: an offline oracle filled by
``WindowkitStrategy.reads``, a dry run), ``refresh=`` re-conditions drifted survivors (``policies.refresh``).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence, Union

from tqdm import tqdm

from windowkit.trace.costs import CostProfile, load_profile
from windowkit.trace.floor import FloorStrategy
from windowkit.trace.orders import resolve_placement
from windowkit.trace.result import SimResult
from windowkit.trace.schema import Step, Trace
from windowkit.trace.strategies import (BlindReuse, FullRecompute, RadixCache, StepCost, Strategy, TokenBlend,
                                        WindowkitStrategy, check_store_options)
from windowkit.window.plan import RepairRule

STRATEGIES: dict[str, Callable[[], Strategy]] = {
    "recompute": FullRecompute, "radix": RadixCache, "blind": BlindReuse, "blend": TokenBlend,
    # the Window's defaults: form="lazy" (deferred forming), fidelity="balanced" (survivor repair rule)
    "windowkit": WindowkitStrategy,
    # opt-in: form="lazy" is the default now; kept as a name (the same costs as "windowkit")
    "windowkit-lazy": lambda: WindowkitStrategy(form="lazy", name="windowkit-lazy"),
    # opt-in: the former default, form="eager" (canonical + patch at every conditioned admission), keep-as-is
    "windowkit-eager": lambda: WindowkitStrategy(form="eager", repair="none", name="windowkit-eager"),
    # opt-in: deferred forming without survivor repair (fidelity="fast") / with full repair (fidelity="exact")
    "windowkit-fast-fidelity": lambda: WindowkitStrategy(fidelity="fast", name="windowkit-fast-fidelity"),
    "windowkit-exact-fidelity": lambda: WindowkitStrategy(fidelity="exact", name="windowkit-exact-fidelity"),
    # the defaults, and the agent prepares the next step's survivors between steps (prefetch(next=...)): its
    # critical path in total_ms, the preparation in idle_ms
    "windowkit-ahead": lambda: WindowkitStrategy(anticipate=True, name="windowkit-ahead"),
    # the Window's default loop: win.prefetch() between steps, which forms canonicals and patches and prepares its
    # guess policy's next window from the window's history alone (policies.guess "slide": the last slide again);
    # all of it, wrong guesses included, booked in idle_ms
    "windowkit-slide": lambda: WindowkitStrategy(guess="slide", name="windowkit-slide"),
    # the lower bound: each chunk prefilled once at its first appearance + the queries (windowkit/trace/floor.py)
    "floor": FloorStrategy,
}
DEFAULT_STRATEGIES = ("recompute", "radix", "blind", "blend", "windowkit", "floor")


def make_strategies(spec: Optional[Sequence[Union[str, Strategy]]] = None) -> list[Strategy]:
    """Fresh strategies from names in ``STRATEGIES`` (default: ``DEFAULT_STRATEGIES``) or instances, kept as is."""
    out = []
    for s in (spec or DEFAULT_STRATEGIES):
        if isinstance(s, Strategy):
            out.append(s)
        elif s in STRATEGIES:
            out.append(STRATEGIES[s]())
        else:
            raise ValueError(f"unknown strategy {s!r}; choose from {', '.join(STRATEGIES)}")
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        raise ValueError(f"strategy names must be distinct, got {names}")
    return out


def simulate(trace: Union[Trace, Sequence[Step]], profile: Union[str, CostProfile] = "h100-kamera",
             strategies: Optional[Sequence[Union[str, Strategy]]] = None, *, progress: Optional[bool] = None,
             max_steps: Optional[int] = None, placement: Any = None, store_budget_bytes: Optional[int] = None,
             store_policy: Any = None, refresh: Any = None, repair: Optional[str] = None) -> SimResult:
    """Replay ``trace`` through each strategy (all of them by default) under ``profile``.

    progress: a tqdm bar (None: only for traces of 500+ steps). max_steps: replay only the first steps.
    placement: the order of every ``ordered: false`` step, for all strategies alike: a name from
    ``policies.placement.PLACEMENTS`` ("listed", "arrival", "greedy", "orbit", "optimal") or a policy;
    None keeps today's behaviour (``resolve_orders``). ``summary()["placement"]`` records it.
    store_budget_bytes, store_policy, refresh: set on the windowkit strategies built here from names
    (see ``WindowkitStrategy``); strategy instances passed in keep their own. repair: a survivor repair spec
    (``Window(repair=...)``, e.g. "sink:5", "head:64", "all") for the windowkit strategies built here from names
    that keep the default rule (not ``windowkit-eager`` / ``-fast-fidelity`` / ``-exact-fidelity``, which set
    their own): what another point of the cost/fidelity front costs on this trace.

        res = simulate(read_trace("run.jsonl"), "cpu-tiny", strategies=["radix", "windowkit"])
        res.summary()["strategies"]["windowkit"]["total_ms"]
        simulate(grow_interleave_set(), placement="greedy", store_budget_bytes=1 << 16, store_policy="belady")
        simulate(read_trace("run.jsonl"), strategies=["radix", "windowkit"], repair="sink:5")
    """
    prof = load_profile(profile)
    rule = None if repair is None else RepairRule.parse(repair)  # a bad spec: WindowkitError, before any step
    strats = make_strategies(strategies)
    given = {id(s) for s in (strategies or ()) if isinstance(s, Strategy)}
    for s in strats:
        if id(s) in given or not hasattr(s, "budget"):  # store options: the windowkit strategies (a Window's store)
            continue
        if store_budget_bytes is not None:
            s.budget = store_budget_bytes
        if isinstance(s, WindowkitStrategy):
            if store_policy is not None:
                s.store_policy = store_policy
            if refresh is not None:
                s.refresh = refresh
            if rule is not None and not ({"repair", "fidelity"} & set(s.window_kw)):
                s.window_kw = dict(s.window_kw, repair=rule)
        check_store_options(s)
    steps = list(trace)[:max_steps] if max_steps is not None else list(trace)
    orders, pol = resolve_placement(steps, placement, prof)
    for s in strats:
        s.reset(prof)
        s.prepare(steps, orders)
    costs: dict[str, list[StepCost]] = {s.name: [] for s in strats}
    wall = {s.name: 0.0 for s in strats}
    show = len(steps) >= 500 if progress is None else progress
    it = zip(steps, orders)
    bar = None
    if show:
        bar = tqdm(total=len(steps), desc=f"simulate {getattr(trace, 'name', '')}".strip(), unit="step")
    for step, ctx in it:
        for s in strats:
            t0 = time.perf_counter()
            costs[s.name].append(s.step(step, ctx))
            wall[s.name] += time.perf_counter() - t0
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    meta: dict[str, Any] = {}
    if pol is not None:
        meta["placement"] = pol.name
        meta["placement_counters"] = dict(pol.counters)
        meta["placement_model_ms"] = pol.model_ms(orders)
    for s in strats:
        if isinstance(s, WindowkitStrategy):
            meta[f"{s.name}_repair"] = s.win.repair.name  # the survivor repair rule it ran (the front's point)
            if s.approximated_steps:
                meta["windowkit_approximated_steps"] = s.approximated_steps
            if s.refresher is not None:
                meta[f"{s.name}_refresh"] = {"policy": repr(s.refresher), **s.refresher.counters}
            if s.budget is not None:
                meta[f"{s.name}_store"] = {"policy": s.store.policy.name, "budget_bytes": s.budget,
                                           "evictions": s.store.stats.evictions, "rejected": s.store.stats.rejected}
    return SimResult(getattr(trace, "name", "") or "trace", prof.name, [s.name for s in strats], costs, wall, meta,
                     orders=orders, queries=[st.query_tokens for st in steps])


__all__ = ["STRATEGIES", "DEFAULT_STRATEGIES", "make_strategies", "simulate"]
