"""Which patches condition on which chunks, what an eviction makes stale, and what a recall cascades into.

A conditioning patch ``(chunk_id, ctx)`` is formed on an ordered antecedent context (or, for an orbit patch,
an antecedent set). The graph is a networkx ``DiGraph`` with two kinds of node:

    chunk node   the chunk id (a ``str``)
    patch node   ``PatchRef(chunk_id, ctx)`` (a named tuple, so never equal to a chunk id)

    antecedent chunk --> every patch formed on it --> the patch's own chunk

so ``a -> (b, ctx) -> b`` reads "b's patch for ctx was formed on a". A patch never depends on its own chunk
(``add_patch`` refuses it); the graph as a whole may still hold cycles (b formed on a, later a formed on b after
a reorder), which the cascade never follows backwards because it only moves forward in window order.

State beside the graph, all updated in O(degree) per event:

  evicted      chunks out of the window; a patch is *stale* while any of its antecedents is evicted
               (the paper: a patch frozen on a context that has since turned over turns harmful), and
               fresh again when they are all back. ``on_evict`` / ``on_recall`` keep a per-patch count.
  current      the patch each chunk wears now (its KV's conditioning): the last ``add_patch`` for it,
               cleared when the chunk is evicted. Only worn patches propagate a cascade.

Staleness has one definition, ``entry_is_stale(ante, ids, i)``: a window entry at index ``i`` of ``ids`` is stale
when the ordered antecedents its KV was formed on (``ante``) are not exactly ``ids[:i]`` (``Window.stale_ids``, the
Window's repair and focus, and the planner's model of them all use it, through ``stale_indices``). The graph's
stale set is the part of it that eviction alone decides, kept per *patch record* rather than per entry: a patch is
in it while one of its antecedents is out of the window. A worn patch in the stale set makes its entry stale
(its ``ante`` names a chunk not in ``ids``); an entry can be stale with no stale patch (a reorder or an insert
ahead changed its antecedents, all still in the window; a fork's context-clean view), and a stale patch the entry
no longer wears says nothing about the entry. The Window never reads the graph's stale set: it decides with
``entry_is_stale``; the set serves the graph's own users (``is_stale`` / ``stale_patches`` of a patch).

The recall cascade (the paper's App. E leaves it as future work): re-instating chunk r re-forms r's KV on its
new earlier context, so every chunk after r in the window whose worn patch was formed on r binds to a KV that
changed and needs a fresh patch; each of those changes in turn, so the chunks after it conditioned on it do too.
``cascade`` returns them in window order with a cost estimate per step; ``Cascade.__str__`` prints a table.

    g = DependencyGraph()
    g.add_patch("b", "ctx-b", ["a"], tokens=64)
    g.add_patch("c", "ctx-c", ["a", "b"], tokens=64)
    g.on_evict("a")                 # [PatchRef('b', 'ctx-b'), PatchRef('c', 'ctx-c')] now stale
    print(g.on_recall("a", ["a", "b", "c"]))   # b (via a), then c (via a, b)
"""
from __future__ import annotations

import hashlib
import json
from itertools import repeat
from typing import Callable, Iterable, Iterator, Mapping, NamedTuple, Optional, Sequence, Union

import networkx as nx

from windowkit.errors import ChunkNotFoundError, WindowkitError
from windowkit.graph.divergence import Embed, divergence

KINDS = ("fresh", "orbit", "removal")
CostModel = Callable[[str, int], "tuple[float, int]"]  # (chunk_id, tokens) -> (ms, bytes)


def entry_is_stale(ante: Sequence[str], ids: Sequence[str], i: int) -> bool:
    """THE staleness rule: the KV of the entry at index ``i`` of the window ``ids`` was formed on the ordered
    antecedents ``ante``; it is stale unless those are exactly the chunks now in front of it (``ids[:i]``).

        entry_is_stale(("a", "b"), ["a", "b", "c"], 2) is False
        entry_is_stale(("b", "a"), ["a", "b", "c"], 2) is True
    """
    return len(ante) != i or tuple(ante) != tuple(ids[:i])


def stale_indices(ids: Sequence[str], antes: Sequence[Optional[Sequence[str]]], first: int = 0,
                  upto: Optional[int] = None) -> list[int]:
    """Indices in ``first..upto-1`` (default: to the end) whose entry is stale (``entry_is_stale``); ``antes[i]``
    is the ordered antecedents entry ``i``'s KV was formed on, or None for an entry whose KV is not formed yet
    (a pending admission: never stale).

        stale_indices(["b", "c"], [("a",), ("a", "b")]) == [0, 1]
    """
    end = len(ids) if upto is None else upto
    # entry_is_stale inlined (the planner's per-op scan): a length that differs decides without a slice
    return [i for i in range(first, end) if (a := antes[i]) is not None
            and (len(a) != i or tuple(a) != tuple(ids[:i]))]


