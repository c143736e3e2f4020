"""Content-addressed store of canonical KV and conditioning patches: memory tier, optional disk tier.

    from windowkit.store import ChunkStore, chunk_key, context_hash, orbit_context_hash

    store = ChunkStore("runs/store", budget_bytes=8 << 30, model_fingerprint=backend.fingerprint())
    key = store.chunk_key(chunk.content_hash())
    store.put_canonical(key, kv)
    store.put_patch(key, context_hash([key_a]), patch)
    kv = store.get_canonical(key)

Layering: imports ``windowkit.kv``, ``windowkit.errors`` and ``windowkit.registry`` only (never ``policies``:
the eviction protocol and the default ``LRU`` are ``windowkit.store.eviction``; other policies are found by
name through its registry).
Cold tier (off by default): ``ChunkStore(..., cold=ColdTierConfig(rank=16))`` stores canonicals under
budget pressure (or on ``store.compress(key)``) as exact edge rows + low-rank factors; see docs/store.md.
Shared tier (off by default): ``ChunkStore(..., shared=EmbeddedBackend())`` or ``shared=MooncakeBackend(...)``
(``windowkit.store.mooncake``, imported lazily: Mooncake is an optional dependency) is read after the local
tiers and written through on put, so several processes reuse each other's canonicals and patches.
Trust (off by default; docs/security.md): ``ChunkStore(..., cache_salt="tenant-a", auth_key=secret)`` puts the
store in a trust domain and HMAC-authenticates every shared and disk entry (``windowkit.store.auth``).
"""
from windowkit.store.backend import EmbeddedBackend, StoreBackend
from windowkit.store.cold import ColdTierConfig
from windowkit.store.keys import chunk_key, conditioned_key, context_hash, context_root, context_step, orbit_context_hash
from windowkit.store.store import ChunkStore, StoreStats

# the public names (docs/api.md); the others imported above stay importable from here and from their modules
__all__ = ["ChunkStore", "ColdTierConfig", "StoreBackend", "EmbeddedBackend", "chunk_key", "context_hash",
           "orbit_context_hash"]
