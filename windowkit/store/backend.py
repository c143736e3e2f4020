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
"""
from __future__ import annotations

import hashlib
import json
import struct
import threading
from typing import Optional, Protocol, Sequence, runtime_checkable

from windowkit.errors import SharedStoreError, StoreCorruptError, WindowkitError

MAGIC = b"WKSV1\n"  # windowkit shared value, envelope version 1
_LEN = struct.Struct("<I")

Item = tuple[str, bytes, dict]  # (key, value, meta) of a batched put
Got = Optional[tuple[bytes, dict]]  # a get's result: (value, meta) or None on a miss


def namespace_prefix(namespace: Optional[str]) -> str:
    """Key prefix of a namespace: ``wk/<16 hex of sha256(namespace)>/`` (fingerprints may hold any characters)."""
    ns = hashlib.sha256((namespace or "").encode()).hexdigest()[:16]
    return f"wk/{ns}/"


def _meta_bytes(meta: dict) -> bytes:
    return json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()


def _digest(mb: bytes, value) -> str:
    h = hashlib.sha256(mb)
    h.update(value)  # incremental: no concatenated copy of a large value
    return h.hexdigest()


def pack(value: bytes, meta: Optional[dict] = None) -> bytes:
    """The envelope stored under a key: MAGIC | u32 header length | header JSON | value.

    The header holds the value's size, the metadata and sha256(metadata JSON + value).
    """
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise WindowkitError(f"a shared value is bytes, got {type(value).__name__}")
    meta = {} if meta is None else meta
    try:
        mb = _meta_bytes(meta)
    except (TypeError, ValueError) as e:
        raise WindowkitError(f"shared value meta must be JSON-serialisable: {e}") from None
    header = json.dumps({"size": len(value), "sha256": _digest(mb, value),
                         "meta": meta}, sort_keys=True, separators=(",", ":")).encode()
    return b"".join((MAGIC, _LEN.pack(len(header)), header, value))


def unpack(blob: bytes) -> tuple[bytes, dict]:
    """(value, meta) of an envelope; ``StoreCorruptError`` if anything does not check out."""
    n0 = len(MAGIC) + _LEN.size
    if len(blob) < n0 or bytes(blob[:len(MAGIC)]) != MAGIC:
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
    return {"puts": 0, "gets": 0, "hits": 0, "misses": 0, "corrupt": 0, "errors": 0,
            "bytes_written": 0, "bytes_read": 0}


class EmbeddedBackend:
    """In-process ``StoreBackend``: a dict of envelopes behind a lock. No server, no other process.

        shared = EmbeddedBackend()
        a = ChunkStore(shared=shared); b = ChunkStore(shared=shared)   # b reads what a put

    It is the protocol's reference implementation: several stores (windows, threads) of one process share
    it, and tests use it to check the shared-tier logic without a server. ``data`` is the raw dict of
    envelopes (tests corrupt values through it). For several processes use ``MooncakeBackend``.
    """

    def __init__(self, namespace: Optional[str] = None) -> None:
        self.namespace = namespace
        self.stats = new_stats()
        self.data: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def _k(self, key: str) -> str:
        return namespace_prefix(self.namespace) + key

    def put(self, key: str, value: bytes, meta: Optional[dict] = None) -> None:
        blob = pack(value, meta)
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
                got = unpack(blob)
            except StoreCorruptError:
                del self.data[self._k(key)]  # never served again
                self.stats["corrupt"] += 1
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


__all__ = ["StoreBackend", "EmbeddedBackend", "pack", "unpack", "namespace_prefix", "new_stats", "MAGIC",
           "SharedStoreError"]