class PatchNotFoundError(ChunkNotFoundError):
    """A ``(chunk_id, ctx)`` patch is not in the dependency graph."""


class PatchRef(NamedTuple):
    """A patch node: the patched chunk and the context hash it was formed on (the store's patch key)."""

    chunk_id: str
    ctx: str

    def __repr__(self) -> str:
        return f"PatchRef({self.chunk_id!r}, {self.ctx!r})"


class TokenCostModel:
    """Default cost model: forming a patch costs time and bytes in proportion to the chunk's tokens.

    The defaults are placeholders of the right order for a 7B model on one GPU (one conditioned forward of the
    chunk + a rank-m SVD; a rank-32 patch of a few tens of KiB per token-layer slice). A Window should pass one
    built from its measured ms/token and its layout's patch bytes per token.
    """

    __slots__ = ("ms_per_token", "bytes_per_token", "ms_fixed")

    def __init__(self, ms_per_token: float = 0.05, bytes_per_token: int = 4096, ms_fixed: float = 0.0):
        self.ms_per_token = float(ms_per_token)
        self.bytes_per_token = int(bytes_per_token)
        self.ms_fixed = float(ms_fixed)

    def __call__(self, chunk_id: str, tokens: int) -> tuple[float, int]:
        return self.ms_fixed + tokens * self.ms_per_token, tokens * self.bytes_per_token

    def batch(self, chunk_ids: Sequence[str], tokens: Sequence[int]) -> tuple[list, list]:
        """Same as calling it per chunk, in one go (a cost model may define ``batch``; it is optional)."""
        ms = list(map(self.ms_per_token.__mul__, tokens))  # C-level: this runs on every planned recall
        if self.ms_fixed:
            ms = list(map(self.ms_fixed.__add__, ms))
        return ms, list(map(self.bytes_per_token.__mul__, tokens))

    def __repr__(self) -> str:
        return f"TokenCostModel(ms_per_token={self.ms_per_token}, bytes_per_token={self.bytes_per_token})"


class CascadeStep(NamedTuple):
    """One chunk the cascade re-conditions (step 0, ``cascade.root``, is the recalled chunk itself).

    index: its place in the window (its fresh patch is formed on ``cascade.window[:index]``); depth: hops from
    the recalled chunk (0 for the root); via: the cascade members (root included) its worn patch was formed
    on, in window order; patch: the patch it wore until now (None for the root); tokens, ms, nbytes: the cost
    model's estimate of forming its fresh patch.
    """

    chunk_id: str
    index: int
    depth: int
    via: tuple
    patch: Optional[PatchRef]
    tokens: int
    ms: float
    nbytes: int


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


