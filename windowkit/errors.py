"""windowkit's exception hierarchy.

Every error windowkit raises on bad input is a ``WindowkitError``, so an agent loop can catch one
type::

    try:
        win.recall("frame-12")
    except wk.ChunkNotFoundError:
        win.admit(frame_chunk)
"""
from __future__ import annotations


class WindowkitError(Exception):
    """Base class of every error windowkit raises on purpose."""


class UnsupportedModelError(WindowkitError):
    """The model (or its RoPE / cache layout) is not one windowkit can relocate exactly."""


class ChunkNotFoundError(WindowkitError, KeyError):
    """A chunk id is not in the window or the store."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "chunk not found"


class StoreCorruptError(WindowkitError):
    """A stored entry failed its checksum or was truncated; it is dropped, never served."""


class SharedStoreError(WindowkitError):
    """A shared store tier (e.g. Mooncake) could not answer: ``reason`` is "unavailable", "timeout", "full",
    "missing" (listed but unreadable) or "error". ``ChunkStore`` counts it and treats the call as a miss."""

    def __init__(self, message: str, reason: str = "error") -> None:
        super().__init__(message)
        self.reason = reason


class StoreAuthError(StoreCorruptError):
    """A stored entry failed its authentication (HMAC-SHA256) check: forged, replayed under another key or
    domain, written with another auth key, or unauthenticated where a key is required. Never served."""


class AuthKeyError(WindowkitError):
    """An auth key is missing, malformed or not the one a store was written with (the message says which
    key to pass: ``auth_key=`` or the ``WINDOWKIT_AUTH_KEY`` / ``WINDOWKIT_AUTH_KEY_FILE`` variables)."""


class TrustDomainError(WindowkitError):
    """A store (e.g. a disk folder) belongs to another trust domain (``cache_salt``) than the one asked for."""


class UnauthenticatedStoreWarning(UserWarning):
    """A shared store tier is used without an auth key: anyone who can write to it can forge entries."""


class ModelMismatchError(WindowkitError):
    """KV or a store was produced by a different model than the one in use."""


class TraceFormatError(WindowkitError):
    """A trace file does not follow the JSON Lines trace schema."""


class ChunkError(WindowkitError, ValueError):
    """A chunk's inputs are malformed (empty, wrong dtype, inconsistent vision inputs...)."""


class KVShapeError(WindowkitError, ValueError):
    """KV tensors do not match the layout, dtype or device they are combined with."""


class PolicyError(WindowkitError, ValueError):
    """A policy (eviction, placement, refresh) was asked for by an unknown name, given a bad argument, or
    given a spec it cannot be made from. Also a ``ValueError``, so older ``except ValueError`` callers work."""


class PolicyTypeError(PolicyError, TypeError):
    """A policy cannot be made from a spec of this type (e.g. a number). Also a ``TypeError``."""


__all__ = [
    "WindowkitError",
    "UnsupportedModelError",
    "ChunkNotFoundError",
    "StoreCorruptError",
    "SharedStoreError",
    "StoreAuthError",
    "AuthKeyError",
    "TrustDomainError",
    "UnauthenticatedStoreWarning",
    "ModelMismatchError",
    "TraceFormatError",
    "ChunkError",
    "KVShapeError",
    "PolicyError",
    "PolicyTypeError",
]
