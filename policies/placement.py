"""Placement policies: the order in which an unordered trace step's chunks enter the window.

A trace step with ``ordered: false`` names a *set*: any order is acceptable to the agent, so the order
is ours to choose. The order decides what can be reused: windowkit keys a chunk's conditioning patch by
its exact ordered antecedents, a radix cache reuses only a shared leading run, and a chunk kept behind
the same antecedents as in the previous step needs nothing at all.

Every policy has the same few methods:

    reset(profile=None)                     fresh state (and per-token costs from a CostProfile)
    prepare(steps)                          offline policies read the whole trace here (a no-op otherwise)
    place(index, chunks, prev) -> order     the order of step ``index``'s chunks (prev: last step's order)
    observe(order)                          the order actually used at this step (updates the history)

    pol = make_placement("greedy")
    pol.reset(); pol.prepare(steps)
    orders = pol.resolve(steps)             # ordered steps keep their order; unordered ones are placed

Policies
  listed   the step's listed order, or the previous order when the set did not change (the simulator's
           behaviour without a placement policy)
  arrival  survivors keep their previous relative order, new chunks go to the tail in listed order
  greedy   ``GreedyPatchHit``: the order whose leading run of reusable chunks (kept, or a stored patch for
           exactly that antecedent sequence) saves the most modeled time; the rest in arrival order
  orbit    ``OrbitSet``: a canonical order per set (first-seen order of the chunk ids), so a set that
           recurs recurs in the same order and finds its patches
  optimal  ``OfflineOptimal``: the per-step orders minimizing the total modeled cost over the known trace
           (exact branch-and-bound for windows of at most ``max_chunks`` chunks, see its docstring)

The modeled cost (``PatchHitCost``), which ``greedy`` and ``optimal`` minimize: every chunk must end up
with KV conditioned on exactly its antecedents in the chosen order (binding kept), so a chunk is

  kept   it sat behind the same ordered antecedents in the previous step: 0 ms
  hit    that (chunk, ordered antecedents) pair occurred at an earlier step, so its patch is stored (or
         it is at the head and its canonical is stored): KV replay + patch apply
  miss   otherwise: one conditioned forward (prefill) + a patch SVD (none at the head)

Vision encodes and the query are order-independent and left out. Because a pair (c, a) is stored exactly
when ``a + [c]`` was a prefix of an earlier order, the reusable chunks of an order always form a leading run.
"""
from __future__ import annotations

import itertools
from typing import Any, Optional, Sequence

from windowkit.errors import PolicyError, PolicyTypeError

_INF = float("inf")


class PatchHitCost:
    """Per-token weights of the placement cost model; ``profile``: a CostProfile (None: 1 ms per missed
    token, everything else free, i.e. the cost is the number of missed tokens).

        cost = PatchHitCost()                     # unit model: missed tokens
        cost = PatchHitCost(load_profile("h100-kamera"))
    """

    def __init__(self, profile: Any = None):
        if profile is None:
            self.prefill, self.replay, self.apply, self.form = 1.0, 0.0, 0.0, 0.0
        else:
            self.prefill = profile.prefill_ms_per_token
            self.replay = profile.kv_replay_ms_per_token
            self.apply = profile.patch_apply_ms_per_token
            self.form = profile.patch_form_ms_per_token

    def kept(self, tokens: int) -> float:
        return 0.0

    def hit(self, tokens: int, head: bool) -> float:
        return tokens * (self.replay + (0.0 if head else self.apply))

    def miss(self, tokens: int, head: bool) -> float:
        return tokens * (self.prefill + (0.0 if head else self.form))


