"""Replay a trace through several reuse strategies side by side and account their modeled cost.

Strategies (all see the same resolved order of every step; the query is prefilled by all):
  recompute  full recompute: re-prefill the whole context each step (and, by default, re-run the vision
             tower on every visual chunk, as an agent re-sending its images does)
  radix      prefix / radix cache (SGLang, vLLM): reuse the longest common *leading* prefix of chunk ids
             with any earlier step's context, recompute the rest; the cache is unbounded
  blind      blind position-independent reuse: a chunk is prefilled in context the first time, then only
             relocated; counts binding-loss risk = reused chunks whose antecedents differ from the first time
  blend      token-recompute blending (CacheBlend-style): blind + recompute 15% of the tokens of every
             reused chunk whose antecedents changed
  windowkit  a real windowkit Window (mode="patch") on the CostModelBackend, driven by ``win.assign``
  windowkit-lazy  (opt-in, not in the default set) the same with ``Window(form="lazy")``: no eager
             canonical encode or patch; canonicals are encoded on first need
  floor      the lower bound (``windowkit/trace/floor.py``): each chunk prefilled once, at its first
             appearance, plus every query; vision once per never-seen visual chunk; nothing else. With floor
             and radix run, ``summary()`` adds "<strategy>/floor", "<strategy>/radix", "target" ("0.6x radix",
             or "1.15x floor" where the floor is above 0.6x radix), "target_ms" and "meets_target"

Every strategy reports per step and in total: total_ms (prefill_ms + vision_ms + reuse_ms), prefill_tokens,
encodes (canonical encodes), vision_encodes, patch_forms, patch_applies, relocations, binding_risk and
bytes_held (KV bytes held after the step; ``bytes_peak`` in the totals). windowkit also reports encode_ms, the
part of its prefill spent on canonical encodes of chunks it had already prefilled in context (the Window
encodes eagerly; ``ratios["windowkit_bg_encode/..."]`` show the cost were they done in the background).

    from windowkit.trace import simulate, sliding_window
    res = simulate(sliding_window(steps=50), "h100-kamera")
    res.summary()["ratios"]            # {"windowkit/radix": ..., "windowkit/recompute": ...}
    print(res.table())

Options: ``placement=`` orders the ``ordered: false`` steps (``policies.placement``: listed, arrival, greedy,
orbit, optimal; ``compare_placements`` runs several), ``store_budget_bytes=`` / ``store_policy=`` bound windowkit's
store (lru, size/gds, belady: an offline oracle filled by ``WindowkitStrategy.reads``, a dry run), ``refresh=`` re-conditions
drifted survivors (``policies.refresh``).
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch

from windowkit.chunk import Chunk
from windowkit.errors import WindowkitError
from windowkit.store import ChunkStore
from windowkit.registry import make_policy
from windowkit.store.eviction import LRU, EvictionPolicy, make_eviction_policy
from windowkit.store.store import CANONICAL
from windowkit.trace.backend import CostModelBackend
from windowkit.trace.costs import CostProfile, load_profile
from windowkit.trace.schema import ChunkRef, Step, Trace


@dataclass
class StepCost:
    """Modeled cost of one step under one strategy."""

    prefill_ms: float = 0.0
    vision_ms: float = 0.0
    reuse_ms: float = 0.0  # KV replay (relocate / place) + patch apply + patch SVD
    encode_ms: float = 0.0  # part of prefill_ms: canonical encodes of chunks already prefilled in context
    prefill_tokens: int = 0
    encodes: int = 0  # canonical KV(B|∅) encodes
    vision_encodes: int = 0
    patch_forms: int = 0
    patch_applies: int = 0
    relocations: int = 0
    binding_risk: int = 0
    bytes_held: int = 0

    @property
    def total_ms(self) -> float:
        return self.prefill_ms + self.vision_ms + self.reuse_ms

    def as_dict(self) -> dict:
        d = asdict(self)
        d["total_ms"] = self.total_ms
        return d


_SUMMED = [f.name for f in fields(StepCost) if f.name != "bytes_held"]


def _totals(costs: Sequence[StepCost]) -> dict:
    out: dict[str, Any] = {k: sum(getattr(c, k) for c in costs) for k in _SUMMED}
    out["total_ms"] = out["prefill_ms"] + out["vision_ms"] + out["reuse_ms"]
    out["bytes_peak"] = max((c.bytes_held for c in costs), default=0)
    return out


# ====================================================================== strategies
class Strategy:
    """Base: ``reset(profile)`` before a run, ``prepare(steps, orders)`` (offline strategies read the
    resolved trace there; a no-op by default), then ``step(step, ctx)`` per step (ctx: resolved order)."""

    name = "strategy"

    def reset(self, profile: CostProfile) -> None:
        self.p = profile
        self._seen_visual: set[str] = set()

    def prepare(self, steps: Sequence[Step], orders: Sequence[Sequence[ChunkRef]]) -> None:
        """Called once after ``reset`` with the whole trace and every step's resolved order."""

    def step(self, step: Step, ctx: Sequence[ChunkRef]) -> StepCost:
        raise NotImplementedError

    def _vision(self, cost: StepCost, chunks: Sequence[ChunkRef], cache: bool) -> None:
        seen, n, toks = self._seen_visual, 0, 0
        for c in chunks:
            if c.kind != "text" and (not cache or c.id not in seen):
                seen.add(c.id)
                n += 1
                toks += c.tokens
        cost.vision_encodes += n
        cost.vision_ms += self.p.vision_ms(toks)


