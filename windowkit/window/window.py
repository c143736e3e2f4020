"""The Window: a deque of position-free KV chunks that an agent edits instead of re-prefilling.

    win = Window(backend, rank=32, mode="patch")
    a = win.admit(Chunk.text(ids_a)); b = win.admit(Chunk.text(ids_b))
    win.evict("head")                 # survivors relocate; the stale ones are repaired (fidelity="balanced")
    win.recall(a)                     # a's conditioned prefill on its now-fixed earlier context
    logits = win.forward(query_ids)   # next-token logits after the window; the window is unchanged

Modes
  exact  re-prefill of the whole window (the ceiling; every materialize runs one forward)
  blind  canonical KV(B|∅) relocated to its place, no patch (cheap, loses cross-chunk binding)
  patch  the first admission keeps its conditioned prefill; later placements use R(δ)(KV(B|∅) + U_m V_mᵀ)

Each entry holds the chunk's *current* KV at a known start position. Moving an entry (evict before it,
recall or reorder) relocates that KV by the position delta: exact algebra, the paper's keep-as-is.
A chunk (re-)entering behind a context gets the patch keyed by (chunk, context hash) from the store, or
one formed now from a single conditioned forward and stored for the next time that context recurs.

Forming is deferred by default (``form="lazy"``): an admission keeps its conditioned prefill and pays
nothing else; canonicals and patches are formed when something needs them, or in ``win.prefetch()``.
After an edit that changes survivors' antecedents (eviction in front of them, an insert ahead of them) the
stale survivors are repaired by a ``repair`` rule (selective recompute, CacheBlend semantics), chosen by
``fidelity``: "exact" (recompute every stale survivor), "balanced" (default), "fast" (keep-as-is).
"""
from __future__ import annotations

import copy
import operator
import time
import weakref
from collections import ChainMap, deque
from dataclasses import dataclass, field
from itertools import accumulate
from operator import attrgetter
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from windowkit.backends.base import Backend
from windowkit.chunk import Chunk
from windowkit.errors import ChunkError, ChunkNotFoundError, KVShapeError, WindowkitError
from windowkit.kv.layout import ChunkKV, concat
from windowkit.kv.rope import is_zero_delta
from windowkit.kv.patch import Patch, deficit, form_orbit_patch, form_patch, form_removal_patch, orderings, place
from windowkit.graph import Cascade, DependencyGraph, TokenCostModel, divergence, reuse_decision
from windowkit.graph.dependency import LazyCtx, entry_is_stale, stale_indices
from windowkit.store import (ChunkStore, chunk_key, conditioned_key, context_hash, context_root, context_step,
                             orbit_context_hash)
from windowkit.registry import make_policy
from windowkit.window.config import Mode, WindowConfig
from windowkit.window.plan import (FIDELITY, RepairRule, StepChoice, WindowView, choose_step, common_prefix,
                                   first_repair_end, movers_of)

Where = Union[str, int]

# Per in-memory store: every context (chain hash, ``context_step``) that is a prefix of a context some Window in
# this process stored a patch or conditioned KV under. Prefix-closed, so a survivor whose new context is not in it
# has nothing stored for it, and neither has any survivor behind it (their contexts extend it): after a head
# eviction the look-ups stop at the first survivor instead of hashing the whole window. A persistent or shared
# store holds entries this process never wrote: there every context is looked up (``Window._context_hint``).
_CONTEXT_HINTS: "weakref.WeakKeyDictionary[ChunkStore, set[str]]" = weakref.WeakKeyDictionary()


# C-level per-entry reads (map) on the per-op paths
_ID, _SPAN, _N, _PENDING = attrgetter("id"), attrgetter("span"), attrgetter("n"), attrgetter("pending")


class _KnownContexts:
    """Context hashes of antecedent id sequences, walked along ``_CONTEXT_HINTS``: ``get(ante)`` is the chain
    hash of ``ante`` (``context_step`` from ``root`` over the chunks' keys), or None where a prefix of it is not a
    known context, so nothing is stored under it nor under any context that extends it (the walk stops there,
    as ``_refresh_known``'s does). ``hint`` None (a store that may hold what this process never wrote): every
    context is hashed. The contexts asked for share prefixes: each is hashed once (a trie by chunk id)."""

    def __init__(self, root: str, keys: Mapping[str, str], hint: Optional[set[str]]):
        self.keys, self.hint = keys, hint
        self.root = root if hint is None or root in hint else None
        self.trie: dict[str, tuple] = {}  # id -> (context hash or None, children)

    def get(self, ante: Sequence[str]) -> Optional[str]:
        h, node, keys, hint = self.root, self.trie, self.keys, self.hint
        for cid in ante:
            if h is None:
                return None
            got = node.get(cid)
            if got is None:
                nh = context_step(h, keys[cid])
                got = node[cid] = (nh if hint is None or nh in hint else None, {})
            h, node = got
        return h


