"""Content-addressed store of canonical KV and conditioning patches: memory tier, optional disk tier.

    from windowkit.store import ChunkStore, chunk_key, context_hash, orbit_context_hash

    store = ChunkStore("runs/store", budget_bytes=8 << 30, model_fingerprint=backend.fingerprint())
    key = store.chunk_key(chunk.content_hash())
    store.put_canonical(key, kv)
    store.put_patch(key, context_hash([key_a]), patch)
    kv = store.get_canonical(key)

Layering: imports ``windowkit.kv``, ``windowkit.errors`` and ``policies.eviction`` only.
See docs/store.md.
"""
from windowkit.store.keys import chunk_key, context_hash, orbit_context_hash
from windowkit.store.store import ChunkStore, StoreStats

__all__ = ["ChunkStore", "StoreStats", "chunk_key", "context_hash", "orbit_context_hash"]