class FullRecompute(Strategy):
    """Re-prefill the whole context every step. ``vision_cache=False`` (default) re-runs the vision tower
    on every visual chunk each step; True runs it once per distinct chunk."""

    name = "recompute"

    def __init__(self, vision_cache: bool = False):
        self.vision_cache = vision_cache

    def step(self, step: Step, ctx: Sequence[ChunkRef]) -> StepCost:
        c = StepCost()
        toks = sum(x.tokens for x in ctx)
        self._vision(c, ctx, self.vision_cache)
        c.prefill_tokens = toks + step.query_tokens
        c.prefill_ms = self.p.prefill_ms(c.prefill_tokens)
        c.bytes_held = toks * self.p.kv_bytes_per_token
        return c


class _Edge:
    """A radix-tree edge: a run of chunk ids (compressed path) and the child node it leads to."""

    __slots__ = ("label", "child")

    def __init__(self, label: tuple, child: dict):
        self.label, self.child = label, child


class RadixCache(Strategy):
    """Prefix cache: the longest leading run of chunk ids shared with any earlier context is free, the
    rest is recomputed (and inserted). Unbounded: ``bytes_held`` is every token in the tree.
    A compressed radix tree (one edge per inserted suffix), so a step costs O(matched + 1) dict lookups."""

    name = "radix"

    def __init__(self, vision_cache: bool = True):
        self.vision_cache = vision_cache

    def reset(self, profile: CostProfile) -> None:
        super().reset(profile)
        self.root: dict = {}
        self.tree_tokens = 0

    def _match_insert(self, ids: list) -> int:
        """Length of the longest prefix of ``ids`` in the tree; inserts the rest (splitting an edge if needed)."""
        node, i, n = self.root, 0, len(ids)
        while i < n:
            e = node.get(ids[i])
            if e is None:
                break
            lab, j = e.label, 1
            m = len(lab)
            while j < m and i + j < n and lab[j] == ids[i + j]:
                j += 1
            i += j
            if j == m:
                node = e.child
                continue
            if i < n:  # diverges inside the edge: split it so the new suffix can hang off the split point
                mid = {lab[j]: _Edge(lab[j:], e.child)}
                e.label, e.child = lab[:j], mid
                node = mid
            break
        if i < n:
            node[ids[i]] = _Edge(tuple(ids[i:]), {})
        return i

    def step(self, step: Step, ctx: Sequence[ChunkRef]) -> StepCost:
        c = StepCost()
        hit = self._match_insert([x.id for x in ctx])
        miss = ctx[hit:]
        miss_tokens = sum(x.tokens for x in miss)
        self.tree_tokens += miss_tokens
        self._vision(c, miss, self.vision_cache)
        c.prefill_tokens = miss_tokens + step.query_tokens
        c.prefill_ms = self.p.prefill_ms(c.prefill_tokens)
        c.bytes_held = self.tree_tokens * self.p.kv_bytes_per_token
        return c


