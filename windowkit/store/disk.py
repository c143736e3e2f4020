"""The disk tier: one safetensors file per entry + a SQLite index, written atomically, read verified.

    <path>/
      index.sqlite            table meta(k, v): format, model fingerprint, KV layout (JSON)
                              table entries: (kind, key, ctx) -> file, sha256, file_bytes, nbytes, meta, seq
      objects/<h>-<seq>.safetensors   h = sha256 of the entry id; the header metadata repeats kind/key/ctx
      LOCK                    flock'ed while a process has the store open (one writer at a time)

Why SQLite rather than a JSON index: a put or an eviction is one small transaction (O(log n)), where a
JSON index would be rewritten whole on every change (O(n) bytes per put for a store of thousands of
frames); SQLite's journal already gives the crash atomicity a hand-rolled JSON rename would need, and it
ships with Python. The index is still easy to inspect: ``sqlite3 index.sqlite 'select * from entries'``.

Crash safety: a file is written to a temp name, fsync'ed, renamed into place (``os.replace``) and the
directory fsync'ed *before* the index row that names it commits; a new version of an entry gets a new
file name (``-<seq>``), so the old row never points at a half-written file. A crash leaves at worst an
orphan file, removed on the next open. Every read checks size and sha256 before parsing.

Authenticated (``DiskTier(..., auth=EntryAuth(secret))``): the index's ``sha256`` column holds
``hmac:<HMAC-SHA256>`` over the entry's identity (model, domain, kind/key/ctx, nbytes), its meta and the file,
checked in the same single pass; the folder records the key's id (``meta.auth_key_id``) and trust domain
(``meta.domain``), and opening it with another key, without its key, or for another domain is refused.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import sqlite3
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from windowkit.errors import (AuthKeyError, KVShapeError, ModelMismatchError, StoreCorruptError, TrustDomainError,
                              WindowkitError)
from windowkit.kv.layout import KVLayout
from windowkit.store.auth import EntryAuth, domain_tag

try:  # advisory lock; absent on Windows, where a second opener is simply not detected
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

FORMAT = "windowkit-store/1"
EntryId = tuple[str, str, str]  # (kind: "c" canonical | "p" patch, chunk key, context hash or "")


class CorruptEntry(Exception):
    """Internal: a file failed a check. The store turns it into a drop + StoreCorruptError (or a miss)."""


class AuthFailed(CorruptEntry):
    """Internal: a file failed its HMAC check (forged or replaced). The store drops it and counts a miss."""


@dataclass
class Row:
    eid: EntryId
    file: str
    sha256: str
    file_bytes: int
    nbytes: int
    meta: dict
    seq: int


def layout_to_json(layout: KVLayout) -> str:
    return json.dumps({"family": layout.family, "num_layers": layout.num_layers,
                       "slot_shapes": [list(s) for s in layout.slot_shapes], "rope_slot": layout.rope_slot},
                      sort_keys=True)


def layout_from_json(text: str) -> KVLayout:
    d = json.loads(text)
    (h0, d0), (h1, d1) = d["slot_shapes"]
    return KVLayout(d["family"], int(d["num_layers"]), ((int(h0), int(d0)), (int(h1), int(d1))), int(d["rope_slot"]))


def header_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors blob (safetensors' ``load`` returns tensors only)."""
    if len(data) < 8:
        raise CorruptEntry("file shorter than a safetensors header")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise CorruptEntry("safetensors header runs past the end of the file")
    try:
        return dict(json.loads(data[8:8 + n]).get("__metadata__") or {})
    except (ValueError, AttributeError) as e:
        raise CorruptEntry(f"unreadable safetensors header: {e}") from None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover  (platforms that cannot open directories)
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


