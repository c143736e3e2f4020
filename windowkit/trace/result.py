"""The result of a run: every strategy's per-step ``StepCost``, their totals, the headline ratios and the target.

    res = simulate(sliding_window(steps=50), "h100-kamera")     # a SimResult
    res.summary()["ratios"]            # {"windowkit/radix": ..., "windowkit/recompute": ...}
    res.totals("radix")["total_ms"]; res.per_step("windowkit")[0]["prefill_tokens"]
    print(res.table())

With ``floor`` and ``radix`` run, ``summary()`` adds "<strategy>/floor", "<strategy>/radix", "target" ("0.6x radix",
or "1.15x floor" where the floor is above 0.6x radix), "target_ms" and "meets_target" (``windowkit.trace.floor``).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional, Sequence

from windowkit.trace.floor import meets, target_for
from windowkit.trace.strategies import StepCost

_SUMMED = [f.name for f in fields(StepCost) if f.name != "bytes_held"]


def _totals(costs: Sequence[StepCost]) -> dict:
    out: dict[str, Any] = {k: sum(getattr(c, k) for c in costs) for k in _SUMMED}
    out["total_ms"] = out["prefill_ms"] + out["vision_ms"] + out["reuse_ms"]
    out["bytes_peak"] = max((c.bytes_held for c in costs), default=0)
    return out


@dataclass
class SimResult:
    """Per-step costs of every strategy. ``summary()`` gives totals and the headline ratios."""

    trace_name: str
    profile: str
    strategies: list[str]
    steps: dict[str, list[StepCost]]
    wall_s: dict[str, float] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    orders: list = field(default_factory=list, repr=False)  # the order each step was replayed in (placement applied)
    queries: list = field(default_factory=list, repr=False)  # each step's query_tokens

    def totals(self, name: str) -> dict:
        return _totals(self.steps[name])

    def per_step(self, name: str) -> list[dict]:
        return [c.as_dict() for c in self.steps[name]]

    def summary(self) -> dict:
        tot = {n: self.totals(n) for n in self.strategies}
        ratios = {}
        for w in [n for n in tot if n.startswith("windowkit")]:
            wk = tot[w]
            for base in ("radix", "recompute", "blind", "blend"):
                if base in tot and tot[base]["total_ms"] > 0:
                    ratios[f"{w}/{base}"] = wk["total_ms"] / tot[base]["total_ms"]
                    if w == "windowkit":  # what-if: canonical encodes done in the background, off the critical path
                        ratios[f"windowkit_bg_encode/{base}"] = (wk["total_ms"] - wk["encode_ms"]) / tot[base]["total_ms"]
        for name, t in tot.items():  # every strategy against the floor (the lower bound) and the prefix cache
            for base in ("floor", "radix"):
                if base in tot and name != base and tot[base]["total_ms"] > 0:
                    ratios.setdefault(f"{name}/{base}", t["total_ms"] / tot[base]["total_ms"])
        n = len(next(iter(self.steps.values()), []))
        place = {"placement": self.meta["placement"]} if "placement" in self.meta else {}
        return {"trace": self.trace_name, "profile": self.profile, "steps": n, **place, "strategies": tot,
                "ratios": ratios, **self.target(tot),
                "wall_s": dict(self.wall_s), **({"meta": self.meta} if self.meta else {})}

    def target(self, tot: Optional[dict] = None) -> dict:
        """The planner's target on this trace, when both ``floor`` and ``radix`` ran (else {}): ``target`` is
        "0.6x radix", or "1.15x floor" where the floor itself is above 0.6x radix; ``target_ms`` its limit;
        ``meets_target`` {strategy: total_ms <= target_ms} (see ``windowkit.trace.floor.target_for``)."""
        tot = tot if tot is not None else {n: self.totals(n) for n in self.strategies}
        if "floor" not in tot or "radix" not in tot:
            return {}
        name, limit = target_for(tot["floor"]["total_ms"], tot["radix"]["total_ms"])
        return {"target": name, "target_ms": limit,
                "meets_target": {n: meets(t["total_ms"], limit) for n, t in tot.items()}}

    def table(self) -> str:
        """Markdown table of the totals; with ``floor`` and ``radix`` among the strategies, each one's time
        relative to both and whether it meets the target in force (named in a line under the table)."""
        cols = ["total_ms", "encode_ms", "prefill_tokens", "encodes", "vision_encodes", "patch_forms", "patch_applies",
                "relocations", "binding_risk", "bytes_peak"]
        tot = {n: self.totals(n) for n in self.strategies}
        bases = [b for b in ("floor", "radix") if b in tot and tot[b]["total_ms"] > 0]
        tgt = self.target(tot)
        idle = any(t["idle_ms"] > 0 for t in tot.values())  # an anticipating strategy: its between-steps work
        extra = (["idle_ms (between steps, not in total)"] if idle else []) + [f"/{b}" for b in bases] \
            + (["meets target"] if tgt else [])
        lines = ["| strategy | " + " | ".join(cols + extra) + " |", "|---" * (len(cols) + len(extra) + 1) + "|"]
        for n in self.strategies:
            t = tot[n]
            cells = [f"{t['total_ms']:.1f}", f"{t['encode_ms']:.1f}"] + [str(t[k]) for k in cols[2:-1]] + [f"{t['bytes_peak'] / 2**20:.1f} MiB"]
            cells += [f"{t['idle_ms']:.1f}"] if idle else []
            cells += [f"{t['total_ms'] / tot[b]['total_ms']:.3f}" for b in bases]
            cells += (["yes" if tgt["meets_target"][n] else "no"] if tgt else [])
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        if tgt:
            fr = (f"; floor/radix {tot['floor']['total_ms'] / tot['radix']['total_ms']:.3f}"
                  if tot["radix"]["total_ms"] > 0 else "")
            lines.append(f"\ntarget in force: {tgt['target']} ({tgt['target_ms']:.1f} ms{fr})")
        return "\n".join(lines)


__all__ = ["SimResult"]