class BlindReuse(Strategy):
    """Prefill a chunk in context the first time, keep that KV, and only relocate it afterwards.

    A reused chunk costs a KV replay when it is not resident at the same position as in the previous step.
    ``binding_risk`` counts reused chunks whose ordered antecedents differ from those of their first prefill
    (their cross-chunk conditioning is stale). Holds the first KV of every chunk plus the live window."""

    name = "blind"
    recompute_fraction = 0.0

    def __init__(self, vision_cache: bool = True):
        self.vision_cache = vision_cache

    def reset(self, profile: CostProfile) -> None:
        super().reset(profile)
        self.first_ante: dict[str, int] = {}  # chunk id -> key of its ordered antecedents at first prefill
        self.resident: dict[str, int] = {}
        self.stored_tokens = 0

    def step(self, step: Step, ctx: Sequence[ChunkRef]) -> StepCost:
        c = StepCost()
        pos, new_resident, replay, recompute, fresh = 0, {}, 0, 0, []
        frac = self.recompute_fraction
        ante = 0  # chained hash of the ordered antecedent ids: O(1) per chunk instead of a tuple per chunk
        for x in ctx:
            first = self.first_ante.get(x.id)
            if first is None:
                self.first_ante[x.id] = ante
                self.stored_tokens += x.tokens
                fresh.append(x)
            else:
                if self.resident.get(x.id) != pos:
                    c.relocations += 1
                    replay += x.tokens
                if first != ante:
                    c.binding_risk += 1
                    if frac:
                        recompute += math.ceil(frac * x.tokens)
            new_resident[x.id] = pos
            pos += x.tokens
            ante = hash((ante, x.id))
        self.resident = new_resident
        self._vision(c, fresh, self.vision_cache)
        c.prefill_tokens = sum(x.tokens for x in fresh) + recompute + step.query_tokens
        c.prefill_ms = self.p.prefill_ms(c.prefill_tokens)
        c.reuse_ms = self.p.replay_ms(replay)
        c.bytes_held = (self.stored_tokens + pos) * self.p.kv_bytes_per_token
        return c


class TokenBlend(BlindReuse):
    """CacheBlend-style: blind reuse plus an in-context recompute of ``fraction`` of the tokens (rounded up)
    of every reused chunk whose antecedents changed (an unchanged context needs no blending)."""

    name = "blend"

    def __init__(self, fraction: float = 0.15, vision_cache: bool = True):
        super().__init__(vision_cache)
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], got {fraction}")
        self.recompute_fraction = fraction


def _floor(**kw: Any) -> Strategy:
    from windowkit.trace.floor import FloorStrategy  # floor.py subclasses Strategy from this module: import on use

    return FloorStrategy(**kw)


class _ReadLog(LRU):
    """An LRU that also logs, per entry, the steps at which it was read (``advance`` gives the step)."""

    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.now, self.uses = 0, {}

    def advance(self, now: int) -> None:
        self.now = now

    def _on_touch(self, key) -> None:
        super()._on_touch(key)
        self.uses.setdefault(key, []).append(self.now)


