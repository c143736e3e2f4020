"""WindowkitFast: the windowkit strategy's costs without running a Window (bookkeeping only).

``WindowkitStrategy`` drives a real ``Window`` on the cost-model backend: correct by construction, but a
few thousand steps per minute on a 64-chunk window. ``WindowkitFast`` keeps only what decides the costs
(chunk ids, token counts, start positions, the antecedents each chunk's KV was formed on, which canonicals
and patches the store holds) and replays what the Window does with them, so every ``StepCost`` field is
equal to the real strategy's, step by step (``tests/test_fastsim.py`` checks that on every generator,
VideoTree and random traces, for mode patch / blind / exact, form eager / lazy, every repair rule kind, with and
without a budget).

    from windowkit.trace import simulate, sliding_window
    from windowkit.trace.fastsim import WindowkitFast
    res = simulate(sliding_window(steps=1000, k=64), "h100-kamera", ["radix", WindowkitFast()])
    res.totals("windowkit-fast")["total_ms"]

What is modeled, read off ``windowkit/window/window.py`` (no prefix, ``removal_patches=False``,
``cascade="plan"``, no shared basis, ``orbit_samples=24``: what the simulator builds):

- ``assign``: evict the unwanted ids in window order; keep the longest run of survivors already in the wanted
  order (the Window's own ``_longest_increasing``, so ties break the same way); if more than half the
  survivors must move, one ``reorder``, else evict + recall each mover; then recall known ids and admit new
  ones at their wanted index, in wanted order.
- insert (admit / recall) pins the chunk's canonical in the store, then in patch mode conditions it on the
  ids in front: a stored patch for exactly that context (canonical fetched or encoded, placed with the patch);
  nothing in front (its prefill at 0 *is* the canonical: fetched if stored, else one encode); form="lazy":
  one conditioned forward, nothing stored; form="eager": the conditioned forward, then the canonical (fetched
  or encoded: a second forward of the same chunk, booked as ``encode_ms``) and a fresh patch stored for that
  context. Blind mode fetches or encodes the canonical and places it. Exact mode does nothing until
  materialize, which re-prefills the whole window once per window version.
- evict (patch mode) refreshes the survivors behind the gap with whatever exact conditioning is free: the new
  head gets its canonical placed at 0 (lazy: only if one is stored), a survivor whose new context has a stored
  patch gets it; every other survivor keeps its KV as-is (it only relocates) until the repair rule runs.
- survivor repair (``repair=`` / ``fidelity=``, patch mode): stale survivors (KV formed on other antecedents than
  they have now) from the edit's index on get the rule's first tokens recomputed in one forward, booked as
  prefill (``prefill_ms`` of their count; no vision, no encode_ms); the window up to the last repaired chunk is
  relocated first (net, like materialize), except chunks recomputed wholly, which are fresh at their start and
  take their new antecedents. ``assign`` runs one repair after its evictions (before any insert) and one after
  its inserts.
- reorder (patch mode): each chunk whose antecedents changed fetches or encodes its canonical, then takes the
  patch stored for its exact new context, else the orbit patch of its antecedent set, else forms one from a
  forward of every sampled ordering (K! orderings for K <= 4 antecedents, else 24) and stores it.
- materialize (``forward(query)`` or ``window_kv()``) relocates every entry whose KV start differs from its
  current start; then the query is prefilled.

Surprises mirrored here (the Window's behaviour, not choices of this model):

- Relocations are *net*: a chunk that moves and comes back to its start within one step is not relocated.
- KV replay (``reused_tokens``) is credited on every placement of stored KV, even a canonical placed at
  position 0 (no rotation: the new head after a head eviction), but a chunk admitted at the head whose
  canonical is already stored takes it without a placement and is credited nothing.
- A patch lookup with nothing in front always misses (no patch is ever stored for the empty context), and
  the orbit path fetches (or encodes) the canonical *before* looking up any patch.
- ``binding_risk`` compares the antecedent ids by value: a chunk whose antecedents are restored (its evicted
  neighbour recalled into the same place) is no longer at risk, though nothing was refreshed.
- ``bytes_held`` uses the metering store's ``canon_sum`` / ``patch_sum``: tokens of the canonicals and patches
  the store holds now (a bounded store's evictions are subtracted).
- ``encode_ms`` is the backend's heuristic: a lone forward at position 0 of an id forwarded before. So an
  exact-mode re-prefill of a one-chunk window counts, and ids starting with ``"__"`` never count.
- Under a budget the store refuses a put that cannot fit beside the pinned (live) canonicals, evicts
  least-recently-used unpinned entries otherwise (a get and an unpin count as a use), and a canonical it
  dropped is encoded again on its next need (one more ``encodes``).

Where the work goes: a step costs O(chunks that change) Python operations plus a few whole-window passes
done inside C builtins (``accumulate`` for the start positions, ``map``/``compress`` to count relocations
and binding-risk candidates, a set intersection to find survivors that could have a stored patch for their
new context). Contexts are tuples of ids (exact, no hash collisions; the Window hashes content keys, which
map one-to-one to trace ids). A survivor can only hit a stored patch if one was formed for it with the same
number of antecedents, and a chunk can only be free of binding risk if it sits at the index it was formed at:
those two checks (dict / list lookups) prune the per-survivor context comparisons that cost the real
Window a sha256 per survivor per eviction.

Not modeled (the constructor has no such arguments; the simulator never sets them): a prefix, removal
patches, ``cascade="apply"``, a shared basis, other ``orbit_samples``, SVD options. The metering store's fallback to a mean patch size never
triggers here (a chunk id keeps one token count), so it is not modeled either.
"""
from __future__ import annotations

