"""Reuse strategies: the ``Strategy`` contract, the analytic strategies and the real Window's.

  recompute  full recompute: re-prefill the whole context each step (and, by default, re-run the vision
             tower on every visual chunk, as an agent re-sending its images does)
  radix      prefix / radix cache (SGLang, vLLM): reuse the longest common *leading* prefix of chunk ids
             with any earlier step's context, recompute the rest; the cache is unbounded
  blind      blind position-independent reuse: a chunk is prefilled in context the first time, then only
             relocated; counts binding-loss risk = reused chunks whose antecedents differ from the first time
  blend      token-recompute blending (CacheBlend-style): blind + recompute 15% of the tokens of every
             reused chunk whose antecedents changed
  windowkit  a real windowkit Window (mode="patch") on the CostModelBackend, driven by ``win.assign``
             (``WindowkitStrategy``; opt-in variants by name in ``windowkit.trace.run.STRATEGIES``)
  floor      the lower bound (``windowkit/trace/floor.py``: ``FloorStrategy``, built on this module's contract)

Every strategy reports per step a ``StepCost``: total_ms (prefill_ms + vision_ms + reuse_ms), prefill_tokens,
encodes (canonical encodes), vision_encodes, patch_forms, patch_applies, relocations, binding_risk and
bytes_held (KV bytes held after the step; ``bytes_peak`` in the totals). windowkit also reports encode_ms, the
part of its prefill spent on canonical encodes of chunks it had already prefilled in context (the Window
encodes eagerly; ``ratios["windowkit_bg_encode/..."]`` show the cost were they done in the background).

    from windowkit.trace.strategies import RadixCache
    from windowkit.trace import simulate, sliding_window
    simulate(sliding_window(steps=50), "cpu-tiny", [RadixCache(), "windowkit"]).table()
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

import torch

from windowkit.chunk import Chunk
from windowkit.errors import WindowkitError
from windowkit.registry import make_policy
from windowkit.store import ChunkStore
from windowkit.store.eviction import LRU, EvictionPolicy, make_eviction_policy
from windowkit.store.tiers import CANONICAL
from windowkit.trace.backend import CostModelBackend
from windowkit.trace.costs import CostProfile
from windowkit.trace.schema import ChunkRef, Step
from windowkit.window import Window

# store policy names the simulator accepts beside the eviction registry's (``--store-policy gds``)
STORE_POLICY_ALIASES = {"gds": "size"}


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
    # work between this step and the next, off the step's critical path (not in total_ms): an anticipating
    # Window's ``prefetch(next=...)`` of the next step's survivors (WindowkitStrategy(anticipate=True))
    idle_ms: float = 0.0
    idle_tokens: int = 0
    bytes_held: int = 0

    @property
    def total_ms(self) -> float:
        return self.prefill_ms + self.vision_ms + self.reuse_ms

    def as_dict(self) -> dict:
        d = asdict(self)
        d["total_ms"] = self.total_ms
        return d


class Strategy:
    """A reuse strategy: what a serving stack would compute at each step of a trace, as a modeled ``StepCost``.

    The contract (``windowkit.trace.run.simulate`` calls these, per run, in this order):

      reset(profile)          start afresh under ``profile`` (a ``CostProfile``): drop every cache and counter
                              (one instance is reused across runs); the base sets ``self.p`` and the vision cache
      prepare(steps, orders)  once, with the whole trace and every step's resolved order (placement applied):
                              offline strategies (a Belady store's oracle) read the future here; a no-op by default
      step(step, ctx)         once per step, in trace order; ``ctx`` is the step's resolved order (``ChunkRef``s,
                              the same for every strategy); returns the step's ``StepCost``. Every strategy
                              prefills the step's query (``step.query_tokens``) and books its own vision encodes
                              (``_vision``); ``bytes_held`` is the KV it holds after the step.

    ``name`` is the strategy's column in ``SimResult`` (distinct within a run). A strategy with a ``budget``
    attribute has a store: ``simulate``'s store options reach it (``check_store_options``).
    """

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

    def entry_removed(self, kind, key, ctx, evicted):
        # an evicted (or replaced) entry no longer counts toward bytes_held; a replacement is re-added by the put
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
    relocates or places from stored KV: ``WindowStats.reused_tokens``, less ``reused_as_is``, the stored tensors read
    at their own position without a patch, which cost no work), patch applies and patch SVDs are
    charged from the step's stats deltas. ``binding_risk`` counts chunks kept as-is whose conditioning
    was formed on other antecedents (``plan()``'s refresh-patch edits), after the refresh policy ran.

    anticipate: after each step, ``win.prefetch(next=...)`` of what the next step opens with that the agent holds
              now: the leading run of its chunks that this Window has seen (live now, or a look-back: the agent
              chooses what it recalls with this step's answer), with the never-seen text chunks in front of a live
              one (the agent's own rewrites of its history, such as a screenshot clipped to its text where it
              stood). A never-seen visual chunk, or never-seen text behind every live chunk, ends the run: an
              observation comes from outside, after the step. What an agent that decides its next context at the
              end of a step prepares while it waits for the next observation (``LongVideoAgent(anticipate=True)``).
              A guess is never wrong here (the trace
              says what comes), so a wrong guess's idle cost is not modeled; the critical path is. The prefetch's
              cost is booked as ``idle_ms`` / ``idle_tokens`` of the step before, not in its ``total_ms``.
    guess:    the Window's guess policy (``Window(guess=...)``, ``policies.guess``: "slide", or an instance), and
              ``win.prefetch()`` after each step instead of ``anticipate``'s: the Window's default loop, where the
              agent knows nothing of its next step; ``prefetch()`` forms canonicals and patches and lets the policy
              guess the next window from the window's history; that work, wrong guesses included, is real idle
              work, booked as ``idle_ms`` / ``idle_tokens`` (``guess_counters``: guesses, hits, wasted tokens)
    store_budget_bytes: bound the store (None: unbounded); the fake KV is 16 bytes per token
    store_policy: its eviction policy: None / "lru", "lfu", "fifo", "size" (= "gds", GreedyDual-Size),
              "belady" (offline OPT: its future is filled from the trace in ``prepare``), or an instance
    refresh:  a ``policies.refresh`` policy or name ("never", "always", "threshold:0.3", "budget:2"),
              applied after each step's ``assign`` (None: the Window's default, keep-as-is)
    reads_attention: whether the model the trace stands for reads query attention, which decides how the Window
              spends its repair rule's ``query:N`` part. None (default): from the trace, as the Window does on the
              real backend: a trace with a visual chunk is a VLM's (the M-RoPE families read no attention), whose
              Window spends ``query:N`` by position at the edit (``RepairRule.by_position``), every token of it
              counted here; a text-only trace is a text LLM's, whose focus reads the query's attention within
              ``focus_budget``'s account and is not modeled (the cost model has no attention). True / False
              force one or the other.

        WindowkitStrategy(store_budget_bytes=1 << 20, store_policy="belady", refresh="threshold:0.3")
    """

    name = "windowkit"

    def __init__(self, rank: int = 32, mode: str = "patch", store_budget_bytes: Optional[int] = None,
                 vision_cache: bool = True, name: str = "windowkit", store_policy: Any = None,
                 refresh: Any = None, anticipate: bool = False, reads_attention: Optional[bool] = None,
                 guess: Any = None, **window_kw: Any):
        self.rank, self.mode, self.budget, self.vision_cache = rank, mode, store_budget_bytes, vision_cache
        if reads_attention not in (None, True, False):
            raise WindowkitError("reads_attention must be None (from the trace), True or False, "
                                 f"got {reads_attention!r}")
        self.name, self.anticipate, self.reads_attention = name, bool(anticipate), reads_attention
        if anticipate and guess is not None:
            raise WindowkitError("anticipate (the agent knows its next step) and guess (a policy guesses it) "
                                 "exclude each other")
        self.guess = guess
        self._orders: Sequence[Sequence[ChunkRef]] = ()
        self.store_policy, self.refresh = store_policy, refresh
        self.window_kw = window_kw  # passed to Window(...), e.g. form="eager", repair="sink:8", svd="randomized"
        check_store_options(self)

    def _make_store_policy(self):
        spec = self.store_policy
        if isinstance(spec, EvictionPolicy):  # an instance is used once: a fresh one of its class per run
            spec = type(spec)
        if isinstance(spec, str):
            spec = STORE_POLICY_ALIASES.get(spec.lower(), spec)
        return make_eviction_policy(spec)  # a name the registry does not know: PolicyError (a WindowkitError)

    def reset(self, profile: CostProfile) -> None:
        super().reset(profile)
        self.backend = CostModelBackend(profile, vision_cache=self.vision_cache)
        self.store = _MeteredStore(budget_bytes=self.budget, model_fingerprint=self.backend.fingerprint(),
                                   layout=self.backend.layout, policy=self._make_store_policy())
        self.win = Window(self.backend, store=self.store, rank=self.rank, mode=self.mode, guess=self.guess,
                          **self.window_kw)
        self.guesser = self.win.guesser  # the Window's own (its prefetch() runs it): None without one
        if self.guesser is not None:
            self.guesser.reset()  # (an instance passed in keeps no history from an earlier run)
        self.refresher = make_policy("refresh", self.refresh)
        if self.refresher is not None:
            self.refresher.reset()
        self.chunks: dict[str, Chunk] = {}
        self.queries: dict[int, Chunk] = {}
        self.approximated_steps = 0  # steps where store-side apply counts disagreed with stats (see below)
        self._t = 0  # step index (the Belady oracle's clock)

    def prepare(self, steps: Sequence[Step], orders: Sequence[Sequence[ChunkRef]]) -> None:
        """Before the steps: the repair rule spent as on the trace's model family (``reads_attention``); for a
        Belady store, the oracle's future, every store entry this Window reads at each step, recorded from a dry
        run of the same steps with an unbounded store (the Window's own reads, not a model of them)."""
        self._model_family(steps)
        pol = self.store.policy
        if hasattr(pol, "set_future"):
            pol.set_future(self.reads(steps, orders))
        self._orders = list(orders) if self.anticipate else ()

    def _model_family(self, steps: Sequence[Step]) -> None:
        """Spend the rule's query:N part as the Window does on the trace's model family (``reads_attention``)."""
        reads = self.reads_attention
        if reads is None:
            reads = not any(x.is_visual for s in steps for x in s.context)
        if not reads:
            self.win.repair = self.win.repair.by_position()

    def reads(self, steps: Sequence[Step], orders: Sequence[Sequence[ChunkRef]],
              profile: Optional[CostProfile] = None) -> dict[tuple, list[int]]:
        """``{store entry id: [step indices]}``: the entries a twin of this strategy (same Window settings and
        refresh policy, unbounded LRU store) reads at each step of ``steps`` in ``orders``, under ``profile``
        (default: the one of the last ``reset``).

            fut = WindowkitStrategy(form="eager").reads(list(trace), resolve_orders(trace), load_profile("cpu-tiny"))
        """
        twin = WindowkitStrategy(rank=self.rank, mode=self.mode, vision_cache=self.vision_cache,
                                 refresh=self.refresh, name=self.name, reads_attention=self.reads_attention,
                                 anticipate=self.anticipate, guess=_fresh(self.guess), **self.window_kw)
        twin.store_policy = _ReadLog  # unbounded: a store policy only orders what it holds, nothing is evicted
        twin.reset(profile if profile is not None else self.p)
        twin._model_family(steps)
        twin._orders = list(orders) if self.anticipate else ()
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
        s0 = (st.encodes, st.patch_forms, st.patch_applies, st.relocations, _replayed(st))
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
        c.reuse_ms = self.backend.charge_reuse(_replayed(st) - s0[4], apply_tokens, store.formed_tokens - f0)
        c.prefill_ms = led.prefill_ms - l0.prefill_ms
        c.encode_ms = led.encode_extra_ms - l0.encode_extra_ms
        c.vision_ms = led.vision_ms - l0.vision_ms
        c.prefill_tokens = led.prefill_tokens - l0.prefill_tokens
        c.vision_encodes = led.vision_encodes - l0.vision_encodes
        if self.mode == "patch":
            c.binding_risk = len(win.stale_ids())  # plan()'s refresh-patch edits, without scoring them
        if self.anticipate and self._t < len(self._orders):
            self._prepare_next(c, self._orders[self._t])
        elif self.guesser is not None:  # the default loop: canonicals, patches and the guess, between steps
            self._idle(c, win.prefetch)
        p = self.p
        c.bytes_held = ((store.canon_sum + win.num_tokens) * p.kv_bytes_per_token
                        + store.patch_sum * p.patch_bytes_per_token)
        return c

    def _prepare_next(self, c: StepCost, nxt: Sequence[ChunkRef]) -> None:
        """``win.prefetch(next=...)`` of the next step's leading chunks the agent holds now (``anticipate``), booked
        as ``c``'s idle work (the next step's ledger snapshot is taken after it, so its own cost does not hold it)."""
        win = self.win
        run: list = []
        for x in nxt:
            if x.is_visual and x.id not in self.chunks:  # a new observation, from outside: not in hand before
                break
            run.append(x)
        last_live = max((i for i, x in enumerate(run) if x.id in win), default=-1)
        guess: list = []
        for i, x in enumerate(run):
            if x.id in self.chunks:  # seen: live now, or a look-back the agent chose with this step's answer
                guess.append(x.id)
            elif i < last_live:  # never-seen text in front of a live chunk: the agent's own rewrite (a clip)
                guess.append(self._chunk(x))
            else:  # new text behind every live chunk: an observation (a new log entry), read at the step
                break
        self._idle(c, lambda: win.prefetch(next=guess))

    def _idle(self, c: StepCost, work) -> None:
        """Run ``work()`` between steps and book what it costs as ``c``'s idle work."""
        win, led = self.win, self.backend.ledger
        l0, st0 = led.copy(), _replayed(win.stats)
        work()
        c.idle_tokens = led.prefill_tokens - l0.prefill_tokens
        c.idle_ms = (led.prefill_ms - l0.prefill_ms + led.vision_ms - l0.vision_ms
                     + self.backend.charge_reuse(_replayed(win.stats) - st0, 0, 0))

    @property
    def guess_counters(self) -> dict:
        """The guess policy's counters of the last run (``policies.guess``), or {} without one."""
        return dict(self.guesser.counters) if getattr(self, "guesser", None) is not None else {}


def _replayed(st: Any) -> int:
    """Tokens a Window's stats say were placed from stored KV with work (rotation, copy): ``reused_tokens`` less
    ``reused_as_is``, the stored tensors read at their own position without a patch, charged nothing (as a prefix
    cache's hit on a branch it still holds)."""
    return st.reused_tokens - st.reused_as_is


def _fresh(spec: Any) -> Any:
    """A policy spec a second strategy can own: an instance's class (its state is the first one's), else as is."""
    return spec if spec is None or isinstance(spec, (str, type)) else type(spec)


def check_store_options(s: Any) -> None:
    """Refuse a store policy without a store budget (an unbounded store never evicts)."""
    if getattr(s, "store_policy", None) is not None and s.budget is None:
        raise WindowkitError(f"{s.name}: store_policy={s.store_policy!r} needs a store budget (store_budget_bytes / "
                             "--store-budget): an unbounded store never evicts")


__all__ = ["StepCost", "Strategy", "FullRecompute", "RadixCache", "BlindReuse", "TokenBlend", "WindowkitStrategy",
           "STORE_POLICY_ALIASES", "check_store_options"]