class _MeteredStore(ChunkStore):
    """A ChunkStore that also counts the tokens of canonicals and patches stored and patches served, so the
    simulator can charge per-token patch costs exactly (Window.stats counts patches, not their tokens)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.canon_tokens: dict[str, int] = {}
        self.patch_tokens: dict[tuple, int] = {}
        self.canon_sum = self.patch_sum = 0
        self.formed_tokens = self.applied_tokens = self.applied_count = 0

    def put_canonical(self, key, kv, meta=None):
        ok = super().put_canonical(key, kv, meta)
        if ok:
            self.canon_sum += kv.num_tokens - self.canon_tokens.get(key, 0)
            self.canon_tokens[key] = kv.num_tokens
        return ok

    def put_patch(self, key, ctx, patch, meta=None):
        ok = super().put_patch(key, ctx, patch, meta)
        n = int(patch.num_tokens)
        self.formed_tokens += n
        if patch.meta.get("kind") != "fresh":  # orbit patches are applied at once; fresh ones keep the forward
            self.applied_tokens += n
            self.applied_count += 1
        if ok:
            self.patch_sum += n - self.patch_tokens.get((key, ctx), 0)
            self.patch_tokens[(key, ctx)] = n
        return ok

    def _remove(self, eid, evicted):
        # an evicted (or replaced) entry no longer counts toward bytes_held; a replacement is re-added by the put
        super()._remove(eid, evicted)
        kind, key, ctx = eid
        if kind == CANONICAL:
            self.canon_sum -= self.canon_tokens.pop(key, 0)
        else:
            self.patch_sum -= self.patch_tokens.pop((key, ctx), 0)

    def get_patch(self, key, ctx, **kw):
        p = super().get_patch(key, ctx, **kw)
        if p is not None:  # the Window applies every patch it gets back (token counts are fixed per id)
            self.applied_tokens += int(p.num_tokens)
            self.applied_count += 1
        return p


class WindowkitStrategy(Strategy):
    """A real ``windowkit.window.Window`` on the CostModelBackend, driven by ``win.assign(chunks)``.

    Prefill and vision costs are booked by the backend's forwards; KV replay (every token the Window
    relocates or places from stored KV: ``WindowStats.reused_tokens``), patch applies and patch SVDs are
    charged from the step's stats deltas. ``binding_risk`` counts chunks kept as-is whose conditioning
    was formed on other antecedents (``plan()``'s refresh-patch edits), after the refresh policy ran.

    store_budget_bytes: bound the store (None: unbounded); the fake KV is 16 bytes per token
    store_policy: its eviction policy: None / "lru", "lfu", "fifo", "size" (= "gds", GreedyDual-Size),
              "belady" (offline OPT: its future is filled from the trace in ``prepare``), or an instance
    refresh:  a ``policies.refresh`` policy or name ("never", "always", "threshold:0.3", "budget:2"),
              applied after each step's ``assign`` (None: the Window's default, keep-as-is)

        WindowkitStrategy(store_budget_bytes=1 << 20, store_policy="belady", refresh="threshold:0.3")
    """

    name = "windowkit"

    def __init__(self, rank: int = 32, mode: str = "patch", store_budget_bytes: Optional[int] = None,
                 vision_cache: bool = True, name: str = "windowkit", store_policy: Any = None,
                 refresh: Any = None, **window_kw: Any):
        self.rank, self.mode, self.budget, self.vision_cache = rank, mode, store_budget_bytes, vision_cache
        self.name = name
        self.store_policy, self.refresh = store_policy, refresh
        self.window_kw = window_kw  # passed to Window(...), e.g. form="eager", repair="sink:8", svd="randomized"
        _check_store_options(self)

    def _make_store_policy(self):
        spec = self.store_policy
        if isinstance(spec, EvictionPolicy):  # an instance is used once: a fresh one of its class per run
            spec = type(spec)
        if isinstance(spec, str) and spec.lower() == "gds":
            spec = "size"
        return make_eviction_policy(spec)  # a name the registry does not know: PolicyError (a WindowkitError)

    def reset(self, profile: CostProfile) -> None:
        from windowkit.window import Window

        super().reset(profile)
        self.backend = CostModelBackend(profile, vision_cache=self.vision_cache)
        self.store = _MeteredStore(budget_bytes=self.budget, model_fingerprint=self.backend.fingerprint(),
                                   layout=self.backend.layout, policy=self._make_store_policy())
        self.win = Window(self.backend, store=self.store, rank=self.rank, mode=self.mode, **self.window_kw)
        self.refresher = make_policy("refresh", self.refresh)
        if self.refresher is not None:
            self.refresher.reset()
        self.chunks: dict[str, Chunk] = {}
        self.queries: dict[int, Chunk] = {}
        self.approximated_steps = 0  # steps where store-side apply counts disagreed with stats (see below)
        self._t = 0  # step index (the Belady oracle's clock)

    def prepare(self, steps: Sequence[Step], orders: Sequence[Sequence[ChunkRef]]) -> None:
        """For a Belady store: the oracle's future, every store entry this Window reads at each step, recorded
        from a dry run of the same steps with an unbounded store (the Window's own reads, not a model of them)."""
        pol = self.store.policy
        if hasattr(pol, "set_future"):
            pol.set_future(self.reads(steps, orders))

    def reads(self, steps: Sequence[Step], orders: Sequence[Sequence[ChunkRef]],
              profile: Optional[CostProfile] = None) -> dict[tuple, list[int]]:
        """``{store entry id: [step indices]}``: the entries a twin of this strategy (same Window settings and
        refresh policy, unbounded LRU store) reads at each step of ``steps`` in ``orders``, under ``profile``
        (default: the one of the last ``reset``).

            fut = WindowkitStrategy(form="eager").reads(list(trace), resolve_orders(trace), load_profile("cpu-tiny"))
        """
        twin = WindowkitStrategy(rank=self.rank, mode=self.mode, vision_cache=self.vision_cache,
                                 refresh=self.refresh, name=self.name, **self.window_kw)
        twin.store_policy = _ReadLog  # unbounded: a store policy only orders what it holds, nothing is evicted
        twin.reset(profile if profile is not None else self.p)
        for step, order in zip(steps, orders):
            twin.step(step, order)
        return twin.store.policy.uses

    def _chunk(self, x: ChunkRef) -> Chunk:
        ch = self.chunks.get(x.id)
        if ch is None:
            ch = self.chunks[x.id] = CostModelBackend.chunk(x.id, x.tokens, x.kind)
        return ch

    def step(self, step: Step, ctx: Sequence[ChunkRef]) -> StepCost:
        win, st, led, store = self.win, self.win.stats, self.backend.ledger, self.store
        s0 = (st.encodes, st.patch_forms, st.patch_applies, st.relocations, st.reused_tokens)
        l0 = led.copy()
        a0, f0, ac0 = store.applied_tokens, store.formed_tokens, store.applied_count
        if hasattr(store.policy, "advance"):
            store.policy.advance(self._t)
        self._t += 1
        win.assign([self._chunk(x) for x in ctx])
        if self.refresher is not None:
            self.refresher.apply(win)
        if step.query_tokens:
            q = self.queries.get(step.query_tokens)
            if q is None:
                q = self.queries[step.query_tokens] = Chunk.text(torch.zeros(step.query_tokens, dtype=torch.long),
                                                                 id="__query__")
            win.forward(q)  # materializes the window (the Window relocates lazily) + the query prefill
        else:
            win.window_kv()
        c = StepCost(encodes=st.encodes - s0[0], patch_forms=st.patch_forms - s0[1],
                     patch_applies=st.patch_applies - s0[2], relocations=st.relocations - s0[3])
        apply_tokens = store.applied_tokens - a0
        if store.applied_count - ac0 != c.patch_applies:  # a Window path we do not meter: average size
            self.approximated_steps += 1
            apply_tokens = c.patch_applies * sum(x.tokens for x in ctx) // max(len(ctx), 1)
        c.reuse_ms = self.backend.charge_reuse(st.reused_tokens - s0[4], apply_tokens, store.formed_tokens - f0)
        c.prefill_ms = led.prefill_ms - l0.prefill_ms
        c.encode_ms = led.encode_extra_ms - l0.encode_extra_ms
        c.vision_ms = led.vision_ms - l0.vision_ms
        c.prefill_tokens = led.prefill_tokens - l0.prefill_tokens
        c.vision_encodes = led.vision_encodes - l0.vision_encodes
        if self.mode == "patch":
            c.binding_risk = len(win.stale_ids())  # plan()'s refresh-patch edits, without scoring them
        p = self.p
        c.bytes_held = ((store.canon_sum + win.num_tokens) * p.kv_bytes_per_token
                        + store.patch_sum * p.patch_bytes_per_token)
        return c


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
    # the lower bound: each chunk prefilled once at its first appearance + the queries (windowkit/trace/floor.py)
    "floor": _floor,
}
DEFAULT_STRATEGIES = ("recompute", "radix", "blind", "blend", "windowkit", "floor")


