"""The Window's tensor-free rules: survivor repair, the fewest-edits matching of ``assign``, and the step cap.

Nothing here touches a tensor, a model or a store: the Window calls these functions with a view of itself
(ids, token counts, the antecedents each entry's KV was formed on, what the store holds). The simulator runs
that same Window on the cost-model backend, so the rules exist once.

The step cap: a prefix cache (SGLang's radix tree, vLLM's APC) holding the previous window serves the longest
unchanged prefix and prefills the rest, exactly. ``choose_step`` models what the Window's edits would prefill
for the same step (repairs, conditioned forwards, orbit forms, encodes) and picks the prefix cache's own plan
whenever the edits would not be cheaper, so windowkit never plans a step dearer than that prefix cache, and
such a step is exact.

    c = choose_step(view, ["b", "c", "d"])
    c.route, c.keep, c.prefill_tokens, c.edit_tokens      # ("edit", 0, 300, 110)
"""
from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, replace
from math import factorial
from pathlib import Path
from typing import Callable, Container, Mapping, Optional, Sequence, Union

from windowkit.errors import WindowkitError
from windowkit.graph.dependency import stale_indices


@dataclass(frozen=True)
class RepairRule:
    """Which tokens of the stale survivors are recomputed (CacheBlend semantics: chosen tokens at their own
    positions, attending to the stale KV of the rest): at the edit by position, and at the next query by what the
    query reads.

      none         keep-as-is: nothing recomputed, survivors only relocate
      sink:N       the first N tokens of every stale survivor (their attention sink moved; EPIC-like)
      head         the whole first stale survivor (the chunk right behind the edit)
      head:N       its first N tokens only (the whole of a chunk of N tokens or fewer): caps the head's price on
                   large chunks (a 765-token screenshot) and is ``head`` on text chunks of up to N tokens
      head+sink:N  both
      query:N      at the next ``forward`` / ``generate`` (or ``Window.focus``): the N stale tokens the query
                   attends to most, read from one probe forward of the query (CacheBlend's selection by attention,
                   driven by the question); combines with the above, e.g. "head+query:32"
      all          every stale survivor wholly (= exact re-conditioning of the survivors)

    On a model backend that reads no attention (M-RoPE: a query's weights are not mapped to its slots) the
    Window spends a query:N part by position instead (``by_position``): N more stale tokens at the edit, in window
    order after the head and sinks.

        RepairRule.parse("head+sink:5").counts([40, 40, 3])   # [40, 5, 3]
        RepairRule.parse("head:32+sink:5").counts([40, 40])   # [32, 5]
        RepairRule.parse("sink:5+query:32").query            # 32
    """

    name: str
    sink: int = 0
    head: bool = False
    full: bool = False
    query: int = 0
    head_max: int = 0  # head:N caps the head at N tokens; 0: the whole first survivor
    extra: int = 0  # tokens recomputed at the edit after the head and sinks, in window order (by_position)

    @property
    def is_none(self) -> bool:
        """Nothing recomputed at the edit (a query:N part may still recompute at the next query)."""
        return not (self.full or self.head or self.sink or self.extra)

    def by_position(self) -> "RepairRule":
        """This rule with its query:N part spent at the edit by position (for a backend that reads no attention):
        N more stale tokens, continuing the head and sinks in window order.

            RepairRule.parse("head:4+query:6").by_position().counts([5, 5, 5])   # [5, 5, 0]
        """
        if not self.query:
            return self
        return replace(self, name=f"{self.name}@position", query=0, extra=self.extra + self.query)

    def counts(self, sizes: Sequence[int]) -> list[int]:
        """Tokens to recompute (from each chunk's start) for stale survivors of these sizes, in window order."""
        ns = list(map(int, sizes))
        if self.full:
            return ns
        s = self.sink  # min(sink, n) per survivor; the head rule keeps the first wholly (runs per edit: no calls)
        out = [n if n < s else s for n in ns]
        if self.head and ns:
            m = self.head_max
            out[0] = ns[0] if not m or ns[0] <= m else max(m, out[0])
        left = self.extra
        for i, n in enumerate(ns):
            if left <= 0:
                break
            more = min(n - out[i], left)
            out[i] += more
            left -= more
        return out

    @classmethod
    def parse(cls, spec: Union[str, "RepairRule", None]) -> "RepairRule":
        if isinstance(spec, RepairRule):
            return spec
        if spec is None:
            return cls("none")
        if not isinstance(spec, str):
            raise WindowkitError(f"repair must be a spec string or a RepairRule, got {type(spec).__name__}")
        s = spec.strip().lower().replace(" ", "")
        if s in ("none", "keep", "keep-as-is"):
            return cls("none")
        if s in ("all", "exact"):
            return cls("all", full=True)
        head, head_max, sink, query, seen = False, 0, None, 0, set()
        for part in s.split("+"):
            kind, colon, num = part.partition(":")
            if kind in seen or kind not in ("head", "sink", "query") or (kind != "head" and not colon):
                break
            seen.add(kind)
            if kind == "head" and not colon:
                head = True
                continue
            try:
                n = int(num)
            except ValueError:
                break
            if n < 1 and not (kind == "sink" and n == 0 and "head" in seen):
                break
            if kind == "head":
                head, head_max = True, n
            elif kind == "sink":
                sink = n
            else:
                query = n
        else:
            name = "+".join(([f"head:{head_max}" if head_max else "head"] if head else [])
                            + ([f"sink:{sink}"] if sink is not None else []) + ([f"query:{query}"] if query else []))
            return cls(name, sink=sink or 0, head=head, query=query, head_max=head_max)
        raise WindowkitError(f"repair spec {spec!r} not understood: use 'none', 'all', or one or more of 'head' "
                             "(or 'head:N', N >= 1), 'sink:N' (N >= 1; 0 after head), 'query:N' (N >= 1) joined by "
                             "'+', e.g. 'head+query:32'")