class History:
    """What the cost model remembers: (chunk id, ordered antecedent ids) pairs formed so far, chunks seen,
    and the antecedents of every chunk in the previous step (what ``kept`` compares against)."""

    def __init__(self) -> None:
        self.pairs: set[tuple[str, tuple]] = set()
        self.seen: set[str] = set()
        self.prev_ante: dict[str, tuple] = {}

    def status(self, cid: str, ante: tuple) -> str:
        """"kept" | "hit" | "miss" for chunk ``cid`` behind ``ante``."""
        if self.prev_ante.get(cid) == ante:
            return "kept"
        if (cid, ante) in self.pairs or (not ante and cid in self.seen):
            return "hit"
        return "miss"

    def observe(self, order: Sequence[Any]) -> None:
        ids = [c.id for c in order]
        self.prev_ante = {}
        for i, cid in enumerate(ids):
            a = tuple(ids[:i])
            self.pairs.add((cid, a))
            self.prev_ante[cid] = a
            self.seen.add(cid)


def step_cost(order: Sequence[Any], hist: History, cost: PatchHitCost) -> tuple[float, list[str]]:
    """Modeled ms of placing ``order`` (ChunkRef-like: ``.id``, ``.tokens``) given ``hist``, and each chunk's
    status. Does not update ``hist``.

        step_cost([a, b], History(), PatchHitCost())   # (a.tokens + b.tokens, ["miss", "miss"])
    """
    total, kinds, ids = 0.0, [], []
    for i, c in enumerate(order):
        a = tuple(ids)
        k = hist.status(c.id, a)
        total += cost.kept(c.tokens) if k == "kept" else cost.hit(c.tokens, i == 0) if k == "hit" \
            else cost.miss(c.tokens, i == 0)
        kinds.append(k)
        ids.append(c.id)
    return total, kinds


def model_cost(orders: Sequence[Sequence[Any]], cost: Optional[PatchHitCost] = None) -> tuple[float, list[float]]:
    """Total and per-step modeled cost of a whole sequence of orders (a fresh history).

        total, per_step = model_cost(make_placement("arrival").resolve(steps))
    """
    cost = cost or PatchHitCost()
    hist, per = History(), []
    for o in orders:
        per.append(step_cost(o, hist, cost)[0])
        hist.observe(o)
    return sum(per), per


# ====================================================================== the policies
class PlacementPolicy:
    """Base: keeps the cost model and the history; subclasses implement ``place``."""

    name = "placement"

    def __init__(self) -> None:
        self.reset()

    def reset(self, profile: Any = None) -> None:
        """Forget everything; ``profile`` (a CostProfile) sets the cost model's per-token weights."""
        self.cost = PatchHitCost(profile)
        self.hist = History()
        self.counters: dict[str, int] = {"placed": 0}

    def prepare(self, steps: Sequence[Any]) -> None:
        """Offline policies read the whole trace here; online ones ignore it."""

    def place(self, index: int, chunks: Sequence[Any], prev: Optional[Sequence[Any]]) -> list:
        raise NotImplementedError

    def observe(self, order: Sequence[Any]) -> None:
        self.hist.observe(order)

    def resolve(self, steps: Sequence[Any]) -> list[list]:
        """The order of every step: ordered steps as listed, unordered ones placed by this policy.
        Calls ``observe`` on every step, so run it on a fresh (``reset``, ``prepare``) policy."""
        out: list[list] = []
        prev: Optional[list] = None
        for i, s in enumerate(steps):
            if s.ordered:
                order = list(s.context)
            else:
                order = list(self.place(i, list(s.context), prev))
                if sorted(c.id for c in order) != sorted(s.ids):
                    raise PolicyError(f"placement {self.name!r} returned another set at step {i}")
                self.counters["placed"] += 1
            self.observe(order)
            out.append(order)
            prev = order
        return out

    def model_ms(self, orders: Sequence[Sequence[Any]]) -> float:
        """This policy's cost model (``PatchHitCost`` under the profile of the last ``reset``) summed over
        ``orders`` from a fresh history: what the simulator reports as ``placement_model_ms``."""
        return model_cost(orders, self.cost)[0]

    def replay(self, orders: Sequence[Sequence[Any]]) -> "PlacementPolicy":
        """A policy that replays ``orders`` (e.g. this one's ``resolve``) under this policy's name and counters."""
        return Fixed(orders, self.name, dict(self.counters))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _arrival(chunks: Sequence[Any], prev: Optional[Sequence[Any]]) -> list:
    """Survivors in their previous relative order, then new chunks in listed order."""
    by = {c.id: c for c in chunks}
    kept = [by[p.id] for p in (prev or ()) if p.id in by]
    seen = {c.id for c in kept}
    return kept + [c for c in chunks if c.id not in seen]