from collections import OrderedDict
from itertools import accumulate, compress
from operator import attrgetter, eq, ne, not_
from typing import Optional, Sequence

from windowkit.errors import WindowkitError
from windowkit.kv.patch import orderings
from windowkit.trace.costs import CostProfile
from windowkit.trace.schema import ChunkRef, Step
from windowkit.trace.simulate import StepCost, Strategy
from windowkit.window.plan import WindowView, choose_step, movers_of, repair_rule

CANON_BYTES_PER_TOKEN = 16  # CostModelBackend's fake KV: 1 layer, K and V of [1 head, n, 2] float32
PATCH_FEATURES = 2  # H*D of each slot of that layout: a patch keeps min(rank, tokens, 2) directions
ORBIT_SAMPLES = 24  # Window(orbit_samples=24), the default the simulator uses

_ids_of = attrgetter("id")


def patch_nbytes(tokens: int, rank: Optional[int]) -> int:
    """Bytes of a patch of a ``tokens``-token chunk on the fake layout: 2 slots x (us [S, m] + vt [m, 2]) fp32.

        patch_nbytes(5, 32) == 112
    """
    m = min(tokens, PATCH_FEATURES) if rank is None else min(int(rank), tokens, PATCH_FEATURES)
    return 2 * (tokens * m + m * PATCH_FEATURES) * 4


