"""The tiers of a ``ChunkStore``: where entries live. One protocol (``Tier``), four kinds.

    MemoryTier   payloads in a dict: every entry of a memory-only store, or an LRU cache in front of the disk
    DiskEntries  the disk tier (``disk.DiskTier``: safetensors files + SQLite index), one row per entry
    ColdTier     canonicals kept compressed (``cold``), stored in the home tier (memory or disk) in cold form
    SharedTier   a ``StoreBackend`` (embedded or Mooncake) shared by processes: envelopes under derived keys

A tier only stores and checks; the ``ChunkStore`` core does the accounting over them (budget, the pin
ledger, the eviction policy, the stats) and owns the one corruption path: a tier never drops an entry that
fails a check, it raises ``CorruptEntry`` (``AuthFailed`` for a failed MAC) and the core drops it.
"""
from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from windowkit.errors import (AuthKeyError, ModelMismatchError, SharedStoreError, StoreAuthError, StoreCorruptError,
                              WindowkitError)
from windowkit.kv.layout import KVLayout
from windowkit.store import cold as _cold
from windowkit.store.auth import EntryAuth, domain_tag, warn_unauthenticated
from windowkit.store.backend import EmbeddedBackend, StoreBackend
from windowkit.store.disk import AuthFailed, CorruptEntry, DiskTier, EntryId, header_metadata, layout_from_json, \
    layout_to_json
from windowkit.store.eviction import LRU
from windowkit.store.mooncake import MooncakeBackend

CANONICAL, PATCH = "c", "p"
PATCH_PREFIX = "patch."  # Patch.to_tensors() metadata, namespaced in the file / shared value header

Tensors = dict[str, torch.Tensor]


@dataclass
class Payload:
    """One entry's stored form: its tensors (``ChunkKV.to_tensors()``, a cold form, or ``Patch.to_tensors()``),
    the patch metadata (None for canonicals) and ``nbytes``, the tensor bytes the budget counts. A tier's ``get``
    also fills ``read_bytes`` (bytes read from its medium: 0 for memory) and, for the shared tier, ``meta``."""

    tensors: Tensors
    patch_meta: Optional[dict[str, str]]
    nbytes: int
    read_bytes: int = 0
    meta: dict = field(default_factory=dict)