class Listed(PlacementPolicy):
    """The simulator's default: the previous order if the set is unchanged, else the listed order."""

    name = "listed"

    def place(self, index, chunks, prev):
        if prev is not None and len(prev) == len(chunks) and {c.id for c in prev} == {c.id for c in chunks}:
            return _arrival(chunks, prev)
        return list(chunks)


class Arrival(PlacementPolicy):
    """Survivors keep their previous relative order; new chunks go to the tail in listed order.

        Arrival().place(1, [c, a, b], prev=[a, b])   # [a, b, c]
    """

    name = "arrival"

    def place(self, index, chunks, prev):
        return _arrival(chunks, prev)


def _prefix_options(chunks: Sequence[Any], hist: History, cost: PatchHitCost,
                    limit: int = 4096) -> list[tuple[list, float]]:
    """Every leading run of reusable chunks (kept or hit at each position) the set allows, with its cost,
    the empty run first. Depth-first over the history's pairs; at most ``limit`` runs."""
    out: list[tuple[list, float]] = [([], 0.0)]
    stack: list[tuple[list, float]] = [([], 0.0)]
    while stack and len(out) < limit:
        pre, c0 = stack.pop()
        used = {c.id for c in pre}
        a = tuple(used_id.id for used_id in pre)
        for c in chunks:
            if c.id in used:
                continue
            k = hist.status(c.id, a)
            if k == "miss":
                continue
            run = (pre + [c], c0 + (cost.kept(c.tokens) if k == "kept" else cost.hit(c.tokens, not pre)))
            out.append(run)
            stack.append(run)
            if len(out) >= limit:
                break
    return out


def _miss_cost(rest: Sequence[Any], cost: PatchHitCost, head_free: bool) -> float:
    """Cost of ``rest`` placed after a run where every chunk misses; the first is at the head if ``head_free``."""
    return sum(cost.miss(c.tokens, head_free and i == 0) for i, c in enumerate(rest))


class GreedyPatchHit(PlacementPolicy):
    """Lead with the run of reusable chunks that saves the most (every run the history allows is tried,
    ties to the longer one), then the rest in arrival order. Myopic: the tail is not chosen for the future.

        GreedyPatchHit().place(2, [b, a], prev=[c])   # [a, b] if (b after a) occurred before
    """

    name = "greedy"

    def __init__(self, max_runs: int = 4096):
        self.max_runs = max_runs
        super().__init__()

    def place(self, index, chunks, prev):
        tail_order = _arrival(chunks, prev)
        best, best_key = None, None
        for run, c0 in _prefix_options(chunks, self.hist, self.cost, self.max_runs):
            ids = {c.id for c in run}
            order = run + [c for c in tail_order if c.id not in ids]
            total = c0 + _miss_cost(order[len(run):], self.cost, not run)
            key = (total, -len(run))
            if best_key is None or key < best_key:
                best, best_key = order, key
        return best


class OrbitSet(PlacementPolicy):
    """A canonical order for a set: chunks sorted by when their id was first seen (new ids in listed
    order), so every recurrence of a set comes back in one order and reuses its patches.

        OrbitSet().place(0, [b, a], None)   # [b, a]; later any step holding {a, b} gets [b, a]
    """

    name = "orbit"

    def reset(self, profile: Any = None) -> None:
        super().reset(profile)
        self.first_seen: dict[str, int] = {}

    def place(self, index, chunks, prev):
        n = len(self.first_seen)
        rank = {c.id: self.first_seen.get(c.id, n + i) for i, c in enumerate(chunks)}
        return sorted(chunks, key=lambda c: rank[c.id])

    def observe(self, order):
        super().observe(order)
        for c in order:
            self.first_seen.setdefault(c.id, len(self.first_seen))