class _Store:
    """The metered ChunkStore reduced to entry ids and byte sizes, with its budget and LRU behaviour.

    Entry ids: ("c", chunk id) canonical, ("p", chunk id, antecedent tuple) fresh patch, ("o", chunk id,
    frozenset of antecedents) orbit patch. Without a budget nothing is ever evicted and use order is not kept.
    """

    def __init__(self, budget: Optional[int]):
        if budget is not None and budget < 0:
            raise WindowkitError(f"budget_bytes must be >= 0 or None, got {budget}")
        self.budget = budget
        self.sizes: dict[tuple, int] = {}
        self.plen: dict[tuple[str, int], int] = {}  # (chunk id, antecedent count) -> fresh patches + "x" stored
        self.pinned: set[str] = set()  # chunk ids whose canonical is pinned (the live window)
        self.order: OrderedDict[tuple, None] = OrderedDict()  # unpinned entries, least recently used first
        self.total = self.pinned_bytes = 0
        self.ntok: dict[tuple, int] = {}  # entry -> tokens it covers (bytes_held is charged per token)
        self.canon_sum = self.patch_sum = 0  # tokens of the canonicals / patches held now

    def touch(self, eid: tuple) -> None:
        """A get that hit: the entry becomes the most recently used."""
        if self.budget is not None and eid in self.order:
            self.order.move_to_end(eid)

    def pin(self, cid: str) -> None:
        self.pinned.add(cid)
        if self.budget is not None and ("c", cid) in self.sizes:
            self.order.pop(("c", cid), None)
            self.pinned_bytes += self.sizes[("c", cid)]

    def unpin(self, cid: str) -> None:
        self.pinned.discard(cid)
        if self.budget is not None and ("c", cid) in self.sizes:
            self.order[("c", cid)] = None  # unpinning counts as a use (LRU)
            self.pinned_bytes -= self.sizes[("c", cid)]

    def put(self, eid: tuple, nbytes: int, ntok: int) -> bool:
        """ChunkStore._put: refuse what cannot fit beside the pinned entries, else evict LRU victims first."""
        budget = self.budget
        pinned = eid[0] == "c" and eid[1] in self.pinned
        if budget is not None:
            old = self.sizes.get(eid)
            held = self.pinned_bytes - (old if old is not None and pinned else 0)
            if nbytes > budget or held + nbytes > budget:
                return False
            if old is not None:
                self._remove(eid)
            while self.total + nbytes > budget:
                self._remove(next(iter(self.order)))
        elif eid in self.sizes:
            self._remove(eid)
        self.sizes[eid] = nbytes
        self.total += nbytes
        self.ntok[eid] = ntok
        if eid[0] in "cx":
            self.canon_sum += ntok
        else:
            self.patch_sum += ntok
        if eid[0] in "px":
            k = (eid[1], len(eid[2]))
            self.plen[k] = self.plen.get(k, 0) + 1
        if budget is not None:
            if pinned:
                self.pinned_bytes += nbytes
            else:
                self.order[eid] = None
        return True

    def _remove(self, eid: tuple) -> None:
        nbytes = self.sizes.pop(eid)
        self.total -= nbytes
        ntok = self.ntok.pop(eid)
        if eid[0] in "cx":
            self.canon_sum -= ntok
        else:
            self.patch_sum -= ntok
        self.order.pop(eid, None)
        if self.budget is not None and eid[0] == "c" and eid[1] in self.pinned:
            self.pinned_bytes -= nbytes  # only a replaced pinned canonical: victims are never pinned
        if eid[0] in "px":
            k = (eid[1], len(eid[2]))
            if self.plen[k] == 1:
                del self.plen[k]
            else:
                self.plen[k] -= 1


