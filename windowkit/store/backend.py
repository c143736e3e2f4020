"""StoreBackend: the byte-level key-value protocol of a store's shared tier, and its embedded default.

    from windowkit.store.backend import EmbeddedBackend

    b = EmbeddedBackend(namespace=backend.fingerprint())  # in-process; MooncakeBackend shares across processes
    b.put("c/key", data, {"tokens": 64})
    data, meta = b.get("c/key")                            # None on a miss
    b.exists("c/key"); b.remove("c/key")
    b.put_batch([("k1", d1, {}), ("k2", d2, {})]); b.get_batch(["k1", "k2"])

Values are opaque bytes (``ChunkStore`` puts safetensors bytes) plus a JSON-serialisable metadata dict. A
backend stores them in an *envelope* (``pack``): a short header naming the value's size and the sha256 of
metadata + value, so that ``get`` can check what comes back before returning it. A value that fails the
check (flipped byte, truncation, a foreign blob under the key) is never returned: ``get`` removes it and
raises ``StoreCorruptError``; the batched ``get_batch`` skips it (``None``) and counts it in ``stats``.

Faults of the backend itself (server gone, a call past its timeout) raise ``SharedStoreError`` with a
``reason`` ("unavailable" | "timeout" | "full" | "missing" | "error"); ``ChunkStore`` turns every one of them into a miss
and counts it (``stats.shared_fallbacks``), so the caller recomputes exactly as on any other miss.

Keys are namespaced by the model fingerprint (``namespace``): two models never read each other's entries
even if their chunk keys collided, and a namespace can be listed or cleared on its own.

Authenticated (``auth_key=``, see windowkit/store/auth.py and docs/security.md): the envelope's sha256 is
replaced by an HMAC-SHA256 over (namespace, key), header and value, in the same single pass and checked
before any byte is parsed (``MAGIC_AUTH | tag | u32 header length | {size, meta} | value``), and the stored
key is ``wk/<HMAC(ns)>/<HMAC(ns, key)>``: without the secret nobody can compute where an entry lives, forge
one, or move one to another key. A value whose MAC does not check (forged, replayed, unauthenticated, another
key's) raises ``StoreAuthError`` (a ``StoreCorruptError``), is removed and counted in ``stats["forged"]``.

    b = EmbeddedBackend(auth_key=secret)
"""
from __future__ import annotations

import hashlib
import json
import struct
import threading
from typing import Optional, Protocol, Sequence, runtime_checkable

from windowkit.errors import SharedStoreError, StoreAuthError, StoreCorruptError, WindowkitError
from windowkit.store.auth import EntryAuth, KeySpec, as_auth

MAGIC = b"WKSV1\n"  # windowkit shared value, envelope version 1
MAGIC_AUTH = b"WKSA1\n"  # windowkit shared value, authenticated (HMAC-SHA256), version 1
_TAG = 32  # bytes of an HMAC-SHA256
_LEN = struct.Struct("<I")

Item = tuple[str, bytes, dict]  # (key, value, meta) of a batched put
Got = Optional[tuple[bytes, dict]]  # a get's result: (value, meta) or None on a miss


def namespace_prefix(namespace: Optional[str]) -> str:
    """Key prefix of a namespace: ``wk/<16 hex of sha256(namespace)>/`` (fingerprints may hold any characters)."""
    ns = hashlib.sha256((namespace or "").encode()).hexdigest()[:16]
    return f"wk/{ns}/"


def storage_key(namespace: Optional[str], key: str, auth: Optional[EntryAuth] = None) -> str:
    """Where ``key`` of ``namespace`` is stored: ``namespace_prefix + key`` without a key (as ever), else
    ``wk/<16 hex HMAC(ns)>/<32 hex HMAC(ns, key)>``, which only holders of the secret can compute."""
    if auth is None:
        return namespace_prefix(namespace) + key
    ns = namespace or ""
    return f"wk/{auth.address('ns', ns)[:16]}/{auth.address('key', ns, key)}"


def storage_prefix(namespace: Optional[str], auth: Optional[EntryAuth] = None) -> str:
    """The prefix every stored key of ``namespace`` starts with (what ``clear`` removes)."""
    return namespace_prefix(namespace) if auth is None else f"wk/{auth.address('ns', namespace or '')[:16]}/"


def _ident(namespace: Optional[str], key: str) -> bytes:
    """What an entry's MAC binds it to: its namespace and key (so it cannot be replayed under another)."""
    ns = (namespace or "").encode()
    return _LEN.pack(len(ns)) + ns + key.encode()  # length-prefixed: no (ns, key) pair reads as another


def _meta_bytes(meta: dict) -> bytes:
    return json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()


def _digest(mb: bytes, value) -> str:
    h = hashlib.sha256(mb)
    h.update(value)  # incremental: no concatenated copy of a large value
    return h.hexdigest()