class OfflineOptimal(GreedyPatchHit):
    """The orders minimizing the total ``PatchHitCost`` of the known trace (``prepare(steps)`` first).

    What is optimized: the sum over steps of the modeled cost above (kept / hit / miss per chunk) with
    the given profile's weights; vision and query costs are order-free and left out. Steps split into
    independent components (steps linked by shared chunk ids: nothing carries between components).

    How: per component, a depth-first branch-and-bound over the steps. A step's candidate orders are
    [a reusable leading run] + [every permutation of the remaining chunks that occur again later in the
    component] + [the chunks that never occur again, in listed order] (those never help a later step, so
    they go last without loss; with no run, the largest of them is also tried at the head, where it needs
    no SVD). The incumbent is the best of the online policies on that component, so the result is never
    worse than any of them, and equals the optimum when the search finishes.

    Limits (counters): a component with an unordered step of more than ``max_chunks`` chunks is not
    searched (``fallback_steps`` counts its unordered steps; they take the best online policy's orders,
    greedy among them); a search that evaluates more than ``max_nodes`` candidate orders stops with the
    best found (``budget_components``); ``exact_components`` finished.

        pol = OfflineOptimal(); pol.reset(profile); pol.prepare(steps); orders = pol.resolve(steps)
    """

    name = "optimal"

    def __init__(self, max_chunks: int = 7, max_nodes: int = 200_000, max_runs: int = 4096):
        self.max_chunks, self.max_nodes = max_chunks, max_nodes
        super().__init__(max_runs)

    def reset(self, profile: Any = None) -> None:
        super().reset(profile)
        self._profile = profile
        self.plan: dict[int, list] = {}
        self.counters.update(fallback_steps=0, exact_components=0, budget_components=0, searched_steps=0)

    def place(self, index, chunks, prev):
        plan = self.plan.get(index)
        if plan is not None and {c.id for c in plan} == {c.id for c in chunks}:
            by = {c.id: c for c in chunks}
            return [by[c.id] for c in plan]
        return super().place(index, chunks, prev)  # not prepared for this step: greedy

    # ------------------------------------------------------------------ offline planning
    def prepare(self, steps: Sequence[Any]) -> None:
        steps = list(steps)
        if not any(not s.ordered for s in steps):
            return
        # incumbents: every online policy's orders over the whole trace
        heur = []
        for cls in (Listed, Arrival, GreedyPatchHit, OrbitSet):
            p = cls()
            p.reset(self._profile)
            heur.append(p.resolve(steps))
        for comp in _components(steps):
            costs = [_component_cost(steps, comp, h, self.cost) for h in heur]
            j = min(range(len(heur)), key=costs.__getitem__)
            best_cost, best_orders = costs[j], [heur[j][i] for i in comp]
            unordered = [i for i in comp if not steps[i].ordered]
            if not unordered:
                continue
            if any(len(steps[i].context) > self.max_chunks for i in unordered):
                self.counters["fallback_steps"] += len(unordered)
            else:
                best_cost, best_orders, finished = _Search(steps, comp, self.cost, self.max_nodes,
                                                           self.max_runs).run(best_cost, best_orders)
                self.counters["exact_components" if finished else "budget_components"] += 1
                self.counters["searched_steps"] += len(unordered)
            for i, o in zip(comp, best_orders):
                self.plan[i] = o