class WindowkitFast(Strategy):
    """Bookkeeping model of ``WindowkitStrategy``: the same StepCost every step, no tensors, no Window.

    rank / mode ("patch" | "blind" | "exact") / form ("lazy" default | "eager") / fidelity / repair /
    store_budget_bytes / vision_cache mean what they mean for ``WindowkitStrategy`` and the Window (rank only
    changes patch bytes, i.e. what fits a budget).

        simulate(trace, "h100-kamera", [WindowkitStrategy(repair="sink:8"), WindowkitFast(repair="sink:8")])
    """

    name = "windowkit-fast"

    def __init__(self, rank: Optional[int] = 32, mode: str = "patch", store_budget_bytes: Optional[int] = None,
                 vision_cache: bool = True, name: str = "windowkit-fast", form: str = "lazy",
                 fidelity: str = "balanced", repair=None, cap: bool = True):
        if mode not in ("patch", "blind", "exact"):
            raise WindowkitError(f"mode must be 'patch', 'blind' or 'exact', got {mode!r}")
        if rank is not None and int(rank) < 1:
            raise WindowkitError(f"rank must be >= 1 or None (full rank), got {rank}")
        if form not in ("eager", "lazy"):
            raise WindowkitError(f"form must be 'eager' or 'lazy', got {form!r}")
        if store_budget_bytes is not None and store_budget_bytes < 0:
            raise WindowkitError(f"budget_bytes must be >= 0 or None, got {store_budget_bytes}")
        self.rule = repair_rule(fidelity, repair)
        self.rank, self.mode, self.form, self.budget = rank, mode, form, store_budget_bytes
        self.vision_cache, self.name = vision_cache, name
        self.cap = bool(cap)
        self.exact_budget = self.rule.full  # Window._exact_budget: no low-rank patch served, no orbit reorder
        self.keep_cond = mode == "patch" and form == "lazy"  # Window._keep_conditioned / _conditioned
        self.use_patches = not self.exact_budget or rank is None

    # ================================================================== run state
    def reset(self, profile: CostProfile) -> None:
        super().reset(profile)
        self.store = _Store(self.budget)
        self.tok: dict[str, int] = {}  # chunk id -> tokens (first sight, as WindowkitStrategy caches its Chunk)
        self.visual: set[str] = set()
        self.known: set[str] = set()  # ids ever admitted (recall instead of admit)
        self.seen_visual: set[str] = set()  # backend: vision tower already ran
        self.forwarded: set[str] = set()  # backend: ids forwarded at least once (encode_ms heuristic)
        self.perms: dict[int, list[tuple]] = {}
        # the window, as parallel lists in window order
        self.ids: list[str] = []
        self.spans: list[int] = []
        self.kvst: list[int] = []  # start position the entry's KV is valid at
        self.ante: list[tuple] = []  # antecedent ids the entry's conditioning was formed on (patch mode)
        self.live: set[str] = set()
        self.num_tokens = 0
        self.version, self.exact_version = 0, -1
        self.batching, self.pending = False, None  # assign: the evictions' repair runs once, before inserts
        # cumulative counters, as the Window's stats, the backend's ledger and the metering store keep them
        self.encodes = self.forms = self.applies = self.relocs = self.reused = 0
        self.applied_tokens = self.formed_tokens = 0
        self.prefill_ms = self.vision_ms = self.encode_extra_ms = 0.0
        self.prefill_tokens = self.vision_encodes = 0
        self.prefix_plans = 0

    # ================================================================== one step
    def step(self, step: Step, ctx: Sequence[ChunkRef]) -> StepCost:
        s0 = (self.encodes, self.forms, self.applies, self.relocs, self.reused, self.applied_tokens,
              self.formed_tokens, self.prefill_ms, self.encode_extra_ms, self.vision_ms, self.prefill_tokens,
              self.vision_encodes)
        self._assign(ctx)
        self._materialize()
        if step.query_tokens:  # the query runs after the window: plain prefill (never an encode, never vision)
            self.prefill_ms += self.p.prefill_ms(step.query_tokens)
            self.prefill_tokens += step.query_tokens
        p = self.p
        c = StepCost(encodes=self.encodes - s0[0], patch_forms=self.forms - s0[1], patch_applies=self.applies - s0[2],
                     relocations=self.relocs - s0[3])
        c.reuse_ms = (p.replay_ms(self.reused - s0[4]) + p.patch_apply_ms(self.applied_tokens - s0[5])
                      + p.patch_form_ms(self.formed_tokens - s0[6]))
        c.prefill_ms = self.prefill_ms - s0[7]
        c.encode_ms = self.encode_extra_ms - s0[8]
        c.vision_ms = self.vision_ms - s0[9]
        c.prefill_tokens = self.prefill_tokens - s0[10]
        c.vision_encodes = self.vision_encodes - s0[11]
        if self.mode == "patch":
            c.binding_risk = self._binding_risk()
        st = self.store
        c.bytes_held = (st.canon_sum + self.num_tokens) * p.kv_bytes_per_token + st.patch_sum * p.patch_bytes_per_token
        return c

    def _assign(self, ctx: Sequence[ChunkRef]) -> None:
        """Window.assign: evictions, survivor moves, then recalls / admits at their wanted index."""
        want = list(map(_ids_of, ctx))
        wset = set(want)
        if len(wset) != len(want):
            raise WindowkitError("assign: duplicate chunk ids")
        if want == self.ids:
            return
        if self.mode == "patch" and self.form == "lazy" and self.cap:
            for x in ctx:  # sizes and kinds as first seen (the Window's Chunk is cached by id)
                if x.id not in self.tok:
                    self.tok[x.id] = x.tokens
                    if x.kind != "text":
                        self.visual.add(x.id)
            choice = choose_step(self._view(), want, self.rule)
            if choice.route == "prefill":
                self._prefill_route(choice.keep, want)
                return
        ids, live = self.ids, self.live
        gone = live - wset
        self.batching, self.pending = True, None
        if gone:
            order = [i for i in ids if i in gone] if len(gone) > 1 else list(gone)
            for cid in order:
                self._evict(self.ids.index(cid))
        tail_only = False
        if self.ids != want:
            n = len(self.ids)
            tail_only = want[:n] == self.ids  # survivors in place, new chunks only at the tail (sliding, appending)
            if not tail_only:
                survivors = list(filter(self.live.__contains__, want))  # wanted relative order
                if survivors != self.ids:
                    movers, one_reorder = movers_of(self.ids, survivors)
                    if one_reorder and not self.exact_budget:
                        self._reorder(survivors)
                        movers = []
                    for cid in movers:
                        self._evict(self.ids.index(cid))
        self.batching = False
        if self.pending is not None:
            self._repair(self.pending)
        if self.ids != want:  # (equal: nothing to do, the common unchanged step)
            self.batching, self.pending = True, None  # the inserts' repair: once, after the last insert
            if tail_only:
                for idx in range(len(self.ids), len(want)):
                    self._insert_wanted(ctx[idx], idx)
            else:
                # in wanted order, every earlier wanted id is already in place: insert at the wanted index
                for idx in list(compress(range(len(want)), map(not_, map(self.live.__contains__, want)))):
                    if self.exact_budget and self.pending is not None and self.pending < idx:
                        first, self.pending, self.batching = self.pending, idx, False  # Window._flush_repair
                        self._repair(first, idx)
                        self.batching = True
                    self._insert_wanted(ctx[idx], idx)
            self.batching = False
            if self.pending is not None:
                self._repair(self.pending)

    def _view(self) -> WindowView:
        sizes, use, keep = self.store.sizes, self.use_patches, self.keep_cond
        return WindowView(ids=self.ids, ante=self.ante, tokens=self.tok,
                          has_canonical=lambda cid: ("c", cid) in sizes,
                          has_patch=lambda cid, ante: use and ("p", cid, tuple(ante)) in sizes,
                          has_orbit=lambda cid, ante: use and ("o", cid, frozenset(ante)) in sizes,
                          has_exact=lambda cid, ante: keep and ("x", cid, tuple(ante)) in sizes)

    def _prefill_route(self, keep: int, want: list[str]) -> None:
        """Window._prefill_route: drop the entries behind the kept prefix (from the tail), one forward of the
        rest of the wanted window over it; the prefilled entries are exact at their starts."""
        front_exact = all(self.ante[j] == tuple(self.ids[:j]) for j in range(keep))
        while len(self.ids) > keep:
            cid = self.ids.pop()
            self.spans.pop()
            self.kvst.pop()
            self.ante.pop()
            self.live.discard(cid)
            self.num_tokens -= self.tok[cid]
            self.store.unpin(cid)
        new = want[keep:]
        self.version += 1
        if not new:
            return
        self._forward(new, keep == 0)
        start = sum(self.spans)
        for cid in new:
            self.known.add(cid)
            self.store.pin(cid)
            self.kvst.append(start)
            self.ante.append(tuple(self.ids))
            self.ids.append(cid)
            self.spans.append(self.tok[cid])
            self.live.add(cid)
            self.num_tokens += self.tok[cid]
            start += self.tok[cid]
        if keep == 0 and ("c", new[0]) not in self.store.sizes:  # its prefill at 0 is its canonical
            self.encodes += 1
            self.store.put(("c", new[0]), CANON_BYTES_PER_TOKEN * self.tok[new[0]], self.tok[new[0]])
        if self.keep_cond and front_exact:
            for i in range(max(keep, 1), len(self.ids)):
                n = self.tok[self.ids[i]]
                self.store.put(("x", self.ids[i], self.ante[i]), CANON_BYTES_PER_TOKEN * n, n)
        self.version += 1
        self.prefix_plans += 1

    def _insert_wanted(self, x: ChunkRef, idx: int) -> None:
        """Recall a known id, or admit a new one (its size and kind as first seen), at index ``idx``."""
        if x.id in self.known:
            self._insert(x.id, idx, recall=True)
            return
        if x.id not in self.tok:
            self.tok[x.id] = x.tokens
            if x.kind != "text":
                self.visual.add(x.id)
        self.known.add(x.id)
        self._insert(x.id, idx, recall=False)

    # ================================================================== Window edits
    def _evict(self, idx: int) -> None:
        cid = self.ids.pop(idx)
        self.spans.pop(idx)
        self.kvst.pop(idx)
        self.ante.pop(idx)
        self.live.discard(cid)
        self.num_tokens -= self.tok[cid]
        self.store.unpin(cid)
        self.version += 1
        if self.mode == "patch" and idx < len(self.ids):
            self._refresh_known(idx)
            self._repair(idx)

    def _insert(self, cid: str, idx: int, recall: bool) -> None:
        """Window._insert (+ recall's refresh of the survivors behind it, in patch mode)."""
        self.store.pin(cid)
        kvs, ante = 0, ()
        if self.mode != "exact":
            start = sum(self.spans[:idx])
            if self.mode == "blind":
                self._canonical(cid)
                self._placed(cid, start, False)
                kvs = start
            else:
                kvs, ante = self._condition(cid, start, tuple(self.ids[:idx]))
        self.ids.insert(idx, cid)
        self.spans.insert(idx, self.tok[cid])
        self.kvst.insert(idx, kvs)
        self.ante.insert(idx, ante)
        self.live.add(cid)
        self.num_tokens += self.tok[cid]
        self.version += 1
        if self.mode == "patch":
            if recall:
                self._refresh_known(idx + 1)
            self._repair(idx + 1)  # assign admits and recalls at an index: survivors behind it are stale

    def _condition(self, cid: str, start: int, ante: tuple) -> tuple[int, tuple]:
        """Window._condition; returns the entry's (KV start, formation antecedents)."""
        n = self.tok[cid]
        store = self.store
        if ante and self.use_patches and (cid, len(ante)) in store.plen and ("p", cid, ante) in store.sizes:
            store.touch(("p", cid, ante))
            self.applied_tokens += n
            self._canonical(cid)
            self._placed(cid, start, True)
            return start, ante
        if ante and self.keep_cond and ("x", cid, ante) in store.sizes:  # Window._conditioned: exact, relocated
            store.touch(("x", cid, ante))
            self._placed(cid, start, False)
            return start, ante
        if not ante:  # its prefill at 0 is its canonical
            if ("c", cid) in store.sizes:
                store.touch(("c", cid))
            else:
                self._encode(cid)
            return 0, ()
        self._forward([cid], False)  # the conditioned forward, kept as the KV
        ids, fa = self.ids, self.ante
        if self.keep_cond and all(fa[j] == tuple(ids[:j]) for j in range(len(ante))):  # Window._keep_conditioned
            store.put(("x", cid, ante), CANON_BYTES_PER_TOKEN * n, n)
        if self.form == "eager":
            self._canonical(cid)
            if all(fa[j] == tuple(ids[:j]) for j in range(len(ante))):  # Window._exact_upto: over stale survivors
                self.forms += 1  # the forward is not KV(B|ante), so no patch is stored for that context
                self._put_patch(("p", cid, ante), n, orbit=False)
        return start, ante

    def _condition_orbit(self, i: int, start: int, ante: tuple) -> None:
        cid = self.ids[i]
        if not ante:
            self.kvst[i], self.ante[i] = self._condition(cid, start, ante)
            return
        n = self.tok[cid]
        store = self.store
        self._canonical(cid)
        if ("p", cid, ante) in store.sizes:
            store.touch(("p", cid, ante))
            self.applied_tokens += n
        elif ("o", cid, frozenset(ante)) in store.sizes:
            store.touch(("o", cid, frozenset(ante)))
            self.applied_tokens += n
        else:
            perms = self.perms.get(len(ante))
            if perms is None:  # the Window's own sampler: which orderings depends only on the count
                perms = self.perms[len(ante)] = orderings(tuple(range(len(ante))), limit=ORBIT_SAMPLES)
            for perm in perms:
                self._forward([ante[j] for j in perm] + [cid], True)
            self.forms += 1
            self._put_patch(("o", cid, frozenset(ante)), n, orbit=True)
        self._placed(cid, start, True)
        self.kvst[i], self.ante[i] = start, ante

    def _reorder(self, new_ids: list[str]) -> None:
        pos = {cid: k for k, cid in enumerate(self.ids)}
        perm = [pos[c] for c in new_ids]
        self.ids = list(new_ids)
        self.spans = [self.spans[k] for k in perm]
        self.kvst = [self.kvst[k] for k in perm]
        self.ante = [self.ante[k] for k in perm]
        self.version += 1
        if self.mode != "patch":
            return
        starts = list(accumulate(self.spans, initial=0))
        for i in range(len(self.ids)):
            ante = tuple(self.ids[:i])
            if ante != self.ante[i]:
                self._condition_orbit(i, starts[i], ante)

    def _refresh_known(self, first: int) -> None:
        """Window._refresh_known: free exact conditioning for survivors from ``first`` on, else keep-as-is."""
        ids, n = self.ids, len(self.ids)
        store = self.store
        if first == 0:  # the new head: its canonical is its exact conditioning
            cid = ids[0]
            if self.ante[0] != () and not (self.form == "lazy" and ("c", cid) not in store.sizes):
                self._canonical(cid)
                self._placed(cid, 0, False)
                self.kvst[0], self.ante[0] = 0, ()
            first = 1
        if first >= n or not store.plen or not (self.use_patches or self.keep_cond):
            return
        # only a survivor with a stored patch (or conditioned KV) formed behind as many chunks as it has now can hit
        cands = sorted(store.plen.keys() & zip(ids[first:], range(first, n)), key=lambda t: t[1])
        for cid, i in cands:
            ante = tuple(ids[:i])
            if ante == self.ante[i]:
                continue
            if self.use_patches and ("p", cid, ante) in store.sizes:
                store.touch(("p", cid, ante))
                self.applied_tokens += self.tok[cid]
                self._canonical(cid)
                patched = True
            elif self.keep_cond and ("x", cid, ante) in store.sizes:
                store.touch(("x", cid, ante))
                patched = False
            else:
                continue
            start = sum(self.spans[:i])
            self._placed(cid, start, patched)
            self.kvst[i], self.ante[i] = start, ante

    def _repair(self, first: int, upto: Optional[int] = None) -> None:
        """Window._repair: the rule's first tokens of every stale survivor from ``first`` on, one recompute
        (booked as prefill); the window up to the last repaired chunk is relocated first (a wholly recomputed
        chunk is fresh at its start, not relocated)."""
        if self.mode != "patch" or self.rule.is_none:
            return
        if self.batching:
            self.pending = first if self.pending is None else min(self.pending, first)
            return
        ids, ante, tok = self.ids, self.ante, self.tok
        n = len(ids)
        if first >= n:
            return
        stale = [i for i in range(first, n if upto is None else min(n, upto))
                 if len(ante[i]) != i or ante[i] != tuple(ids[:i])]
        if not stale:
            return
        counts = self.rule.counts([tok[ids[i]] for i in stale])
        pairs = [(i, k) for i, k in zip(stale, counts) if k > 0]
        if not pairs:
            return
        starts = list(accumulate(self.spans, initial=0))
        full = {i for i, k in pairs if k == tok[ids[i]]}
        kvst = self.kvst
        for j in range(pairs[-1][0] + 1):
            if j not in full and kvst[j] != starts[j]:
                self.relocs += 1
                self.reused += tok[ids[j]]
                kvst[j] = starts[j]
        total = sum(k for _, k in pairs)
        self.prefill_ms += self.p.prefill_ms(total)
        self.prefill_tokens += total
        for i in full:
            kvst[i], ante[i] = starts[i], tuple(ids[:i])

    # ================================================================== reading the window
    def _materialize(self) -> None:
        """window_kv / the query's past: relocate what moved (patch, blind) or re-prefill (exact)."""
        if self.mode == "exact":
            if self.ids and self.exact_version != self.version:
                self._forward(self.ids, True)
                self.exact_version = self.version
            return
        starts = list(accumulate(self.spans, initial=0))
        starts.pop()
        if starts != self.kvst:
            moved = list(map(ne, self.kvst, starts))
            self.relocs += sum(moved)
            self.reused += sum(compress(self.spans, moved))
            self.kvst = starts

    def _binding_risk(self) -> int:
        """plan()'s refresh-patch edits: entries whose KV was formed on other antecedents than now."""
        ids, ante = self.ids, self.ante
        clean = 0
        for i in compress(range(len(ids)), map(eq, map(len, ante), range(len(ids)))):
            if ante[i] == tuple(ids[:i]):
                clean += 1
        return len(ids) - clean

    # ================================================================== store, backend
    def _canonical(self, cid: str) -> None:
        if ("c", cid) in self.store.sizes:
            self.store.touch(("c", cid))
        else:
            self._encode(cid)

    def _encode(self, cid: str) -> None:
        self._forward([cid], True)
        self.encodes += 1
        self.store.put(("c", cid), CANON_BYTES_PER_TOKEN * self.tok[cid], self.tok[cid])

    def _put_patch(self, eid: tuple, n: int, orbit: bool) -> None:
        self.formed_tokens += n
        if orbit:  # an orbit patch is applied at once (a fresh one is formed beside a kept forward)
            self.applied_tokens += n
        self.store.put(eid, patch_nbytes(n, self.rank), n)

    def _placed(self, cid: str, start: int, patch: bool) -> None:
        if patch:
            self.applies += 1
        if start != 0:
            self.relocs += 1
        self.reused += self.tok[cid]

    def _forward(self, ids: Sequence[str], at_zero: bool) -> None:
        """CostModelBackend.forward: vision at first sight (or always), prefill, the encode_ms heuristic."""
        p, tok = self.p, self.tok
        for cid in ids:
            if cid in self.visual and (not self.vision_cache or cid not in self.seen_visual):
                self.seen_visual.add(cid)
                self.vision_ms += p.vision_ms(tok[cid])
                self.vision_encodes += 1
        n = sum(map(tok.__getitem__, ids))
        self.prefill_ms += p.prefill_ms(n)
        if at_zero and len(ids) == 1 and ids[0] in self.forwarded and not ids[0].startswith("__"):
            self.encode_extra_ms += p.prefill_ms(n)
        self.forwarded.update(ids)
        self.prefill_tokens += n


__all__ = ["WindowkitFast", "patch_nbytes"]