class DiskTier:
    """Files + index of one store directory. Not thread-safe on its own: ``ChunkStore`` serialises calls."""

    def __init__(self, path: str | os.PathLike, model_fingerprint: Optional[str], layout: Optional[KVLayout],
                 auth: Optional[EntryAuth] = None, domain: str = ""):
        self.path = Path(path)
        self.auth = auth
        self.domain = domain_tag(domain) if domain else ""
        self.objects = self.path / "objects"
        self.objects.mkdir(parents=True, exist_ok=True)
        self._lock_fd: Optional[int] = None
        self._acquire_lock()
        try:
            self.db = sqlite3.connect(str(self.path / "index.sqlite"), isolation_level=None, check_same_thread=False)
            self.db.execute("PRAGMA synchronous=FULL")
            with self._tx():
                self.db.execute("CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL)")
                self.db.execute("CREATE TABLE IF NOT EXISTS entries (kind TEXT NOT NULL, key TEXT NOT NULL, "
                                "ctx TEXT NOT NULL, file TEXT NOT NULL, sha256 TEXT NOT NULL, "
                                "file_bytes INTEGER NOT NULL, nbytes INTEGER NOT NULL, meta TEXT NOT NULL, "
                                "seq INTEGER NOT NULL, PRIMARY KEY (kind, key, ctx))")
            self.model_fingerprint, self.layout = self._check_meta(model_fingerprint, layout)
            self._check_trust()
        except sqlite3.DatabaseError as e:
            self.close()
            raise StoreCorruptError(f"store index {self.path / 'index.sqlite'} is unreadable: {e}") from None
        except BaseException:
            self.close()
            raise
        self.seq = int(self.db.execute("SELECT COALESCE(MAX(seq), 0) FROM entries").fetchone()[0])

    # ---------------------------------------------------------------- open
    def _acquire_lock(self) -> None:
        if fcntl is None:  # pragma: no cover
            return
        fd = os.open(self.path / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise WindowkitError(f"store {self.path} is open elsewhere (another ChunkStore or process); "
                                 "close it first") from None
        self._lock_fd = fd

    @contextmanager
    def _tx(self) -> Iterator[None]:
        """One write transaction (the connection runs in autocommit mode, so this is explicit)."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def _get_meta(self, k: str) -> Optional[str]:
        r = self.db.execute("SELECT v FROM meta WHERE k = ?", (k,)).fetchone()
        return None if r is None else r[0]

    def _set_meta(self, k: str, v: str) -> None:
        with self._tx():
            self.db.execute("INSERT OR REPLACE INTO meta (k, v) VALUES (?, ?)", (k, v))

    def _check_meta(self, fp: Optional[str], layout: Optional[KVLayout]) -> tuple[Optional[str], Optional[KVLayout]]:
        fmt = self._get_meta("format")
        if fmt is None:
            self._set_meta("format", FORMAT)
        elif fmt != FORMAT:
            raise WindowkitError(f"store {self.path} has format {fmt!r}; this windowkit reads {FORMAT!r}")
        stored_fp = self._get_meta("model_fingerprint") or None
        if stored_fp is not None and fp is not None and stored_fp != fp:
            raise ModelMismatchError(f"store {self.path} was written for model {stored_fp}, not {fp}; "
                                     "open it with that model or use another path")
        if stored_fp is None and fp is not None:
            self._set_meta("model_fingerprint", fp)
        stored_layout_text = self._get_meta("layout")
        stored_layout = layout_from_json(stored_layout_text) if stored_layout_text else None
        if stored_layout is not None and layout is not None and stored_layout != layout:
            raise KVShapeError(f"store {self.path} holds KV of layout {stored_layout.describe()}, "
                               f"not {layout.describe()}")
        if stored_layout is None and layout is not None:
            self.set_layout(layout)
        return stored_fp or fp, stored_layout or layout

    def _check_trust(self) -> None:
        """The folder's auth key id and domain must be ours; an empty folder is (re)bound to ours."""
        kid, dom = self._get_meta("auth_key_id") or None, self._get_meta("domain") or ""
        ours = None if self.auth is None else self.auth.key_id
        if (kid, dom) == (ours, self.domain):
            return
        if self.db.execute("SELECT COUNT(*) FROM entries").fetchone()[0] == 0:
            with self._tx():
                for k, v in (("auth_key_id", ours), ("domain", self.domain)):
                    if v:
                        self.db.execute("INSERT OR REPLACE INTO meta (k, v) VALUES (?, ?)", (k, v))
                    else:
                        self.db.execute("DELETE FROM meta WHERE k = ?", (k,))
            return
        if dom != self.domain:
            raise TrustDomainError(f"store {self.path} belongs to another trust domain (cache_salt) than this one; "
                                   "open it with the cache_salt it was written with, or use another path")
        if kid is not None and ours is None:
            raise AuthKeyError(f"store {self.path} holds authenticated entries (auth key id {kid}): pass that key "
                               "(auth_key=..., or WINDOWKIT_AUTH_KEY / WINDOWKIT_AUTH_KEY_FILE)")
        if kid is None:
            raise AuthKeyError(f"store {self.path} was written without an auth key, so its entries cannot be "
                               "authenticated: open it without auth_key, or give the keyed store a new path")
        raise AuthKeyError(f"store {self.path} was written with auth key id {kid}, not this key ({ours}): pass the "
                           "key it was written with, or give the new key a new path (see docs/security.md, rotation)")

    def _mac(self, eid: EntryId, nbytes: int, meta: dict, data) -> str:
        ident = json.dumps([self.model_fingerprint or "", self.domain, *eid, int(nbytes)]).encode()
        mb = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
        return "hmac:" + self.auth.mac(ident, mb, data)  # type: ignore[union-attr]

    def set_layout(self, layout: KVLayout) -> None:
        self._set_meta("layout", layout_to_json(layout))
        self.layout = layout

    def load_rows(self) -> tuple[list[Row], list[EntryId]]:
        """Index rows in write order, after dropping rows whose file is missing or has the wrong size and
        deleting files no row names (temp files and crash leftovers). Returns (rows, ids of the rows dropped)."""
        rows, dropped = [], []
        for kind, key, ctx, file, sha, fbytes, nbytes, meta, seq in self.db.execute(
                "SELECT kind, key, ctx, file, sha256, file_bytes, nbytes, meta, seq FROM entries ORDER BY seq"):
            rows.append(Row((kind, key, ctx), file, sha, int(fbytes), int(nbytes), json.loads(meta), int(seq)))
        keep = []
        for r in rows:
            try:
                ok = (self.objects / r.file).stat().st_size == r.file_bytes
            except OSError:
                ok = False
            if ok:
                keep.append(r)
            else:
                self.delete(r)
                dropped.append(r.eid)
        named = {r.file for r in keep}
        for f in self.objects.iterdir():
            if f.name not in named:
                f.unlink(missing_ok=True)
        return keep, dropped

    # ---------------------------------------------------------------- write / read / delete
    @staticmethod
    def file_stem(eid: EntryId) -> str:
        return hashlib.sha256(json.dumps(list(eid)).encode()).hexdigest()[:32]

    def write(self, eid: EntryId, tensors: dict[str, torch.Tensor], header: dict[str, str], nbytes: int,
              meta: dict) -> Row:
        """Write one entry atomically (file first, then its index row); replaces an older version."""
        kind, key, ctx = eid
        header = {**header, "format": FORMAT, "kind": kind, "key": key, "ctx": ctx,
                  "model_fingerprint": self.model_fingerprint or ""}
        data = st_save({k: t.detach().to("cpu") for k, t in tensors.items()}, metadata=header)
        sha = hashlib.sha256(data).hexdigest() if self.auth is None else self._mac(eid, nbytes, meta, data)
        self.seq += 1
        name = f"{self.file_stem(eid)}-{self.seq}.safetensors"
        tmp = self.objects / f".tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.objects / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(self.objects)
        old = self.db.execute("SELECT file FROM entries WHERE kind = ? AND key = ? AND ctx = ?", eid).fetchone()
        with self._tx():
            self.db.execute("INSERT OR REPLACE INTO entries (kind, key, ctx, file, sha256, file_bytes, nbytes, meta, "
                            "seq) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                            (kind, key, ctx, name, sha, len(data), int(nbytes), json.dumps(meta), self.seq))
        if old is not None and old[0] != name:
            (self.objects / old[0]).unlink(missing_ok=True)
        return Row(eid, name, sha, len(data), int(nbytes), meta, self.seq)

    def read(self, row: Row) -> tuple[dict[str, torch.Tensor], dict[str, str], int]:
        """(tensors, header metadata, bytes read) of a verified file; ``CorruptEntry`` on any failed check."""
        try:
            data = (self.objects / row.file).read_bytes()
        except OSError as e:
            raise CorruptEntry(f"cannot read {row.file}: {e}") from None
        if len(data) != row.file_bytes:
            raise CorruptEntry(f"{row.file}: {len(data)} bytes, the index says {row.file_bytes} (truncated?)")
        if self.auth is not None:  # the keyed check replaces the sha256 (one pass over the file either way)
            if not hmac.compare_digest(self._mac(row.eid, row.nbytes, row.meta, data), row.sha256):
                raise AuthFailed(f"{row.file}: HMAC mismatch (forged, replaced, or written with another key)")
        elif hashlib.sha256(data).hexdigest() != row.sha256:
            raise CorruptEntry(f"{row.file}: sha256 mismatch")
        header = header_metadata(data)
        kind, key, ctx = row.eid
        if (header.get("kind"), header.get("key"), header.get("ctx")) != (kind, key, ctx):
            raise CorruptEntry(f"{row.file}: holds {header.get('kind')}/{header.get('key')}/{header.get('ctx')}, "
                               f"the index says {kind}/{key}/{ctx}")
        try:
            tensors = st_load(data)
        except Exception as e:  # safetensors raises its own error types
            raise CorruptEntry(f"{row.file}: unreadable safetensors: {e}") from None
        return tensors, header, len(data)

    def delete(self, row: Row) -> None:
        with self._tx():
            self.db.execute("DELETE FROM entries WHERE kind = ? AND key = ? AND ctx = ?", row.eid)
        (self.objects / row.file).unlink(missing_ok=True)

    def close(self) -> None:
        db = getattr(self, "db", None)
        if db is not None:
            db.close()
            self.db = None  # type: ignore[assignment]
        if self._lock_fd is not None:
            if fcntl is not None:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None


__all__ = ["DiskTier", "Row", "EntryId", "CorruptEntry", "AuthFailed", "FORMAT", "layout_to_json", "layout_from_json"]
