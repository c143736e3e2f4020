"""Placement comparison: one run of a trace per placement policy, and its table.

    rows = compare_placements(grow_interleave_set(episodes=20), profile="cpu-tiny")
    print(placement_table(rows))

Each placement orders the ``ordered: false`` steps (``windowkit.trace.orders.resolve_placement``; the policies
are ``policies.placement``'s, by name through ``windowkit.registry``).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from windowkit.registry import names
from windowkit.trace.costs import CostProfile, load_profile
from windowkit.trace.orders import resolve_placement
from windowkit.trace.run import simulate
from windowkit.trace.schema import Step, Trace
from windowkit.trace.strategies import Strategy


def compare_placements(trace: Union[Trace, Sequence[Step]], placements: Optional[Sequence[Any]] = None,
                       profile: Union[str, CostProfile] = "h100-kamera",
                       strategies: Optional[Sequence[Union[str, Strategy]]] = ("radix", "blind", "windowkit"),
                       **kw: Any) -> dict:
    """Run ``trace`` once per placement; per placement: every strategy's totals, the placement model's cost
    (``policies.placement.PatchHitCost``) and the policy's counters. A placement whose orders equal an
    earlier one's is not replayed again (``same_orders_as`` names it). ``placements`` defaults to every
    registered placement, in the registry's order (``windowkit.registry.names("placement")``: listed, arrival,
    greedy, orbit, optimal). ``kw`` goes to ``simulate``.

        rows = compare_placements(grow_interleave_set(episodes=20), profile="cpu-tiny")
        print(placement_table(rows))
    """
    if placements is None:
        placements = names("placement")
    prof = load_profile(profile)
    steps = list(trace)
    name = getattr(trace, "name", "") or "trace"
    out: dict[str, Any] = {}
    done: dict[tuple, str] = {}
    for pl in placements:
        orders, pol = resolve_placement(steps, pl, prof)
        label = pol.name if pol is not None else "none"
        row: dict[str, Any] = {"model_ms": pol.model_ms(orders) if pol is not None else None,
                               "counters": dict(pol.counters) if pol is not None else {}}
        key = tuple(tuple(x.id for x in o) for o in orders)
        if key in done:
            first = out[done[key]]
            out[label] = {**row, "strategies": first["strategies"], "wall_s": first["wall_s"],
                          "same_orders_as": done[key]}
            continue
        done[key] = label
        res = simulate(Trace(steps, name=name), prof, list(strategies) if strategies else None, progress=False,
                       placement=pol.replay(orders) if pol is not None else None, **kw)
        out[label] = {**row, "strategies": {n: res.totals(n) for n in res.strategies}, "wall_s": dict(res.wall_s)}
    return {"trace": name, "steps": len(steps), "profile": prof.name, "placements": out}


def placement_table(rows: dict, strategy: str = "windowkit", base: str = "arrival") -> str:
    """Markdown: per placement, ``strategy``'s total_ms, its gain over ``base`` ((base - x) / base), binding
    risk, and the placement model's cost."""
    pl = rows["placements"]
    ref = pl.get(base, {}).get("strategies", {}).get(strategy, {}).get("total_ms")
    lines = [f"| placement | {strategy} total_ms | gain vs {base} | binding_risk | model_ms |", "|---|---|---|---|---|"]
    for name, r in pl.items():
        t = r["strategies"].get(strategy)
        if t is None:
            continue
        gain = f"{(ref - t['total_ms']) / ref:+.1%}" if ref else "-"
        model = f"{r['model_ms']:.1f}" if r.get("model_ms") is not None else "-"
        lines.append(f"| {name} | {t['total_ms']:.1f} | {gain} | {t['binding_risk']} | {model} |")
    return "\n".join(lines)


__all__ = ["compare_placements", "placement_table"]