def make_strategies(spec: Optional[Sequence[Union[str, Strategy]]] = None) -> list[Strategy]:
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


def _check_store_options(s: Any) -> None:
    if getattr(s, "store_policy", None) is not None and s.budget is None:
        raise WindowkitError(f"{s.name}: store_policy={s.store_policy!r} needs a store budget (store_budget_bytes / "
                             "--store-budget): an unbounded store never evicts")


# ====================================================================== the run
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
        from windowkit.trace.floor import meets, target_for

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
        extra = [f"/{b}" for b in bases] + (["meets target"] if tgt else [])
        lines = ["| strategy | " + " | ".join(cols + extra) + " |", "|---" * (len(cols) + len(extra) + 1) + "|"]
        for n in self.strategies:
            t = tot[n]
            cells = [f"{t['total_ms']:.1f}", f"{t['encode_ms']:.1f}"] + [str(t[k]) for k in cols[2:-1]] + [f"{t['bytes_peak'] / 2**20:.1f} MiB"]
            cells += [f"{t['total_ms'] / tot[b]['total_ms']:.3f}" for b in bases]
            cells += (["yes" if tgt["meets_target"][n] else "no"] if tgt else [])
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        if tgt:
            fr = (f"; floor/radix {tot['floor']['total_ms'] / tot['radix']['total_ms']:.3f}"
                  if tot["radix"]["total_ms"] > 0 else "")
            lines.append(f"\ntarget in force: {tgt['target']} ({tgt['target_ms']:.1f} ms{fr})")
        return "\n".join(lines)


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


