"""Authenticated store entries and trust domains: one secret key, two derived keys (addresses and MACs).

    from windowkit.store.auth import EntryAuth, auth_key_from_env

    auth = EntryAuth(b"32 random bytes from a secrets manager.....")
    auth.address("c/key/")                   # the shared-tier address: not computable without the key
    tag = auth.tag(b"ident", b"meta", value)  # HMAC-SHA256 over an entry, replaces the unkeyed sha256
    auth.verify(tag, b"ident", b"meta", value)
    key = auth_key_from_env()                # WINDOWKIT_AUTH_KEY (text) or WINDOWKIT_AUTH_KEY_FILE (raw bytes)

The secret is never used directly: ``HMAC(secret, label)`` derives one key for entry MACs and one for
addresses, so a leaked address reveals nothing about the MAC key. A MAC covers the entry's identity (its
key, and whatever the caller binds: namespace, domain, size), its metadata and its value, each part length
prefixed, so no part can be shifted into another. ``key_id`` (16 hex of a third derived value) names a key
in error messages and disk folders without revealing it. See docs/security.md.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import struct
import threading
import warnings
from pathlib import Path
from typing import Mapping, Optional, Union

from windowkit.errors import AuthKeyError, UnauthenticatedStoreWarning

ENV_KEY = "WINDOWKIT_AUTH_KEY"  # the key itself, as text (UTF-8 bytes are the key)
ENV_KEY_FILE = "WINDOWKIT_AUTH_KEY_FILE"  # a file holding the key (raw bytes; one trailing newline dropped)
MIN_KEY_BYTES = 16
_U32 = struct.Struct("<I")
_MAKE_KEY = "python -c 'import secrets; print(secrets.token_hex(32))'"

KeySpec = Union[bytes, bytearray, str, "EntryAuth", None]


class EntryAuth:
    """Keys derived from one secret: ``address`` (shared-tier keys), ``mac`` / ``verify`` (entries).

        auth = EntryAuth(secret)   # bytes (>= 16) or str (its UTF-8 bytes)
    """

    __slots__ = ("key_id", "_mac", "_addr")

    def __init__(self, secret: Union[bytes, bytearray, str]) -> None:
        if isinstance(secret, str):
            secret = secret.encode()
        if not isinstance(secret, (bytes, bytearray)):
            raise AuthKeyError(f"an auth key is bytes or str, got {type(secret).__name__}")
        if len(secret) < MIN_KEY_BYTES:
            raise AuthKeyError(f"an auth key needs at least {MIN_KEY_BYTES} bytes, got {len(secret)}; make one with "
                               f"{_MAKE_KEY}")
        secret = bytes(secret)
        derive = lambda label: hmac.new(secret, b"windowkit/v1/" + label, hashlib.sha256).digest()  # noqa: E731
        # HMAC objects keyed once and copied per use: the key schedule is not redone per entry
        self._mac = hmac.new(derive(b"mac"), digestmod=hashlib.sha256)
        self._addr = hmac.new(derive(b"addr"), digestmod=hashlib.sha256)
        self.key_id = derive(b"id").hex()[:16]

    def address(self, *parts: str) -> str:
        """32 hex of HMAC(address key, parts): a storage key that only holders of the secret can compute."""
        h = self._addr.copy()
        for p in parts:
            b = p.encode()
            h.update(_U32.pack(len(b)))
            h.update(b)
        return h.hexdigest()[:32]

    def tag(self, ident: bytes, meta: bytes, value) -> bytes:
        """HMAC-SHA256 (32 bytes) over (ident, meta, value); ``value`` may be a memoryview (hashed in place)."""
        h = self._mac.copy()
        h.update(b"".join((_U32.pack(len(ident)), ident, _U32.pack(len(meta)), meta)))  # small parts: one call
        h.update(value)  # last: its length is implied, so no prefix is needed
        return h.digest()

    def mac(self, ident: bytes, meta: bytes, value) -> str:
        """``tag`` in hex (for text columns such as the disk index)."""
        return self.tag(ident, meta, value).hex()

    def verify(self, tag: object, ident: bytes, meta: bytes, value) -> bool:
        """Whether ``tag`` (bytes, or hex str) is the MAC of (ident, meta, value); constant-time comparison."""
        if isinstance(tag, str):
            return hmac.compare_digest(tag, self.mac(ident, meta, value))
        return isinstance(tag, (bytes, bytearray, memoryview)) and hmac.compare_digest(bytes(tag),
                                                                                       self.tag(ident, meta, value))

    def __repr__(self) -> str:  # never the secret
        return f"EntryAuth(key_id={self.key_id})"


def as_auth(key: KeySpec) -> Optional[EntryAuth]:
    """None, an ``EntryAuth`` as is, or an ``EntryAuth`` of a bytes / str secret (``AuthKeyError`` if unfit)."""
    if key is None or isinstance(key, EntryAuth):
        return key
    return EntryAuth(key)


def auth_key_from_env(environ: Optional[Mapping[str, str]] = None) -> Optional[bytes]:
    """The key named by ``WINDOWKIT_AUTH_KEY`` (its text) or ``WINDOWKIT_AUTH_KEY_FILE`` (the file's bytes),
    or None if neither is set. Both set, an unreadable file or a short key raise ``AuthKeyError``.

        key = auth_key_from_env()   # e.g. WINDOWKIT_AUTH_KEY_FILE=/run/secrets/windowkit_key
    """
    env = os.environ if environ is None else environ
    text, path = env.get(ENV_KEY) or None, env.get(ENV_KEY_FILE) or None
    if text is not None and path is not None:
        raise AuthKeyError(f"set one of {ENV_KEY} and {ENV_KEY_FILE}, not both")
    if path is not None:
        try:
            key = Path(path).read_bytes()
        except OSError as e:
            raise AuthKeyError(f"{ENV_KEY_FILE}={path!r} cannot be read: {e}") from None
        key = key[:-1] if key.endswith(b"\n") else key  # `echo $KEY > file` adds one
    elif text is not None:
        key = text.encode()
    else:
        return None
    if len(key) < MIN_KEY_BYTES:
        raise AuthKeyError(f"the auth key from {ENV_KEY_FILE if path else ENV_KEY} has {len(key)} bytes; it needs "
                           f"at least {MIN_KEY_BYTES}: make one with {_MAKE_KEY}")
    return key


def domain_tag(salt: str) -> str:
    """A non-secret name of a trust domain (16 hex of sha256), recorded where the salt itself need not be."""
    return hashlib.sha256(("windowkit-domain\0" + salt).encode()).hexdigest()[:16]


_warned = False
_warn_lock = threading.Lock()


def warn_unauthenticated(what: str) -> None:
    """Warn once per process that a shared tier runs without a key (``UnauthenticatedStoreWarning``)."""
    global _warned
    with _warn_lock:
        if _warned:
            return
        _warned = True
    warnings.warn(f"{what} is used without an auth key: anyone who can write to it can make every reader serve "
                  f"forged KV, and any client can test which documents were processed. Set a shared secret: "
                  f"ChunkStore(..., auth_key=...) or {ENV_KEY} / {ENV_KEY_FILE} (make one with {_MAKE_KEY}); "
                  "see docs/security.md", UnauthenticatedStoreWarning, stacklevel=4)


__all__ = ["EntryAuth", "as_auth", "auth_key_from_env", "domain_tag", "warn_unauthenticated", "ENV_KEY",
           "ENV_KEY_FILE", "MIN_KEY_BYTES"]