# fidelity= presets: what each maps to (docs/window.md has the measured front on SmolLM2-135M)
FIDELITY = {"exact": "all", "balanced": "head:128+query:96", "fast": "none"}
FRONT_PATH = Path(__file__).with_name("repair_front.json")  # written by bench/bench_repair.py from its run


def measured_front(path: Union[str, Path, None] = None) -> dict[str, dict[str, float]]:
    """The repair rules' measured cost share and mean next-token KL (``repair_front.json``: SmolLM2-135M, a
    sliding window of 5 chunks with look-backs; bench/bench_repair.py rewrites it)."""
    try:
        return dict(json.loads(Path(path or FRONT_PATH).read_text())["rules"])
    except (OSError, ValueError, KeyError) as e:
        raise WindowkitError(f"cannot read the measured repair front {path or FRONT_PATH}: {e}") from None


def rule_for_kl(target: float, front: Optional[Mapping[str, Mapping[str, float]]] = None) -> str:
    """The cheapest repair rule whose measured mean next-token KL is at most ``target`` nats ("all" if none is).

        rule_for_kl(1e-2)   # "head": the cheapest rule measured under 0.01 nats
    """
    t = float(target)
    if not t >= 0:  # also rejects NaN
        raise WindowkitError(f"a fidelity KL target is a number of nats >= 0, got {target!r}")
    rows = measured_front() if front is None else front
    ok = [(float(v["cost_share"]), name) for name, v in rows.items() if float(v["mean_kl"]) <= t]
    return min(ok)[1] if ok else "all"


def repair_rule(fidelity: Union[str, float] = "balanced", repair: Union[str, RepairRule, None] = None) -> RepairRule:
    """The repair rule a fidelity budget (preset name or KL target in nats) picks; ``repair`` overrides it.

        repair_rule("balanced").name == "head:128+query:96";  repair_rule(1e-2).name == "head"
    """
    if isinstance(fidelity, (int, float)) and not isinstance(fidelity, bool):
        preset = rule_for_kl(fidelity)  # a KL target: the cheapest rule measured under it
    elif isinstance(fidelity, str) and fidelity in FIDELITY:
        preset = FIDELITY[fidelity]
    else:
        raise WindowkitError(f"fidelity must be one of {', '.join(FIDELITY)} or a next-token KL target in nats "
                             f"(e.g. 1e-2), got {fidelity!r}")
    return RepairRule.parse(preset if repair is None else repair)


def longest_increasing(keys: Sequence[int], items: Sequence[str]) -> list[str]:
    """Items whose keys form a longest strictly increasing subsequence (patience sorting, O(n log n)).

        longest_increasing([2, 0, 1], ["a", "b", "c"]) == ["b", "c"]
    """
    tails: list[int] = []  # tails[k]: index into keys of the smallest tail of an increasing run of length k+1
    tail_keys: list[int] = []
    prev = [-1] * len(keys)
    for i, k in enumerate(keys):
        j = bisect.bisect_left(tail_keys, k)
        if j > 0:
            prev[i] = tails[j - 1]
        if j == len(tails):
            tails.append(i)
            tail_keys.append(k)
        else:
            tails[j] = i
            tail_keys[j] = k
    out, i = [], tails[-1] if tails else -1
    while i >= 0:
        out.append(items[i])
        i = prev[i]
    return out[::-1]


def movers_of(current: Sequence[str], survivors: Sequence[str]) -> tuple[list[str], bool]:
    """``assign``'s survivor moves: the survivors (in wanted order) that leave the longest run already in order,
    and whether one ``reorder`` replaces them (more than half must move).

        movers_of(["a", "b", "c"], ["c", "a", "b"]) == (["c"], False)
    """
    pos = {cid: k for k, cid in enumerate(current)}
    keep = set(longest_increasing([pos[i] for i in survivors], list(survivors)))
    movers = [i for i in survivors if i not in keep]
    return movers, bool(movers) and len(movers) * 2 > len(survivors)