def pack(value: bytes, meta: Optional[dict] = None, *, auth: Optional[EntryAuth] = None,
         namespace: Optional[str] = None, key: str = "") -> bytes:
    """The envelope stored under a key.

    Unkeyed: ``MAGIC | u32 header length | header JSON {size, sha256, meta} | value``, the sha256 over the
    metadata JSON + value. Keyed (``auth``): ``MAGIC_AUTH | 32-byte HMAC-SHA256 | u32 header length | header
    JSON {size, meta} | value``, the HMAC over (namespace, key), the header bytes and the value::

        pack(data, {"tokens": 64})                                                    # checks damage
        pack(data, {"tokens": 64}, auth=EntryAuth(secret), namespace=fp, key="c/k/")  # and forgery
    """
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise WindowkitError(f"a shared value is bytes, got {type(value).__name__}")
    meta = {} if meta is None else meta
    try:
        mb = _meta_bytes(meta)
    except (TypeError, ValueError) as e:
        raise WindowkitError(f"shared value meta must be JSON-serialisable: {e}") from None
    if auth is not None:
        header = json.dumps({"size": len(value), "meta": meta}, sort_keys=True, separators=(",", ":")).encode()
        tag = auth.tag(_ident(namespace, key), header, value)
        return b"".join((MAGIC_AUTH, tag, _LEN.pack(len(header)), header, value))
    header = json.dumps({"size": len(value), "sha256": _digest(mb, value), "meta": meta}, sort_keys=True,
                        separators=(",", ":")).encode()
    return b"".join((MAGIC, _LEN.pack(len(header)), header, value))


def unpack(blob: bytes, *, auth: Optional[EntryAuth] = None, namespace: Optional[str] = None,
           key: str = "") -> tuple[bytes, dict]:
    """(value, meta) of an envelope; ``StoreCorruptError`` if anything does not check out. A keyed reader
    (``auth``) raises ``StoreAuthError`` (a subclass) for anything that is not an envelope of its key for
    ``(namespace, key)``; it checks the MAC over the raw bytes before it parses any of them."""
    head = bytes(blob[:len(MAGIC)])
    if auth is not None:
        if head != MAGIC_AUTH:
            raise StoreAuthError("shared value is not authenticated (written without an auth key, or forged)"
                                 if head == MAGIC else f"shared value is not a windowkit envelope ({len(blob)} bytes)")
        n0 = len(MAGIC_AUTH) + _TAG + _LEN.size
        if len(blob) < n0:
            raise StoreAuthError(f"authenticated shared value truncated ({len(blob)} bytes)")
        (hlen,) = _LEN.unpack_from(blob, n0 - _LEN.size)
        if n0 + hlen > len(blob):
            raise StoreAuthError("authenticated shared value header runs past its end (truncated?)")
        view = memoryview(blob)
        header, value = view[n0:n0 + hlen], view[n0 + hlen:]
        # one keyed pass in place of the sha256 one; the header is re-used as stored, not re-serialised
        if not auth.verify(view[len(MAGIC_AUTH):len(MAGIC_AUTH) + _TAG], _ident(namespace, key), header, value):
            raise StoreAuthError("shared value HMAC mismatch (forged, replayed from another key, or written with "
                                 "another auth key)")
        try:  # authentic from here on: only a key holder's bug could fail these
            h = json.loads(bytes(header))
            size, meta = int(h["size"]), h["meta"]
        except (ValueError, KeyError, TypeError) as e:
            raise StoreCorruptError(f"unreadable shared value header: {e}") from None
        if len(value) != size or not isinstance(meta, dict):
            raise StoreCorruptError("authenticated shared value does not match its header")
        return bytes(value), meta
    if head == MAGIC_AUTH:
        raise StoreAuthError("shared value is authenticated with a key this client does not hold: pass the "
                             "deployment's auth_key (or WINDOWKIT_AUTH_KEY / WINDOWKIT_AUTH_KEY_FILE)")
    n0 = len(MAGIC) + _LEN.size
    if len(blob) < n0 or head != MAGIC:
        raise StoreCorruptError(f"shared value is not a windowkit envelope ({len(blob)} bytes)")
    (hlen,) = _LEN.unpack_from(blob, len(MAGIC))
    if n0 + hlen > len(blob):
        raise StoreCorruptError("shared value header runs past its end (truncated?)")
    try:
        header = json.loads(bytes(blob[n0:n0 + hlen]))
        size, sha, meta = int(header["size"]), str(header["sha256"]), header["meta"]
    except (ValueError, KeyError, TypeError) as e:
        raise StoreCorruptError(f"unreadable shared value header: {e}") from None
    value = memoryview(blob)[n0 + hlen:]  # a view: the value is copied once, after it checks out
    if len(value) != size:
        raise StoreCorruptError(f"shared value has {len(value)} bytes, its header says {size} (partial?)")
    if not isinstance(meta, dict) or _digest(_meta_bytes(meta), value) != sha:
        raise StoreCorruptError("shared value sha256 mismatch")
    return bytes(value), meta