def simulate(trace: Union[Trace, Sequence[Step]], profile: Union[str, CostProfile] = "h100-kamera",
             strategies: Optional[Sequence[Union[str, Strategy]]] = None, *, progress: Optional[bool] = None,
             max_steps: Optional[int] = None, placement: Any = None, store_budget_bytes: Optional[int] = None,
             store_policy: Any = None, refresh: Any = None) -> SimResult:
    """Replay ``trace`` through each strategy (all of them by default) under ``profile``.

    progress: a tqdm bar (None: only for traces of 500+ steps). max_steps: replay only the first steps.
    placement: the order of every ``ordered: false`` step, for all strategies alike: a name from
    ``policies.placement.PLACEMENTS`` ("listed", "arrival", "greedy", "orbit", "optimal") or a policy;
    None keeps today's behaviour (``resolve_orders``). ``summary()["placement"]`` records it.
    store_budget_bytes, store_policy, refresh: set on the windowkit strategies built here from names
    (see ``WindowkitStrategy``); strategy instances passed in keep their own.

        res = simulate(read_trace("run.jsonl"), "cpu-tiny", strategies=["radix", "windowkit"])
        res.summary()["strategies"]["windowkit"]["total_ms"]
        simulate(grow_interleave_set(), placement="greedy", store_budget_bytes=1 << 16, store_policy="belady")
    """
    prof = load_profile(profile)
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
        _check_store_options(s)
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
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(steps), desc=f"simulate {getattr(trace, 'name', '')}".strip(), unit="step")
        except ImportError:  # tqdm is a dependency, but a bar is never worth failing a run for
            bar = None
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
            if s.approximated_steps:
                meta["windowkit_approximated_steps"] = s.approximated_steps
            if s.refresher is not None:
                meta[f"{s.name}_refresh"] = {"policy": repr(s.refresher), **s.refresher.counters}
            if s.budget is not None:
                meta[f"{s.name}_store"] = {"policy": s.store.policy.name, "budget_bytes": s.budget,
                                           "evictions": s.store.stats.evictions, "rejected": s.store.stats.rejected}
    return SimResult(getattr(trace, "name", "") or "trace", prof.name, [s.name for s in strats], costs, wall, meta,
                     orders=orders, queries=[st.query_tokens for st in steps])