class Cascade:
    """The ordered re-conditioning a recall triggers: ``root`` (the recalled chunk's own fresh patch) and its
    dependents in window order (iterate, ``len``, index, ``ids``). ``str(cascade)`` is a readable table.

    Planning keeps plain columns; the ``CascadeStep`` objects (with ``via`` and ``depth``) are built on first
    access, off the planning hot path.
    """

    __slots__ = ("window", "_ids", "_idx", "_refs", "_antes", "_tokens", "_ms", "_bytes", "_steps")

    def __init__(self, window: Sequence[str], ids: list, idx: list, refs: list, antes: list, tokens: list,
                 ms: list, nbytes: list):
        self.window = tuple(window)
        self._ids, self._idx, self._refs, self._antes = ids, idx, refs, antes  # position 0: the root
        self._tokens, self._ms, self._bytes = tokens, ms, nbytes
        self._steps: Optional[tuple] = None

    def _materialize(self) -> tuple:
        if self._steps is None:
            root = self._ids[0]
            depth = {root: 0}
            order = [root]
            out = [CascadeStep(root, self._idx[0], 0, (), None, self._tokens[0], self._ms[0], self._bytes[0])]
            pos = {root: self._idx[0]}
            for k in range(1, len(self._ids)):
                ante = self._antes[k]  # via: the members its worn patch was formed on, in window order
                if len(ante) < len(order):
                    via = tuple(sorted(filter(depth.__contains__, ante), key=pos.__getitem__))
                else:
                    via = tuple(filter(ante.__contains__, order))
                d = self._ids[k]
                pos[d] = self._idx[k]
                depth[d] = 1 + max(map(depth.__getitem__, via))
                order.append(d)
                out.append(CascadeStep(d, self._idx[k], depth[d], via, self._refs[k], self._tokens[k], self._ms[k],
                                       self._bytes[k]))
            self._steps = tuple(out)
        return self._steps

    @property
    def root(self) -> CascadeStep:
        return self._materialize()[0]

    @property
    def steps(self) -> tuple:
        """The dependents, in window order (the root excluded)."""
        return self._materialize()[1:]

    def __len__(self) -> int:
        return len(self._ids) - 1

    def __iter__(self) -> Iterator[CascadeStep]:
        return iter(self.steps)

    def __getitem__(self, i: int) -> CascadeStep:
        return self.steps[i]

    @property
    def ids(self) -> list[str]:
        """Dependents' chunk ids, in window order (the root excluded)."""
        return self._ids[1:]

    @property
    def indices(self) -> list[int]:
        """Dependents' window indices (ascending); the columns ``ids`` / ``indices`` / ``total_*`` need no
        ``CascadeStep`` objects, so a caller on a hot path can use them alone."""
        return self._idx[1:]

    @property
    def total_ms(self) -> float:
        """Root + dependents."""
        return sum(self._ms)

    @property
    def total_bytes(self) -> int:
        return sum(self._bytes)

    @property
    def depth(self) -> int:
        return max((s.depth for s in self.steps), default=0)

    def antecedents(self, step: CascadeStep) -> tuple:
        """The context ``step``'s fresh patch is to be formed on: the window before it."""
        return self.window[:step.index]

    def as_dict(self) -> dict:
        return {"window": list(self.window), "total_ms": self.total_ms, "total_bytes": self.total_bytes,
                "steps": [{**s._asdict(), "via": list(s.via), "patch": list(s.patch) if s.patch else None}
                          for s in self._materialize()]}

    def __repr__(self) -> str:
        return (f"Cascade(root={self._ids[0]!r}, dependents={self.ids}, total_ms={self.total_ms:.3f}, "
                f"total_bytes={self.total_bytes})")

    def __str__(self) -> str:
        root = self.root
        head = (f"recall {root.chunk_id!r} at index {root.index}: {len(self)} dependent(s) need a fresh patch, "
                f"depth {self.depth}, total ~{self.total_ms:.2f} ms, {_fmt_bytes(self.total_bytes)}")
        rows = [("step", "idx", "chunk", "depth", "via", "tokens", "est ms", "est bytes")]
        for k, s in enumerate(self._materialize()):
            via = "(recalled)" if k == 0 else ", ".join(s.via)
            rows.append((str(k), str(s.index), s.chunk_id, str(s.depth), via, str(s.tokens), f"{s.ms:.3f}",
                         _fmt_bytes(s.nbytes)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        right = (0, 1, 3, 5, 6, 7)
        lines = [head]
        for j, r in enumerate(rows):
            lines.append("  " + "  ".join(c.rjust(w) if i in right else c.ljust(w)
                                          for i, (c, w) in enumerate(zip(r, widths))).rstrip())
            if j == 0:
                lines.append("  " + "  ".join("-" * w for w in widths))
        return "\n".join(lines)


_STR_ONLY = frozenset({str})


class LazyCtx:
    """A context hash computed on first use: ``fn(*args)``, once (``value``).

    ``DependencyGraph.add_patch`` given one as ``ctx`` defers the patch node and its edges until something reads
    the graph (every read sees exactly the graph the eager calls would have built). A Window passes one for a tail
    admission whose context nothing in the store can be under: hashing that context (a chain over the whole
    window) and linking its antecedents is then paid only if the graph is read.
    """

    __slots__ = ("_fn", "_args", "_value")

    def __init__(self, fn: Callable[..., str], *args):
        self._fn, self._args, self._value = fn, args, None

    @property
    def value(self) -> str:
        if self._value is None:
            self._value = str(self._fn(*self._args))
            self._fn = self._args = None
        return self._value

    def __repr__(self) -> str:
        return f"LazyCtx({self._value!r})" if self._value is not None else "LazyCtx(<not computed>)"


class _Patch:
    __slots__ = ("ref", "antecedents", "kind", "nbytes", "tokens", "missing")

    def __init__(self, ref: PatchRef, antecedents: tuple, kind: str, nbytes: int, tokens: int):
        self.ref, self.antecedents, self.kind, self.nbytes, self.tokens = ref, antecedents, kind, nbytes, tokens
        self.missing = 0  # how many distinct antecedents are evicted now


def _auto_ctx(kind: str, antecedents: tuple) -> str:
    obj = ["orbit", sorted(antecedents)] if kind == "orbit" else ["ctx", list(antecedents)]
    return "auto:" + hashlib.sha256(json.dumps(obj, separators=(",", ":")).encode()).hexdigest()[:16]


def _check_id(chunk_id: object) -> str:
    if not isinstance(chunk_id, str):
        raise WindowkitError(f"chunk ids are strings, got {type(chunk_id).__name__} {chunk_id!r}")
    return chunk_id


class DependencyGraph:
    """The conditioning graph of a window's chunks and their patches (see the module docstring).

        g = DependencyGraph(cost_model=TokenCostModel(ms_per_token=0.03, bytes_per_token=8192))
        ref = g.add_patch(cid, ctx, antecedent_ids, kind="fresh", nbytes=p.nbytes, tokens=len(chunk))
        stale = g.on_evict(cid)                     # patches formed on cid: stale now
        plan = g.on_recall(cid, window_ids)         # after cid is back in window_ids: the cascade
        g.refresh_order(g.stale_patches(), window_ids)   # most diverged first

    Every event is O(degree of the chunk) plus, for a cascade, O(window); no tensor work.
    """

    def __init__(self, cost_model: Optional[CostModel] = None):
        self.cost_model: CostModel = cost_model if cost_model is not None else TokenCostModel()
        self._g = nx.DiGraph()
        self._succ = self._g._succ  # adjacency dicts, read directly on the hot paths
        self._pred = self._g._pred
        self._patches: dict[PatchRef, _Patch] = {}
        self._tokens: dict[str, int] = {}
        self._evicted: set[str] = set()
        self._stale: set[PatchRef] = set()
        self._current: dict[str, PatchRef] = {}
        self._worn_ante: dict[str, dict] = {}  # chunk -> antecedents of its worn patch (the graph's pred dict)
        self._wearers: dict[str, set[str]] = {}  # chunk -> chunks whose worn patch was formed on it
        # deferred patch links (add_patch with a LazyCtx), in call order; every read links them first (_flush)
        self._later: list[list] = []
        self._later_of: dict[str, list[list]] = {}  # chunk -> its deferred links
        # node -> its place in call order: a deferred link's node is placed where add_patch was called, so the
        # networkx view lists nodes in the order the eager calls would have (``graph`` re-sorts when needed)
        self._rank: dict = {}
        self._clock = 0
        self._disordered = False

    # ------------------------------------------------------------------ facts
    @property
    def graph(self) -> nx.DiGraph:
        """A read-only view of the networkx graph (for analysis and drawing)."""
        self._flush()
        if self._disordered:
            self._sort_nodes()
        return self._g.copy(as_view=True)

    def __contains__(self, node: object) -> bool:
        self._flush()
        return node in self._g

    def __len__(self) -> int:
        """Number of chunk nodes."""
        return len(self._tokens)

    @property
    def num_patches(self) -> int:
        self._flush()
        return len(self._patches)

    def chunks(self) -> list[str]:
        return list(self._tokens)

    def patches(self) -> list[PatchRef]:
        self._flush()
        return list(self._patches)

    def tokens(self, chunk_id: str) -> int:
        return self._tokens.get(chunk_id, 0)

    def evicted(self) -> frozenset:
        return frozenset(self._evicted)

    def is_evicted(self, chunk_id: str) -> bool:
        return chunk_id in self._evicted

    def patch_info(self, chunk_id: Union[str, PatchRef], ctx: Optional[str] = None) -> dict:
        """``{"chunk_id", "ctx", "antecedents", "kind", "nbytes", "tokens", "stale", "current"}`` of a patch."""
        self._flush()
        p = self._get(chunk_id, ctx)
        return {"chunk_id": p.ref.chunk_id, "ctx": p.ref.ctx, "antecedents": p.antecedents, "kind": p.kind,
                "nbytes": p.nbytes, "tokens": p.tokens, "stale": p.missing > 0,
                "current": self._current.get(p.ref.chunk_id) == p.ref}

    def antecedents(self, chunk_id: Union[str, PatchRef], ctx: Optional[str] = None) -> tuple:
        self._flush()
        return self._get(chunk_id, ctx).antecedents

    def patches_of(self, chunk_id: str) -> list[PatchRef]:
        """Every patch of ``chunk_id`` (formed on any context), oldest first."""
        self._flush()
        return list(self._pred[chunk_id]) if chunk_id in self._tokens else []

    def dependents(self, chunk_id: str) -> list[PatchRef]:
        """Patches formed on ``chunk_id`` (it is one of their antecedents), oldest first."""
        self._flush()
        return list(self._succ[chunk_id]) if chunk_id in self._tokens else []

    def current_patch(self, chunk_id: str) -> Optional[PatchRef]:
        """The patch ``chunk_id`` wears now (None: canonical / keep-as-is / evicted)."""
        self._flush()
        return self._current.get(chunk_id)

    def current_dependents(self, chunk_id: str) -> set:
        """Chunks whose worn patch was formed on ``chunk_id``: the ones a disposability test (App. E) toggles
        back to their canonical to ask whether ``chunk_id`` is still load-bearing."""
        self._flush()
        return set(self._wearers.get(chunk_id, ()))

    def is_stale(self, chunk_id: Union[str, PatchRef], ctx: Optional[str] = None) -> bool:
        """True while an antecedent of the patch is evicted."""
        self._flush()
        return self._get(chunk_id, ctx).missing > 0

    def stale_patches(self) -> set:
        self._flush()
        return set(self._stale)

    def copy(self) -> "DependencyGraph":
        """An independent copy (for ``Window.fork``): later events on one never show in the other. O(graph)."""
        self._flush()
        new = DependencyGraph(self.cost_model)
        new._g = self._g.copy()
        new._succ, new._pred = new._g._succ, new._g._pred
        for ref, p in self._patches.items():
            q = _Patch(ref, p.antecedents, p.kind, p.nbytes, p.tokens)
            q.missing = p.missing
            new._patches[ref] = q
        new._tokens = dict(self._tokens)
        new._evicted = set(self._evicted)
        new._stale = set(self._stale)
        new._current = dict(self._current)
        new._worn_ante = {c: new._pred[r] for c, r in new._current.items()}
        new._wearers = {a: set(w) for a, w in self._wearers.items()}
        new._rank, new._clock, new._disordered = dict(self._rank), self._clock, self._disordered
        return new

    # ------------------------------------------------------------------ edits
    def add_chunk(self, chunk_id: str, tokens: int = 0) -> None:
        """Register a chunk (idempotent; ``tokens`` > 0 updates its size). ``add_patch`` does this itself."""
        _check_id(chunk_id)
        if chunk_id not in self._tokens:
            self._g.add_node(chunk_id, tokens=int(tokens))
            self._tokens[chunk_id] = int(tokens)
            self._rank[chunk_id] = self._clock
            self._clock += 1
        elif tokens:
            self._tokens[chunk_id] = int(tokens)
            self._g._node[chunk_id]["tokens"] = int(tokens)

    def add_patch(self, chunk_id: str, ctx: Optional[str], antecedents: Sequence[str], kind: str = "fresh",
                  nbytes: int = 0, tokens: int = 0, *, current: bool = True) -> Optional[PatchRef]:
        """Record that ``chunk_id`` has a patch for context ``ctx`` formed on ``antecedents`` (window order; for
        ``kind="orbit"`` the order does not matter). ``ctx`` should be the store's context hash so graph and
        store keys agree; None derives one from the antecedents. ``current=True`` (default) also makes it the
        patch the chunk wears now. Re-adding the same ``(chunk_id, ctx)`` updates it in place.

        ``ctx`` may be a ``LazyCtx`` (every antecedent already a chunk of the graph): the patch is then linked
        when the graph is next read, as if it had been linked now, and None is returned.
        """
        _check_id(chunk_id)
        if kind not in KINDS:
            raise WindowkitError(f"patch kind must be one of {KINDS}, got {kind!r}")
        if isinstance(antecedents, str):
            raise WindowkitError(f"antecedents is a sequence of chunk ids, not the string {antecedents!r}")
        ante = tuple(antecedents)
        uniq = tuple(dict.fromkeys(ante))
        if not _STR_ONLY.issuperset(map(type, uniq)):  # a str subclass or a non-str: the exact check, in order
            for a in uniq:
                _check_id(a)
        if chunk_id in uniq:
            raise WindowkitError(f"a patch of {chunk_id!r} cannot be conditioned on {chunk_id!r} itself")
        if isinstance(ctx, LazyCtx):
            if all(map(self._tokens.__contains__, uniq)):  # deferred: only the chunk node is added now
                self.add_chunk(chunk_id, tokens)
                rec = [chunk_id, ctx, ante, kind, int(nbytes), int(tokens), self._tokens[chunk_id], current,
                       self._clock]
                self._clock += 1  # the patch node's place in call order
                if len(self._later) >= 4096:  # bounded: a caller that never reads the graph links in batches
                    self._flush()
                self._later.append(rec)
                self._later_of.setdefault(chunk_id, []).append(rec)
                return None
            ctx = ctx.value
        self._flush()
        ctx = _auto_ctx(kind, ante) if ctx is None else str(ctx)
        self.add_chunk(chunk_id, tokens)
        return self._link(chunk_id, ctx, ante, uniq, kind, int(nbytes), int(tokens), self._tokens[chunk_id], current,
                          None)

    def _link(self, chunk_id: str, ctx: str, ante: tuple, uniq: tuple, kind: str, nbytes: int, tokens: int,
              chunk_tokens: int, current: bool, rank: Optional[int]) -> PatchRef:
        """``add_patch`` after its checks and its chunk node: the patch node, its edges, the chunk's wear.
        ``rank``: the node's place in call order (None: now)."""
        ref = PatchRef(chunk_id, ctx)
        old = self._patches.get(ref)
        if old is not None:
            if old.antecedents != ante:  # same key, new antecedents: rebuild the edges
                self._drop_patch(old)
                old = None
            else:
                old.kind, old.nbytes = kind, nbytes
                old.tokens = tokens or old.tokens
                self._g._node[ref].update(kind=kind, nbytes=old.nbytes, tokens=old.tokens)
        if old is None:
            rec = _Patch(ref, ante, kind, nbytes, tokens or chunk_tokens)
            self._patches[ref] = rec
            g = self._g
            g.add_node(ref, kind=kind, antecedents=ante, nbytes=rec.nbytes, tokens=rec.tokens)
            if rank is None:
                rank = self._clock
                self._clock += 1
            elif rank < self._clock - 1:  # nodes placed after this call's time are already in: re-sort on view
                self._disordered = True
            self._rank[ref] = rank
            tokens = self._tokens
            if not all(map(tokens.__contains__, uniq)):
                for a in uniq:
                    if a not in tokens:
                        self.add_chunk(a)
            # the edges a -> ref without ``g.add_edge``'s per-edge checks (``ref`` is a new node, every ``a`` is a
            # node already), written in C (map; dict.__setitem__ returns None, so any() walks them all). The
            # edges into one patch share one empty attribute dict: they carry no data (a patch's antecedents
            # and costs are node attributes), and a patch of a tail chunk has the whole window as antecedents
            data: dict = {}
            self._pred[ref].update(dict.fromkeys(uniq, data))
            any(map(dict.__setitem__, map(self._succ.__getitem__, uniq), repeat(ref), repeat(data)))
            nx._clear_cache(g)
            rec.missing = len(self._evicted.intersection(uniq))  # walks uniq: O(antecedents), not O(evicted)
            g.add_edge(ref, chunk_id)
            if rec.missing:
                self._stale.add(ref)
        if current:
            self._wear(chunk_id, ref)
        return ref

    def set_current(self, chunk_id: str, ctx: Optional[str]) -> None:
        """Make ``(chunk_id, ctx)`` the patch the chunk wears; ``ctx=None``: it wears none (canonical/blind)."""
        if ctx is None:
            for rec in self._later_of.get(chunk_id, ()):  # its deferred patches: linked, but not worn
                rec[7] = False
            self._wear(chunk_id, None)
        else:
            self._flush()
            self._wear(chunk_id, self._get(chunk_id, ctx).ref)

    def remove_patch(self, chunk_id: Union[str, PatchRef], ctx: Optional[str] = None) -> None:
        """Forget a patch (e.g. the store dropped it). Raises PatchNotFoundError if unknown."""
        self._flush()
        self._drop_patch(self._get(chunk_id, ctx))

    def forget(self, chunk_id: str) -> list[PatchRef]:
        """Drop a chunk for good: its node, its own patches and every patch formed on it (returned)."""
        self._flush()
        if chunk_id not in self._tokens:
            return []
        gone = list(self._pred[chunk_id]) + list(self._succ[chunk_id])
        for ref in gone:
            self._drop_patch(self._patches[ref])
        self._wear(chunk_id, None)
        self._wearers.pop(chunk_id, None)
        self._evicted.discard(chunk_id)
        del self._tokens[chunk_id]
        self._rank.pop(chunk_id, None)
        self._g.remove_node(chunk_id)
        return gone

    # ------------------------------------------------------------------ window events
    def on_evict(self, chunk_id: str) -> list[PatchRef]:
        """``chunk_id`` left the window. Every patch formed on it is stale now (returned, oldest first); the
        chunk itself stops wearing a patch. Idempotent. O(patches formed on it)."""
        self._flush()
        _check_id(chunk_id)
        if chunk_id not in self._tokens:
            self.add_chunk(chunk_id)
        deps = list(self._succ[chunk_id])
        self._mark_evicted(chunk_id, deps)
        return deps

    def _mark_evicted(self, chunk_id: str, deps) -> None:
        """The eviction's state change: each patch formed on the chunk misses one more antecedent (stale from the
        first), and the chunk stops wearing a patch."""
        if chunk_id not in self._evicted:
            self._evicted.add(chunk_id)
            patches, stale = self._patches, self._stale
            for ref in deps:
                rec = patches[ref]
                rec.missing += 1
                if rec.missing == 1:
                    stale.add(ref)
        if chunk_id in self._current:
            self._wear(chunk_id, None)

    def evict_quietly(self, chunk_id: str) -> None:
        """``on_evict`` without its answer (the list of patches formed on the chunk): deferred links stay
        deferred (a link counts its evicted antecedents when it is made, so the state read later is the same)."""
        _check_id(chunk_id)
        if chunk_id not in self._tokens:
            self.on_evict(chunk_id)
            return
        for rec in self._later_of.get(chunk_id, ()):  # its deferred patches: linked, but not worn
            rec[7] = False
        self._mark_evicted(chunk_id, self._succ[chunk_id])

    def on_recall(self, chunk_id: str, window_ids: Sequence[str]) -> Cascade:
        """``chunk_id`` is back in the window, at its place in ``window_ids`` (the window after the recall). Its
        dependents' patches are live again as far as it is concerned; returns ``cascade(chunk_id, window_ids)``:
        the recalled chunk's own fresh patch and, in window order, the dependents that need a fresh one."""
        self._flush()
        _check_id(chunk_id)
        if chunk_id not in self._tokens:
            self.add_chunk(chunk_id)
        plan = self.cascade(chunk_id, window_ids)  # validates before any state changes
        if chunk_id in self._evicted:
            self._evicted.discard(chunk_id)
            patches, stale = self._patches, self._stale
            for ref in self._succ[chunk_id]:
                rec = patches[ref]
                rec.missing -= 1
                if rec.missing == 0:
                    stale.discard(ref)
        return plan

    def cascade(self, chunk_id: str, window_ids: Sequence[str]) -> Cascade:
        """The re-conditioning that (re-)instating ``chunk_id`` at its place in ``window_ids`` triggers, without
        changing any state (``Window.plan`` can show it before the edit runs).

        A chunk d after ``chunk_id`` is in the cascade iff the patch d wears was formed on ``chunk_id`` or on a
        chunk already in the cascade that sits before d. Steps come in window order; each costs
        ``cost_model(d, tokens)``. O(window) with C-level set tests.
        """
        self._flush()
        window = window_ids if isinstance(window_ids, (list, tuple)) else list(window_ids)
        try:
            r = window.index(chunk_id)
        except ValueError:
            raise WindowkitError(f"cascade: {chunk_id!r} is not in the window {list(window)}") from None
        if len(set(window)) != len(window):
            raise WindowkitError("cascade: the window lists a chunk twice")
        idx, antes = [r], [()]
        if self._wearers.get(chunk_id):
            members = {chunk_id}  # the cascade so far: every member sits before the chunk being tested
            for i, ante in enumerate(map(self._worn_ante.get, window[r + 1:]), r + 1):
                if ante is None or ante.keys().isdisjoint(members):
                    continue  # wears nothing, or a patch formed on no member
                members.add(window[i])
                idx.append(i)
                antes.append(ante)
        ids = list(map(window.__getitem__, idx))
        refs = [None]
        refs += map(self._current.__getitem__, ids[1:])
        toks = list(map(self._tokens.get, ids, repeat(0, len(ids))))
        ms, nbytes = self._costs(ids, toks)
        return Cascade(window, ids, idx, refs, antes, toks, ms, nbytes)

    def _costs(self, ids: list, toks: list) -> tuple[list, list]:
        batch = getattr(self.cost_model, "batch", None)
        if batch is not None:
            return batch(ids, toks)
        pairs = list(map(self.cost_model, ids, toks))
        return [float(p[0]) for p in pairs], [int(p[1]) for p in pairs]

    # ------------------------------------------------------------------ drift
    def divergence(self, chunk_id: Union[str, PatchRef], ctx: Optional[str], current: Sequence[str],
                   embed: Optional[Embed] = None) -> float:
        """``divergence`` of a stored patch's antecedents from ``current`` (order ignored for orbit patches)."""
        self._flush()
        p = self._get(chunk_id, ctx)
        return divergence(p.antecedents, current, embed, ordered=p.kind != "orbit")

    def refresh_order(self, stale_patches: Iterable[PatchRef],
                      current_context: Union[Sequence[str], Mapping[str, Sequence[str]]],
                      embed: Optional[Embed] = None) -> list[tuple[PatchRef, float]]:
        """Rank patches to refresh, most diverged first: ``[(patch, divergence), ...]``.

        ``current_context`` is either the window order (a chunk in it has the chunks before it as antecedents;
        one not in it would be appended at the tail, so it has the whole window) or a mapping
        ``chunk_id -> antecedents``. Ties: earlier in the window first (its refresh feeds later ones), then id.
        """
        self._flush()
        if isinstance(current_context, Mapping):
            ante_of = lambda c: current_context.get(c, ())  # noqa: E731
            pos = {}
        else:
            window = list(current_context)
            pos = {c: i for i, c in enumerate(window)}
            ante_of = lambda c: window[:pos[c]] if c in pos else window  # noqa: E731
        scored = []
        for ref in dict.fromkeys(stale_patches):
            p = self._get(ref)
            d = divergence(p.antecedents, ante_of(ref.chunk_id), embed, ordered=p.kind != "orbit")
            scored.append((ref, d))
        scored.sort(key=lambda x: (-x[1], pos.get(x[0].chunk_id, len(pos)), x[0].chunk_id, x[0].ctx))
        return scored

    # ------------------------------------------------------------------ internals
    def link_deferred(self) -> None:
        """Link now the patches ``add_patch`` deferred (given a LazyCtx): what any read would do first. For a
        caller with idle time (``Window.flush`` between steps), so that the next read finds nothing to link.

            g.add_patch("b", LazyCtx(str, "ctx-1"), ["a"])   # recorded, not linked
            g.link_deferred()                                # linked: node ("b", "ctx-1") and edge a -> it
        """
        self._flush()

    def _flush(self) -> None:
        """Link the deferred patches (``add_patch`` with a LazyCtx), in call order."""
        if not self._later:
            return
        later, self._later = self._later, []
        self._later_of.clear()
        for cid, lazy, ante, kind, nbytes, tokens, chunk_tokens, current, rank in later:
            self._link(cid, lazy.value, ante, tuple(dict.fromkeys(ante)), kind, nbytes, tokens, chunk_tokens, current,
                       rank)

    def _sort_nodes(self) -> None:
        """Put the networkx node dicts in call order (deferred links place their nodes late). O(n log n)."""
        rank, g = self._rank.__getitem__, self._g
        for d in (g._node, g._succ, g._pred):
            items = sorted(d.items(), key=lambda kv: rank(kv[0]))
            d.clear()
            d.update(items)
        self._disordered = False

    def _get(self, chunk_id: Union[str, PatchRef], ctx: Optional[str] = None) -> _Patch:
        ref = chunk_id if ctx is None and isinstance(chunk_id, tuple) else PatchRef(chunk_id, ctx)
        rec = self._patches.get(ref)
        if rec is None:
            raise PatchNotFoundError(f"patch {ref!r} is not in the dependency graph")
        return rec

    def _wear(self, chunk_id: str, ref: Optional[PatchRef]) -> None:
        old = self._current.get(chunk_id)
        if old == ref:
            return
        wearers = self._wearers
        # the loops over a patch's antecedents run in C (map; set.add / set.discard return None, so any() walks
        # them all): a worn patch of a tail chunk has the whole window as antecedents, and this runs per edit
        if old is not None:
            any(map(set.discard, filter(None, map(wearers.get, self._pred[old])), repeat(chunk_id)))
            del self._current[chunk_id]
            del self._worn_ante[chunk_id]
        if ref is not None:
            ante = self._pred[ref]
            self._current[chunk_id] = ref
            self._worn_ante[chunk_id] = ante
            if not all(map(wearers.__contains__, ante)):
                for a in ante:
                    if a not in wearers:
                        wearers[a] = set()
            any(map(set.add, map(wearers.__getitem__, ante), repeat(chunk_id)))

    def _drop_patch(self, rec: _Patch) -> None:
        ref = rec.ref
        if self._current.get(ref.chunk_id) == ref:
            self._wear(ref.chunk_id, None)
        self._stale.discard(ref)
        del self._patches[ref]
        self._rank.pop(ref, None)
        self._g.remove_node(ref)


__all__ = ["DependencyGraph", "PatchRef", "Cascade", "CascadeStep", "TokenCostModel", "PatchNotFoundError",
           "CostModel", "KINDS"]
