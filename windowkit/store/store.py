"""ChunkStore: content-addressed canonicals ``KV(B|∅)`` and conditioning patches, under a byte budget.

    from windowkit.store import ChunkStore, chunk_key, context_hash

    store = ChunkStore(budget_bytes=2 << 30, model_fingerprint=backend.fingerprint())   # memory only
    store = ChunkStore("runs/store", budget_bytes=20 << 30, model_fingerprint=fp)        # + disk tier

    key = store.chunk_key(chunk.content_hash())
    store.put_canonical(key, kv)                   # False (and stats.rejected += 1) if it cannot fit
    ctx = context_hash([key_a], prefix="sys")
    store.put_patch(key, ctx, patch)
    store.pin(key); store.pin(key, ctx)            # the live window's entries are never evicted
    kv = store.get_canonical(key)                  # ChunkNotFoundError on a miss
    p = store.get_patch(key, ctx)                  # None on a miss
    store.unpin(key); store.unpin(key, ctx)

Tiers: without ``path`` the store is memory only. With ``path`` the disk tier holds every entry and is
the one the budget bounds; memory is a write-through LRU cache in front of it, bounded by
``memory_budget_bytes`` (default: the store budget; 0 turns the cache off). Each tier is a ``Tier`` object
(``windowkit.store.tiers``); this module is the accounting core over them (docs/store.md, "Tiers").

Budget: an entry's size is the bytes of the tensors it stores (``ChunkKV.nbytes`` plus its positions, if
any; ``Patch.nbytes``); ``store.nbytes`` never exceeds ``budget_bytes``. A put evicts the policy's victims
(never pinned ones) to make room; a put that cannot fit even then (an entry larger than the budget, or a
budget held by pinned entries) is refused before anything is evicted: it returns False, leaves the store
as it was and counts ``stats.rejected`` with a reason. A cache must be ready for misses anyway, so a
refused put is just an entry evicted at once, not an error.

Shared tier (off by default): ``shared=`` a ``StoreBackend`` (e.g. ``MooncakeBackend``; "mooncake" builds one
from ``WINDOWKIT_MOONCAKE_*`` variables) is consulted after the local tiers and written through on every put,
so other processes reuse what this one computed. Any fault there (server gone, timeout, a value failing its
sha256) is a counted miss (``stats.shared_fallbacks``), never an error and never a wrong value.

Trust (off by default; docs/security.md): ``cache_salt="tenant-a"`` puts the store in a trust domain: the salt
is mixed into the address of every entry in the shared tier and into ``store.chunk_key`` (hence every
context hash chained from it), and a disk folder is bound to its domain, so domains never read each other's
entries. ``auth_key=secret`` (bytes or str, >= 16 bytes) authenticates every entry written to the shared and
disk tiers with an HMAC-SHA256 over its key, metadata and value (in place of the unkeyed sha256) and derives
the shared tier's keys with the secret; an entry whose MAC fails is removed, never served, and counted as a
miss (``stats.auth_failures``, ``shared_fallback_reasons["auth"]``). A shared tier other than an
``EmbeddedBackend`` without a key warns once (``UnauthenticatedStoreWarning``)::

    store = ChunkStore(model_fingerprint=fp, shared="mooncake", cache_salt="tenant-a", auth_key=secret)

Corruption: a disk entry whose size, sha256 or header does not check out is dropped (file and index
row) and counted in ``stats.corrupt_dropped``; then ``on_corrupt="raise"`` (default) raises
``StoreCorruptError`` and ``on_corrupt="miss"`` treats the read as a miss. Either way it is never served,
and the next get is a plain miss, so the caller recomputes and puts again.
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass, field
from typing import Literal, Optional

import torch

from windowkit.errors import ChunkNotFoundError, KVShapeError, StoreCorruptError, WindowkitError
from windowkit.kv.layout import ChunkKV, KVLayout
from windowkit.kv.patch import Patch
from windowkit.store import cold as _cold
from windowkit.store.auth import EntryAuth, KeySpec, as_auth
from windowkit.store.backend import StoreBackend
from windowkit.store.cold import ColdTierConfig
from windowkit.store.disk import AuthFailed, CorruptEntry, DiskTier, EntryId
from windowkit.store.eviction import EvictionPolicy, PinLedger, PolicySpec, make_eviction_policy
from windowkit.store.keys import chunk_key
from windowkit.store.tiers import (CANONICAL, PATCH, ColdTier, DiskEntries, MemoryTier, Payload, SharedFault,
                                   SharedTier, Tier, open_backend, shared_key, tensor_bytes)

Tensors = dict[str, torch.Tensor]
_UNDECODABLE = (KeyError, ValueError, TypeError)  # a payload that does not rebuild (KVShapeError is a ValueError)


@dataclass
class StoreStats:
    """Counters since the store was opened (in-process; not persisted)."""

    hits: int = 0  # gets served (memory or disk)
    misses: int = 0  # gets of absent entries (incl. corrupt ones just dropped)
    evictions: int = 0  # entries evicted by the policy to honour the budget
    corrupt_dropped: int = 0  # disk entries dropped on a failed size/checksum/header check
    rejected: int = 0  # puts refused because the entry cannot fit (see rejected_reasons)
    rejected_reasons: dict[str, int] = field(default_factory=dict)  # "too_large" | "pinned"
    bytes_read: int = 0  # payload bytes served by gets
    bytes_written: int = 0  # payload bytes accepted by puts
    memory_hits: int = 0  # gets served from the memory tier
    memory_evictions: int = 0  # entries dropped from the memory cache (still on disk)
    disk_reads: int = 0
    disk_bytes_read: int = 0  # file bytes (payload + safetensors header)
    disk_bytes_written: int = 0
    cold_compressed: int = 0  # canonicals turned cold (compress() or budget pressure with a cold tier)
    cold_bytes_saved: int = 0  # sum over those of exact bytes - cold bytes (see also ChunkStore.cold_stats())
    # shared tier (``shared=``; all zero without one)
    shared_hits: int = 0  # local misses served by the shared tier (then kept locally)
    shared_misses: int = 0  # local misses the shared tier did not have either
    shared_puts: int = 0  # entries written through to the shared tier
    shared_fallbacks: int = 0  # shared-tier calls that failed and were treated as misses / skipped writes
    shared_fallback_reasons: dict[str, int] = field(default_factory=dict)  # unavailable|timeout|corrupt|missing|full|layout|error
    shared_bytes_read: int = 0  # payload bytes served by the shared tier
    auth_failures: int = 0  # entries (shared or disk) whose MAC failed: removed, never served, counted as misses

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Entry:
    nbytes: int
    meta: dict


class ChunkStore:
    """Content-addressed store of canonical KV (``ChunkKV``) and patches (``Patch``) with a byte budget.

    Args:
        path: directory of the disk tier; None keeps everything in memory.
        budget_bytes: upper bound on ``nbytes`` (tensor payload of every entry); None is unbounded.
        policy: eviction policy: None (LRU), a registered name ("lru"; "lfu" | "fifo" | "size" | "belady" from
            ``policies.eviction``), an ``EvictionPolicy`` class or a fresh instance (``windowkit.store.eviction``).
        model_fingerprint: id of the model whose KV this is; a disk store written for another model is
            refused with ``ModelMismatchError``. None adopts the stored one.
        layout: the ``KVLayout`` every entry must have; None takes the stored one or the first put's.
        memory_budget_bytes: with ``path``, bound of the memory cache (default: ``budget_bytes``; 0: off).
        on_corrupt: "raise" (``StoreCorruptError``) or "miss", after dropping a corrupt disk entry.
        shared: a ``StoreBackend`` consulted after the local tiers and written through on put (default None:
            no shared tier), or "mooncake" for ``MooncakeBackend.from_env()`` (then owned: closed by ``close``).
            Its namespace is set to ``model_fingerprint`` if unset. Faults there are counted misses.
        cold: a ``ColdTierConfig`` turns the compressed cold tier on (default None: off, every entry exact).
            Then a put that needs room compresses the policy's victim instead of evicting it when that
            victim is an exact canonical that compresses (see docs/store.md, "Cold tier"); ``compress(key)``
            does it on demand.
        cache_salt: the trust domain (e.g. a tenant id; default None: the shared, unsalted domain). Stores of
            one domain share entries; stores of different domains never see each other's.
        auth_key: the deployment's secret (bytes or str, >= 16 bytes; default None: unauthenticated). Every
            entry written to the shared and disk tiers is HMAC-authenticated with it; see docs/security.md.

    Example::

        store = ChunkStore(budget_bytes=1 << 20)
        store.put_canonical("k", kv)
        assert torch.equal(store.get_canonical("k").layers[0][0], kv.layers[0][0])

    Structure (docs/store.md, "Tiers"): the store is an accounting core over ``Tier`` objects
    (``windowkit.store.tiers``): memory, disk, cold and shared. The core keeps the entry table, the budget,
    the pin ledger (``PinLedger``; the eviction policy reads it, ``EvictionPolicy.use_pins``), the policy
    calls and the stats, and drops every entry a tier reports corrupt through one method (``_corrupt``).
    """

    def __init__(self, path: str | os.PathLike | None = None, budget_bytes: Optional[int] = None,
                 policy: PolicySpec = None, model_fingerprint: Optional[str] = None,
                 layout: Optional[KVLayout] = None, *, memory_budget_bytes: Optional[int] = None,
                 on_corrupt: Literal["raise", "miss"] = "raise", cold: Optional[ColdTierConfig] = None,
                 shared: "StoreBackend | str | None" = None, cache_salt: Optional[str] = None,
                 auth_key: KeySpec = None) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise WindowkitError(f"budget_bytes must be >= 0 or None, got {budget_bytes}")
        if memory_budget_bytes is not None and (path is None or memory_budget_bytes < 0):
            raise WindowkitError("memory_budget_bytes bounds the memory cache in front of a disk tier: it needs a "
                                 "path and a value >= 0 (a memory-only store is bounded by budget_bytes)")
        if on_corrupt not in ("raise", "miss"):
            raise WindowkitError(f"on_corrupt must be 'raise' or 'miss', got {on_corrupt!r}")
        self._policy: EvictionPolicy = make_eviction_policy(policy)  # PolicyError (a WindowkitError) on a bad spec
        if cold is not None and not isinstance(cold, ColdTierConfig):
            raise WindowkitError(f"cold must be a ColdTierConfig or None, got {type(cold).__name__}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise WindowkitError("cache_salt is a string (a trust domain, e.g. a tenant id), got "
                                 f"{type(cache_salt).__name__}")
        self.cache_salt = cache_salt or ""
        self._auth: Optional[EntryAuth] = as_auth(auth_key)
        self.budget_bytes = budget_bytes
        self.on_corrupt = on_corrupt
        self.cold = cold
        self.stats = StoreStats()
        self._lock = threading.RLock()  # background encoders may put while the window reads
        self._entries: dict[EntryId, _Entry] = {}
        self._by_key: dict[str, set[EntryId]] = {}
        self._pins = PinLedger()  # the one pin ledger: counted, and pins may precede the put they protect
        self._policy.use_pins(self._pins)
        self._model_fingerprint = model_fingerprint
        self._layout = layout
        self._disk: Optional[DiskEntries] = None
        self.shared: Optional[StoreBackend] = None
        self._shared: Optional[SharedTier] = None
        self._owns_shared = False
        if path is None:
            self._memory = MemoryTier()
        else:
            disk = DiskTier(path, model_fingerprint, layout, auth=self._auth, domain=self.cache_salt)
            self._model_fingerprint, self._layout = disk.model_fingerprint, disk.layout
            self._disk = DiskEntries(disk)
            self._memory = MemoryTier(budget_bytes if memory_budget_bytes is None else memory_budget_bytes,
                                      cache=True, on_evict=self._memory_evicted)
        self._home: Tier = self._disk if self._disk is not None else self._memory  # holds every entry
        self._cold = ColdTier(self._home, cold)
        self._local: tuple[Tier, ...] = (self._memory, self._cold) + ((self._disk,) if self._disk is not None else ())
        if self._disk is not None:
            rows, dropped = self._disk.load()
            for eid in dropped:  # file missing or of the wrong size (the disk tier deleted the row)
                self._corrupt(self._disk, eid, CorruptEntry("file missing or of the wrong size"))
            for eid, nbytes, meta in rows:  # write order stands in for recency: access order is not persisted
                self._add_entry(eid, _Entry(nbytes, meta))
            if budget_bytes is not None:  # reopened with a smaller budget: shrink now
                self._make_room(0, budget_bytes)
        if shared is not None:  # open_backend warns with stacklevel=4: keep it called from here
            self.shared, self._owns_shared = open_backend(shared, self._model_fingerprint, self._auth)
            self._shared = SharedTier(self.shared, model_fingerprint=self._model_fingerprint, salt=self.cache_salt,
                                      layout=lambda: self._layout,
                                      adopt_layout=lambda layout: self._check_layout(layout, "shared entry"))

    # ---------------------------------------------------------------- facts
    @property
    def model_fingerprint(self) -> Optional[str]:
        return self._model_fingerprint

    @property
    def layout(self) -> Optional[KVLayout]:
        return self._layout

    @property
    def path(self) -> Optional[str]:
        return None if self._disk is None else str(self._disk.disk.path)

    @property
    def policy(self) -> EvictionPolicy:
        return self._policy

    @property
    def nbytes(self) -> int:
        """Payload bytes of every entry (the quantity ``budget_bytes`` bounds)."""
        return self._policy.nbytes

    @property
    def memory_nbytes(self) -> int:
        """Payload bytes held in memory (equals ``nbytes`` for a memory-only store)."""
        return self._memory.nbytes

    @property
    def pinned_nbytes(self) -> int:
        with self._lock:
            return sum(self._entries[e].nbytes for e in self._pins if e in self._entries)

    def chunk_key(self, content_hash: str) -> str:
        """``chunk_key(content_hash, self.model_fingerprint, salt=self.cache_salt)``."""
        return chunk_key(content_hash, self._model_fingerprint, self.cache_salt)

    @property
    def authenticated(self) -> bool:
        """Whether entries are MAC-checked: the disk tier (if any) and the shared tier (if any) both keyed."""
        return (self._disk is None or self._auth is not None) and \
            (self.shared is None or getattr(self.shared, "auth", None) is not None)

    def __len__(self) -> int:
        """Number of entries: canonicals plus patches."""
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.has_canonical(key)

    def keys(self) -> list[str]:
        """Chunk keys that have a canonical (a snapshot; patches are listed by ``patches(key)``)."""
        with self._lock:
            return [k for (kind, k, _) in self._entries if kind == CANONICAL]

    def patches(self, key: str) -> list[str]:
        """Context hashes of the patches stored for chunk ``key``."""
        with self._lock:
            return sorted(ctx for kind, _, ctx in self._by_key.get(key, ()) if kind == PATCH)

    def has_canonical(self, key: str) -> bool:
        """Local tiers, then the shared tier (if any; a fault there counts and answers False)."""
        eid = (CANONICAL, key, "")
        return eid in self._entries or self._shared_exists(eid)

    def has_patch(self, key: str, ctx: str) -> bool:
        eid = (PATCH, key, ctx)
        return eid in self._entries or self._shared_exists(eid)

    def _may_hold_patch(self, key: str) -> bool:
        """False only when no tier can hold a patch of chunk ``key`` (any context): a Window then skips hashing
        the context of an admission just to look one up."""
        if self.shared is not None:
            return True
        return any(eid[0] == PATCH for eid in self._by_key.get(key, ()))

    def meta(self, key: str, ctx: Optional[str] = None) -> dict:
        """The ``meta`` given at put time (a copy); ChunkNotFoundError if absent."""
        e = self._entries.get(_eid(key, ctx))
        if e is None:
            raise ChunkNotFoundError(f"no {'patch' if ctx is not None else 'canonical'} for chunk key {key!r}")
        return json.loads(json.dumps(e.meta))

    def entry_path(self, key: str, ctx: Optional[str] = None) -> Optional[str]:
        """The file holding an entry (None for a memory-only store); ChunkNotFoundError if absent."""
        eid = _eid(key, ctx)
        if eid not in self._entries:
            raise ChunkNotFoundError(f"no {'patch' if ctx is not None else 'canonical'} for chunk key {key!r}")
        return None if self._disk is None else self._disk.file_of(eid)

    # ---------------------------------------------------------------- put
    def put_canonical(self, key: str, kv: ChunkKV, meta: Optional[dict] = None) -> bool:
        """Store ``KV(B|∅)`` under ``key`` (replacing any previous one). False if refused for budget.

            store.put_canonical(store.chunk_key(chunk.content_hash()), kv, {"tokens": len(chunk)})
        """
        if not isinstance(kv, ChunkKV):
            raise KVShapeError(f"put_canonical takes a ChunkKV, got {type(kv).__name__}")
        self._check_layout(kv.layout, "canonical")
        if isinstance(meta, dict) and _is_cold_meta(meta):  # e.g. meta(key) of a cold entry: the put is exact
            meta = {k: v for k, v in meta.items() if k not in ("approx", "cold")}
        return self._put(_eid(key, None), kv.to_tensors(contiguous=False), None, meta)  # _put copies them

    def put_patch(self, key: str, ctx: str, patch: Patch, meta: Optional[dict] = None) -> bool:
        """Store a patch of chunk ``key`` formed on context ``ctx`` (see ``context_hash``)."""
        if not isinstance(patch, Patch):
            raise KVShapeError(f"put_patch takes a Patch, got {type(patch).__name__}")
        _check_ctx(ctx)
        self._check_layout(patch.layout, "patch")
        tensors, pmeta = patch.to_tensors()
        return self._put(_eid(key, ctx), tensors, pmeta, meta)

    def _put(self, eid: EntryId, tensors: Tensors, patch_meta: Optional[dict[str, str]],
             meta: Optional[dict], write_through: bool = True) -> bool:
        meta = _check_meta(meta)
        # a private copy: the caller may edit its tensors in place later (the store is content-addressed)
        tensors = {k: t.detach().clone(memory_format=torch.contiguous_format) for k, t in tensors.items()}
        payload = Payload(tensors, patch_meta, tensor_bytes(tensors))  # KV + positions, if any
        nbytes = payload.nbytes
        if write_through and self._shared is not None:  # outside the lock: a network call
            self._check_open()
            self._shared_put(eid, payload, meta)
        with self._lock:
            self._check_open()
            budget = self.budget_bytes
            if budget is not None:
                old = self._entries.get(eid)
                held = self.pinned_nbytes - (old.nbytes if old is not None and eid in self._pins else 0)
                reason = "too_large" if nbytes > budget else "pinned" if held + nbytes > budget else None
                if reason is not None:  # refuse before evicting anything
                    self.stats.rejected += 1
                    self.stats.rejected_reasons[reason] = self.stats.rejected_reasons.get(reason, 0) + 1
                    return False
            if eid in self._entries:
                self._remove(eid, evicted=False)
            if budget is not None:
                self._make_room(nbytes, budget)
            if self._disk is not None:
                self.stats.disk_bytes_written += self._disk.put(eid, payload, meta)
            self._add_entry(eid, _Entry(nbytes, meta))
            self._memory.put(eid, payload, meta)
            self.stats.bytes_written += nbytes
            return True

    # ---------------------------------------------------------------- get
    def get_canonical(self, key: str, *, device: torch.device | str | None = None, copy: bool = True) -> ChunkKV:
        """The canonical KV of ``key``; ChunkNotFoundError on a miss.

        The result never aliases the store's tensors unless ``copy=False`` (then treat it as read-only).
        ``device`` moves it (disk reads land on the CPU; memory entries keep the device they were put on).
        """
        got = self._get(_eid(key, None), device, copy)
        if got is None:
            raise ChunkNotFoundError(f"no canonical KV for chunk key {key!r} in the store")
        return got  # type: ignore[return-value]

    def get_patch(self, key: str, ctx: str, *, device: torch.device | str | None = None,
                  copy: bool = True) -> Optional[Patch]:
        """The patch of chunk ``key`` on context ``ctx``, or None on a miss."""
        _check_ctx(ctx)
        return self._get(_eid(key, ctx), device, copy)  # type: ignore[return-value]

    def _get(self, eid: EntryId, device, copy: bool) -> ChunkKV | Patch | None:
        if self._shared is not None and eid not in self._entries:
            obj = self._shared_get(eid)  # outside the lock; kept locally on a hit
            if obj is None:
                return None
            return obj if device is None else obj.to(device=device)  # fresh tensors: nothing to clone
        with self._lock:
            self._check_open()
            e = self._entries.get(eid)
            if e is None:
                self.stats.misses += 1
                return None
            payload = self._memory.get(eid)
            if payload is not None:
                if self._memory.is_cache:
                    self.stats.memory_hits += 1
                obj = self._build(eid, payload)
            else:  # the disk tier: read, verify, rebuild; any failure drops the entry
                try:
                    payload = self._read_disk(eid)
                    obj = self._build(eid, payload)
                except (CorruptEntry, *_UNDECODABLE) as err:
                    self._corrupt(self._disk, eid, err, miss=True, raises=True)  # type: ignore[arg-type]
                    return None
                self._memory.put(eid, payload, e.meta)
            aliased = eid in self._memory  # the object's tensors are the store's own (memory tier)
            self._policy.touch(eid)
            self.stats.hits += 1
            self.stats.bytes_read += e.nbytes
        if device is not None:
            obj = obj.to(device=device)  # a no-op for tensors already there, so aliasing is checked below
        return _copy_aliased(obj, payload.tensors) if (copy and aliased) else obj

    def _read_disk(self, eid: EntryId) -> Payload:
        payload = self._disk.get(eid)  # type: ignore[union-attr]
        assert payload is not None  # every entry is on the disk tier of a disk store
        self.stats.disk_reads += 1
        self.stats.disk_bytes_read += payload.read_bytes
        return payload

    def _build(self, eid: EntryId, payload: Payload) -> ChunkKV | Patch:
        if self._layout is None:  # pragma: no cover  (an entry implies a layout)
            raise KVShapeError("store has entries but no layout")
        if eid[0] == CANONICAL:
            if _cold.is_cold(payload.tensors):
                return ColdTier.decode(payload.tensors, self._layout)
            return ChunkKV.from_tensors(payload.tensors, self._layout)
        return Patch.from_tensors(payload.tensors, payload.patch_meta or {}, self._layout)

    # ---------------------------------------------------------------- corruption (the one path)
    def _corrupt(self, tier: Tier, eid: EntryId, err: Exception, *, miss: bool = False, raises: bool = False,
                 mac: bool = True) -> None:
        """Every entry a tier reports corrupt (failed size / checksum / header check, undecodable) or forged
        (``AuthFailed``: failed MAC) comes here. It is dropped (a local entry from every local tier and the
        policy; a shared value from the backend, unless it removed it already: ``err.removed``) and counted:
        ``auth_failures`` for a MAC, else ``corrupt_dropped`` (local) or ``shared_fallback_reasons["corrupt"]``
        (shared; a MAC failure there counts ``["auth"]`` instead). ``miss``: the drop answers a get (``misses``).
        ``raises``: then a corrupt local entry raises ``StoreCorruptError`` when ``on_corrupt="raise"``; a
        forged one never does (a counted miss: the caller recomputes). ``mac=False`` (compress, budget
        pressure) treats a failed MAC as any corruption: counted in ``corrupt_dropped``, raised as such."""
        auth = mac and isinstance(err, AuthFailed)
        shared = isinstance(tier, SharedTier)
        with self._lock:
            if auth:
                self.stats.auth_failures += 1
            if shared:
                self._shared_fault("auth" if auth else "corrupt")
            else:
                if eid in self._entries:
                    self._remove(eid, evicted=False)
                else:
                    tier.remove(eid)
                if not auth:
                    self.stats.corrupt_dropped += 1
            if miss:
                self.stats.misses += 1
        if shared and not getattr(err, "removed", False):
            tier.remove(eid)  # outside the lock: a network call
        if raises and not auth and not shared and self.on_corrupt == "raise":
            raise StoreCorruptError(f"store entry {eid[0]}/{eid[1]}/{eid[2]} dropped: {err}") from None

    # ---------------------------------------------------------------- cold tier
    def compress(self, key: str, config: Optional[ColdTierConfig] = None) -> int:
        """Store the canonical of ``key`` cold now (``config`` or the store's ``cold``); pinned or not.

        Returns the bytes saved: 0 when it is already cold or no slot is worth compressing (it stays exact).
        ChunkNotFoundError if absent; a corrupt disk entry is dropped as by a get (``on_corrupt``).
        The entry re-enters the eviction policy as a fresh entry of its new size, as a put would.
        """
        cfg = config if config is not None else self.cold
        if not isinstance(cfg, ColdTierConfig):
            raise WindowkitError("compress needs a ColdTierConfig (pass one, or open the store with cold=...)")
        eid = _eid(key, None)
        with self._lock:
            self._check_open()
            if eid not in self._entries:
                raise ChunkNotFoundError(f"no canonical KV for chunk key {key!r} in the store")
            try:
                return self._compress(eid, cfg)
            except (CorruptEntry, *_UNDECODABLE) as err:
                self._corrupt(self._home, eid, err, raises=True, mac=False)
                return 0

    def is_cold(self, key: str) -> bool:
        """Whether the canonical of ``key`` is stored cold (approximate); False if absent."""
        return _eid(key, None) in self._cold

    def cold_stats(self) -> dict:
        """Live cold entries: count, their bytes, the exact bytes they stand for and the bytes saved."""
        with self._lock:
            cold = [self._entries[eid] for eid in self._cold]
            exact = sum(int(e.meta["cold"]["exact_bytes"]) for e in cold)
            held = sum(e.nbytes for e in cold)
            return {"entries": len(cold), "bytes": held, "exact_bytes": exact, "bytes_saved": exact - held}

    def _compress(self, eid: EntryId, cfg: ColdTierConfig) -> int:
        """Replace an exact canonical by its cold form (same entry id). 0 if already cold or incompressible."""
        e = self._entries[eid]
        if eid[0] != CANONICAL or eid in self._cold or self._layout is None:
            return 0
        payload = self._memory.peek(eid)
        if payload is None:
            payload = self._read_disk(eid)
        got = ColdTier.encode(payload, self._layout, cfg)
        if got is None:
            return 0
        cpayload, facts = got
        if cpayload.nbytes >= e.nbytes:  # pragma: no cover  (compress_kv only factorizes slots that shrink)
            return 0
        cold = {k: v for k, v in facts.items() if k != "approx"}
        meta = _check_meta({**e.meta, "approx": facts["approx"], "cold": cold})
        written = self._cold.put(eid, cpayload, meta)  # into the home tier, under the same id
        if self._disk is not None:
            self.stats.disk_bytes_written += written
            if eid in self._memory:  # keep the cold form cached where the exact one was
                self._memory.put(eid, cpayload, meta)
        saved = e.nbytes - cpayload.nbytes
        e.nbytes, e.meta = cpayload.nbytes, meta
        self._policy.insert(eid, cpayload.nbytes)  # a fresh entry of the new size (a pin stays a pin)
        self.stats.cold_compressed += 1
        self.stats.cold_bytes_saved += saved
        return saved

    def _make_room(self, nbytes: int, budget: int) -> None:
        """Free bytes until ``nbytes`` more fit: the policy's victim is compressed when the cold tier is on
        and it is an exact canonical that compresses, evicted otherwise (each step shrinks the store or
        turns one exact canonical cold, so this ends)."""
        while self._policy.nbytes + nbytes > budget:
            victim = self._policy.victim()
            if self.cold is not None and victim is not None and victim[0] == CANONICAL:
                try:
                    if self._compress(victim, self.cold) > 0:
                        continue
                except (CorruptEntry, *_UNDECODABLE) as err:
                    self._corrupt(self._home, victim, err, mac=False)
                    continue
            self._evict(victim)

    # ---------------------------------------------------------------- pins, drops
    def pin(self, key: str, ctx: Optional[str] = None) -> None:
        """Protect the canonical of ``key`` (or, with ``ctx``, that patch) from eviction.

        Pins count (pin twice, unpin twice) and may precede the put they protect; they live in this
        process only. An explicit ``drop`` still removes a pinned entry.
        """
        eid = _eid(key, ctx)
        with self._lock:
            if eid in self._entries:
                self._policy.pin(eid)  # one more pin in the ledger; the policy reorders on the first
            else:
                self._pins.pin(eid)

    def unpin(self, key: str, ctx: Optional[str] = None) -> None:
        """Release one pin; unpinning something not pinned is a no-op."""
        eid = _eid(key, ctx)
        with self._lock:
            if eid in self._entries:
                self._policy.unpin(eid)
            else:
                self._pins.unpin(eid)

    def is_pinned(self, key: str, ctx: Optional[str] = None) -> bool:
        return _eid(key, ctx) in self._pins

    def drop(self, key: str, ctx: Optional[str] = None) -> int:
        """Remove chunk ``key``'s canonical and all its patches (or, with ``ctx``, that one patch), pinned
        or not. Returns the number of entries removed (0 if none)."""
        with self._lock:
            self._check_open()
            eids = [_eid(key, ctx)] if ctx is not None else list(self._by_key.get(key, ()))
            n = 0
            for eid in eids:
                if eid in self._entries:
                    self._remove(eid, evicted=False)
                    n += 1
            return n

    def verify(self) -> int:
        """Read and checksum (with a key: authenticate) every disk entry now; drop the ones that fail.
        Returns how many were dropped."""
        if self._disk is None:
            return 0
        dropped = 0
        with self._lock:
            self._check_open()
            for eid in list(self._entries):
                try:
                    self._disk.get(eid)
                except CorruptEntry as err:
                    self._corrupt(self._disk, eid, err)
                    dropped += 1
        return dropped

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if the accounting is off: ``nbytes`` is the sum of the entries' bytes and
        within ``budget_bytes``; the policy tracks exactly the entries, at their sizes, reads the store's pin
        ledger and never offers a pinned victim; the home tier (disk, or memory without a path) holds every
        entry and the same bytes; the memory cache and the cold tier hold only entries, at their sizes; each
        tier's own check passes. Cheap enough for tests to call after every operation."""
        with self._lock:
            ents, pol = self._entries, self._policy
            total = sum(e.nbytes for e in ents.values())
            assert self.nbytes == total, f"nbytes {self.nbytes} != sum of entries {total}"
            assert self.budget_bytes is None or total <= self.budget_bytes, "over budget"
            assert len(pol) == len(ents) and all(pol.size_of(eid) == e.nbytes for eid, e in ents.items()), \
                "the policy's keys or sizes are not the store's"
            assert pol.pin_ledger is self._pins, "the policy keeps a pin ledger of its own"
            assert pol.pinned == {eid for eid in self._pins if eid in ents}
            v = pol.victim()
            assert v is None or (v in ents and v not in self._pins), f"victim {v} is pinned or absent"
            assert all(eid in self._home for eid in ents) and self._home.nbytes == total, \
                "the home tier does not hold exactly the entries"
            for eid in ents:
                p = self._memory.peek(eid)
                assert p is None or p.nbytes == ents[eid].nbytes, f"memory holds {eid} at another size"
            assert len(self._memory) <= len(ents) and self._memory.nbytes <= total
            cold = {eid for eid, e in ents.items() if eid[0] == CANONICAL and _is_cold_meta(e.meta)}
            assert set(self._cold) == cold and all(self._cold.size_of(eid) == ents[eid].nbytes for eid in cold), \
                "the cold tier's entries are not the cold canonicals"
            assert {k: s for k, s in self._by_key.items()} == _group(ents), "by-key index is off"
            for tier in self._local:
                tier.check_integrity()

    def close(self) -> None:
        """Release the disk tier (index connection and lock); later puts and gets raise WindowkitError.
        A shared backend built from ``shared="mooncake"`` is closed too; one passed in is the caller's."""
        with self._lock:
            if self._disk is not None:
                self._disk.close()
            if self._owns_shared and self._shared is not None:
                self._shared.close()
            self._closed = True

    # ---------------------------------------------------------------- shared tier

    def _shared_key(self, eid: EntryId) -> str:
        """The entry's key in the shared tier (``tiers.shared_key``; the security tests forge entries under it)."""
        return shared_key(self.cache_salt, eid)

    def _shared_fault(self, reason: str) -> None:
        with self._lock:
            self.stats.shared_fallbacks += 1
            r = self.stats.shared_fallback_reasons
            r[reason] = r.get(reason, 0) + 1

    def _shared_exists(self, eid: EntryId) -> bool:
        if self._shared is None:
            return False
        try:
            return eid in self._shared
        except SharedFault as f:
            self._shared_fault(f.reason)
            return False

    def _shared_put(self, eid: EntryId, payload: Payload, meta: dict) -> None:
        """Write one entry through; a fault only counts."""
        try:
            self._shared.put(eid, payload, meta)  # type: ignore[union-attr]
        except SharedFault as f:
            self._shared_fault(f.reason)
            return
        with self._lock:
            self.stats.shared_puts += 1

    def _shared_get(self, eid: EntryId) -> ChunkKV | Patch | None:
        """A local miss: read the shared tier, check the entry is the one asked for, keep it locally.
        None on a miss or any fault (counted); a value that fails a check is never returned."""
        self._check_open()
        tier = self._shared
        assert tier is not None
        try:
            payload = tier.get(eid)
            if payload is not None:
                try:
                    obj = self._build(eid, payload)
                except _UNDECODABLE as e:  # tensors missing or of the wrong shape: not our entry
                    raise CorruptEntry(f"shared value does not rebuild: {e}") from None
        except CorruptEntry as err:  # checksum, MAC or identity failed: nobody should read it
            self._corrupt(tier, eid, err, miss=True)
            return None
        except (SharedFault, KVShapeError) as err:  # unanswered, or a store of another layout (the value stays)
            self._shared_fault(err.reason if isinstance(err, SharedFault) else "layout")
            with self._lock:
                self.stats.misses += 1
            return None
        if payload is None:
            with self._lock:
                self.stats.misses += 1
                self.stats.shared_misses += 1
            return None
        # keep it locally (budget permitting; a refusal just means the next get reads the shared tier again)
        self._put(eid, payload.tensors, payload.patch_meta, payload.meta, write_through=False)
        with self._lock:
            self.stats.hits += 1
            self.stats.shared_hits += 1
            self.stats.shared_bytes_read += payload.nbytes
            self.stats.bytes_read += payload.nbytes
        return obj

    def __enter__(self) -> "ChunkStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f"path={self.path!r}" if self._disk is not None else "memory"
        return (f"ChunkStore({where}, entries={len(self)}, nbytes={self.nbytes}, budget_bytes={self.budget_bytes}, "
                f"policy={self._policy.name})")

    # ---------------------------------------------------------------- internals
    _closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise WindowkitError("the chunk store is closed")

    def _check_layout(self, layout: KVLayout, what: str) -> None:
        with self._lock:
            if self._layout is None:
                self._layout = layout
                if self._disk is not None:
                    self._disk.disk.set_layout(layout)
            elif layout != self._layout:
                raise KVShapeError(f"{what} has layout {layout.describe()}; the store holds {self._layout.describe()}")

    def _add_entry(self, eid: EntryId, e: _Entry) -> None:
        self._entries[eid] = e
        self._by_key.setdefault(eid[1], set()).add(eid)
        self._policy.insert(eid, e.nbytes)  # a key the ledger pins is out of the victim order at once
        if eid[0] == CANONICAL and _is_cold_meta(e.meta):
            self._cold.mark(eid, e.nbytes)

    def _remove(self, eid: EntryId, evicted: bool) -> None:
        """Every removal (eviction, replacement, drop, corrupt entry) passes here: the entry leaves the table,
        the policy and every local tier (its pins stay in the ledger)."""
        self._entries.pop(eid)
        keyset = self._by_key[eid[1]]
        keyset.discard(eid)
        if not keyset:
            del self._by_key[eid[1]]
        self._policy.remove(eid, evicted=evicted)
        for tier in self._local:
            tier.remove(eid)
        self.entry_removed(eid[0], eid[1], eid[2] or "", evicted)

    def entry_removed(self, kind: str, key: str, ctx: str, evicted: bool) -> None:
        """Called after any entry leaves the store (eviction, replacement by a new put, ``drop``, a corrupt
        entry); ``kind`` is "c" (canonical, ``ctx`` "") or "p" (patch, with its ``ctx``), ``evicted`` True for an
        eviction under budget. Does nothing: a subclass that meters the store overrides it (the simulator's store does)."""

    def _evict(self, eid: Optional[EntryId]) -> None:
        if eid is None:  # pragma: no cover  (puts check feasibility first)
            raise WindowkitError("store over budget with nothing evictable")
        self._remove(eid, evicted=True)
        self.stats.evictions += 1

    def _memory_evicted(self) -> None:
        self.stats.memory_evictions += 1


# -------------------------------------------------------------------- helpers
def _eid(key: str, ctx: Optional[str]) -> EntryId:
    if not isinstance(key, str) or not key:
        raise ChunkNotFoundError(f"chunk keys are non-empty strings, got {key!r}")
    return (CANONICAL, key, "") if ctx is None else (PATCH, key, ctx)


def _group(entries) -> dict[str, set[EntryId]]:
    out: dict[str, set[EntryId]] = {}
    for eid in entries:
        out.setdefault(eid[1], set()).add(eid)
    return out


def _is_cold_meta(meta: dict) -> bool:
    """The store's own mark of a cold canonical: ``meta["cold"]`` as written by ``compress``."""
    c = meta.get("cold")
    return isinstance(c, dict) and "exact_bytes" in c and "approx" in meta


def _check_ctx(ctx: str) -> None:
    if not isinstance(ctx, str):
        raise WindowkitError(f"a patch context is a string (see context_hash), got {type(ctx).__name__}")


def _check_meta(meta: Optional[dict]) -> dict:
    if meta is None:
        return {}
    if isinstance(meta, dict) and all(type(k) is str and type(v) is str for k, v in meta.items()):
        return dict(meta)  # flat strings (the Window's own metas): JSON as they are, a copy is enough
    try:  # JSON round trip: the index stores it as JSON, and the caller's dict must not alias ours
        return json.loads(json.dumps(meta))
    except (TypeError, ValueError) as e:
        raise WindowkitError(f"store meta must be JSON-serialisable: {e}") from None


def _copy_aliased(obj: ChunkKV | Patch, store_tensors: Tensors) -> ChunkKV | Patch:
    """Clone the tensors of ``obj`` that share storage with the store's; leave fresh ones alone."""
    ptrs = {t.untyped_storage().data_ptr() for t in store_tensors.values()}
    fix = lambda t: t.clone() if t.untyped_storage().data_ptr() in ptrs else t  # noqa: E731
    if isinstance(obj, ChunkKV):
        return ChunkKV([(fix(a), fix(b)) for a, b in obj.layers], obj.layout,
                       None if obj.positions is None else fix(obj.positions))
    return Patch({k: (fix(u), fix(v)) for k, (u, v) in obj.factors.items()}, obj.layout, obj.num_tokens, obj.rank,
                 obj.rope_rank, dict(obj.energy), dict(obj.meta))


__all__ = ["ChunkStore", "StoreStats"]