def tensor_bytes(tensors: Tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class SharedFault(Exception):
    """Internal: the shared backend could not answer (``reason``: unavailable | timeout | layout | ...)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Tier(ABC):
    """Where entries live, keyed by ``EntryId = (kind, chunk key, ctx)``. The contract every tier keeps:

    get(eid) -> Payload | None   the entry's payload, None if this tier does not hold it. A held entry that
                                 fails a check raises ``CorruptEntry`` (``AuthFailed``: its MAC failed) and is
                                 left in place: dropping it is the core's (``ChunkStore._corrupt``).
    put(eid, payload, meta) -> int   hold ``payload`` under ``eid``, replacing any older version; returns the
                                 bytes written to the medium (0 for memory). ``meta`` is the entry's JSON meta.
    remove(eid)                  forget the entry; a no-op when it is not held.
    eid in tier                  whether the tier holds it (a local answer; the shared tier asks its backend).
    nbytes                       payload bytes (``Payload.nbytes``) of the entries held here.
    check_integrity()            raise ``AssertionError`` if the tier's own accounting is off.
    close()                      release what the tier holds open.
    """

    name = "tier"

    @abstractmethod
    def get(self, eid: EntryId) -> Optional[Payload]: ...

    @abstractmethod
    def put(self, eid: EntryId, payload: Payload, meta: dict) -> int: ...

    @abstractmethod
    def remove(self, eid: EntryId) -> None: ...

    @abstractmethod
    def __contains__(self, eid: object) -> bool: ...

    @property
    @abstractmethod
    def nbytes(self) -> int: ...

    def check_integrity(self) -> None:
        pass

    def close(self) -> None:
        pass


class MemoryTier(Tier):
    """Payloads in a dict: every entry put (a memory-only store's home), or with ``cache=True`` a cache in front
    of the disk tier (reads refresh an LRU order). With a ``budget`` a put evicts the least recently read until
    it fits (``on_evict`` is called per entry evicted) and an entry larger than the budget is not kept."""

    name = "memory"

    def __init__(self, budget: Optional[int] = None, *, cache: bool = False,
                 on_evict: Optional[Callable[[], None]] = None) -> None:
        self.budget = budget
        self.is_cache = cache
        self._on_evict = on_evict
        self._payloads: dict[EntryId, Payload] = {}
        self._lru = LRU()  # recency and the byte total

    def get(self, eid: EntryId) -> Optional[Payload]:
        p = self._payloads.get(eid)
        if p is not None and self.is_cache:
            self._lru.touch(eid)
        return p

    def peek(self, eid: EntryId) -> Optional[Payload]:
        """``get`` without refreshing the LRU order (a read that is not a use)."""
        return self._payloads.get(eid)

    def put(self, eid: EntryId, payload: Payload, meta: dict) -> int:
        self.remove(eid)
        if self.budget is not None:
            if payload.nbytes > self.budget:
                return 0
            while self._lru.nbytes + payload.nbytes > self.budget:
                old = self._lru.victim()
                self._lru.remove(old, evicted=True)
                del self._payloads[old]
                if self._on_evict is not None:
                    self._on_evict()
        self._payloads[eid] = Payload(payload.tensors, payload.patch_meta, payload.nbytes)
        self._lru.insert(eid, payload.nbytes)
        return 0

    def remove(self, eid: EntryId) -> None:
        if self._payloads.pop(eid, None) is not None:
            self._lru.remove(eid)

    def __contains__(self, eid: object) -> bool:
        return eid in self._payloads

    def __len__(self) -> int:
        return len(self._payloads)

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes

    def check_integrity(self) -> None:
        assert len(self._lru) == len(self._payloads) and all(e in self._lru for e in self._payloads), \
            "memory tier: payloads and LRU disagree"
        assert self._lru.nbytes == sum(p.nbytes for p in self._payloads.values()), "memory tier: byte total"
        assert self.budget is None or self._lru.nbytes <= self.budget, "memory tier over its budget"


class DiskEntries(Tier):
    """The disk tier: ``disk.DiskTier`` (files + index, the on-disk format) and the index row of each entry."""

    name = "disk"

    def __init__(self, disk: DiskTier) -> None:
        self.disk = disk
        self._rows: dict = {}
        self._nbytes = 0

    def load(self) -> tuple[list[tuple[EntryId, int, dict]], list[EntryId]]:
        """The entries on disk in write order as ``(eid, nbytes, meta)``, and the ids of rows dropped because
        their file is missing or of the wrong size (already deleted: report them, do not remove them)."""
        rows, dropped = self.disk.load_rows()
        for r in rows:
            self._hold(r)
        return [(r.eid, r.nbytes, r.meta) for r in rows], dropped

    def _hold(self, row) -> None:
        old = self._rows.pop(row.eid, None)
        self._nbytes += row.nbytes - (old.nbytes if old is not None else 0)
        self._rows[row.eid] = row

    def get(self, eid: EntryId) -> Optional[Payload]:
        row = self._rows.get(eid)
        if row is None:
            return None
        tensors, header, nread = self.disk.read(row)
        pm = {k[len(PATCH_PREFIX):]: v for k, v in header.items() if k.startswith(PATCH_PREFIX)}
        return Payload(tensors, pm if eid[0] == PATCH else None, row.nbytes, nread)

    def put(self, eid: EntryId, payload: Payload, meta: dict) -> int:
        header = {PATCH_PREFIX + k: v for k, v in (payload.patch_meta or {}).items()}
        row = self.disk.write(eid, payload.tensors, header, payload.nbytes, meta)
        self._hold(row)
        return row.file_bytes

    def remove(self, eid: EntryId) -> None:
        row = self._rows.pop(eid, None)
        if row is not None:
            self._nbytes -= row.nbytes
            self.disk.delete(row)

    def __contains__(self, eid: object) -> bool:
        return eid in self._rows

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def row(self, eid: EntryId):
        """The index row (``disk.Row``) of an entry held here."""
        return self._rows[eid]

    def file_of(self, eid: EntryId) -> str:
        return str(self.disk.objects / self._rows[eid].file)

    def check_integrity(self) -> None:
        assert self._nbytes == sum(r.nbytes for r in self._rows.values()), "disk tier: byte total"

    def close(self) -> None:
        self.disk.close()


class ColdTier(Tier):
    """Canonicals stored compressed. The cold form is stored in the ``home`` tier under the entry's own id (so a
    disk store's format is unchanged: a cold entry is a file like any other, marked by its meta); this tier
    knows which entries are cold and their bytes, and encodes (``encode``) and decodes (``decode``)."""

    name = "cold"

    def __init__(self, home: Tier, config: Optional[_cold.ColdTierConfig]) -> None:
        self.home = home
        self.config = config
        self._sizes: dict[EntryId, int] = {}

    @staticmethod
    def encode(payload: Payload, layout: KVLayout, cfg: _cold.ColdTierConfig) -> Optional[tuple[Payload, dict]]:
        """The cold form of an exact canonical's payload and its facts (``approx`` and the ``cold`` mark's
        fields); None when it is already cold or no slot is worth compressing."""
        got = _cold.compress_tensors(payload.tensors, layout, cfg)
        if got is None:
            return None
        ctensors, facts = got
        return Payload(ctensors, None, tensor_bytes(ctensors)), facts

    @staticmethod
    def decode(tensors: Tensors, layout: KVLayout):
        return _cold.decompress_tensors(tensors, layout)

    def mark(self, eid: EntryId, nbytes: int) -> None:
        """Count an entry the home tier already holds in cold form (a reopened disk store)."""
        self._sizes[eid] = int(nbytes)

    def get(self, eid: EntryId) -> Optional[Payload]:
        return self.home.get(eid) if eid in self._sizes else None

    def put(self, eid: EntryId, payload: Payload, meta: dict) -> int:
        written = self.home.put(eid, payload, meta)
        self._sizes[eid] = payload.nbytes
        return written

    def remove(self, eid: EntryId) -> None:
        """Forget the cold mark; the bytes are the home tier's to remove."""
        self._sizes.pop(eid, None)

    def __contains__(self, eid: object) -> bool:
        return eid in self._sizes

    def __iter__(self):
        """The cold entries' ids (a snapshot)."""
        return iter(list(self._sizes))

    def size_of(self, eid: EntryId) -> int:
        return self._sizes[eid]

    @property
    def nbytes(self) -> int:
        return sum(self._sizes.values())

    def check_integrity(self) -> None:
        assert all(e in self.home for e in self._sizes), "cold tier: an entry its home tier does not hold"


class SharedTier(Tier):
    """A ``StoreBackend`` shared by processes. An entry is a safetensors value (its header names the entry) and a
    JSON meta ``{format, kind, key, ctx, model_fingerprint[, domain], nbytes, meta, layout}``, stored under
    ``shared_key(salt, eid)``. Backend faults raise ``SharedFault``; a value that fails its checksum or MAC
    (``StoreCorruptError`` / ``StoreAuthError``: the backend removed it) or names another entry, model or
    domain raises ``CorruptEntry`` / ``AuthFailed``, with ``removed`` set when the backend already removed it.

    ``layout()`` is the store's layout (None before the first entry); ``adopt_layout(layout)`` adopts a value's
    layout or raises ``KVShapeError`` (then ``get`` raises it: the value is fine, for another store)."""

    name = "shared"

    def __init__(self, backend: StoreBackend, *, model_fingerprint: Optional[str], salt: str,
                 layout: Callable[[], Optional[KVLayout]], adopt_layout: Callable[[KVLayout], None]) -> None:
        self.backend = backend
        self._fp = model_fingerprint or ""
        self._salt = salt
        self._layout = layout
        self._adopt_layout = adopt_layout

    def key(self, eid: EntryId) -> str:
        return shared_key(self._salt, eid)

    def _ident(self, eid: EntryId) -> dict:
        kind, key, ctx = eid
        ident = {"format": "windowkit-shared/1", "kind": kind, "key": key, "ctx": ctx, "model_fingerprint": self._fp}
        if self._salt:  # only then: unsalted entries keep today's bytes
            ident["domain"] = domain_tag(self._salt)
        return ident

    def get(self, eid: EntryId) -> Optional[Payload]:
        try:
            got = self.backend.get(self.key(eid))
        except StoreAuthError as e:  # forged / replayed / another key's
            raise _removed(AuthFailed(str(e))) from None
        except StoreCorruptError as e:
            raise _removed(CorruptEntry(str(e))) from None
        except SharedStoreError as err:
            raise SharedFault(err.reason) from None
        if got is None:
            return None
        data, smeta = got
        if smeta.get("layout"):  # an empty store adopts the writer's layout; another layout is refused
            self._adopt_layout(layout_from_json(smeta["layout"]))
        kind, key, ctx = eid
        if (smeta.get("kind"), smeta.get("key"), smeta.get("ctx")) != (kind, key, ctx) or \
                smeta.get("model_fingerprint") != self._fp or \
                smeta.get("domain", "") != (domain_tag(self._salt) if self._salt else ""):
            raise CorruptEntry("shared value names another entry, model or trust domain")
        header = header_metadata(data)
        if (header.get("kind"), header.get("key"), header.get("ctx")) != (kind, key, ctx):
            raise CorruptEntry("safetensors header names another entry")
        try:
            tensors = st_load(data)
        except Exception as e:  # safetensors raises its own error types
            raise CorruptEntry(f"unreadable safetensors: {e}") from None
        pm = {k[len(PATCH_PREFIX):]: v for k, v in header.items() if k.startswith(PATCH_PREFIX)}
        n = int(smeta.get("nbytes") or 0)
        return Payload(tensors, pm if kind == PATCH else None, n, n, smeta.get("meta") or {})

    def put(self, eid: EntryId, payload: Payload, meta: dict) -> int:
        ident = self._ident(eid)
        header = {**{PATCH_PREFIX + k: v for k, v in (payload.patch_meta or {}).items()}, **ident}
        data = st_save({k: t.detach().to("cpu") for k, t in payload.tensors.items()}, metadata=header)
        layout = self._layout()
        smeta = {**ident, "nbytes": payload.nbytes, "meta": meta, "layout": layout_to_json(layout) if layout else None}
        try:
            self.backend.put(self.key(eid), data, smeta)
        except SharedStoreError as err:
            raise SharedFault(err.reason) from None
        return len(data)

    def remove(self, eid: EntryId) -> None:
        try:
            self.backend.remove(self.key(eid))
        except SharedStoreError:
            pass

    def __contains__(self, eid: object) -> bool:
        try:
            return bool(self.backend.exists(self.key(eid)))  # type: ignore[arg-type]
        except SharedStoreError as err:
            raise SharedFault(err.reason) from None

    @property
    def nbytes(self) -> int:
        """0: the shared tier's bytes are the backend's, not this store's (no budget counts them)."""
        return 0

    def close(self) -> None:
        self.backend.close()


def open_backend(shared: "StoreBackend | str", model_fingerprint: Optional[str],
                 auth: Optional[EntryAuth]) -> tuple[StoreBackend, bool]:
    """The backend of a store's shared tier, checked against the store: ``(backend, owned)``. "mooncake" builds
    ``MooncakeBackend.from_env()`` (owned: the store closes it). A backend without a namespace takes the model
    fingerprint, another model's is refused (``ModelMismatchError``); with ``auth`` the backend gets that key or
    must already have it (``AuthKeyError``); without, a backend other than ``EmbeddedBackend`` warns once."""
    owned = False
    if isinstance(shared, str):
        if shared != "mooncake":
            raise WindowkitError(f"shared must be a StoreBackend, 'mooncake' or None, got {shared!r}")
        shared, owned = MooncakeBackend.from_env(namespace=model_fingerprint, auth_key=auth), True
    if not isinstance(shared, StoreBackend):
        raise WindowkitError(f"shared must implement StoreBackend, got {type(shared).__name__}")
    if shared.namespace is None:
        shared.namespace = model_fingerprint
    elif model_fingerprint is not None and shared.namespace != model_fingerprint:
        raise ModelMismatchError(f"shared backend namespace {shared.namespace!r} is not this store's model "
                                 f"{model_fingerprint!r}")
    theirs = getattr(shared, "auth", None)
    if auth is not None:
        if theirs is None:
            if not hasattr(shared, "auth"):
                raise AuthKeyError(f"{type(shared).__name__} cannot authenticate entries (it has no 'auth' "
                                   "attribute): use EmbeddedBackend or MooncakeBackend, or open without auth_key")
            shared.auth = auth  # type: ignore[attr-defined]
        elif theirs.key_id != auth.key_id:
            raise AuthKeyError(f"the shared backend's auth key (id {theirs.key_id}) is not this store's "
                               f"(id {auth.key_id}): give both the same key")
    elif theirs is None and not isinstance(shared, EmbeddedBackend):
        warn_unauthenticated(f"the shared store tier ({type(shared).__name__})")
    return shared, owned


def _removed(err: CorruptEntry) -> CorruptEntry:
    err.removed = True  # type: ignore[attr-defined]
    return err


def shared_key(salt: str, eid: EntryId) -> str:
    """``kind/key/ctx``; in a trust domain, a hash of the salt and the entry id (the backend derives its own
    stored key from this, with the secret when it has one)."""
    if not salt:
        return f"{eid[0]}/{eid[1]}/{eid[2]}"
    return f"{eid[0]}/d-{_salted(salt, eid)}/"


def _salted(salt: str, eid: EntryId) -> str:
    """32 hex of sha256 over the trust domain and the entry id (JSON: no two (salt, id) pairs collide)."""
    return hashlib.sha256(json.dumps(["domain", salt, *eid], separators=(",", ":")).encode()).hexdigest()[:32]


__all__ = ["Tier", "Payload", "MemoryTier", "DiskEntries", "ColdTier", "SharedTier", "SharedFault", "shared_key",
           "open_backend", "CANONICAL", "PATCH"]