def _components(steps: Sequence[Any]) -> list[list[int]]:
    """Step indices grouped by shared chunk ids (union-find), each group in trace order."""
    parent = list(range(len(steps)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    owner: dict[str, int] = {}
    for i, s in enumerate(steps):
        for c in s.context:
            j = owner.setdefault(c.id, i)
            a, b = find(i), find(j)
            if a != b:
                parent[max(a, b)] = min(a, b)
    groups: dict[int, list[int]] = {}
    for i in range(len(steps)):
        groups.setdefault(find(i), []).append(i)
    return sorted(groups.values())


def _component_cost(steps, comp: list[int], orders: Sequence[Sequence[Any]], cost: PatchHitCost) -> float:
    """Cost of a component's steps under whole-trace ``orders`` (``kept`` only across adjacent steps)."""
    hist, total, last = History(), 0.0, None
    for i in comp:
        if last is not None and last != i - 1:
            hist.prev_ante = {}
        total += step_cost(orders[i], hist, cost)[0]
        hist.observe(orders[i])
        last = i
    return total


class _Search:
    """Branch-and-bound over one component's steps (see OfflineOptimal)."""

    def __init__(self, steps, comp: list[int], cost: PatchHitCost, max_nodes: int, max_runs: int):
        self.steps, self.comp, self.cost = steps, comp, cost
        self.max_nodes, self.max_runs, self.nodes = max_nodes, max_runs, 0
        n = len(comp)
        self.later: list[set[str]] = [set() for _ in range(n)]  # ids occurring after component step k
        acc: set[str] = set()
        for k in range(n - 1, -1, -1):
            self.later[k] = set(acc)
            acc |= set(steps[comp[k]].ids)
        # lower bound of the cost from step k on: every chunk's first occurrence is a miss (prefill at least)
        self.lb = [0.0] * (n + 1)
        first: set[str] = set()
        news = []
        for k in range(n):
            fresh = [c for c in steps[comp[k]].context if c.id not in first]
            first |= {c.id for c in fresh}
            news.append(sum(cost.miss(c.tokens, True) for c in fresh))
        for k in range(n - 1, -1, -1):
            self.lb[k] = self.lb[k + 1] + news[k]

    def run(self, best_cost: float, best_orders: list) -> tuple[float, list, bool]:
        self.best_cost, self.best_orders, self.finished = best_cost, list(best_orders), True
        self._rec(0, History(), 0.0, [])
        return self.best_cost, self.best_orders, self.finished

    def _candidates(self, k: int, hist: History) -> list[tuple[float, list]]:
        s = self.steps[self.comp[k]]
        if s.ordered:
            return [(step_cost(s.context, hist, self.cost)[0], list(s.context))]
        later, cost = self.later[k], self.cost
        out = []
        for run, c0 in _prefix_options(s.context, hist, cost, self.max_runs):
            used = {c.id for c in run}
            live = [c for c in s.context if c.id not in used and c.id in later]
            dead = [c for c in s.context if c.id not in used and c.id not in later]
            tails = [dead]
            if not run and dead:
                big = max(dead, key=lambda c: c.tokens)
                tails.append([big] + [c for c in dead if c is not big])
            for perm in itertools.permutations(live):
                for tail in tails:
                    if tail is not dead and perm:
                        rest = [tail[0]] + list(perm) + tail[1:]  # the big never-again chunk at the head
                    else:
                        rest = list(perm) + tail
                    out.append((c0 + _miss_cost(rest, cost, not run), run + rest))
                    self.nodes += 1
                if self.nodes > self.max_nodes:
                    self.finished = False
                    break
        out.sort(key=lambda t: t[0])
        return out

    def _rec(self, k: int, hist: History, so_far: float, orders: list) -> None:
        if k == len(self.comp):
            if so_far < self.best_cost - 1e-9:
                self.best_cost, self.best_orders = so_far, list(orders)
            return
        if so_far + self.lb[k] >= self.best_cost - 1e-9 or self.nodes > self.max_nodes:
            if self.nodes > self.max_nodes:
                self.finished = False
            return
        adjacent = k > 0 and self.comp[k - 1] == self.comp[k] - 1
        base_prev = hist.prev_ante if adjacent else {}
        seen_sigs: set = set()
        for c, order in self._candidates(k, _with_prev(hist, base_prev)):
            if so_far + c + self.lb[k + 1] >= self.best_cost - 1e-9:
                break  # sorted by cost: nothing further can do better
            added = [(x.id, tuple(y.id for y in order[:i])) for i, x in enumerate(order)]
            # only pairs a later step can meet matter for the rest: orders equal on them are equivalent
            later = self.later[k]
            sig = frozenset(p for p in added if p[0] in later and all(a in later for a in p[1]))
            if sig in seen_sigs:
                continue
            seen_sigs.add(sig)
            new_pairs = [p for p in added if p not in hist.pairs]
            new_seen = [x.id for x in order if x.id not in hist.seen]
            saved_prev = hist.prev_ante
            hist.pairs.update(new_pairs)
            hist.seen.update(new_seen)
            hist.prev_ante = dict(added)
            self._rec(k + 1, hist, so_far + c, orders + [order])
            hist.pairs.difference_update(new_pairs)
            hist.seen.difference_update(new_seen)
            hist.prev_ante = saved_prev
            if self.nodes > self.max_nodes:
                self.finished = False
                return


def _with_prev(hist: History, prev_ante: dict) -> History:
    h = History.__new__(History)
    h.pairs, h.seen, h.prev_ante = hist.pairs, hist.seen, prev_ante
    return h


class Fixed(PlacementPolicy):
    """Replays orders computed before (e.g. by another policy's ``resolve``), under that policy's name;
    a step whose set differs from the stored order's falls back to arrival order (``counters["unplanned"]``).

        orders = make_placement("optimal").resolve(steps)    # after reset / prepare
        simulate(trace, placement=Fixed(orders, "optimal"))
    """

    def __init__(self, orders: Sequence[Sequence[Any]], name: str = "fixed", counters: Optional[dict] = None):
        self.orders, self.name, self._given = [list(o) for o in orders], name, dict(counters or {})
        super().__init__()

    def reset(self, profile: Any = None) -> None:
        super().reset(profile)
        self.counters.update(self._given)
        self.counters["placed"] = 0
        self.counters.setdefault("unplanned", 0)

    def place(self, index, chunks, prev):
        if index < len(self.orders) and {c.id for c in self.orders[index]} == {c.id for c in chunks}:
            by = {c.id: c for c in chunks}
            return [by[c.id] for c in self.orders[index]]
        self.counters["unplanned"] += 1
        return _arrival(chunks, prev)


PLACEMENTS: dict[str, type[PlacementPolicy]] = {"listed": Listed, "arrival": Arrival, "greedy": GreedyPatchHit,
                                                 "orbit": OrbitSet, "optimal": OfflineOptimal}


def make_placement(spec: Any = None) -> Optional[PlacementPolicy]:
    """A fresh policy from a name ("listed", "arrival", "greedy", "orbit", "optimal"), a class or an instance;
    None gives None (the simulator's default behaviour).

        make_placement("orbit")   # -> OrbitSet()
    """
    if spec is None or isinstance(spec, PlacementPolicy):
        return spec
    if isinstance(spec, str):
        try:
            return PLACEMENTS[spec.lower()]()
        except KeyError:
            raise PolicyError(f"unknown placement policy {spec!r}; known: {', '.join(PLACEMENTS)}") from None
    if isinstance(spec, type) and issubclass(spec, PlacementPolicy):
        return spec()
    raise PolicyTypeError(f"cannot make a placement policy from {spec!r}")


__all__ = ["PlacementPolicy", "Listed", "Arrival", "GreedyPatchHit", "OrbitSet", "OfflineOptimal", "Fixed",
           "PatchHitCost", "History", "step_cost", "model_cost", "PLACEMENTS", "make_placement"]