@runtime_checkable
class StoreBackend(Protocol):
    """A key -> (bytes, meta) store a ``ChunkStore`` consults after its local tiers.

    ``get`` returns None on a miss, raises ``StoreCorruptError`` for a value that failed its checksum (and
    removes it) and ``SharedStoreError`` when the backend cannot answer. ``put`` replaces any value under the
    key. Batched calls take and return lists in key order; ``get_batch`` skips corrupt values (None).
    """

    namespace: Optional[str]
    stats: dict
    # optional: ``auth`` (an ``EntryAuth`` or None). A backend with it authenticates entries and derives its
    # stored keys with the secret; ``ChunkStore(auth_key=...)`` sets it on a backend that has none.

    def put(self, key: str, value: bytes, meta: Optional[dict] = None) -> None: ...
    def get(self, key: str) -> Got: ...
    def exists(self, key: str) -> bool: ...
    def remove(self, key: str) -> bool: ...
    def put_batch(self, items: Sequence[Item]) -> None: ...
    def get_batch(self, keys: Sequence[str]) -> list[Got]: ...
    def exists_batch(self, keys: Sequence[str]) -> list[bool]: ...
    def remove_batch(self, keys: Sequence[str]) -> int: ...
    def close(self) -> None: ...


def new_stats() -> dict:
    """The counters every backend keeps (cumulative)."""
    return {"puts": 0, "gets": 0, "hits": 0, "misses": 0, "corrupt": 0, "forged": 0, "errors": 0,
            "bytes_written": 0, "bytes_read": 0}


class EmbeddedBackend:
    """In-process ``StoreBackend``: a dict of envelopes behind a lock. No server, no other process.

        shared = EmbeddedBackend()
        a = ChunkStore(shared=shared); b = ChunkStore(shared=shared)   # b reads what a put

    It is the protocol's reference implementation: several stores (windows, threads) of one process share
    it, and tests use it to check the shared-tier logic without a server. ``data`` is the raw dict of
    envelopes (tests corrupt values through it). For several processes use ``MooncakeBackend``.
    """

    def __init__(self, namespace: Optional[str] = None, auth_key: KeySpec = None) -> None:
        self.namespace = namespace
        self.auth: Optional[EntryAuth] = as_auth(auth_key)
        self.stats = new_stats()
        self.data: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def _k(self, key: str) -> str:
        return storage_key(self.namespace, key, self.auth)

    def put(self, key: str, value: bytes, meta: Optional[dict] = None) -> None:
        blob = pack(value, meta, auth=self.auth, namespace=self.namespace, key=key)
        with self._lock:
            self.data[self._k(key)] = blob
            self.stats["puts"] += 1
            self.stats["bytes_written"] += len(blob)

    def get(self, key: str) -> Got:
        with self._lock:
            self.stats["gets"] += 1
            blob = self.data.get(self._k(key))
            if blob is None:
                self.stats["misses"] += 1
                return None
            try:
                got = unpack(blob, auth=self.auth, namespace=self.namespace, key=key)
            except StoreCorruptError as e:
                del self.data[self._k(key)]  # never served again
                self.stats["forged" if isinstance(e, StoreAuthError) else "corrupt"] += 1
                raise
            self.stats["hits"] += 1
            self.stats["bytes_read"] += len(blob)
            return got

    def exists(self, key: str) -> bool:
        with self._lock:
            return self._k(key) in self.data

    def remove(self, key: str) -> bool:
        with self._lock:
            return self.data.pop(self._k(key), None) is not None

    def put_batch(self, items: Sequence[Item]) -> None:
        for key, value, meta in items:
            self.put(key, value, meta)

    def get_batch(self, keys: Sequence[str]) -> list[Got]:
        out: list[Got] = []
        for k in keys:
            try:
                out.append(self.get(k))
            except StoreCorruptError:
                out.append(None)
        return out

    def exists_batch(self, keys: Sequence[str]) -> list[bool]:
        return [self.exists(k) for k in keys]

    def remove_batch(self, keys: Sequence[str]) -> int:
        return sum(self.remove(k) for k in keys)

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"EmbeddedBackend(entries={len(self.data)})"


__all__ = ["StoreBackend", "EmbeddedBackend", "pack", "unpack", "namespace_prefix", "storage_key", "storage_prefix",
           "new_stats", "MAGIC", "MAGIC_AUTH",
           "SharedStoreError"]
