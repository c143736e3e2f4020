"""Content addresses of store entries.

A canonical ``KV(B|∅)`` depends on the chunk's content and the model, so its key hashes both::

    key = chunk_key(chunk.content_hash(), backend.fingerprint())

A patch depends on what came before the chunk, so it is stored under ``(key, ctx)``::

    ctx = context_hash([key_a, key_b], prefix=prefix_key)        # antecedents in window order
    ctx = orbit_context_hash([key_b, key_a], prefix=prefix_key)  # orbit patch: any order of the set

Trust domains: every function takes ``salt=`` (a ``cache_salt``, e.g. a tenant id); a non-empty salt is
mixed into the hash, so one domain's keys never equal another's, and the empty salt (default) gives
exactly the unsalted keys. Salting the chunk key salts every context hash chained from it::

    key = chunk_key(chunk.content_hash(), backend.fingerprint(), salt="tenant-a")

Hashes are hex sha256 prefixes of length 32 (128 bits). The inputs are JSON-encoded before hashing, so
no choice of ids can make two different contexts collide by concatenation (``["ab"]`` vs ``["a", "b"]``).
"""
from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from json.encoder import encode_basestring_ascii
from typing import Iterable, Sequence

KEY_HEX = 32


def _digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, separators=(",", ":")).encode()).hexdigest()[:KEY_HEX]


def _digest_strs(*items: str) -> str:
    """``_digest(list(items))`` for a flat list of strings, byte for byte the same JSON, without json.dumps's
    generic machinery (a Window hashes a context step per survivor per edit: this is its hot path)."""
    text = "[" + ",".join(map(encode_basestring_ascii, items)) + "]"
    return hashlib.sha256(text.encode()).hexdigest()[:KEY_HEX]


def chunk_key(content_hash: str, model_fingerprint: str | None, salt: str = "") -> str:
    """Key of a chunk's canonical KV: its content hash bound to the model that encoded it (and the trust
    domain ``salt``, if any).

        chunk_key(Chunk.text(ids).content_hash(), backend.fingerprint())
    """
    if salt:
        return _digest_strs("chunk", str(content_hash), model_fingerprint or "", str(salt))
    return _digest_strs("chunk", str(content_hash), model_fingerprint or "")


@lru_cache(maxsize=1 << 10)  # pure: every context chain of a window starts here
def context_root(prefix: str = "", salt: str = "") -> str:
    """Hash of the empty context after ``prefix`` (the start of the chain ``context_hash`` walks)."""
    if salt:
        return _digest_strs("ctx", str(prefix), str(salt))
    return _digest_strs("ctx", str(prefix))


@lru_cache(maxsize=1 << 16)  # pure: the same (context, key) pairs recur on every edit of a window
def context_step(prev: str, key: str) -> str:
    """The context hash one antecedent further: chained, so a window hashes all its contexts in O(n)."""
    return _digest_strs(str(prev), str(key))


@lru_cache(maxsize=1 << 16)
def _step_tail(key: str) -> bytes:
    """The JSON text of a chain step after the previous hash: ``",<key as JSON>]``."""
    return ('",' + encode_basestring_ascii(str(key)) + "]").encode()


def context_chain(h: str, keys: Iterable[str]) -> str:
    """``context_step`` applied over ``keys`` in turn, starting from the context hash ``h``: the same value, byte
    for byte, with one sha256 per key and nothing else (a hash is hex, so it needs no JSON escaping; the key's
    escaped text is cached). The tail admission of a window hashes its whole window: this is its hot path."""
    it = iter(keys)
    for k in it:  # the first step through the general path (``h`` may be any string)
        h = context_step(h, k)
        break
    else:
        return h
    b, sha, tail = h.encode(), hashlib.sha256, _step_tail
    for k in it:
        b = sha(b'["' + b + tail(k)).hexdigest()[:KEY_HEX].encode()
    return b.decode()


def context_hash(ids: Sequence[str], prefix: str = "", salt: str = "") -> str:
    """Hash of an ordered antecedent context: the chunk keys before the patched chunk, after ``prefix``.

        context_hash([key_a, key_b]) != context_hash([key_b, key_a])

    Defined as a chain (``context_root`` then one ``context_step`` per key) so that the contexts of every
    chunk of a window, each one a prefix of the next, cost one step each.
    """
    if isinstance(ids, str):  # a lone string would hash as its characters
        raise TypeError("context_hash takes a sequence of chunk keys, not one string")
    return context_chain(context_root(prefix, salt), ids)


def orbit_context_hash(ids: Sequence[str], prefix: str = "", salt: str = "") -> str:
    """Order-free context hash, for orbit patches that serve every ordering of the same antecedent set.

        orbit_context_hash([key_a, key_b]) == orbit_context_hash([key_b, key_a])

    Repeated ids count (a multiset). Never equal to an ordered ``context_hash``: an orbit patch is a
    different object than the patch for one particular order.
    """
    if isinstance(ids, str):
        raise TypeError("orbit_context_hash takes a sequence of chunk keys, not one string")
    if salt:
        return _digest(["orbit", prefix, sorted(str(i) for i in ids), str(salt)])
    return _digest(["orbit", prefix, sorted(str(i) for i in ids)])


def conditioned_key(key: str, ctx: str, salt: str = "") -> str:
    """Key of a chunk's exact conditioned KV (its prefill behind the context ``ctx``), stored like a canonical at
    position 0: the chunk-granular entry a radix prefix cache keeps (the same chunk behind the same context).

        conditioned_key(chunk_key(h, fp), context_hash([key_a])) != chunk_key(h, fp)
    """
    return _conditioned_key(str(key), str(ctx), str(salt))


@lru_cache(maxsize=1 << 16)
def _conditioned_key(key: str, ctx: str, salt: str) -> str:
    return _digest_strs("conditioned", key, ctx, salt) if salt else _digest_strs("conditioned", key, ctx)


__all__ = ["chunk_key", "conditioned_key", "context_chain", "context_hash", "context_root", "context_step",
           "orbit_context_hash"]