def orbit_forwards(antecedents: int, samples: int = 24) -> int:
    """Forwards an orbit patch takes for a chunk with this many antecedents (every ordering for K <= 4)."""
    return factorial(antecedents) if antecedents <= 4 else int(samples)


@dataclass
class WindowView:
    """What the rules read of a window: nothing but ids, sizes and what the store holds.

    ids:    entry ids in window order
    ante:   per entry, the ordered antecedent ids its KV's conditioning was formed on
    tokens: tokens of every chunk id the step may place (live, recalled, new)
    has_canonical(id), has_patch(id, antecedents), has_orbit(id, antecedents), has_exact(id, antecedents): what
            the store holds (has_exact: the chunk's conditioned KV for exactly these antecedents, lazy forming)
    may_hold(antecedents): False when no patch or conditioned KV is stored for these antecedents or any that
            extend them (a survivor search stops there; True: unknown, look each up)
    prefix_tokens: tokens of a fixed prefix in front (0: none)
    """

    ids: Sequence[str]
    ante: Sequence[tuple]
    tokens: Mapping[str, int]
    has_canonical: Callable[[str], bool]
    has_patch: Callable[[str, tuple], bool]
    has_orbit: Callable[[str, tuple], bool]
    prefix_tokens: int = 0
    has_exact: Callable[[str, tuple], bool] = lambda cid, ante: False  # its exact conditioned KV for this context
    # False only when nothing is stored under this context nor under any that extends it (prefix-closed)
    may_hold: Callable[[tuple], bool] = lambda ante: True


@dataclass(frozen=True)
class StepChoice:
    """``choose_step``'s answer.

    route:          "edit" (the Window's edits) or "prefill" (the prefix cache's plan: keep the first ``keep``
                    entries as they are, prefill the rest of the wanted window in one forward, exactly)
    keep:           entries the prefix cache's plan keeps (the common prefix of the old and the new window)
    prefill_tokens: tokens the prefix cache's plan prefills
    edit_tokens:    tokens the edits are modelled to run through the model (an upper bound)
    """

    route: str
    keep: int
    prefill_tokens: int
    edit_tokens: int


