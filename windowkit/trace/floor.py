"""The floor of a trace: the modeled cost of prefilling only never-seen tokens.

Every reuse strategy must prefill a chunk's tokens at least once (the first time its content appears in the
trace: nothing can be reused before it was computed), must prefill every step's query tokens (the query is
new every step) and must run the vision tower once on a never-seen visual chunk. The floor charges exactly
that and nothing else: no relocation (KV replay), no patch form or apply, no canonical encode, no binding
repair. It is the lower bound any reuse strategy in ``windowkit.trace.strategies`` can reach on the trace, in
prefill tokens and in modeled time (its costs come from the same ``CostProfile`` as ``RadixCache`` and
``FullRecompute``, so the numbers compare directly), and it is independent of the order a step is replayed in.

A chunk's content is named by its id (``windowkit.trace.schema``: the same id at two steps is the same frame /
screenshot / text span; ``Trace.check`` keeps its size and kind fixed), so "first appearance of its content" is
the first step whose context holds its id.

    from windowkit.trace import simulate
    res = simulate(trace, "h100-kamera", ["radix", "windowkit", "floor"])
    res.summary()["ratios"]["windowkit/floor"], res.summary()["target"], res.summary()["meets_target"]

``bytes_held`` is the KV of every distinct token seen so far (reaching the floor needs every computed chunk
kept: an unbounded store, as radix's); it is what the floor assumes, not a lower bound on memory.
"""
from __future__ import annotations

from typing import Sequence

from windowkit.trace.costs import CostProfile
from windowkit.trace.schema import ChunkRef, Step
from windowkit.trace.strategies import StepCost, Strategy

# the planner's target (see SimResult.summary: "target" / "meets_target")
RADIX_TARGET = 0.6  # a strategy should cost at most 0.6x the prefix cache ...
FLOOR_SLACK = 1.15  # ... unless the floor itself is above 0.6x radix: then within 1.15x of the floor


class FloorStrategy(Strategy):
    """Prefill each chunk once, at its first appearance in the trace, plus every step's query; the vision
    tower once per never-seen visual chunk; nothing else. The lower bound of every reuse strategy."""

    name = "floor"

    def reset(self, profile: CostProfile) -> None:
        super().reset(profile)
        self.seen: set[str] = set()
        self.seen_tokens = 0

    def step(self, step: Step, ctx: Sequence[ChunkRef]) -> StepCost:
        c = StepCost()
        fresh = [x for x in ctx if x.id not in self.seen]
        self.seen.update(x.id for x in fresh)
        new_tokens = sum(x.tokens for x in fresh)
        self.seen_tokens += new_tokens
        self._vision(c, fresh, cache=True)
        c.prefill_tokens = new_tokens + step.query_tokens
        c.prefill_ms = self.p.prefill_ms(c.prefill_tokens)
        c.bytes_held = self.seen_tokens * self.p.kv_bytes_per_token
        return c


def target_for(floor_ms: float, radix_ms: float) -> tuple[str, float]:
    """The planner's target in force on a trace and its limit in ms: "0.6x radix" (0.6 x radix_ms), or
    "1.15x floor" (1.15 x floor_ms) where the floor itself is above 0.6x radix (the prefix barely breaks, so
    0.6x radix is out of every strategy's reach).

        target_for(50.0, 100.0)   # ("0.6x radix", 60.0)
        target_for(70.0, 100.0)   # ("1.15x floor", 80.5)
    """
    if floor_ms > RADIX_TARGET * radix_ms:
        return f"{FLOOR_SLACK:g}x floor", FLOOR_SLACK * floor_ms
    return f"{RADIX_TARGET:g}x radix", RADIX_TARGET * radix_ms


def meets(total_ms: float, limit_ms: float) -> bool:
    """``total_ms <= limit_ms`` up to float rounding of the summed step costs (1e-9 relative)."""
    return total_ms <= limit_ms * (1 + 1e-9) + 1e-12


__all__ = ["FloorStrategy", "target_for", "meets", "RADIX_TARGET", "FLOOR_SLACK"]