def _differs(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are different setting values (identity first: a RepairRule or a list compares by value)."""
    return a is not b and a != b


@dataclass
class WindowStats:
    """Counters an agent can log per step (all cumulative)."""

    encodes: int = 0  # canonical KV(B|∅) encodes (forward of a chunk alone)
    patch_forms: int = 0  # patches formed (SVD of a deficit)
    patch_reuses: int = 0  # patches found in the store for the wanted context
    patch_applies: int = 0  # rank-m adds done at placement
    relocations: int = 0  # chunk KVs re-rotated to a new position
    prefill_tokens: int = 0  # tokens run through the model (conditioned forwards, exact prefills)
    reused_tokens: int = 0  # tokens placed from stored KV instead of a prefill
    # of them: stored KV read at the position it was formed at, without a patch (the stored tensor itself: no
    # rotation, no add, no copy; what a prefix cache's hit on a branch it still holds costs)
    reused_as_is: int = 0
    fallbacks: int = 0  # edits that fell back to an exact re-prefill (also: a repair run as a full recondition)
    repaired_tokens: int = 0  # survivor tokens recomputed by the repair rule (also counted in prefill_tokens)
    probe_tokens: int = 0  # query tokens run to read what a query attends to (focus; also in prefill_tokens)
    prefix_plans: int = 0  # steps run as the prefix cache's plan (the edits were modelled no cheaper): exact
    forwards: int = 0
    vision_calls: int = 0  # vision-tower runs caused by this window (a recalled or moved chunk causes none)
    bytes_moved: int = 0  # KV bytes written by relocate / patch apply
    est_ms_saved: float = 0.0  # reused tokens x measured prefill ms/token, minus time spent editing

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Edit:
    """One pending edit, as ``plan()`` lists it."""

    op: str  # "relocate" | "refresh-patch" | "prefill"
    chunk_id: str
    tokens: int
    est_ms: float
    est_bytes: int
    divergence: float = 0.0  # refresh-patch: how far the context drifted from the one the KV was formed on
    rebuild: bool = False  # refresh-patch: the reuse-safety envelope says rebuild (superset or disjoint context)

    def __repr__(self) -> str:
        extra = f" div={self.divergence:.2f}{' rebuild' if self.rebuild else ''}" if self.op == "refresh-patch" else ""
        return f"Edit({self.op} {self.chunk_id} tokens={self.tokens} ~{self.est_ms:.2f}ms {self.est_bytes}B{extra})"


@dataclass
class _Entry:
    chunk: Chunk
    key: str  # store key of the canonical
    span: int  # position-space span
    kv: Optional[ChunkKV] = None  # current KV (patch/blind modes), valid at kv_start
    kv_start: int = 0
    ctx: str = ""  # context hash the KV's conditioning was formed on
    ante: tuple[str, ...] = ()  # ordered antecedent chunk ids at formation
    pending: bool = False  # a tail admission whose conditioned prefill waits for the next read (Window._settle)
    fresh: Optional[tuple[tuple[str, ...], torch.Tensor]] = None  # (antecedents, [S] bool): tokens recomputed on them
    id: str = field(init=False)  # the chunk's id (a field, not a property: the planner reads it per entry per op)
    n: int = field(init=False)  # the chunk's tokens (a Chunk is immutable; len() reads a tensor: cached here)

    def __post_init__(self) -> None:
        self.id = self.chunk.id
        self.n = len(self.chunk)


def _entry_ctx(self: _Entry) -> str:
    c = self._ctx
    if c.__class__ is not str:  # a LazyCtx (a tail admission's context, hashed on first read)
        c = self._ctx = c.value
    return c


def _set_entry_ctx(self: _Entry, ctx: Union[str, LazyCtx]) -> None:
    self._ctx = ctx


_Entry.ctx = property(_entry_ctx, _set_entry_ctx)  # type: ignore[assignment]  (the dataclass field, read lazily)


class Window:
    """A sliding window of KV chunks: admit / evict / recall / reorder / assign, then materialize or forward.

    backend:  an HFBackend (or anything with the Backend protocol)
    store:    ChunkStore holding canonicals and patches (memory by default)
    rank:     patch rank m; ``None`` keeps full rank (exact up to rounding)
    mode:     "patch" | "blind" | "exact"
    prefix:   optional fixed prefix (system prompt) kept exact at positions 0..
    patch_layers: None (all) | "deep" | list of layer ids
    svd:      "exact" | "randomized" (cheaper forming)
    removal_patches: re-condition survivors after an eviction with a removal patch (deepstack models)
    cascade:  "plan" (default: a recall computes and costs the cascade of dependents whose patch was formed
              on the recalled chunk, in ``last_cascade`` and ``plan()``) or "apply" (also re-conditions them)
    form:     "lazy" (default: keep the conditioned KV only; the canonical and patches are formed on first
              need: reorder, blind view, clean fork, or ``prefetch()`` between steps) or "eager" (every
              conditioned forward also encodes the canonical once and stores a patch for that context)
    fidelity: "balanced" (default), "exact" or "fast": the repair rule used when ``repair`` is not given
              (FIDELITY: exact -> "all", balanced -> "head:128+query:96", fast -> "none"); or a next-token KL target
              in nats (e.g. ``fidelity=1e-2``): the cheapest rule whose mean KL on the measured front
              (windowkit/window/repair_front.json, SmolLM2-135M) is within it
    repair:   survivor repair after an edit that changes survivors' antecedents: "none" | "sink:N" | "head" |
              "head+sink:N" | "all", optionally "+query:N" (at the next query, the N stale tokens it attends to
              most: ``focus``) | a RepairRule (overrides ``fidelity``; ignored with removal_patches=True)
    focus_budget: 0.58 (default) | None: a running account against what a prefix cache spends on the same steps.
              A rule's query:N focus recomputes only as many tokens as keep the window's prefill so far (this step's
              edits + probe + recompute + the query included) within this share; 0.58 sits under the 0.6x target
              because steps no window makes cheaper (a tail append, a look-back to the tail) come after the last
              focus of a run and lift its end by 0.011-0.015 (docs/real-weights.md). The system prompt (``prefix``,
              prefilled at construction) is held by a prefix cache too and is no step's spending. The rule's
              position part (head, sinks) is not bounded by it. None: no ceiling (the focus never exceeds the
              stale tokens)
    cap:      True (default, patch mode with lazy forming): ``assign`` and ``reorder`` never plan a step dearer
              than a prefix cache holding the previous window; where the edits (repairs, conditioned forwards,
              orbit forms) are modelled no cheaper, the step runs the prefix cache's plan instead: keep the
              unchanged prefix, prefill the rest in one forward (exact; ``stats.prefix_plans``)
    cache_salt: trust domain of the Window's own store (docs/security.md); with ``store=``, set it on that store
    auth_key: secret that authenticates the store's shared and disk entries (docs/security.md)
    config:   a WindowConfig holding the settings above (mode, rank, ..., focus_budget) instead of keywords;
              a keyword given as well must be left at its default or agree with it (else WindowkitError).
              ``win.config`` is the Window's settings either way
    guess:    "slide" (default) | "none" | None | a guess policy (``policies.guess``): what ``prefetch()`` between
              steps prepares for the next step besides canonicals and patches. "slide" repeats the window's last
              slide: the survivors of the next one are made exact in the places they will have, so a regular slide
              prefills only what is new; it prepares only while its recent guesses hit. The policy is the
              Window's own (``win.guesser``: its counters), fed by the windows it sees at each ``prefetch()``
    """

    def __init__(self, backend: Backend, store: Optional[ChunkStore] = None, rank: Optional[int] = 32,
                 mode: Mode = "patch", prefix: Optional[Union[Chunk, Sequence[int], torch.Tensor]] = None, *,
                 patch_layers=None, svd: str = "exact", removal_patches: bool = False,
                 removal_rank: Optional[int] = 64, orbit_samples: int = 24, cascade: str = "plan", form: str = "lazy",
                 basis=None, fidelity: Union[str, float] = "balanced", repair: Union[str, "RepairRule", None] = None,
                 cap: bool = True, cache_salt: Optional[str] = None, auth_key: Union[bytes, str, None] = None,
                 focus_budget: Optional[float] = 0.58, config: Optional[WindowConfig] = None,
                 guess: Any = "slide"):
        given = dict(rank=rank, mode=mode, patch_layers=patch_layers, svd=svd, removal_patches=removal_patches,
                     removal_rank=removal_rank, orbit_samples=orbit_samples, cascade=cascade, form=form,
                     fidelity=fidelity, repair=repair, cap=cap, focus_budget=focus_budget)
        if config is None:
            config = WindowConfig(**given)  # every setting validated there, once
        else:
            if not isinstance(config, WindowConfig):
                raise WindowkitError(f"config must be a WindowConfig, got {type(config).__name__}")
            defaults = WindowConfig.defaults()
            mine = {k: getattr(config, k) for k in given}
            if given["repair"] is not None and mine["repair"] is not None:  # a spec and its RepairRule agree
                given["repair"], mine["repair"] = RepairRule.parse(given["repair"]), RepairRule.parse(mine["repair"])
            clash = [k for k, v in given.items() if _differs(v, defaults[k]) and _differs(v, mine[k])]
            if clash:
                raise WindowkitError(f"Window: {', '.join(f'{k}={given[k]!r}' for k in clash)} conflicts with "
                                     f"config ({', '.join(f'{k}={mine[k]!r}' for k in clash)}); pass "
                                     "each setting once")
        self.config = config
        self.backend = backend
        # False for a cost-model backend (simulation): it never reads the cache, so the Window accounts for
        # relocations without doing their tensor work or assembling the window KV
        self._needs_past = bool(backend.needs_past)
        if store is not None and (cache_salt is not None or auth_key is not None):
            raise WindowkitError("cache_salt and auth_key configure the Window's own store: pass them to the "
                                 "ChunkStore given as store= instead")
        self.store = store if store is not None else ChunkStore(model_fingerprint=backend.fingerprint(),
                                                                layout=backend.layout, cache_salt=cache_salt,
                                                                auth_key=auth_key)
        self.rank = config.rank
        self.mode: Mode = config.mode
        # opt-in shared patch basis (windowkit.kv.basis.SharedPatchBasis): fresh patches are stored as
        # coefficients on it; None (default) keeps the per-item SVD patch
        if basis is not None and basis.layout != backend.layout:
            raise WindowkitError("basis layout differs from the backend's KV layout")
        self.basis = basis
        self.patch_layers = config.patch_layers
        self.svd = config.svd
        self.removal_patches = config.removal_patches
        self.removal_rank = config.removal_rank
        self.orbit_samples = config.orbit_samples
        self.cascade = config.cascade
        self.form = config.form
        self.repair = config.repair_rule
        if self._needs_past and not backend.reads_attention:  # no query weights to focus by: spend it by position
            self.repair = self.repair.by_position()
        self.fidelity = config.fidelity
        # an exact budget (repair "all"): every step equals re-prefill, so a low-rank stored patch is never
        # served and a reorder runs as the prefix cache's plan (orbit patches are averages, not exact)
        self._exact_budget = self.repair.full and not self.removal_patches
        self._use_patches = not self._exact_budget or self.rank is None
        self.cap = config.cap
        self.focus_budget = config.focus_budget
        self._read_ids: list[str] = []  # the ids at the last read: a prefix cache re-prefills from the first change
        self._step_p0 = 0  # stats.prefill_tokens at the last read (or prefetch): what this step has spent
        # focus_budget's running account over the steps read so far: a prefix cache's tokens and this window's
        self._bank_pc = self._bank_spent = 0
        self.last_choice = None  # the last StepChoice of assign / reorder (windowkit.window.plan)
        self._repair_pending: Optional[int] = None  # assign batches its evictions' repairs into one
        self._repair_batching = False
        # deferred work (real backends with selective recompute, lazy patch mode): the survivor repair after an
        # eviction and the conditioned prefill of tail admissions wait for the next read of the window, where they
        # run with the query as ONE forward (``_settle``); any other edit settles them first
        self._deferred_repair: Optional[int] = None  # first index whose stale survivors await repair
        self._defer_work = True  # False runs each edit's forwards at once (same tokens, same KV; tests compare)
        self._deferred_tail = 0  # the last entries are admissions awaiting their conditioned prefill
        # conditioned copies made by recent steps, not yet written to the store (write_back): key -> (kv, meta)
        self._unkept: dict[str, tuple[ChunkKV, dict]] = {}
        # the copies the last ``prefetch(next=...)`` made (also in the store): the next step reads them from here
        self._prepared: dict[str, tuple[ChunkKV, dict]] = {}
        # (parts, their concatenation): the past that prefetch(next=...) assembled, read by the next ``_kv_upto``
        self._past_memo: Optional[tuple[list[ChunkKV], ChunkKV]] = None
        # (ids, window version, per id its exact (kv, start, ctx) there or None where it holds it already): the live
        # chunks ``prefetch(next=ids)`` made exact for the next window's front, in memory, while the window is
        # unchanged; an ``assign`` that opens with them needs no planner (_ready_choice) and no search (_ready_route)
        self._ready: Optional[tuple[tuple[str, ...], int, list]] = None
        self.last_logits: Optional[torch.Tensor] = None  # next-token logits of the last forward / generate query
        self.cost_model = TokenCostModel(ms_per_token=0.0, bytes_per_token=self._patch_bytes_per_token())
        self._graph = DependencyGraph(cost_model=self.cost_model)
        # (chunk id, ctx, antecedents, tokens) of exact conditioning given since the graph was last read: recorded
        # into the graph by its next read (``graph``) or ``flush``, off the step's critical path (_record_exact)
        self._graph_later: list[tuple[str, str, tuple[str, ...], int]] = []
        self.last_cascade: Optional[Cascade] = None
        self.stats = WindowStats()
        # the guess policy ``prefetch()`` runs between steps (policies.guess, by name through the registry: this
        # layer does not import policies); None: prefetch() forms canonicals and patches only
        self.guesser = None if guess is None else make_policy("guess", guess)
        self._entries: deque[_Entry] = deque()
        self._evicted: dict[str, Chunk] = {}
        self._known: dict[str, Chunk] = {}
        self._keys: dict[str, str] = {}  # chunk id -> content-addressed store key
        self._live: set[str] = set()  # ids in the window (O(1) membership)
        self._ctx_memo: dict[tuple[str, ...], str] = {}
        self._ms_per_token: Optional[float] = None
        self._exact_cache: Optional[tuple[int, ChunkKV]] = None
        self._version = 0
        self.prefix: Optional[Chunk] = None
        self._prefix_key = ""
        self._prefix_kv: Optional[ChunkKV] = None
        self._prefix_span = 0
        if prefix is not None:
            self.prefix = prefix if isinstance(prefix, Chunk) else Chunk.text(torch.as_tensor(prefix), id="__prefix__")
            res = self._run([self.prefix], 0, None)
            self._prefix_kv, self._prefix_span = res.kv, res.spans[0]
            self._prefix_key = chunk_key(self.prefix.content_hash(), backend.fingerprint())
            # a prefix cache holds the system prompt too: its prefill is no step's spending in the focus account
            self._step_p0 = self.stats.prefill_tokens

    # ================================================================== facts
    @property
    def graph(self) -> DependencyGraph:
        """The dependency graph of the window's patches (which chunk wears what, formed on which antecedents).

            win.graph.current_patch("frame-3")   # PatchRef(chunk_id="frame-3", ctx=...) or None
        """
        if self._graph_later:
            self._record_later()
        return self._graph

    @graph.setter
    def graph(self, g: DependencyGraph) -> None:
        self._graph, self._graph_later = g, []

    def _record_later(self) -> None:
        later, self._graph_later = self._graph_later, []
        g = self._graph
        for cid, ctx, ante, n in later:
            if ante:
                g.add_patch(cid, LazyCtx(str, ctx), ante, "fresh", 0, n)
            else:
                g.add_chunk(cid, n)
                g.set_current(cid, None)

    @property
    def ids(self) -> list[str]:
        return list(map(_ID, self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, chunk_id: str) -> bool:
        return chunk_id in self._live

    @property
    def num_tokens(self) -> int:
        return sum(map(_N, self._entries)) + (len(self.prefix) if self.prefix is not None else 0)

    @property
    def next_position(self) -> int:
        return self._prefix_span + sum(map(_SPAN, self._entries))

    def starts(self) -> list[int]:
        """Start position of every entry (contiguous after the prefix)."""
        out = list(accumulate(map(_SPAN, self._entries), initial=self._prefix_span))
        out.pop()
        return out

    def _slots(self) -> list[int]:
        """Index of every entry's first token in the window's KV (prefix included): its start position on 1-D
        RoPE, fewer positions than slots after an image on M-RoPE (what ``backend.recompute(slots=)`` takes)."""
        out = list(accumulate(map(_N, self._entries), initial=len(self.prefix) if self.prefix is not None else 0))
        out.pop()
        return out

    @property
    def evicted_ids(self) -> list[str]:
        return list(self._evicted)

    def chunk(self, chunk_id: str) -> Chunk:
        c = self._known.get(chunk_id)
        if c is None:
            raise ChunkNotFoundError(f"chunk {chunk_id!r} was never admitted to this window")
        return c

    # ================================================================== edits
    def admit(self, chunk: Chunk, at: Optional[int] = None) -> str:
        """Add a new chunk (default: at the tail). Returns its id.

            cid = win.admit(Chunk.text(ids))
        """
        self._write_back()  # a new step's edit: the last step's kept copies go to the store first
        if not isinstance(chunk, Chunk):
            raise ChunkError(f"admit expects a windowkit.Chunk, got {type(chunk).__name__}")
        if chunk.id in self:
            raise WindowkitError(f"chunk {chunk.id!r} is already in the window")
        self._known[chunk.id] = chunk
        self._evicted.pop(chunk.id, None)
        cid = self._insert(chunk, at)
        if self.mode == "patch" and at is not None:
            self._condition_behind(cid)
        return cid

    def evict(self, which: Where = "head") -> str:
        """Remove a chunk: "head", "tail" or an id. O(1) at either end; survivors only relocate.

        The canonical stays in the store, so ``recall`` can bring the chunk back later.
        """
        self._write_back()  # a new step's edit: the last step's kept copies go to the store first
        if not self._entries:
            raise ChunkNotFoundError("evict from an empty window")
        if self._deferred_tail:
            self._settle()  # a pending admission is conditioned on the window as it was when admitted
        if which == "head":
            idx = 0
        elif which == "tail":
            idx = len(self._entries) - 1
        else:
            idx = self._index(str(which))
        if idx == 0:
            e = self._entries.popleft()
        elif idx == len(self._entries) - 1:
            e = self._entries.pop()
        else:
            e = self._entries[idx]
            del self._entries[idx]
        self._gone(e)
        self._version += 1
        if self.mode == "patch" and idx < len(self._entries):
            if self.removal_patches:
                self._recondition_survivors(idx)
            else:
                self._refresh_known(idx)
                self._repair_later(idx)  # before the next admit's prefill: it sees repaired survivors
        return e.id

    def _condition_behind(self, cid: str) -> None:
        """The chunks behind an inserted ``cid`` have a new antecedent: those whose exact KV for their new context is
        stored take it (``_refresh_known``: e.g. made by ``prefetch(next=...)``), the stale rest are repaired."""
        behind = self._index(cid) + 1
        self._refresh_known(behind)
        self._repair(behind)

    def _gone(self, e: _Entry) -> None:
        """The bookkeeping of an entry taken out of the window (evicted, or dropped by a step's plan)."""
        self._evicted[e.id] = e.chunk
        self._live.discard(e.id)
        self.store.unpin(e.key)
        self.graph.evict_quietly(e.id)  # patches formed on it are stale from now on

    def recall(self, chunk_id: str, at: Optional[int] = None) -> str:
        """Bring an evicted chunk back at index ``at`` (default tail): canonical + R(δ) + a fresh patch
        on its now-fixed earlier context (never the patch frozen at eviction)."""
        self._write_back()  # a new step's edit: the last step's kept copies go to the store first
        if chunk_id in self:
            raise WindowkitError(f"chunk {chunk_id!r} is already in the window")
        chunk = self._evicted.pop(chunk_id, None) or self._known.get(chunk_id)
        if chunk is None:
            raise ChunkNotFoundError(f"chunk {chunk_id!r} was never admitted; admit it first")
        cid = self._insert(chunk, at)
        self.last_cascade = self.graph.on_recall(cid, self.ids)
        if self.mode == "patch":
            self._condition_behind(cid)
            if self.cascade == "apply":
                # the cascade (patches formed on the recalled chunk, transitively) plus chunks behind it whose
                # context became a strict superset of the one they were formed on (App. D: rebuild)
                pos = self._index(cid)
                targets = {step.index for step in self.last_cascade.steps[1:]}
                for i in range(pos + 1, len(self._entries)):
                    if reuse_decision(self._entries[i].ante, self.ids[:i])[1]:
                        targets.add(i)
                starts, ids = self.starts(), self.ids  # re-conditioning moves nothing
                for i in sorted(targets):
                    e = self._entries[i]
                    ante = tuple(ids[:i])
                    if entry_is_stale(e.ante, ids, i):
                        self._condition(e, i, starts[i], ante)
        return cid

    def reorder(self, ids: Sequence[str]) -> None:
        """Same set, new order. Chunks whose antecedents changed get the orbit patch of their new
        antecedent set (one patch serves every ordering of that set). Under the step cap (default) the
        orderings' forwards are weighed against prefilling from the first moved chunk, and that prefill (exact)
        runs when it is no dearer; with an exact budget (fidelity="exact") it always runs.

            win.reorder(["b", "a", "c"])
        """
        self._write_back()  # a new step's edit: the last step's kept copies go to the store first
        ids = list(ids)
        if sorted(ids) != sorted(self.ids) or len(set(ids)) != len(ids):
            raise WindowkitError(f"reorder needs a permutation of the window's ids {self.ids}, got {ids}")
        if ids == self.ids:
            return
        self._settle()
        self._reorder(ids, capped=True)

    def _reorder(self, ids: list[str], capped: bool) -> None:
        if capped and self.mode == "patch" and (self._capped() or self._exact_budget):
            chunks = [self._known[i] for i in ids]
            choice = choose_step(self._view(chunks), ids, self.repair, reorder=True)
            self.last_choice = choice
            if choice.route == "prefill" or self._exact_budget:
                self._prefill_route(choice.keep, chunks)
                return
        by_id = {e.id: e for e in self._entries}
        self._entries = deque(by_id[i] for i in ids)
        self._version += 1
        if self.mode != "patch":
            return
        starts = self.starts()
        for i, e in enumerate(self._entries):
            ante = tuple(x.id for x in list(self._entries)[:i])
            if not entry_is_stale(e.ante, ante, i):
                continue  # same ordered context: the current KV only relocates
            self._condition_orbit(e, i, starts[i], ante)

    def assign(self, chunks: Sequence[Chunk]) -> list[tuple[str, str]]:
        """Declarative: make the window hold exactly ``chunks`` in this order, with the fewest edits.

        Evicts what is not wanted; keeps the longest run of survivors already in the wanted relative order
        (they only relocate); moves each other survivor by evict + recall at its place (one fresh patch
        each) unless more than half must move, where one ``reorder`` (orbit patches) is cheaper; recalls
        known chunks and admits new ones at their places. Returns the edits as (op, chunk id) pairs.

            win.assign([frame3, frame4, question])
        """
        wanted = list(chunks)
        seen = self._known
        # the chunk objects this window already holds under their ids pass at C speed; the rest are checked
        for c in [c for c in wanted if seen.get(getattr(c, "id", None)) is not c]:
            if not isinstance(c, Chunk):
                raise ChunkError(f"assign expects windowkit.Chunk objects, got {type(c).__name__}")
            known = seen.get(c.id)  # assign matches chunks by id: one id must mean one content
            if known is not None and known.content_hash() != c.content_hash():
                raise ChunkError(f"assign: chunk id {c.id!r} is already known with other content; "
                                 "give new content a new id")
        want_ids = [c.id for c in wanted]
        if len(set(want_ids)) != len(want_ids):
            raise WindowkitError("assign: duplicate chunk ids")
        if want_ids == self.ids:
            return []
        self._write_back()  # the last step's conditioned copies (free when the agent flushed between steps)
        self._settle()
        if self._capped():
            choice = self._ready_choice(wanted)
            if choice is not None:
                self.last_choice = choice
                return self._ready_route(wanted)
            choice = choose_step(self._view(wanted), want_ids, self.repair)
            self.last_choice = choice
            if choice.route == "prefill":
                return self._prefill_route(choice.keep, wanted)
        edits: list[tuple[str, str]] = []
        want = set(want_ids)
        # the evictions' survivor repairs run once, after the last eviction and before any insert
        self._repair_batching, self._repair_pending = True, None
        try:
            for cid in [i for i in self.ids if i not in want]:
                edits.append(("evict", self.evict(cid)))
            survivors = [i for i in want_ids if i in self]  # wanted relative order
            movers, one_reorder = movers_of(self.ids, survivors) if survivors != self.ids else ([], False)
            if one_reorder and not self._exact_budget:  # exact budget: evict + recall (exact), never orbit
                self._reorder(survivors, capped=False)  # the step was already weighed against the prefix cache
                edits.append(("reorder", ",".join(survivors)))
                movers = []
            for cid in movers:
                edits.append(("evict", self.evict(cid)))
        finally:
            self._repair_batching, first = False, self._repair_pending
            self._repair_pending = None
        if first is not None:
            # the survivors in front of the first insert now (it is conditioned on them); those behind it once,
            # after the inserts, where plan.first_repair_end says so
            upto = first_repair_end(want_ids, self._live, len(self._entries), first, self._stale_now)
            if upto is None:
                self._repair_later(first)
            else:
                self._repair(first, upto)
        # the inserts' repairs also run once, after the last insert (an insert is conditioned on the KV in front
        # of it as it is then; the chunks behind the first insert are repaired together at the end)
        self._repair_batching, self._repair_pending = True, None
        try:
            live = self._live
            for idx, c in [(i, c) for i, c in enumerate(wanted) if c.id not in live]:
                if self._exact_budget and self._repair_pending is not None and self._repair_pending < idx:
                    self._flush_repair(idx)  # exact: an insert is conditioned on repaired KV, never on stale KV
                if c.id in self._known:
                    edits.append(("recall", self.recall(c.id, at=idx)))
                else:
                    edits.append(("admit", self.admit(c, at=idx)))
        finally:
            self._repair_batching, first = False, self._repair_pending
            self._repair_pending = None
        if first is not None:
            self._repair(first)
        return edits

    # ================================================================== reading the window
    def flush(self) -> None:
        """Run deferred work now. An eviction's survivor repair and a tail admission's conditioned prefill wait
        for the next read of the window (``forward``, ``generate``, ``window_kv``) or the next other edit, and
        run there as one forward with the query; the exact conditioned copies a step keeps for later look-backs
        wait for their store write until the next edit. Call this to pay for both earlier, between steps
        (an agent's idle time: after the answer, before the next observation).

            win.evict("head"); win.admit(chunk)   # nothing run yet
            win.flush()                            # the repair and the admission: one forward
            logits = win.forward(q); win.flush()   # the step, then its store writes off the critical path
        """
        self._settle()
        self._write_back()
        self.graph.link_deferred()  # the steps' graph records (deferred off the critical path: _record_exact)

    def stale_ids(self) -> list[str]:
        """Ids whose KV keeps conditioning formed on other antecedents than they have now (kept as-is, or partly
        repaired): the chunks ``plan()`` lists as "refresh-patch", without scoring them.

            risk = len(win.stale_ids())   # the simulator's binding risk of a step
        """
        if self.mode != "patch":
            return []
        self._settle()
        entries = list(self._entries)
        return [entries[i].id for i in self._stale(entries, [e.id for e in entries], 0, len(entries))]

    def plan(self) -> list[Edit]:
        """Edits ``materialize`` will run now, with estimated ms and bytes (no tensor work)."""
        self._settle()
        ms_tok = self._ms_per_token or 0.0
        edits: list[Edit] = []
        if self.mode == "exact":
            if self._exact_cache is None or self._exact_cache[0] != self._version:
                n = self.num_tokens
                edits.append(Edit("prefill", "*", n, n * ms_tok, self._kv_bytes_per_token() * n))
            return edits
        ids = self.ids
        for i, (e, s) in enumerate(zip(self._entries, self.starts())):
            if e.kv is not None and e.kv_start != s:
                n = e.n
                b = self._rope_bytes_per_token() * n
                edits.append(Edit("relocate", e.id, n, self._bandwidth_ms(2 * b), 2 * b))
            if self.mode == "patch" and entry_is_stale(e.ante, ids, i):
                # optional: its KV keeps conditioning formed on another context (keep-as-is);
                # recondition() would form a fresh patch with one conditioned forward
                n = e.n
                score, rebuild = reuse_decision(e.ante, ids[:i])
                edits.append(Edit("refresh-patch", e.id, n, n * ms_tok, self._patch_bytes_per_token() * n, score,
                                  rebuild))
        return edits

    def materialize(self) -> tuple[Any, torch.Tensor]:
        """A transformers Cache holding the window, and the next position id(s) [n_axes, 1]."""
        kv = self.window_kv()
        return self.backend.make_cache(kv), torch.full((self.backend.n_axes, 1), self.next_position, dtype=torch.long)

    def window_kv(self) -> Optional[ChunkKV]:
        """The window's KV (prefix + chunks, window order) as one ChunkKV. A read: the next step starts here."""
        kv = self._assemble()
        self._mark_read()
        return kv

    def _mark_read(self, query_tokens: int = 0) -> None:
        """The window was read (a step ends here). With a focus budget, book the step into the running account:
        what a prefix cache spent on it (re-prefill from the first entry changed since the last read, + the query)
        and what this window spent (prefill since the last read or prefetch, + the query)."""
        if not self._needs_past:  # a cost-model backend never focuses: keep the simulator's hot path free of this
            return
        ids = self.ids
        if self.repair.query and self.focus_budget is not None:
            self._bank_pc += self._prefix_cache_step(ids) + query_tokens
            self._bank_spent += self.stats.prefill_tokens - self._step_p0 + query_tokens
        self._read_ids, self._step_p0 = ids, self.stats.prefill_tokens

    def _prefix_cache_step(self, ids: list[str]) -> int:
        """Window tokens a prefix cache holding the last read's window re-prefills to reach ``ids``."""
        keep = common_prefix(self._read_ids, ids)
        return sum(len(e.chunk) for e in list(self._entries)[keep:])

    def _assemble(self, then: Optional[ChunkKV] = None) -> Optional[ChunkKV]:
        """The window's KV as one ChunkKV, followed by ``then`` (e.g. a query's KV) in the same single copy."""
        self._settle()
        if self.mode == "exact":
            kv = self._exact_kv()
            return kv if then is None else concat([kv, then])
        parts = [self._prefix_kv] if self._prefix_kv is not None else []
        for e, s in zip(self._entries, self.starts()):
            parts.append(self._kv_at(e, s))
        if then is not None:
            parts.append(then)
        return concat(parts) if parts else None

    def _query_past(self) -> Optional[ChunkKV]:
        """The window KV a query runs over; for a backend that never reads it (cost model), only account."""
        if self.mode != "exact" and not self._needs_past:
            self._relocate_all(list(self._entries), self.starts())  # no tensor work for such a backend
            return None
        return self.window_kv()

    def forward(self, query_ids: Union[Sequence[int], torch.Tensor, Chunk]) -> torch.Tensor:
        """Next-token logits [vocab] of the last query token after the window. The window's contents are unchanged;
        deferred work (a pending repair, pending tail admissions) runs in the same forward as the query."""
        q = query_ids if isinstance(query_ids, Chunk) else Chunk.text(torch.as_tensor(query_ids), id="__query__")
        fused = self._focus(q, None, answer=True)[1] if self.repair.query else None
        if fused is None:
            fused = self._settle(q, query_kv=False)  # the logits only: the query's KV is not kept
        if fused is not None:
            logits = fused[0]
        else:
            past = self._query_past()
            logits = self.backend.forward([q], self.next_position, past).logits
        self.backend.forget(q)
        self.last_logits = logits
        self._mark_read(len(q))
        return logits

    def generate(self, query_ids: Union[Sequence[int], torch.Tensor], max_new_tokens: int = 64,
                 eos_token_id: Optional[int] = None, stop: Optional[Any] = None) -> list[int]:
        """Greedy decode after the window (the window is unchanged). Returns the new token ids; ``stop(tokens)``
        (optional) ends decoding when it returns True; ``last_logits`` holds the first token's logits.

            tokens = win.generate(question_ids, max_new_tokens=8, eos_token_id=tok.eos_token_id)
        """
        ids = torch.as_tensor(query_ids, dtype=torch.long).reshape(-1)
        step = Chunk.text(ids, id="__gen__")
        pos = self.next_position
        out: list[int] = []
        focused = self._focus(step, None, answer=True)[1] if self.repair.query and max_new_tokens > 0 else None
        fused = focused or (self._settle(step) if max_new_tokens > 0 else None)
        whole = focused[2] if focused else None  # a focused answer carries the window + query KV itself
        past = None if whole is not None else self._assemble()
        self._mark_read(len(step) if max_new_tokens > 0 else 0)  # decoding is not the next step's spending
        for k in range(int(max_new_tokens)):
            if k == 0 and fused is not None:  # the query already ran with the deferred work
                logits, kv, span = fused[0], fused[1], len(step)
            else:
                res = self.backend.forward([step], pos, past)
                logits, kv, span = res.logits, res.kv, res.spans[0]
            self.backend.forget(step)
            if k == 0:
                self.last_logits = logits
            if k == 0 and whole is not None:
                past = whole  # the window and the query, already one KV
            else:
                past = kv if past is None else concat([past, kv])
            pos += span
            tok = int(logits.argmax())
            out.append(tok)
            if (eos_token_id is not None and tok == eos_token_id) or (stop is not None and stop(out)):
                break
            step = Chunk.text(torch.tensor([tok]), id="__gen__")
        return out

    def focus(self, query_ids: Union[Sequence[int], torch.Tensor, Chunk], tokens: Optional[int] = None) -> int:
        """Recompute the stale survivor tokens this query reads most; returns how many were recomputed.

            win.assign(entries)
            win.focus(question_ids)              # the repair rule's query:N tokens (or tokens=N)
            answer = win.generate(question_ids)  # a repair rule with query:N focuses inside generate / forward

        A position rule (sink:N, head) is blind to the question: after a slide the facts a question needs can
        sit deep inside a survivor that still carries the evicted chunk's conditioning. One probe forward of the
        query over the window reads where its last token and one greedy token after it attend
        (``backend.query_attention``); the ``tokens`` stale tokens weighed most (tokens not already recomputed on
        the current antecedents) are recomputed in one selective forward (``backend.recompute``, CacheBlend's
        selection by attention). Probe and recompute never exceed the stale survivors' tokens, which a prefix
        cache would re-prefill for this step. A no-op outside patch mode, with no stale survivor, or on a backend
        without selective recompute or attention weights (cost model, MLA, M-RoPE). Counted in
        ``stats.probe_tokens`` / ``repaired_tokens`` / ``prefill_tokens``.

        Called by hand the probe is extra work (the query runs again to answer). Inside ``forward`` /
        ``generate`` it is the query's own run: the recompute forward also re-runs the query's last token over
        the repaired window and answers from there (the rest of the query keeps the KV of the probe).
        """
        return self._focus(query_ids, tokens, answer=False)[0]

    def _focus(self, query_ids: Union[Sequence[int], torch.Tensor, Chunk], tokens: Optional[int],
               answer: bool) -> tuple[int, Optional[tuple]]:
        """``focus``; with ``answer`` also ``(logits, query_kv, window_and_query_kv)``: the query over the repaired
        window, and that window followed by the query. When the query rode in the settling forward but nothing was
        worth recomputing: ``(logits, query_kv, None)`` from that forward. None when the query has not run: the
        caller runs it as usual."""
        n = self.repair.query if tokens is None else int(tokens)
        if n < 0:
            raise WindowkitError(f"focus: tokens must be >= 0, got {tokens!r}")
        if (n == 0 or self.mode != "patch" or not self._recomputes or not self._needs_past
                or not self.backend.reads_attention):
            return 0, None
        q = query_ids if isinstance(query_ids, Chunk) else Chunk.text(torch.as_tensor(query_ids), id="__query__")
        entries = list(self._entries)
        ids = [x.id for x in entries]
        if not self._stale(entries, ids, 0, len(entries)):  # settling makes none stale: keep its forward fused
            return 0, None
        look = self.FOCUS_LOOKAHEAD
        # answering with deferred work pending, the query rides in the settling forward and that forward is the
        # probe (its last row's weights come back with it); else the probe is a forward of the query of its own
        ridden = self._settle(q, probe=True) if answer else self._settle()
        entries = list(self._entries)
        starts = self.starts()
        stale = self._stale(entries, ids, 0, len(entries))
        # candidate window positions: the stale survivors' tokens not yet recomputed on their current antecedents
        cand, owner = [], []
        for i in stale:
            e, ante = entries[i], tuple(ids[:i])
            free = torch.ones(len(e.chunk), dtype=torch.bool)
            if e.fresh is not None and e.fresh[0] == ante:
                free &= ~e.fresh[1]
            off = free.nonzero().reshape(-1)
            cand.append(off + starts[i])
            owner += [i] * off.numel()
        pool = torch.cat(cand) if cand else torch.zeros(0, dtype=torch.long)
        probe = look + 1 if answer else len(q) + look  # answering, the query's own run is not extra
        n = min(n, pool.numel() - probe)  # probe + recompute <= the stale tokens a prefix cache re-prefills
        if self.focus_budget is not None:
            n = min(n, self._focus_allowance(len(q), probe))
        if n < (1 if tokens is not None else self.FOCUS_MIN):  # the rule's own focus skips a probe worth too little
            return 0, ((ridden[0], ridden[1], None) if ridden is not None else None)
        at = self.next_position
        if ridden is not None:  # the query's row came with it; the lookahead token's row is one more token's forward
            full = self._assemble(then=ridden[1])  # the window and the query, one copy
            n_win = full.num_tokens - len(q)
            nxt = Chunk.text(ridden[0].argmax().reshape(1), id="__look__")
            att = ridden[2][:n_win]
            if look:
                att = (att + self.backend.query_attention(full, nxt, at + len(q))[:n_win]) / 2
                self.backend.forget(nxt)
        else:
            past = self._assemble()
            att, full = self.backend.query_attention(past, q, at, lookahead=look, return_kv=True)  # [window tokens]
        top = att[pool].topk(n).indices.sort().values
        picked: dict[int, list[int]] = {}
        for j in top.tolist():
            i = owner[j]
            picked.setdefault(i, []).append(int(pool[j]) - starts[i])
        order = sorted(picked)
        chunks = [entries[i].chunk for i in order]
        where = [starts[i] for i in order]
        offsets = [torch.tensor(picked[i]) for i in order]
        if answer:  # the query's last token rides along: its logits answer over the repaired window
            out = self._recompute(full, chunks + [q], where + [at], offsets + [torch.tensor([len(q) - 1])],
                                         return_logits=True)
            fresh, logits = out[0][:-1], out[1]
            # the window + query KV the answer decodes over: ``full`` with the fresh tokens written in (no copy)
            cols = torch.cat([o + s for o, s in zip(offsets, where)] + [torch.tensor([at + len(q) - 1])])
            for l, (k, v) in enumerate(full.layers):  # k, v: [H, window + query, D]
                k[:, cols] = torch.cat([x.layers[l][0] for x in out[0]], 1)
                v[:, cols] = torch.cat([x.layers[l][1] for x in out[0]], 1)
        else:
            fresh = self._recompute(past, chunks, where, offsets)
        self.backend.forget(q)
        self.stats.forwards += 1 + look + (ridden is None)
        self.stats.prefill_tokens += n + probe
        self.stats.probe_tokens += probe
        self.stats.repaired_tokens += n
        for i, new in zip(order, fresh):
            e, off = entries[i], torch.tensor(picked[i])
            kv = self._kv_at(e, starts[i])
            layers = []
            for (a, b), (x, y) in zip(new.layers, kv.layers):  # x, y: [H, S, D]; a, b: [H, len(off), D]
                x, y = x.clone(), y.clone()
                x[:, off], y[:, off] = a, b
                layers.append((x, y))
            e.kv = ChunkKV(layers, kv.layout, kv.positions)
            self._mark_fresh(e, tuple(ids[:i]), off)
        return n, ((logits, full.slice(at, at + len(q)), full) if answer else None)

    FOCUS_MIN = 8  # fewer tokens than this are not worth a probe forward of the whole query
    FOCUS_LOOKAHEAD = 1  # the probe also decodes one greedy token and reads its attention (query_attention)

    def _focus_allowance(self, q: int, probe: int) -> int:
        """Tokens focus may recompute so that the window's prefill over every step read so far and this one
        (edits since the last read + probe + recompute + the query itself) stays within ``focus_budget`` x what a
        prefix cache spends on the same steps. A running account, not a per-step one: steps that cost a prefix
        cache's price whatever the window does (the first fill, a change only at the tail) count against it."""
        pc = self._bank_pc + self._prefix_cache_step(self.ids) + q
        spent = self._bank_spent + self.stats.prefill_tokens - self._step_p0
        return int(self.focus_budget * pc) - spent - q - probe

    # ================================================================== forks and the disposability test
    def fork(self, clean: bool = False) -> "Window":
        """A new window over the same backend and store with the same chunks.

        Canonicals and patches are shared (nothing is copied: every edit builds new tensors, so the
        fork is copy-on-write). ``clean=True`` gives the context-clean view: every chunk holds its
        relocated canonical, no conditioning; ``recondition()`` adds it back (stored patches first).
        """
        self._settle()
        self._write_back()  # the fork reads the same store: the waiting copies go there first
        other = Window.__new__(Window)
        other.__dict__.update(self.__dict__)
        other._unkept, other._prepared, other._past_memo, other._ready = {}, {}, None, None
        other.stats = WindowStats()
        other.guesser = copy.deepcopy(self.guesser)  # the fork's own history from here (the same windows so far)
        other._step_p0 = self._step_p0 - self.stats.prefill_tokens  # its own counters: the step's spending so far
        other._entries = deque()
        other._evicted = dict(self._evicted)
        other._known = dict(self._known)
        other._keys = dict(self._keys)
        other._live = set(self._live)
        other._ctx_memo = {}
        other._exact_cache = None
        other.graph = self.graph.copy()
        other.last_cascade = None
        starts = self.starts()
        for e, st in zip(self._entries, starts):
            ne = _Entry(e.chunk, e.key, e.span, e.kv, e.kv_start, e.ctx, e.ante)
            if clean and self.mode != "exact":
                ne.kv, ne.kv_start = other._placed(other._canonical(ne), st, None), st
                ne.ctx, ne.ante = "", ("__clean__",)
                other.graph.add_chunk(ne.id, ne.n)
                other.graph.set_current(ne.id, None)
            other.store.pin(e.key)
            other._entries.append(ne)
        return other

    def recondition(self, limit: Optional[int] = None) -> list[str]:
        """Give chunks the conditioning of their current context (stored patch, else one conditioned forward).

        ``limit``: refresh only the ``limit`` chunks whose context drifted most (the reuse-safety envelope's
        divergence, appendix D), e.g. under a time budget. Refreshes run in window order, so a refreshed chunk
        conditions the ones after it. Returns the refreshed ids.
        """
        if self.mode != "patch":
            return []
        self._settle()
        ids = self.ids
        stale = [(divergence(e.ante, ids[:i]), i) for i, e in enumerate(self._entries)
                 if entry_is_stale(e.ante, ids, i)]
        if limit is not None:
            stale = sorted(stale, key=lambda t: (-t[0], t[1]))[:max(int(limit), 0)]
        done = []
        starts = self.starts()  # re-conditioning moves nothing
        for _score, i in sorted(stale, key=lambda t: t[1]):
            e = self._entries[i]
            self._condition(e, i, starts[i], tuple(ids[:i]))
            done.append(e.id)
        self._version += 1
        return done

    def prefetch(self, next: Optional[Sequence[Union[str, Chunk]]] = None) -> dict:
        """Off the critical path (between steps): form what deferred forming skipped, and prepare the next step.

        Every live chunk gets its canonical in the store (a chunk exactly conditioned at the head with no
        prefix *is* its canonical: stored without a forward; others: one encode each), and every chunk whose
        KV is exactly conditioned on its current antecedents gets the patch for that context (an SVD, no
        forward). A later recall or move into a context seen here then costs zero forwards. Then the Window's
        guess policy (``guess=``, default "slide") reads the window and, when it has a guess it trusts, prepares
        it as ``next=`` below would. Returns ``{"encodes": .., "patch_forms": .., "guess": ids or None,
        "prefilled": tokens}`` done by this call (``win.guesser.counters``: the policy's hits and waste).

        ``next``: instead, the leading chunks of the window the agent expects at its next step, in order: ids of
        chunks this window has seen (e.g. ``win.ids[1:]`` before a slide), or ``Chunk`` objects, among them new
        ones the agent writes itself before the step (a screenshot clipped to its text where the screenshot
        stood, a summary). Their exact conditioned KV in that order is formed now, in one forward of those that
        lack a stored copy, and kept by context (as a tail admission's is). The next step's edits then find it:
        the survivors of the slide need no repair, and the step prefills only what is new since, exactly. A
        wrong guess costs this idle forward and nothing else. Returns ``{"prefilled": tokens}``.

            win.assign(chunks); logits = win.forward(q)   # the step
            win.prefetch(next=win.ids[1:])                 # idle time: the next slide's survivors
            win.prefetch(next=[*win.ids[:2], clip, *win.ids[3:]])  # ... or a clip written in place of ids[2]
        """
        self._settle()
        self._write_back()
        if next is not None:
            return self._prepare(list(next))
        e0, f0 = self.stats.encodes, self.stats.patch_forms
        if self.mode == "exact":
            return {"encodes": 0, "patch_forms": 0, "guess": None, "prefilled": 0}
        ids, starts = self.ids, self.starts()
        for i, e in enumerate(self._entries):
            ante = tuple(ids[:i])
            exact = self.mode == "patch" and not entry_is_stale(e.ante, ids, i) and e.kv is not None
            if not self.store.has_canonical(e.key):
                if exact and not ante and self.prefix is None:
                    kv0 = e.kv if e.kv_start == 0 or not self._needs_past else e.kv.relocate(-e.kv_start, self.backend.rope)
                    self.store.put_canonical(e.key, kv0, {"chunk_id": e.id, "tokens": str(e.n)})
                else:
                    self._canonical(e)
            if exact and ante:
                ctx = self._ctx(ante)
                if not self.store.has_patch(e.key, ctx):
                    self._form_fresh(e, e.kv, e.kv_start, ctx, ante)
        out = {"encodes": self.stats.encodes - e0, "patch_forms": self.stats.patch_forms - f0}
        out.update(self.guesser.apply(self) if self.guesser is not None else {"guess": None, "prefilled": 0})
        self._step_p0 = self.stats.prefill_tokens  # between steps: not the next step's spending
        return out

    def _prepare(self, items: list[Union[str, Chunk]]) -> dict:
        """``prefetch(next=items)``: the exact conditioned KV of ``items`` in this order, kept by context."""
        chunks = [self._next_chunk(x) for x in items]
        ids = [c.id for c in chunks]
        if len(set(ids)) != len(ids):
            raise WindowkitError(f"prefetch: duplicate chunk ids in next={ids}")
        self._ready = None  # a new guess replaces the last one
        p0 = self.stats.prefill_tokens
        if not self._keeps_conditioned or not ids:
            return {"prefilled": 0}
        live = {e.id: e for e in self._entries}
        cur = self.ids
        entries = [live.get(c.id) or _Entry(c, self._keys[c.id], self.backend.span(c)) for c in chunks]
        start, starts, have = self._prefix_span, [], []
        for j, e in enumerate(entries):  # the exact KV each already has in this context (None: to compute)
            starts.append(start)
            start += e.span
            ante = tuple(ids[:j])
            if e.id in live and not e.pending and e.kv is not None and not entry_is_stale(e.ante, cur, cur.index(e.id)) \
                    and tuple(e.ante) == ante:
                have.append((e.kv, e.kv_start))
            elif not ante and self.prefix is None:
                have.append((self._canonical(e), 0) if self.store.has_canonical(e.key) else None)
            else:
                have.append(self._conditioned(e, self._ctx(ante)))
        f = next((j for j, h in enumerate(have) if h is None), None)
        if f is None:
            return {"prefilled": 0}
        parts = [self._prefix_kv] if self._prefix_kv is not None else []
        if self._needs_past:  # (a cost model books the forward's tokens only: no past to assemble)
            for j in range(f):  # what is in front of the first missing one, placed where the next window holds it
                kv, at = have[j]
                parts.append(place(kv, starts[j] - at, self.backend.rope))
        res = self._run(chunks[f:], starts[f], concat(parts) if parts else None)
        off, made, ctxs = 0, [], []
        for j in range(f, len(ids)):
            e = entries[j]
            kv = res.kv.slice(off, off + e.n)
            off += e.n
            made.append(kv)
            ante = tuple(ids[:j])
            ctxs.append(self._ctx(ante))
            if ante or self.prefix is not None:
                self._keep_conditioned(e, kv, starts[j], ctxs[-1], ante)
            elif not self.store.has_canonical(e.key):  # nothing in front: its prefill at 0 is its canonical
                self.stats.encodes += 1
                self.store.put_canonical(e.key, kv, {"chunk_id": e.id, "tokens": str(e.n)})
        self._prepared = dict(self._unkept)  # (prefetch wrote back first: only these) read without a store trip
        # every one exact for its next place, in memory: made now, or a live entry already exact there
        if all(c.id in live for c in chunks) and all(
                j >= f or (tuple(live[ids[j]].ante) == tuple(ids[:j]) and not live[ids[j]].pending)
                for j in range(len(ids))):
            self._ready = (tuple(ids), self._version, [None] * f + list(zip(made, starts[f:], ctxs)))
        if f == 0 and self.prefix is not None and self._needs_past:  # the next step's first new chunk's whole past
            self._past_memo = ([self._prefix_kv] + made, concat([self._prefix_kv] + made))
        self._write_back()
        self._step_p0 = self.stats.prefill_tokens  # between steps: not the next step's spending
        return {"prefilled": self.stats.prefill_tokens - p0}

    def _next_chunk(self, x: Union[str, Chunk]) -> Chunk:
        """A ``prefetch(next=...)`` item as a Chunk: a seen id, or a Chunk (a new one's content key noted, so the
        chunks behind it are kept under the context it makes; it is admitted only by the next step's edits)."""
        if isinstance(x, str):
            return self.chunk(x)  # ChunkNotFoundError for an id this window never saw
        if not isinstance(x, Chunk):
            raise ChunkError(f"prefetch(next=...) expects chunk ids or windowkit.Chunk objects, got {type(x).__name__}")
        known = self._known.get(x.id)
        if known is not None:
            if known is not x and known.content_hash() != x.content_hash():
                raise ChunkError(f"prefetch: chunk id {x.id!r} is already known with other content; "
                                 "give new content a new id")
            return known
        self._keys[x.id] = chunk_key(x.content_hash(), self.backend.fingerprint())
        return x

    def is_disposable(self, chunk_id: str, query_ids: Union[Sequence[int], torch.Tensor]) -> bool:
        """Appendix E's test: drop the chunk's conditioning (use its relocated canonical) and check whether
        the next-token decision for ``query_ids`` is unchanged. True: its conditioning is not load-bearing
        for this query. Costs one canonical placement and two query forwards; the window is unchanged."""
        self._settle()
        idx = self._index(chunk_id)
        if self.mode == "exact":
            raise WindowkitError("is_disposable needs per-chunk KV: use mode 'patch' or 'blind'")
        q = Chunk.text(torch.as_tensor(query_ids), id="__query__")
        base = self.backend.forward([q], self.next_position, self._assemble()).logits
        parts = [self._prefix_kv] if self._prefix_kv is not None else []
        for j, (x, st) in enumerate(zip(self._entries, self.starts())):
            parts.append(place(self._canonical(x), st, self.backend.rope) if j == idx else self._kv_at(x, st))
        clean = self.backend.forward([q], self.next_position, concat(parts)).logits
        self.backend.forget(q)
        return int(base.argmax()) == int(clean.argmax())

    # ================================================================== internals
    def _index(self, chunk_id: str) -> int:
        for i, e in enumerate(self._entries):
            if e.id == chunk_id:
                return i
        raise ChunkNotFoundError(f"chunk {chunk_id!r} is not in the window (ids: {self.ids})")

    def _recompute(self, *args: Any, **kw: Any) -> Any:
        """``backend.recompute``, counting the vision-tower runs it causes (a deferred admission's first read)."""
        v0 = self.backend.stats.vision_calls
        try:
            return self.backend.recompute(*args, **kw)
        finally:
            self.stats.vision_calls += self.backend.stats.vision_calls - v0

    def _run(self, chunks: Sequence[Chunk], start: int, past: Optional[ChunkKV]):
        t0 = time.perf_counter()
        v0 = self.backend.stats.vision_calls
        res = self.backend.forward(chunks, start, past)
        dt = (time.perf_counter() - t0) * 1e3
        self.stats.vision_calls += self.backend.stats.vision_calls - v0
        n = sum(res.token_counts)
        self.stats.forwards += 1
        self.stats.prefill_tokens += n
        rate = dt / max(n, 1)  # ms per token, smoothed: used for estimates only
        self._ms_per_token = rate if self._ms_per_token is None else 0.8 * self._ms_per_token + 0.2 * rate
        self.cost_model.ms_per_token = self._ms_per_token
        return res

    def _canonical(self, e: _Entry) -> ChunkKV:
        if self.store.has_canonical(e.key):
            try:
                return self.store.get_canonical(e.key, copy=False)  # read-only use: edits make new tensors
            except WindowkitError:  # corrupt or vanished entry: recompute, never serve
                self.stats.fallbacks += 1
        res = self._run([e.chunk], 0, None)
        self.stats.encodes += 1
        self.store.put_canonical(e.key, res.kv, {"chunk_id": e.id, "tokens": str(e.n)})
        return res.kv

    def _ctx(self, ante: Sequence[str]) -> str:
        """Context hash over the antecedents' *content* keys: a context recurs whenever the same content
        does, whatever ids the caller gave the chunks."""
        ante = tuple(ante)
        memo = self._ctx_memo
        h = memo.get(ante)
        if h is None:  # sha256 over the keys is the cost of a survivor refresh: memoize per context
            if len(memo) > 4096:
                memo.clear()
            parent = memo.get(ante[:-1]) if ante else None
            if parent is not None:  # the chain one key further (context_hash is that chain): one sha256
                h = memo[ante] = context_step(parent, self._keys[ante[-1]])
            else:
                h = memo[ante] = context_hash(list(map(self._keys.__getitem__, ante)), prefix=self._prefix_key)
        return h

    def _get_patch(self, key: str, ctx: str) -> Optional[Patch]:
        if not self._use_patches:  # exact budget: only a full-rank patch is exact
            return None
        try:
            p = self.store.get_patch(key, ctx, copy=False)
        except WindowkitError:  # corrupt entry: dropped by the store, recomputed here, never served
            self.stats.fallbacks += 1
            return None
        if p is not None and p.meta.get("basis_stripped"):
            if self.basis is None or p.meta.get("basis") != self.basis.uid:
                return None  # coefficients on a basis this window does not hold: re-form
            try:  # shared views back in, coefficients rotated from their stored basis version
                p = self.basis.attach(p)
            except KVShapeError:  # rotation history pruned: stale coordinates are never served
                self.stats.fallbacks += 1
                return None
        return p

    def _insert(self, chunk: Chunk, at: Optional[int]) -> str:
        n = len(self._entries)
        idx = n if at is None else int(at)
        if idx < 0:
            idx += n + 1
        if not 0 <= idx <= n:
            raise WindowkitError(f"position {at} outside 0..{n}")
        if idx < n:
            self._settle()  # an insert in front of deferred work: run that work first
        key = chunk_key(chunk.content_hash(), self.backend.fingerprint())
        self._keys[chunk.id] = key
        self.store.pin(key)  # the live window's canonicals are never evicted from the store
        e = _Entry(chunk, key, self.backend.span(chunk))
        if self.mode != "exact":
            before = list(self._entries)[:idx]
            start = self._prefix_span + sum(map(_SPAN, before))
            ante = tuple(map(_ID, before))
            if self.mode == "blind":
                canon = self._canonical(e)
                e.kv, e.kv_start = self._placed(canon, start, None), start
            elif idx == n and self._defers_admission(e, ante):
                e.pending, e.kv_start = True, start  # its conditioned prefill runs at the next read (_settle)
                self._deferred_tail += 1
            else:
                self._settle()  # behind a pending admission: it runs first (this one needs no forward)
                self._condition(e, idx, start, ante)
        if idx == n:
            self._entries.append(e)
        elif idx == 0:
            self._entries.appendleft(e)
        else:
            self._entries.insert(idx, e)
        self._live.add(chunk.id)
        self._version += 1
        return chunk.id

    def _condition(self, e: _Entry, idx: int, start: int, ante: tuple[str, ...]) -> None:
        """Give ``e`` its KV conditioned on ``ante``: a stored patch if that context recurs, else one
        conditioned forward (kept as the KV) and a patch formed from it for next time."""
        ctx = self._condition_ctx(e, ante)
        lazy = ctx.__class__ is LazyCtx  # nothing can be stored under it: both look-ups would miss
        # behind this context before: its exact KV, before any patch (a rank-m patch approximates that KV; the
        # planner's ``_place_tokens`` counts it first too)
        got = self._conditioned(e, ctx) if (ante or self.prefix is not None) and not lazy else None
        patch = None if lazy or got is not None else self._get_patch(e.key, ctx)
        if got is not None:
            e.kv, e.kv_start = self._placed(got[0], start - got[1], None), start
        elif patch is not None and patch.num_tokens == e.n:
            canon = self._canonical(e)
            e.kv, e.kv_start = self._placed(canon, start, patch), start
            self.stats.patch_reuses += 1
        elif not ante and self.prefix is None:
            # nothing in front: the chunk's prefill at position 0 *is* its canonical; no patch needed
            if self.store.has_canonical(e.key):
                e.kv = self._canonical(e)
            else:
                e.kv = self._run([e.chunk], 0, None).kv
                self.stats.encodes += 1
                self.store.put_canonical(e.key, e.kv, {"chunk_id": e.id, "tokens": str(e.n)})
            e.kv_start = 0
        elif self.form == "lazy":
            # keep the conditioned prefill only: no canonical encode, no patch until something needs them
            res = self._run([e.chunk], start, self._kv_upto(idx))
            e.kv, e.kv_start = res.kv, start
            if self._exact_upto(idx):
                self._keep_conditioned(e, res.kv, start, ctx.value if lazy else ctx, ante)
        else:
            past = self._kv_upto(idx)
            res = self._run([e.chunk], start, past)
            if self._exact_upto(idx):
                self._form_fresh(e, res.kv, start, ctx.value if lazy else ctx, ante)
            else:  # a forward over stale survivors is not KV(B|ante): never store it as one (the canonical is exact)
                self._canonical(e)
            e.kv, e.kv_start = res.kv, start
        e.ctx, e.ante = ctx, ante
        if ante:
            self.graph.add_patch(e.id, ctx, ante, "fresh", self._patch_bytes_per_token() * e.n, e.n)
        else:
            self.graph.add_chunk(e.id, e.n)
            self.graph.set_current(e.id, None)

    def _condition_ctx(self, e: _Entry, ante: tuple[str, ...]) -> Union[str, LazyCtx]:
        """The context hash of ``ante`` for ``_condition``; a LazyCtx (hashed on its first read) where the store
        can hold nothing for ``e`` under it: no patch of ``e`` under any context, and a context that is not a
        known one (``_CONTEXT_HINTS``, prefix-closed: the walk stops at the first unknown prefix). A tail
        admission's context is the whole window, a chain of one sha256 per chunk; skipping its look-ups changes
        nothing they would have found."""
        if len(ante) < 2:
            return self._ctx(ante)
        h = self._ctx_memo.get(ante)
        if h is not None:
            return h
        hint = self._context_hint()
        if hint is None or (self._use_patches and self.store._may_hold_patch(e.key)):
            return self._ctx(ante)
        if self._keeps_conditioned:  # _conditioned looks up only a known context
            h = _KnownContexts(context_root(self._prefix_key), self._keys, hint).get(ante)
            if h is not None:  # a known context: the walk hashed it
                if len(self._ctx_memo) > 4096:
                    self._ctx_memo.clear()
                self._ctx_memo[ante] = h
                return h
        return LazyCtx(context_hash, list(map(self._keys.__getitem__, ante)), self._prefix_key)

    def _append_known(self, new: Sequence[Chunk], pending: bool) -> list[tuple[str, str]]:
        """Append ``new`` at the tail as the prefix cache's plan holds them (known, pinned; a recall's cascade
        computed), with no KV yet; ``pending``: as deferred tail admissions, whose prefill the next read runs
        together with the query (``_settle``: ONE forward, as a prefix cache prefills suffix and question)."""
        edits: list[tuple[str, str]] = []
        fp = self.backend.fingerprint()
        start = self.next_position
        recalled = [c.id for c in new if c.id in self._known]
        for c in new:
            edits.append(("recall" if c.id in self._known else "admit", c.id))
            self._known[c.id] = c
            self._evicted.pop(c.id, None)
            key = self._keys[c.id] = chunk_key(c.content_hash(), fp)
            self.store.pin(key)
            e = _Entry(c, key, self.backend.span(c))
            if pending:
                e.pending, e.kv_start = True, start
                start += e.span
                self._deferred_tail += 1
            self._entries.append(e)
            self._live.add(c.id)
        ids = self.ids
        for cid in recalled:
            self.last_cascade = self.graph.on_recall(cid, ids)
        return edits

    def _capped(self) -> bool:
        return self.cap and self.mode == "patch" and self.form == "lazy" and not self.removal_patches

    def _ready_choice(self, wanted: Sequence[Chunk]) -> Optional[StepChoice]:
        """``choose_step``'s answer, known without it, for the step ``prefetch(next=ids)`` prepared: the window is
        unchanged since, and the wanted window opens with ``ids`` (live, in their current order, each one's exact
        KV for that place in memory). The rest of the window goes, but for live chunks the wanted window holds
        after ``ids`` (a question kept behind each new frame): those are recalled there, as any chunk after
        ``ids`` is. The edits then run only the chunks after ``ids`` (at most their tokens), which the prefix
        cache's plan runs too, plus the ``ids`` it does not keep: the edits win whenever it keeps fewer than all
        of them. None: ask the planner."""
        ready = self._ready
        if ready is None or ready[1] != self._version:
            return None
        ids, want_ids = ready[0], [c.id for c in wanted]
        r = len(ids)
        if not r or tuple(want_ids[:r]) != ids:
            return None
        cur, ready_ids = self.ids, set(ids)
        front = [i for i in cur if i in ready_ids]  # the ready ids still in the window, in window order
        if front != list(ids):  # all live, in order
            return None
        keep = common_prefix(cur, want_ids)
        tokens = {e.id: e.n for e in self._entries}
        ready_unkept = sum(tokens[i] for i in ids[keep:])
        if not ready_unkept:
            return None  # the prefix cache keeps them all: a tie or close, the planner decides
        tail = sum(len(c) for c in wanted[r:])
        return StepChoice("edit", keep, ready_unkept + tail, tail)

    def _ready_route(self, wanted: Sequence[Chunk]) -> list[tuple[str, str]]:
        """``assign`` of the step ``_ready_choice`` recognised: drop the rest of the window (a live chunk wanted
        after ``ids`` too: it comes back by ``recall`` behind them, as a look-back does), give each prepared chunk
        the exact KV made for its place (the same ``evict`` would find after a search: ``_refresh_known``), then
        insert what follows them as ``assign`` does. Returns the edits as ``assign`` does."""
        ids, _, made = self._ready
        keep = set(ids)
        edits: list[tuple[str, str]] = []
        for e in [x for x in self._entries if x.id not in keep]:
            self._entries.remove(e)
            self._gone(e)
            edits.append(("evict", e.id))
        self._version += 1
        for j, (e, got) in enumerate(zip(self._entries, made)):
            if got is not None and entry_is_stale(e.ante, ids, j):
                e.kv, e.kv_start, e.ctx, e.ante = got[0], got[1], got[2], ids[:j]
                self._record_exact(e, got[2], ids[:j])
        for idx in range(len(ids), len(wanted)):
            c = wanted[idx]
            edits.append(("recall", self.recall(c.id, at=idx)) if c.id in self._known
                         else ("admit", self.admit(c, at=idx)))
        return edits

    def _view(self, wanted: Sequence[Chunk]) -> WindowView:
        """The window as the tensor-free rules read it (windowkit.window.plan): ids, sizes, what the store holds."""
        known = self._keys
        new: dict[str, str] = {}  # keys of chunks not seen before (no copy of every key ever seen: O(step), not O(history))
        tokens = {e.id: e.n for e in self._entries}
        fp = self.backend.fingerprint()
        for c in wanted:
            cid = c.id
            if cid not in tokens:  # not live (a live chunk is known, its size read)
                tokens[cid] = len(c)
                if cid not in new and (cid not in known or cid not in self._known):  # (a key noted by prefetch
                    new[cid] = chunk_key(c.content_hash(), fp)  # for an id the step now brings with other content)
        keys = ChainMap(new, known) if new else known
        pk, store, use, lazy = self._prefix_key, self.store, self._use_patches, self._keeps_conditioned
        # None for a context nothing is stored under, nor under any that extends it
        ctx = _KnownContexts(context_root(pk), keys, self._context_hint()).get

        def has_patch(cid: str, ante: tuple) -> bool:
            h = ctx(ante) if use else None
            return h is not None and store.has_patch(keys[cid], h)

        def has_exact(cid: str, ante: tuple) -> bool:
            h = ctx(ante) if lazy else None
            return h is not None and self._has_conditioned(conditioned_key(keys[cid], h))

        return WindowView(
            ids=self.ids, ante=[e.ante for e in self._entries], tokens=tokens,
            has_canonical=lambda cid: store.has_canonical(keys[cid]),
            has_patch=has_patch,
            has_orbit=lambda cid, ante: use and store.has_patch(keys[cid], orbit_context_hash([keys[i] for i in ante],
                                                                                             prefix=pk)),
            prefix_tokens=len(self.prefix) if self.prefix is not None else 0,
            has_exact=has_exact, may_hold=lambda ante: ctx(ante) is not None)

    def _prefill_route(self, keep: int, wanted: Sequence[Chunk]) -> list[tuple[str, str]]:
        """The prefix cache's plan for a step: keep the first ``keep`` entries as they are, drop the rest, and
        prefill ``wanted[keep:]`` in one forward over the kept KV (exactly conditioned on it; no repair, no
        patch). Returns the edits as ``assign`` does."""
        edits: list[tuple[str, str]] = []
        while len(self._entries) > keep:  # from the tail: nothing in front of a dropped entry moves
            e = self._entries.pop()
            self._gone(e)
            edits.append(("evict", e.id))
        edits.reverse()
        self._version += 1
        new = list(wanted[keep:])
        if not new:  # only drops (the window shrank to its unchanged prefix)
            return edits
        deferred = self._fuses and bool(keep or self.prefix is not None)  # (the head with no prefix: not deferred)
        res = None if deferred else self._run(new, self.next_position, self._kv_upto(keep))
        self.stats.prefix_plans += 1
        edits += self._append_known(new, pending=deferred)
        if deferred:
            self._version += 1
            return edits
        ids, starts, off = self.ids, self.starts(), 0
        front_exact = self._exact_upto(keep)
        for i in range(keep, len(self._entries)):
            e, n = self._entries[i], self._entries[i].n
            kv = res.kv.slice(off, off + n) if res.kv is not None else None
            off += n
            if i == 0 and self.prefix is None:
                if kv is not None and not self.store.has_canonical(e.key):
                    # nothing in front: its prefill at 0 is its canonical (causal: the rest is behind it)
                    self.stats.encodes += 1
                    self.store.put_canonical(e.key, kv, {"chunk_id": e.id, "tokens": str(n)})
                self._set_exact(e, kv, starts[i], ())
                continue
            self._set_exact(e, kv, starts[i], tuple(ids[:i]))
            if front_exact and kv is not None:
                self._keep_conditioned(e, kv, starts[i], e.ctx, e.ante)
        self._version += 1
        return edits

    @property
    def _keeps_conditioned(self) -> bool:
        """Lazy forming in patch mode keeps each chunk's exact conditioned KV by context (``conditioned_key``)."""
        return self.form == "lazy" and self.mode == "patch"

    def _conditioned(self, e: _Entry, ctx: str) -> Optional[tuple[ChunkKV, int]]:
        """The exact conditioned KV of ``e`` behind context ``ctx`` if the store holds it (lazy forming), and the
        position it is stored at (``_keep_conditioned``; 0 for entries that name none)."""
        if not self._keeps_conditioned or not self._maybe_known(ctx):
            return None
        ck = conditioned_key(e.key, ctx)
        waiting = self._in_memory(ck)
        if waiting is not None:  # made by a recent step, not written back yet: the same exact KV
            kv, meta = waiting
            return (kv, int(meta["start"])) if kv.num_tokens == e.n else None
        if not self.store.has_canonical(ck):
            return None
        try:
            kv = self.store.get_canonical(ck, copy=False)  # read-only use: placing makes new tensors
            at = int(self.store.meta(ck).get("start", 0))
        except (WindowkitError, ValueError):  # corrupt or vanished: recompute, never serve
            self.stats.fallbacks += 1
            return None
        return (kv, at) if kv.num_tokens == e.n else None

    def _context_hint(self) -> Optional[set[str]]:
        """The known-context set of this window's store (``_CONTEXT_HINTS``), or None where it cannot be complete."""
        st = self.store
        if st.path is not None or getattr(st, "shared", None) is not None:
            return None
        hint = _CONTEXT_HINTS.get(st)
        if hint is None:
            hint = _CONTEXT_HINTS[st] = set()
        return hint

    def _note_context(self, ctx: str, ante: Sequence[str]) -> None:
        """Something is stored under ``ctx``, the context of ``ante``: record it and all its prefixes as known."""
        hint = self._context_hint()
        if hint is None or ctx in hint:  # prefix-closed: a known context's prefixes are known too
            return
        if ante and self._ctx_memo.get(tuple(ante[:-1])) in hint:  # its parent is known, and so all before it
            hint.add(ctx)
            return
        h = context_root(self._prefix_key)
        hint.add(h)
        for cid in ante:
            h = context_step(h, self._keys[cid])
            hint.add(h)

    def _maybe_known(self, ctx: str) -> bool:
        """False only when nothing can be stored under the exact context ``ctx`` (a cheap set look-up)."""
        hint = self._context_hint()
        return hint is None or ctx in hint

    def _keep_conditioned(self, e: _Entry, kv: ChunkKV, start: int, ctx: str, ante: Sequence[str]) -> None:
        """Store ``e``'s exact conditioned KV for ``ctx``: the same chunk behind the same context later (a look-back,
        an older branch) is a relocation, as a radix prefix cache would serve it. Stored where it stands (meta
        "start"), not rotated to 0: most of these copies are never read, so the step that makes one pays no
        rotation, and a reader rotates once, by the difference (none when the chunk returns to its place)."""
        if not self._keeps_conditioned:
            return
        # written back between steps (``flush``) or by the next edit: the step that makes a copy never reads it
        self._unkept[conditioned_key(e.key, ctx)] = (kv, {"chunk_id": e.id, "context": ctx, "start": str(int(start))})
        self._note_context(ctx, ante)

    def _write_back(self) -> int:
        """Write the waiting conditioned copies to the store; returns how many."""
        if not self._unkept:
            return 0
        kept, self._unkept = self._unkept, {}
        for key, (kv, meta) in kept.items():
            self.store.put_canonical(key, kv, meta)
        return len(kept)

    def _in_memory(self, key: str) -> Optional[tuple[ChunkKV, dict]]:
        """A conditioned copy still held by the Window (waiting for its write, or made by ``prefetch(next=...)``)."""
        return self._unkept.get(key) or self._prepared.get(key)

    def _has_conditioned(self, key: str) -> bool:
        return key in self._unkept or self.store.has_canonical(key)

    def _exact_upto(self, idx: int) -> bool:
        """True when every entry in front of index ``idx`` holds KV exactly conditioned on its current antecedents
        (none kept as-is or partly repaired after an edit), so a forward over them is the exact conditioned KV."""
        ids = self.ids
        return not any(entry_is_stale(x.ante, ids, j) for j, x in enumerate(list(self._entries)[:idx]))

    def _form_fresh(self, e: _Entry, cond: ChunkKV, start: int, ctx: str, ante: Sequence[str]) -> None:
        """Form and store the patch of ``e`` for context ``ctx`` from its conditioned KV ``cond`` at ``start``."""
        canon = self._canonical(e)
        meta = {"kind": "fresh", "context": ctx}
        if self.basis is None:
            p = form_patch(cond, canon, start, self.backend.rope, self.rank, layers=self.patch_layers,
                           method=self.svd, meta=meta)
        else:
            d = deficit(cond, canon, start, self.backend.rope)
            self.basis.observe(d)  # coordinated update: live basis-backed patches are rotated
            p = self.basis.strip(self.basis.encode(d, self.rank, meta=meta, register=False))
        self.stats.patch_forms += 1
        self.store.put_patch(e.key, ctx, p)  # basis-backed: coefficients only (S·m per layer-slot)
        self._note_context(ctx, ante)

    def _condition_orbit(self, e: _Entry, idx: int, start: int, ante: tuple[str, ...]) -> None:
        if not ante:  # only the prefix (or nothing) in front: one ordering, the ordinary fresh patch
            self._condition(e, idx, start, ante)
            return
        exact_ctx = self._ctx(ante)
        canon = self._canonical(e)
        patch = self._get_patch(e.key, exact_ctx)
        if patch is None and ante:
            octx = orbit_context_hash([self._keys[i] for i in ante], prefix=self._prefix_key)
            patch = self._get_patch(e.key, octx)
            if patch is None:
                conds = []
                for perm in orderings(ante, limit=self.orbit_samples):
                    chunks = ([self.prefix] if self.prefix is not None else []) + [self.chunk(i) for i in perm]
                    res = self._run(chunks + [e.chunk], 0, None)
                    conds.append(res.kv.slice(res.kv.num_tokens - e.n, res.kv.num_tokens))
                patch = form_orbit_patch(conds, canon, start, self.backend.rope, self.rank, layers=self.patch_layers,
                                         method=self.svd, meta={"context": octx})
                self.stats.patch_forms += 1
                self.store.put_patch(e.key, octx, patch)
            else:
                self.stats.patch_reuses += 1
        elif patch is not None:
            self.stats.patch_reuses += 1
        e.kv, e.kv_start = self._placed(canon, start, patch), start
        e.ctx, e.ante = exact_ctx, ante
        if ante:
            self.graph.add_patch(e.id, exact_ctx, ante, "orbit", 0 if patch is None else patch.nbytes, e.n)

    def _refresh_known(self, first: int) -> None:
        """Survivors from ``first`` on have new antecedents. Where the exact conditioning for the new context
        is known for free (no antecedent and no prefix: the canonical itself; or a stored patch or conditioned
        KV for exactly this context) use it; otherwise keep the current KV as-is (it only relocates)."""
        entries = list(self._entries)
        hint = self._context_hint()
        starts: Optional[list[int]] = None
        ids = [x.id for x in entries]
        h = context_root(self._prefix_key)  # chained context hashes: O(1) per survivor
        for x in entries[:first]:
            h = context_step(h, x.key)
        for i in range(first, len(entries)):
            e = entries[i]
            if i > first:  # one step per survivor looked at (none past the last one: the walk usually stops early)
                h = context_step(h, entries[i - 1].key)
            ctx = h
            if e.pending or not entry_is_stale(e.ante, ids, i):
                continue
            head = i == 0 and self.prefix is None
            if not head and hint is not None and ctx not in hint:
                break  # nothing stored for this context, nor for any survivor behind it (theirs extend it)
            if starts is None:
                starts = self.starts()
            ante = tuple(ids[:i])
            if head:
                if self.form == "lazy" and not self.store.has_canonical(e.key):
                    continue  # lazy: no encode just for this; keep-as-is
                e.kv, e.kv_start = self._placed(self._canonical(e), starts[i], None), starts[i]
            else:
                near = self._in_memory(conditioned_key(e.key, ctx))
                patch = None if near is not None else self._get_patch(e.key, ctx)
                if near is not None and near[0].num_tokens == e.n:  # exact, in memory: before any patch
                    # (where ``prefetch(next=...)`` made it, placing returns the same tensors: no rotation)
                    e.kv, e.kv_start = self._placed(near[0], starts[i] - int(near[1]["start"]), None), starts[i]
                elif patch is not None and patch.num_tokens == e.n:
                    e.kv, e.kv_start = self._placed(self._canonical(e), starts[i], patch), starts[i]
                    self.stats.patch_reuses += 1
                else:
                    got = self._conditioned(e, ctx)
                    if got is None:
                        continue  # keep-as-is: relocation only
                    e.kv, e.kv_start = self._placed(got[0], starts[i] - got[1], None), starts[i]
            e.ctx, e.ante = ctx, ante
            self._record_exact(e, ctx, ante)

    def _recondition_survivors(self, first: int) -> None:
        """Removal patches for the survivors behind an eviction: one forward of them over the new context."""
        entries = list(self._entries)
        starts = self.starts()
        past = self._kv_upto(first)
        res = self._run([e.chunk for e in entries[first:]], starts[first], past)
        off = 0
        for e, s in zip(entries[first:], starts[first:]):
            n = e.n
            target = res.kv.slice(off, off + n)
            off += n
            kept = self._kv_at(e, s).relocate(-s, self.backend.rope)  # canonical frame of the kept KV
            p = form_removal_patch(target, kept, s, self.backend.rope, self.removal_rank, layers=self.patch_layers,
                                   method=self.svd)
            self.stats.patch_forms += 1
            e.kv, e.kv_start = self._placed(kept, s, p), s
            e.ante = tuple(x.id for x in entries[:entries.index(e)])
            e.ctx = self._ctx(e.ante)
            if e.ante:
                self.graph.add_patch(e.id, e.ctx, e.ante, "removal", p.nbytes, n)

    def _flush_repair(self, upto: int) -> None:
        """Run the pending (batched) repair on the survivors in front of index ``upto`` now; those from ``upto``
        on stay pending. With the "all" rule a survivor costs its size in any pass, so this splits no cost."""
        first, self._repair_pending, self._repair_batching = self._repair_pending, upto, False
        try:
            self._repair(first, upto)
        finally:
            self._repair_batching = True

    def _repair(self, first: int, upto: Optional[int] = None) -> None:
        """Survivor repair (``self.repair``) for the stale survivors from index ``first`` on (to ``upto``, exclusive).

        Stale: a survivor whose KV was formed on other antecedents than it has now (``_refresh_known`` has
        already given the free exact ones theirs). The rule picks the first tokens of each; ONE selective
        recompute (``backend.recompute``: chosen tokens at their own positions, attending to the stale KV of
        the rest and causally to each other) writes their fresh KV back. A survivor recomputed wholly is
        exactly conditioned on its new context from then on; a partly repaired one stays listed by ``plan()``.
        A backend that cannot recompute selectively (MLA, M-RoPE) re-conditions every chunk from the first
        stale one (to ``upto``) with one forward instead (``stats.fallbacks``).
        """
        if self.mode != "patch" or self.removal_patches or self.repair.is_none:
            return
        if self._repair_batching:  # assign: one repair after its last eviction
            self._repair_pending = first if self._repair_pending is None else min(self._repair_pending, first)
            return
        entries = list(self._entries)
        n = len(entries)
        if first >= n:
            return
        ids = [x.id for x in entries]
        end = n if upto is None else min(n, upto)
        stale = self._stale(entries, ids, first, end)
        if not stale:
            return
        pairs = self._repair_pairs(entries, stale)
        if not pairs:
            return
        starts = self.starts()
        if not self._recomputes:
            f = stale[0]
            res = self._run([x.chunk for x in entries[f:end]], starts[f], self._kv_upto(f))
            self.stats.fallbacks += 1
            self.stats.repaired_tokens += sum(res.token_counts)
            off = 0
            for i in range(f, end):
                e, m = entries[i], entries[i].n
                self._set_exact(e, res.kv.slice(off, off + m), starts[i], tuple(ids[:i]))
                off += m
            return
        last = pairs[-1][0]
        full = {i for i, k in pairs if k == entries[i].n}
        if self._needs_past:
            parts = [self._prefix_kv] if self._prefix_kv is not None else []
            for j in range(last + 1):  # the window up to the last repaired chunk (a wholly recomputed one is masked)
                parts.append(entries[j].kv if j in full else self._kv_at(entries[j], starts[j]))
            past = concat(parts) if parts else None
        else:  # a backend that never reads the past (cost model): only the relocations are counted
            moved = [j for j in range(last + 1) if j not in full]
            self._relocate_all([entries[j] for j in moved], [starts[j] for j in moved])
            past = None
        at, ks = [i for i, _ in pairs], [k for _, k in pairs]
        total = sum(ks)
        slots = self._slots()
        res = self._recompute(past, [entries[i].chunk for i in at], [starts[i] for i in at], list(map(range, ks)),
                                     slots=[slots[i] for i in at])
        self.stats.forwards += 1
        self.stats.prefill_tokens += total
        self.stats.repaired_tokens += total
        self._write_repair(entries, ids, starts, pairs, full, res)

    def _stale(self, entries: list[_Entry], ids: list[str], first: int, upto: int) -> list[int]:
        """Indices in ``first..upto-1`` whose KV was formed on other antecedents than they have now."""
        return stale_indices(ids, [None if x.pending else x.ante for x in entries], first, upto)

    def _stale_now(self, first: int, upto: int) -> list[int]:
        """``_stale`` over the live entries as they are now."""
        entries = list(self._entries)
        return self._stale(entries, [x.id for x in entries], first, upto)

    def _repair_pairs(self, entries: list[_Entry], stale: list[int]) -> list[tuple[int, int]]:
        """(index, tokens to recompute from its start) per stale survivor, by the repair rule."""
        counts = self.repair.counts([entries[i].n for i in stale])
        return [(i, k) for i, k in zip(stale, counts) if k > 0]

    def _write_repair(self, entries: list[_Entry], ids: list[str], starts: list[int], pairs: list[tuple[int, int]],
                      full: set[int], fresh: Sequence[ChunkKV]) -> None:
        """Write a repair's fresh KV back: a wholly recomputed survivor is exact from now on, a partly
        repaired one gets its first k tokens fresh and keeps the rest (e.kv already sits at starts[i])."""
        if not self._needs_past:  # a cost model's KV is a stand-in: only the wholly recomputed survivors change
            done = pairs if len(fresh) >= len(pairs) else pairs[:len(fresh)]
            for i in (sorted(full) if done is pairs else [i for i, _ in done if i in full]):
                e = entries[i]
                self._set_exact(e, e.kv, starts[i], tuple(ids[:i]))
            return
        for (i, k), new in zip(pairs, fresh):
            e = entries[i]
            if i in full:
                self._set_exact(e, new if self._needs_past else e.kv, starts[i], tuple(ids[:i]))
            elif self._needs_past:
                e.kv = ChunkKV([(torch.cat([a, x[:, k:]], 1), torch.cat([b, y[:, k:]], 1))
                                for (a, b), (x, y) in zip(new.layers, e.kv.layers)], e.kv.layout, e.kv.positions)
                self._mark_fresh(e, tuple(ids[:i]), torch.arange(k))

    def _mark_fresh(self, e: _Entry, ante: tuple[str, ...], offsets: torch.Tensor) -> None:
        """Note that ``e``'s tokens at ``offsets`` now hold KV recomputed on ``ante`` (focus skips them)."""
        mask = e.fresh[1] if e.fresh is not None and e.fresh[0] == ante else torch.zeros(len(e.chunk), dtype=torch.bool)
        mask[offsets] = True
        e.fresh = (ante, mask)

    # ------------------------------------------------------------------ deferred work, run as one forward
    @property
    def _fuses(self) -> bool:
        """Deferred work applies: lazy patch mode on a backend that runs the model (a cost-model backend books the
        same tokens eagerly: it charges per token, not per forward)."""
        return (self._defer_work and self.mode == "patch" and self.form == "lazy" and not self.removal_patches
                and self.cascade == "plan" and self._needs_past)

    @property
    def _recomputes(self) -> bool:
        """Selective recompute (text LLM families); other backends repair by re-conditioning from the first stale."""
        return bool(self.backend.supports_recompute)

    def _repair_later(self, first: int) -> None:
        """The survivor repair from index ``first`` on: deferred to the next read where that applies, else now."""
        if self._fuses and not self._repair_batching and not self.repair.is_none:
            self._deferred_repair = first if self._deferred_repair is None else min(self._deferred_repair, first)
        else:
            self._repair(first)

    def _defers_admission(self, e: _Entry, ante: tuple[str, ...]) -> bool:
        """A tail admission waits for the next read when it would need a conditioned forward now (no stored
        patch or conditioned KV for its context, something in front of it) and nothing else is batched."""
        if not self._fuses:
            return False
        pend = self._repair_pending
        if pend is not None and pend < len(self._entries):
            entries = list(self._entries)  # a batched repair in front: defer only when it has nothing to do (a
            if self._stale(entries, [x.id for x in entries], pend, len(entries)):  # look-back's exact recalls)
                return False
        if not e.n or (not ante and self.prefix is None):
            return False  # the head: not deferred
        ctx = self._ctx(ante)
        if self.store.has_patch(e.key, ctx) and self._use_patches:
            return False
        return not self._has_conditioned(conditioned_key(e.key, ctx))

    def _settle(self, query: Optional[Chunk] = None, probe: bool = False, query_kv: bool = True) -> Optional[tuple]:
        """Run the deferred work now as ONE ``backend.recompute``: the pending repair's chosen survivor tokens (at
        their positions, over the stale KV of the rest), every pending tail admission wholly (a plain continuation
        of the window) and ``query`` behind them. The same tokens, attending to the same KV, as the repair forward,
        then each admission's prefill, then the query's forward would: one forward instead of three.

        Returns ``(logits, query_kv)`` when ``query`` rode along, else None (also when nothing was deferred); with
        ``probe`` (a query, a backend with selective recompute) ``(logits, query_kv, weights)``: where the query's
        last token attends in that same forward (``backend.recompute(probe=True)``), the focus's probe for free.
        ``query_kv=False``: a caller that reads only the logits; query_kv may then be None (not sliced out).
        """
        first, tail = self._deferred_repair, self._deferred_tail
        if first is None and not tail:
            return None
        self._deferred_repair, self._deferred_tail = None, 0
        entries = list(self._entries)
        n = len(entries)
        t = n - tail  # entries[t:] are the pending admissions
        ids = [x.id for x in entries]
        starts = self.starts()
        stale = [] if first is None else self._stale(entries, ids, first, t)
        if not self._recomputes:
            return self._settle_by_forward(entries, ids, starts, stale, t, query, query_kv)
        pairs = self._repair_pairs(entries, stale)
        if not pairs and not tail:
            return None
        if not pairs and not (probe and query is not None and self.backend.reads_attention):
            # only admissions (+ the query) behind exact KV: a plain prefill, the prefix cache's own forward (no
            # per-token masks or slot maps to build)
            return self._settle_by_forward(entries, ids, starts, [], t, query, query_kv)
        full = {i for i, k in pairs if k == entries[i].n}
        chunks = [entries[i].chunk for i, _ in pairs] + [x.chunk for x in entries[t:]]
        at = [starts[i] for i, _ in pairs] + starts[t:]
        slots = self._slots()
        where = [slots[i] for i, _ in pairs] + slots[t:]  # the same in KV slots (they differ after M-RoPE images)
        offsets = [range(k) for _, k in pairs] + [range(x.n) for x in entries[t:]]
        if query is not None:
            chunks, at, offsets = chunks + [query], at + [self.next_position], offsets + [range(len(query))]
            where = where + [self.num_tokens]
        parts = [self._prefix_kv] if self._prefix_kv is not None else []
        for j in range(t):  # the window in front of the admissions (a wholly recomputed survivor is masked)
            parts.append(entries[j].kv if j in full else self._kv_at(entries[j], starts[j]))
        t0 = time.perf_counter()
        probe = probe and query is not None and self.backend.reads_attention
        out = self._recompute(concat(parts) if parts else None, chunks, at, offsets, slots=where,
                                     return_logits=query is not None, probe=probe)
        fresh, logits = (out[0], out[1]) if query is not None else (out, None)
        repaired, admitted = sum(k for _, k in pairs), sum(x.n for x in entries[t:])
        self.stats.forwards += 1
        self.stats.prefill_tokens += repaired + admitted
        self.stats.repaired_tokens += repaired
        rate = (time.perf_counter() - t0) * 1e3 / max(repaired + admitted + (len(query) if query is not None else 0), 1)
        self._ms_per_token = rate if self._ms_per_token is None else 0.8 * self._ms_per_token + 0.2 * rate
        self.cost_model.ms_per_token = self._ms_per_token
        self._write_repair(entries, ids, starts, pairs, full, fresh[:len(pairs)])
        for i, kv in zip(range(t, n), fresh[len(pairs):]):
            e = entries[i]
            ante = tuple(ids[:i])
            ctx = self._ctx(ante)
            e.pending, e.kv, e.kv_start = False, kv, starts[i]
            if self._exact_upto(i):
                self._keep_conditioned(e, kv, starts[i], ctx, ante)
            e.ctx, e.ante = ctx, ante
            if ante:
                self.graph.add_patch(e.id, ctx, ante, "fresh", self._patch_bytes_per_token() * e.n, e.n)
            else:
                self.graph.add_chunk(e.id, e.n)
                self.graph.set_current(e.id, None)
        if probe:
            return logits, fresh[-1], out[2]
        return (logits, fresh[-1]) if query is not None else None

    def _settle_by_forward(self, entries: list[_Entry], ids: list[str], starts: list[int], stale: list[int], t: int,
                           query: Optional[Chunk], query_kv: bool = True) -> Optional[tuple[torch.Tensor, ChunkKV]]:
        """``_settle`` on a backend without selective recompute (MLA, M-RoPE): its repair re-conditions every chunk
        from the first stale one (``_repair``'s fallback), so the repair, the pending admissions and the query are
        one plain forward of entries[f:] (+ query) over the exact KV in front of f: the prefix cache's forward."""
        n = len(entries)
        f = stale[0] if stale else t
        if f == n and query is None:
            return None
        chunks = [x.chunk for x in entries[f:]] + ([query] if query is not None else [])
        res = self._run(chunks, starts[f] if f < n else self.next_position, self._kv_upto(f)) if f < n else None
        if res is None:  # only a query and nothing deferred in front of it: the caller's own forward
            return None
        self.stats.prefill_tokens -= len(query) if query is not None else 0  # the query is not window prefill
        if stale:
            self.stats.fallbacks += 1
            self.stats.repaired_tokens += sum(x.n for x in entries[f:t])
        off = 0
        for i in range(f, n):
            e, m = entries[i], entries[i].n
            kv = res.kv.slice(off, off + m)
            off += m
            e.pending = False
            self._set_exact(e, kv, starts[i], tuple(ids[:i]))
            if i >= t and self._exact_upto(i):
                self._keep_conditioned(e, kv, starts[i], e.ctx, e.ante)
        if query is None:
            return None
        return res.logits, (res.kv.slice(off, res.kv.num_tokens) if query_kv else None)

    def _set_exact(self, e: _Entry, kv: Optional[ChunkKV], start: int, ante: tuple[str, ...]) -> None:
        """``e`` now holds KV exactly conditioned on ``ante`` at ``start``."""
        e.kv, e.kv_start = kv, start
        e.ante, e.ctx = ante, self._ctx(ante)
        self._record_exact(e, e.ctx, ante)

    def _record_exact(self, e: _Entry, ctx: str, ante: tuple[str, ...]) -> None:
        """Tell the graph that ``e`` wears its exact conditioning for ``ctx`` (no stored patch: 0 bytes), at its
        next read or ``flush``: a step that only slides reads no graph, so the graph's edit leaves its critical
        path (in the order of the calls; at most 4,096 wait)."""
        self._graph_later.append((e.id, ctx, tuple(ante), e.n))
        if len(self._graph_later) > 4096:
            self._record_later()

    def _kv_upto(self, idx: int) -> Optional[ChunkKV]:
        if not self._needs_past:
            return None
        parts = [self._prefix_kv] if self._prefix_kv is not None else []
        for e, s in zip(list(self._entries)[:idx], self.starts()):
            parts.append(self._kv_at(e, s))
        if not parts:
            return None
        memo = self._past_memo  # the same parts as the last assembly (a prefetched slide): no second concat
        if memo is not None and len(memo[0]) == len(parts) and all(map(operator.is_, memo[0], parts)):
            return memo[1]
        return concat(parts)

    def _kv_at(self, e: _Entry, start: int) -> ChunkKV:
        if e.pending:  # a read of a deferred admission runs the deferred work first
            self._settle()
        if e.kv is None:
            raise KVShapeError(f"chunk {e.id!r} has no KV in mode {self.mode!r}")
        if e.kv_start != start:
            t0 = time.perf_counter()
            if self._needs_past:
                e.kv = e.kv.relocate(start - e.kv_start, self.backend.rope)
            e.kv_start = start
            self.stats.relocations += 1
            self.stats.bytes_moved += self._rope_bytes_per_token() * e.n * 2
            self._credit(e.n, t0)
        return e.kv

    def _relocate_all(self, entries: Sequence[_Entry], starts: Sequence[int]) -> None:
        """``_kv_at`` for each entry on a backend that never reads the past: the same counts, no tensor work
        (one loop instead of a call per chunk: this is the simulator's hot path)."""
        if any(map(_PENDING, entries)):
            self._settle()
        moved = count = 0
        t0 = time.perf_counter()
        for e, s in zip(entries, starts):
            if e.kv_start != s or e.kv is None:
                if e.kv is None:
                    raise KVShapeError(f"chunk {e.id!r} has no KV in mode {self.mode!r}")
                e.kv_start = s
                moved += e.n
                count += 1
        if count:
            self.stats.relocations += count
            self.stats.bytes_moved += self._rope_bytes_per_token() * 2 * moved
        if moved:
            self._credit(moved, t0)

    def _placed(self, canon: ChunkKV, delta: int, patch: Optional[Patch]) -> ChunkKV:
        """``canon`` (KV stored at some position) moved by ``delta`` (a canonical's: its start), ``patch`` applied."""
        t0 = time.perf_counter()
        kv = place(canon, delta, self.backend.rope, patch)
        if patch is not None:
            self.stats.patch_applies += 1
        if delta != 0:
            self.stats.relocations += 1
        if patch is None and is_zero_delta(delta):
            self.stats.reused_as_is += kv.num_tokens
        else:
            self.stats.bytes_moved += kv.nbytes
        self._credit(kv.num_tokens, t0)
        return kv

    def _credit(self, tokens: int, t0: float) -> None:
        self.stats.reused_tokens += tokens
        if self._ms_per_token is not None:
            self.stats.est_ms_saved += tokens * self._ms_per_token - (time.perf_counter() - t0) * 1e3

    def _exact_kv(self) -> Optional[ChunkKV]:
        if self._exact_cache is not None and self._exact_cache[0] == self._version:
            return self._exact_cache[1]
        chunks = ([self.prefix] if self.prefix is not None else []) + [e.chunk for e in self._entries]
        if not chunks:
            return None
        kv = self._run(chunks, 0, None).kv
        self._exact_cache = (self._version, kv)
        return kv

    def _patch_bytes_per_token(self) -> int:
        """Approximate patch bytes per chunk token at this rank (the U side; V is per chunk, not per token)."""
        lay = self.backend.layout
        m = self.rank or max(h * d for h, d in lay.slot_shapes)
        return lay.num_layers * 2 * m * torch.finfo(self.backend.dtype).bits // 8

    def _rope_bytes_per_token(self) -> int:
        lay = self.backend.layout
        h, d = lay.slot_shapes[lay.rope_slot]
        return lay.num_layers * h * d * torch.finfo(self.backend.dtype).bits // 8

    def _kv_bytes_per_token(self) -> int:
        lay = self.backend.layout
        return lay.num_layers * sum(h * d for h, d in lay.slot_shapes) * torch.finfo(self.backend.dtype).bits // 8

    @staticmethod
    def _bandwidth_ms(nbytes: int, gbps: float = 10.0) -> float:
        return nbytes / (gbps * 1e9) * 1e3


__all__ = ["Window", "WindowStats", "Edit", "Mode", "RepairRule", "FIDELITY"]