def common_prefix(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _stale(ids: Sequence[str], ante: Sequence[tuple], first: int, upto: Optional[int] = None) -> list[int]:
    return stale_indices(ids, ante, first, upto)  # the one staleness rule (windowkit.graph.dependency.entry_is_stale)


def first_repair_end(want: Sequence[str], live: Container[str], n: int, first: int,
                     stale: Callable[[int, int], Sequence[int]]) -> Optional[int]:
    """Where ``assign``'s repair after its evictions stops (exclusive; None: at the end of the window).

    The window holds ``n`` survivors (ids in ``live``) in ``want``'s order; ``stale(first, end)`` lists the stale
    ones in ``first..end-1``. A survivor behind the first insert goes stale again when the insert lands, so it is
    repaired once, after the inserts, on the context it ends with. That keeps the final KV where the rule's first
    stale survivor stands in front of the first insert or right behind it (the pass after the inserts gives it the
    same share); elsewhere the repair runs to the end, as it does without inserts.

        first_repair_end(["b", "x", "c"], {"b", "c"}, 2, 0, lambda a, b: [1])   # 1: c, right behind x
    """
    cut = next((i for i, c in enumerate(want) if c not in live), n)
    return cut if cut < n and stale(first, cut + 1) else None


def _repair_tokens(ids: list, ante: list, tokens: Mapping[str, int], first: Optional[int], rule: RepairRule,
                   upto: Optional[int] = None) -> int:
    """Tokens one repair pass recomputes from ``first`` on (to ``upto``, exclusive); wholly repaired entries become
    exact in ``ante``."""
    if first is None or rule.is_none or first >= len(ids):
        return 0
    stale = _stale(ids, ante, first, upto)
    counts = rule.counts([tokens[ids[i]] for i in stale])
    for i, k in zip(stale, counts):
        if k == tokens[ids[i]]:
            ante[i] = tuple(ids[:i])
    return sum(counts)


def _refresh_free(view: WindowView, ids: list, ante: list, first: Optional[int]) -> None:
    """The Window's ``_refresh_known`` after evictions: a stale survivor whose exact conditioning for its new
    context is stored (its canonical at the head with no prefix, a patch for that context, or its conditioned
    KV, e.g. from ``prefetch(next=...)``) takes it for free and is no longer stale."""
    if first is None:
        return
    for i in _stale(ids, ante, first):
        cid, new = ids[i], tuple(ids[:i])
        if i == 0 and not view.prefix_tokens:
            free = view.has_canonical(cid)
        elif not view.may_hold(new):
            break  # nothing stored for this context, nor for the survivors behind it (theirs extend it)
        else:
            free = (view.has_patch(cid, new) and view.has_canonical(cid)) or view.has_exact(cid, new)
        if free:
            ante[i] = new


def _place_tokens(view: WindowView, cid: str, ante: tuple, orbit: bool = False) -> int:
    """Tokens that placing ``cid`` behind ``ante`` runs (lazy forming): zero when the store holds what it needs."""
    n = view.tokens[cid]
    front = bool(ante) or view.prefix_tokens > 0
    if not front:  # nothing in front: its prefill at 0 is its canonical
        return 0 if view.has_canonical(cid) else n
    if not orbit and view.has_exact(cid, ante):  # the same chunk behind the same context before: its KV, relocated
        return 0
    if view.has_patch(cid, ante) or (orbit and view.has_orbit(cid, ante)):
        return 0 if view.has_canonical(cid) else n
    if not orbit:
        return n  # one conditioned forward over what is in front
    ante_tokens = view.prefix_tokens + sum(view.tokens[a] for a in ante)
    return (0 if view.has_canonical(cid) else n) + orbit_forwards(len(ante)) * (ante_tokens + n)


def edit_tokens(view: WindowView, want: Sequence[str], rule: RepairRule, reorder: Optional[bool] = None) -> int:
    """Tokens the Window's edits run through the model to turn ``view.ids`` into ``want`` (``assign``'s order of
    edits: evictions, survivor moves, one repair, inserts, one repair; the first repair ends where
    ``first_repair_end`` says). A survivor whose exact conditioning for its new context is stored costs nothing
    (``_refresh_free``, as the Window's evictions and inserts find it); otherwise an upper bound.
    ``reorder`` forces (True) or forbids (False) the one-reorder path; None: ``assign``'s rule decides."""
    ids, ante = list(view.ids), [tuple(a) for a in view.ante]
    wset = set(want)
    first: Optional[int] = None

    def drop(idx: int) -> None:
        nonlocal first
        del ids[idx]
        del ante[idx]
        if idx < len(ids):
            first = idx if first is None else min(first, idx)

    for cid in [i for i in ids if i not in wset]:
        drop(ids.index(cid))
    live = set(ids)
    survivors = [i for i in want if i in live]
    cost = 0
    if survivors != ids:
        movers, one_reorder = movers_of(ids, survivors)
        if reorder is not None:
            one_reorder = reorder
        if one_reorder:
            pos = {c: k for k, c in enumerate(ids)}
            ante = [ante[pos[c]] for c in survivors]
            ids = list(survivors)
            for i, c in enumerate(ids):
                if ante[i] != tuple(ids[:i]):
                    cost += _place_tokens(view, c, tuple(ids[:i]), orbit=True)
                    ante[i] = tuple(ids[:i])
        else:
            for cid in movers:
                drop(ids.index(cid))
    _refresh_free(view, ids, ante, first)
    live = set(ids)
    upto = None if first is None else first_repair_end(want, live, len(ids), first,
                                                        lambda a, b: _stale(ids, ante, a, b))
    cost += _repair_tokens(ids, ante, view.tokens, first, rule, upto)
    first = None
    for idx, cid in enumerate(want):
        if cid in live:
            continue
        ids.insert(idx, cid)
        ante.insert(idx, tuple(ids[:idx]))
        cost += _place_tokens(view, cid, tuple(ids[:idx]))
        if idx + 1 < len(ids):
            first = idx + 1 if first is None else min(first, idx + 1)
            _refresh_free(view, ids, ante, idx + 1)  # as admit / recall look behind an insert
    cost += _repair_tokens(ids, ante, view.tokens, first, rule)
    return cost


def choose_step(view: WindowView, want: Sequence[str], rule: RepairRule, reorder: Optional[bool] = None) -> StepChoice:
    """The cheaper of the Window's edits and the prefix cache's plan for turning the window into ``want``.

    The prefix cache keeps the longest common prefix of the current and the wanted ids and prefills the rest; a
    tie goes to it (it is exact). ``reorder`` as for ``edit_tokens``.
    """
    keep = common_prefix(view.ids, want)
    prefill = sum(view.tokens[c] for c in want[keep:])
    edits = edit_tokens(view, want, rule, reorder)
    return StepChoice("prefill" if prefill <= edits else "edit", keep, prefill, edits)


__all__ = ["RepairRule", "FIDELITY", "measured_front", "rule_for_kl", "repair_rule", "WindowView", "StepChoice", "choose_step", "edit_tokens", "common_prefix",
           "first_repair_end", "longest_increasing", "movers_of", "orbit_forwards"]