def compare_placements(trace: Union[Trace, Sequence[Step]], placements: Sequence[Any] = ("listed", "arrival", "greedy",
                                                                                        "orbit", "optimal"),
                       profile: Union[str, CostProfile] = "h100-kamera",
                       strategies: Optional[Sequence[Union[str, Strategy]]] = ("radix", "blind", "windowkit"),
                       **kw: Any) -> dict:
    """Run ``trace`` once per placement; per placement: every strategy's totals, the placement model's cost
    (``policies.placement.PatchHitCost``) and the policy's counters. A placement whose orders equal an
    earlier one's is not replayed again (``same_orders_as`` names it). ``kw`` goes to ``simulate``.

        rows = compare_placements(grow_interleave_set(episodes=20), profile="cpu-tiny")
        print(placement_table(rows))
    """
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


# ====================================================================== CLI hooks (wired by windowkit/cli.py)
_PLACEMENT_NAMES = ("listed", "arrival", "greedy", "orbit", "optimal")
_STORE_POLICY_NAMES = ("lru", "lfu", "fifo", "size", "gds", "belady")


def load_trace_arg(spec: str) -> Trace:
    """A trace from a CLI argument: a JSONL path, ``videotree[:N]`` (first N questions), ``videotree-set[:N]`` (the
    same, unordered: placement policies may choose) or a generator name (``sliding-3``, ``grow-interleave``,
    ``append-zoom``, ``random-lookback``, ``grow-interleave-set``, ``grow-interleave-set-small``, ``random-lookback-set``)."""
    from windowkit.trace.generators import GENERATORS
    from windowkit.trace.io import read_trace
    from windowkit.trace.videotree import load_videotree

    if spec.startswith("videotree"):
        name, _, n = spec.partition(":")
        return load_videotree(max_questions=int(n) if n else None, ordered=name != "videotree-set")
    if spec in GENERATORS:
        return GENERATORS[spec]()
    return read_trace(spec)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``windowkit simulate``."""
    parser.add_argument("trace", help="JSONL trace path, videotree[:N], videotree-set[:N], or a generator: sliding-3, "
                                      "grow-interleave, append-zoom, random-lookback, grow-interleave-set, "
                                      "grow-interleave-set-small, random-lookback-set")
    parser.add_argument("--profile", default="h100-kamera", help="cost profile name or JSON path (default h100-kamera)")
    parser.add_argument("--strategy", action="append", choices=list(STRATEGIES),
                        help="strategy to run (repeatable; default: recompute radix blind blend windowkit floor)")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the summary JSON here")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="write a report here: summary.json, PNG plots and a self-contained report.html")
    parser.add_argument("--policy", action="append", default=[], metavar="NAME",
                        help="any policy by name (repeatable), routed to its family: placement (listed arrival greedy "
                             "orbit optimal), store eviction (lru lfu fifo size gds belady), refresh (never always "
                             "threshold:TAU budget:K)")
    parser.add_argument("--placement", default=None, choices=list(_PLACEMENT_NAMES),
                        help="order of ordered:false steps (default: listed, or the previous order if the set is unchanged)")
    parser.add_argument("--store-budget", type=int, default=None,
                        help="bound windowkit's store to this many bytes (default: unbounded)")
    parser.add_argument("--store-policy", default=None, choices=list(_STORE_POLICY_NAMES),
                        help="eviction policy of the bounded store (belady: offline OPT from the trace)")
    parser.add_argument("--refresh", default=None, help="patch refresh policy: never | always | threshold:TAU | budget:K")
    parser.add_argument("--no-progress", action="store_true")


def _route_policy(args: argparse.Namespace, name: str) -> None:
    """``--policy NAME``: set the placement, store policy or refresh policy it names (one of each at most)."""
    fam = ("placement" if name in _PLACEMENT_NAMES else "store_policy" if name in _STORE_POLICY_NAMES
           else "refresh" if name in ("never", "always") or name.split(":")[0] in ("threshold", "budget") else None)
    if fam is None:
        raise WindowkitError(f"--policy {name!r}: not a placement ({', '.join(_PLACEMENT_NAMES)}), store policy "
                             f"({', '.join(_STORE_POLICY_NAMES)}) or refresh policy (never, always, threshold:TAU, "
                             "budget:K)")
    if getattr(args, fam) not in (None, name):
        raise WindowkitError(f"--policy {name!r}: the {fam.replace('_', ' ')} is already {getattr(args, fam)!r}")
    setattr(args, fam, name)


def run_cli(args: argparse.Namespace) -> int:
    """``windowkit simulate``: print the totals table and ratios; optionally write the summary JSON (``--json``)
    and a report directory (``--out``: summary.json, plots, report.html; see ``windowkit.trace.report``)."""
    for name in args.policy:
        _route_policy(args, name)
    trace = load_trace_arg(args.trace)
    res = simulate(trace, args.profile, args.strategy, max_steps=args.max_steps,
                   progress=False if args.no_progress else None, placement=args.placement,
                   store_budget_bytes=args.store_budget, store_policy=args.store_policy, refresh=args.refresh)
    s = res.summary()
    print(f"{s['trace']}: {s['steps']} steps, profile {s['profile']}")
    print(res.table())
    for k, v in s["ratios"].items():
        print(f"{k}: {v:.3f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(s, indent=2) + "\n", encoding="utf-8")
    if args.out:
        from windowkit.trace.report import write_report  # matplotlib only when a report is asked for

        print(f"writing the report to {args.out} ...", flush=True)
        paths = write_report(res, args.out, trace=trace)
        print(f"report: {paths['html']}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point for ``windowkit simulate ...`` (``windowkit/cli.py`` dispatches ``simulate_main(rest)``).

        main(["sliding-3", "--profile", "cpu-tiny", "--json", "out.json"])
        main(["videotree:50", "--out", "report/"])     # report/report.html, summary.json, *.png
    """
    p = argparse.ArgumentParser(prog="windowkit simulate",
                                description="replay an access trace through reuse strategies under a cost profile")
    add_arguments(p)
    return run_cli(p.parse_args(None if argv is None else list(argv)))


__all__ = ["main", "StepCost", "Strategy", "FullRecompute", "RadixCache", "BlindReuse", "TokenBlend", "WindowkitStrategy",
           "STRATEGIES", "make_strategies", "resolve_orders", "SimResult", "simulate", "load_trace_arg",
           "add_arguments", "run_cli", "resolve_placement", "compare_placements", "placement_table"]
