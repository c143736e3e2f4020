"""Tests written against surviving mutants of windowkit/store (make mutate; docs/testing.md, "Mutation testing").

Expected keys are computed here from the documented format (hex sha256 prefix, 32 chars, of the compact JSON of
a tagged list), never read back from windowkit.
"""
from __future__ import annotations

import hashlib
import json

from windowkit.store import chunk_key


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, separators=(",", ":")).encode()).hexdigest()[:32]


def test_salted_chunk_key_without_a_model_fingerprint():
    # no fingerprint hashes as the empty string, salted or not
    assert chunk_key("abc", None, salt="tenant") == digest(["chunk", "abc", "", "tenant"])
    assert chunk_key("abc", None, salt="tenant") == chunk_key("abc", "", salt="tenant")


# ----------------------------------------------------------------------------------------------- shared tier
# Two stores over one in-process EmbeddedBackend (the StoreBackend reference implementation): what one puts,
# the other reads, and a value that is not the entry asked for is never served.

import pytest  # noqa: E402
import torch  # noqa: E402

from windowkit.errors import AuthKeyError, ChunkNotFoundError, ModelMismatchError, WindowkitError  # noqa: E402
from windowkit.kv.layout import ChunkKV, KVLayout  # noqa: E402
from windowkit.kv.patch import patch_from_deficit  # noqa: E402
from windowkit.store import ChunkStore  # noqa: E402
from windowkit.store.backend import EmbeddedBackend  # noqa: E402

LAY = KVLayout("gqa", 1, ((1, 4), (1, 3)), 0)
KEY = b"0123456789abcdef0123456789abcdef"


def _kv(seed=0, s=5, layout=LAY):
    g = torch.Generator().manual_seed(seed)
    return ChunkKV([tuple(torch.randn(h, s, d, generator=g) for h, d in layout.slot_shapes)
                    for _ in range(layout.num_layers)], layout)


def _same(a, b):
    return all(torch.equal(x, y) for p, q in zip(a.layers, b.layers) for x, y in zip(p, q))


def test_one_store_reads_what_another_put():
    shared = EmbeddedBackend()
    a = ChunkStore(model_fingerprint="fp", layout=LAY, shared=shared)
    b = ChunkStore(model_fingerprint="fp", layout=LAY, shared=shared)
    kv, p = _kv(1), patch_from_deficit(_kv(2), 2, meta={"kind": "fresh"})
    assert a.put_canonical("k", kv) and a.put_patch("k", "ctx1", p)
    assert a.stats.shared_puts == 2 and shared.namespace == "fp"
    assert len(shared.data) == 2
    got = b.get_canonical("k")
    assert _same(got, kv) and b.stats.shared_hits == 1 and b.stats.hits == 1
    assert b.stats.shared_bytes_read == kv.nbytes and b.has_canonical("k")        # kept locally
    gp = b.get_patch("k", "ctx1")
    assert gp.meta == {"kind": "fresh"} and gp.rank == 2
    assert all(torch.equal(gp.factors[k][i], p.factors[k][i]) for k in p.factors for i in (0, 1))
    with pytest.raises(ChunkNotFoundError):
        b.get_canonical("nope")
    assert b.get_patch("k", "ctx2") is None
    assert b.stats.shared_misses == 2 and b.stats.misses == 2 and b.stats.shared_fallbacks == 0


def test_an_empty_store_adopts_the_writers_layout():
    shared = EmbeddedBackend()
    ChunkStore(model_fingerprint="fp", layout=LAY, shared=shared).put_canonical("k", _kv(1))
    blank = ChunkStore(model_fingerprint="fp", shared=shared)
    assert _same(blank.get_canonical("k"), _kv(1)) and blank.layout == LAY


def test_trust_domains_share_nothing():
    shared = EmbeddedBackend()
    ChunkStore(model_fingerprint="fp", layout=LAY, shared=shared, cache_salt="t1").put_canonical("k", _kv(1))
    assert not any("/k/" in k for k in shared.data)                     # a salted address hides the key
    with pytest.raises(ChunkNotFoundError):
        ChunkStore(model_fingerprint="fp", layout=LAY, shared=shared, cache_salt="t2").get_canonical("k")
    with pytest.raises(ChunkNotFoundError):
        ChunkStore(model_fingerprint="fp", layout=LAY, shared=shared).get_canonical("k")
    same = ChunkStore(model_fingerprint="fp", layout=LAY, shared=shared, cache_salt="t1")
    assert _same(same.get_canonical("k"), _kv(1))


def test_a_value_under_another_entrys_address_is_never_served():
    shared = EmbeddedBackend()
    a = ChunkStore(model_fingerprint="fp", layout=LAY, shared=shared)
    a.put_canonical("k1", _kv(1))
    a.put_canonical("k2", _kv(2))
    addr = {k: v for k, v in shared.data.items()}
    k1, k2 = sorted(addr, key=lambda s: "k2" in s)
    shared.data[k2] = addr[k1]                                          # k1's value at k2's address
    b = ChunkStore(model_fingerprint="fp", layout=LAY, shared=shared)
    with pytest.raises(ChunkNotFoundError):
        b.get_canonical("k2")
    assert b.stats.shared_fallback_reasons and b.stats.shared_hits == 0 and k2 not in shared.data
    shared.data[k1] = addr[k1][:-3] + b"xyz"                            # flipped bytes
    with pytest.raises(ChunkNotFoundError):
        b.get_canonical("k1")
    assert b.stats.shared_hits == 0 and k1 not in shared.data


def test_keyed_stores_authenticate_the_shared_tier():
    shared = EmbeddedBackend()
    a = ChunkStore(model_fingerprint="fp", layout=LAY, shared=shared, auth_key=KEY)
    assert shared.auth is not None and shared.auth.key_id == a._auth.key_id
    a.put_canonical("k", _kv(1))
    b = ChunkStore(model_fingerprint="fp", layout=LAY, shared=shared, auth_key=KEY)
    assert _same(b.get_canonical("k"), _kv(1))
    (addr, blob), = shared.data.items()
    shared.data[addr] = blob[:-1] + bytes([blob[-1] ^ 1])                # one flipped bit: the MAC fails
    c = ChunkStore(model_fingerprint="fp", layout=LAY, shared=shared, auth_key=KEY)
    with pytest.raises(ChunkNotFoundError):
        c.get_canonical("k")
    assert c.stats.auth_failures == 1 and c.stats.shared_fallback_reasons == {"auth": 1} and not shared.data
    with pytest.raises(AuthKeyError, match="is not this store's"):
        ChunkStore(model_fingerprint="fp", layout=LAY, shared=shared, auth_key=b"another key of 16+ bytes")


def test_shared_argument_checks():
    with pytest.raises(WindowkitError, match=r"^shared must be a StoreBackend, 'mooncake' or None, got 'redis'$"):
        ChunkStore(shared="redis")
    with pytest.raises(WindowkitError, match=r"^shared must implement StoreBackend, got object$"):
        ChunkStore(shared=object())
    with pytest.raises(ModelMismatchError, match=r"shared backend namespace 'fp' is not this store's model 'other'"):
        ChunkStore(model_fingerprint="other", shared=EmbeddedBackend(namespace="fp"))


# ----------------------------------------------------------------------------------------------- auth
# The derivation is the documented one (docs/security.md, windowkit/store/auth.py): HMAC(secret,
# b"windowkit/v1/" + label) gives the MAC, address and id keys; recomputed here with the stdlib.

import hashlib as _hl  # noqa: E402
import hmac  # noqa: E402
import struct  # noqa: E402

from windowkit.store.auth import EntryAuth, as_auth, auth_key_from_env, domain_tag  # noqa: E402


def _derive(label: bytes) -> bytes:
    return hmac.new(KEY, b"windowkit/v1/" + label, _hl.sha256).digest()


def test_entry_auth_by_the_documented_derivation():
    a = EntryAuth(KEY)
    assert a.key_id == _derive(b"id").hex()[:16] and repr(a) == f"EntryAuth(key_id={a.key_id})"
    assert EntryAuth(KEY.decode()).key_id == a.key_id and EntryAuth(bytearray(KEY)).key_id == a.key_id
    want = hmac.new(_derive(b"addr"), struct.pack("<I", 2) + b"c/" + struct.pack("<I", 1) + b"k", _hl.sha256)
    assert a.address("c/", "k") == want.hexdigest()[:32] and a.address("c/k") != a.address("c/", "k")
    body = struct.pack("<I", 5) + b"ident" + struct.pack("<I", 4) + b"meta" + b"value"
    tag = hmac.new(_derive(b"mac"), body, _hl.sha256).digest()
    assert a.tag(b"ident", b"meta", b"value") == tag and a.mac(b"ident", b"meta", b"value") == tag.hex()
    assert a.verify(tag, b"ident", b"meta", b"value") and a.verify(tag.hex(), b"ident", b"meta", b"value")
    assert a.verify(memoryview(tag), b"ident", b"meta", b"value")
    assert not a.verify(tag, b"ident", b"meta", b"valuE") and not a.verify(12, b"ident", b"meta", b"value")
    assert as_auth(None) is None and as_auth(a) is a and as_auth(KEY).key_id == a.key_id
    assert domain_tag("t") == _hl.sha256(b"windowkit-domain\0t").hexdigest()[:16]


def test_entry_auth_refusals_say_what_to_do(tmp_path):
    with pytest.raises(AuthKeyError, match=r"^an auth key is bytes or str, got int$"):
        EntryAuth(5)
    with pytest.raises(AuthKeyError, match=r"^an auth key needs at least 16 bytes, got 15; make one with python -c"):
        EntryAuth(b"x" * 15)
    assert auth_key_from_env({}) is None
    assert auth_key_from_env({"WINDOWKIT_AUTH_KEY": KEY.decode()}) == KEY
    f = tmp_path / "key"
    f.write_bytes(KEY + b"\n")
    assert auth_key_from_env({"WINDOWKIT_AUTH_KEY_FILE": str(f)}) == KEY            # one trailing newline dropped
    with pytest.raises(AuthKeyError, match=r"^set one of WINDOWKIT_AUTH_KEY and WINDOWKIT_AUTH_KEY_FILE, not both$"):
        auth_key_from_env({"WINDOWKIT_AUTH_KEY": KEY.decode(), "WINDOWKIT_AUTH_KEY_FILE": str(f)})
    with pytest.raises(AuthKeyError, match=r"^WINDOWKIT_AUTH_KEY_FILE='/nonexistent/k' cannot be read"):
        auth_key_from_env({"WINDOWKIT_AUTH_KEY_FILE": "/nonexistent/k"})
    with pytest.raises(AuthKeyError, match=r"^the auth key from WINDOWKIT_AUTH_KEY has 3 bytes; it needs at least 16"):
        auth_key_from_env({"WINDOWKIT_AUTH_KEY": "abc"})
    short = tmp_path / "short"
    short.write_bytes(b"abc")
    with pytest.raises(AuthKeyError, match=r"^the auth key from WINDOWKIT_AUTH_KEY_FILE has 3 bytes"):
        auth_key_from_env({"WINDOWKIT_AUTH_KEY_FILE": str(short)})


def test_sixteen_bytes_is_enough_and_the_process_environment_is_the_default(monkeypatch):
    assert EntryAuth(b"x" * 16).key_id and auth_key_from_env({"WINDOWKIT_AUTH_KEY": "y" * 16}) == b"y" * 16
    monkeypatch.delenv("WINDOWKIT_AUTH_KEY", raising=False)
    monkeypatch.delenv("WINDOWKIT_AUTH_KEY_FILE", raising=False)
    assert auth_key_from_env() is None
    monkeypatch.setenv("WINDOWKIT_AUTH_KEY", KEY.decode())
    assert auth_key_from_env() == KEY


def test_unauthenticated_warning_once_per_process(monkeypatch):
    import warnings

    import windowkit.store.auth as auth
    from windowkit.errors import UnauthenticatedStoreWarning

    monkeypatch.setattr(auth, "_warned", False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        auth.warn_unauthenticated("the tier")
        auth.warn_unauthenticated("the tier")
    assert len(w) == 1 and w[0].category is UnauthenticatedStoreWarning
    assert str(w[0].message).startswith("the tier is used without an auth key")
    assert str(w[0].message).endswith("see docs/security.md") and auth._warned is True


# ----------------------------------------------------------------------------------------------- ChunkStore


def test_store_argument_checks_exactly(tmp_path):
    assert ChunkStore(budget_bytes=0).budget_bytes == 0                                    # zero is a budget
    cases = [
        (dict(budget_bytes=-1), r"^budget_bytes must be >= 0 or None, got -1$"),
        (dict(memory_budget_bytes=5), r"^memory_budget_bytes bounds the memory cache in front of a disk tier: it "
                                      r"needs a path and a value >= 0 \(a memory-only store is bounded by "
                                      r"budget_bytes\)$"),
        (dict(on_corrupt="ignore"), r"^on_corrupt must be 'raise' or 'miss', got 'ignore'$"),
        (dict(policy="bogus"), r"^unknown eviction policy 'bogus'; known: "),
        (dict(cold=5), r"^cold must be a ColdTierConfig or None, got int$"),
        (dict(cache_salt=5), r"^cache_salt is a string \(a trust domain, e.g. a tenant id\), got int$"),
    ]
    for kw, msg in cases:
        with pytest.raises(WindowkitError, match=msg):
            ChunkStore(**kw)


def test_store_counters_by_hand(tmp_path):
    s = ChunkStore(tmp_path / "s", model_fingerprint="fp", layout=LAY)
    s.put_canonical("k", _kv(1))
    s.close()
    r = ChunkStore(tmp_path / "s")
    for _ in range(3):
        assert _same(r.get_canonical("k"), _kv(1))
    # one disk read, then two memory hits; three hits in all
    assert (r.stats.disk_reads, r.stats.memory_hits, r.stats.hits, r.stats.misses) == (1, 2, 3, 0)
    assert r.stats.disk_bytes_read > _kv(1).nbytes
    for _ in range(2):
        assert r.get_patch("k", "none") is None
    assert r.stats.misses == 2


# ----------------------------------------------------------------------------------------------- store.py survivors
# Written against the survivors of windowkit/store/store.py (docs/testing.md, "Mutation testing"). Expected values
# are worked out here: byte counts from tensor shapes (float32: 4 bytes), file sizes from the files on disk,
# addresses from the documented formats; never read back from the store under test.

import os  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

from policies.eviction import LRU  # noqa: E402
from windowkit.errors import (KVShapeError, SharedStoreError, StoreCorruptError,  # noqa: E402
                              TrustDomainError, UnauthenticatedStoreWarning)
from windowkit.store import ColdTierConfig, context_hash  # noqa: E402
from windowkit.store.disk import layout_to_json  # noqa: E402

NB = (1 * 5 * 4 + 1 * 5 * 3) * 4  # bytes of _kv(): one layer, slots [1, 5, 4] and [1, 5, 3], float32
WIDE = KVLayout("gqa", 1, ((2, 8), (2, 8)), 0)  # d = 16: a 64-token canonical compresses at rank 2
COLD = ColdTierConfig(rank=2, protected_rows=2, recent_rows=4)


class RecLRU(LRU):
    """LRU that records every removal and whether it was an eviction (SizeAware ages its clock on those only)."""

    def __init__(self) -> None:
        super().__init__()
        self.removed: list = []

    def _on_remove(self, key, evicted) -> None:
        self.removed.append((key, evicted))
        super()._on_remove(key, evicted)


class RecBackend(EmbeddedBackend):
    """EmbeddedBackend that records the keys it is asked for, can fail a call, and counts closes."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.calls: list = []
        self.faults: dict = {}
        self.closed = 0

    def _call(self, op, key):
        self.calls.append((op, key))
        if op in self.faults:
            raise self.faults[op]

    def put(self, key, value, meta=None):
        self._call("put", key)
        super().put(key, value, meta)

    def get(self, key):
        self._call("get", key)
        return super().get(key)

    def exists(self, key):
        self._call("exists", key)
        return super().exists(key)

    def close(self):
        self.closed += 1


class NoAuthBackend:
    """A StoreBackend without an ``auth`` attribute (it cannot authenticate)."""

    def __init__(self) -> None:
        self._b = EmbeddedBackend()
        self.namespace = None
        self.stats = self._b.stats

    def put(self, key, value, meta=None):
        self._b.namespace = self.namespace
        self._b.put(key, value, meta)

    def get(self, key):
        return self._b.get(key)

    def exists(self, key):
        return self._b.exists(key)

    def remove(self, key):
        return self._b.remove(key)

    def put_batch(self, items):
        self._b.put_batch(items)

    def get_batch(self, keys):
        return self._b.get_batch(keys)

    def exists_batch(self, keys):
        return self._b.exists_batch(keys)

    def remove_batch(self, keys):
        return self._b.remove_batch(keys)

    def close(self):
        pass


def _wide(seed=0, s=64):
    return _kv(seed, s, WIDE)


def _flip(path) -> None:
    data = bytearray(Path(path).read_bytes())
    data[-1] ^= 1  # a payload byte: the file still parses, only the checksum / MAC can tell
    Path(path).write_bytes(bytes(data))


def _reput(shared, addr_key, **changes):
    """Re-store the value under ``addr_key`` with its shared meta edited (a fresh, valid envelope)."""
    data, smeta = shared.get(addr_key)
    shared.put(addr_key, data, {**smeta, **changes})


def test_refusals_name_what_is_wrong_exactly(tmp_path):
    s = ChunkStore(layout=LAY)
    with pytest.raises(WindowkitError, match=r"^a patch context is a string \(see context_hash\), got int$"):
        s.put_patch("k", 5, patch_from_deficit(_kv(2), 2))
    with pytest.raises(ChunkNotFoundError, match=r"^chunk keys are non-empty strings, got 5$"):
        s.get_canonical(5)
    with pytest.raises(ChunkNotFoundError, match=r"^chunk keys are non-empty strings, got ''$"):
        s.put_canonical("", _kv(1))
    with pytest.raises(KVShapeError, match=r"^put_canonical takes a ChunkKV, got str$"):
        s.put_canonical("k", "kv")
    with pytest.raises(KVShapeError, match=r"^put_patch takes a Patch, got str$"):
        s.put_patch("k", "c", "patch")
    other = KVLayout("gqa", 1, ((1, 4), (1, 4)), 0)
    with pytest.raises(KVShapeError, match=r"^canonical has layout .*; the store holds "):
        s.put_canonical("k", _kv(1, layout=other))
    with pytest.raises(KVShapeError, match=r"^patch has layout .*; the store holds "):
        s.put_patch("k", "c", patch_from_deficit(_kv(2, layout=other), 2))
    for f in (s.meta, s.entry_path):
        with pytest.raises(ChunkNotFoundError, match=r"^no canonical for chunk key 'k'$"):
            f("k")
        with pytest.raises(ChunkNotFoundError, match=r"^no patch for chunk key 'k'$"):
            f("k", "c")
    with pytest.raises(WindowkitError, match=r"^compress needs a ColdTierConfig \(pass one, or open the store with "
                                             r"cold=\.\.\.\)$"):
        s.compress("k")
    with pytest.raises(ChunkNotFoundError, match=r"^no canonical KV for chunk key 'k' in the store$"):
        s.compress("k", COLD)
    s.close()
    with pytest.raises(WindowkitError, match=r"^the chunk store is closed$"):
        s.put_canonical("k", _kv(1))


def test_entry_path_meta_contains_and_repr(tmp_path):
    s = ChunkStore(layout=LAY)
    assert "absent" not in s and 5 not in s
    s.put_patch("k", "c", patch_from_deficit(_kv(2), 2), {"n": 1})
    assert s.entry_path("k", "c") is None and s.meta("k", "c") == {"n": 1}    # a patch without its canonical
    s.put_canonical("k", _kv(1))
    assert "k" in s and s.entry_path("k") is None
    assert repr(s) == f"ChunkStore(memory, entries=2, nbytes={s.nbytes}, budget_bytes=None, policy=lru)"
    d = ChunkStore(tmp_path / "d", budget_bytes=1000, layout=LAY)
    d.put_patch("k", "c", patch_from_deficit(_kv(2), 2))
    p = Path(d.entry_path("k", "c"))
    assert p.parent == tmp_path / "d" / "objects" and p.exists()
    assert repr(d) == f"ChunkStore(path={str(tmp_path / 'd')!r}, entries=1, nbytes={d.nbytes}, budget_bytes=1000, " \
                      "policy=lru)"
    st = d.stats.as_dict()
    assert st["bytes_written"] == d.nbytes and st["hits"] == 0 and set(st) == set(vars(d.stats))


def test_user_meta_named_approx_is_not_a_cold_mark():
    s = ChunkStore(layout=LAY)
    s.put_canonical("k", _kv(1), {"approx": 0.5})
    assert not s.is_cold("k") and s.meta("k") == {"approx": 0.5}
    assert s.cold_stats() == {"entries": 0, "bytes": 0, "exact_bytes": 0, "bytes_saved": 0}


def test_budget_edges_and_rejection_counts():
    s = ChunkStore(budget_bytes=NB, layout=LAY)
    assert s.put_canonical("a", _kv(1)) and s.nbytes == NB                     # exactly the budget fits
    s.pin("a")
    assert not s.put_canonical("b", _kv(2, s=6))                                # 168 > 140: too large
    assert not s.put_canonical("c", _kv(3, s=6))
    assert not s.put_canonical("b", _kv(2))                                     # fits alone; "a" is pinned
    assert s.stats.rejected == 3 and s.stats.rejected_reasons == {"too_large": 2, "pinned": 1}
    assert s.keys() == ["a"] and s.stats.bytes_written == NB
    # pinned bytes + the new entry one byte over the budget: refused, not a failed eviction
    t = ChunkStore(budget_bytes=2 * NB - 1, layout=LAY)
    t.pin("a")
    assert t.put_canonical("a", _kv(1))
    assert not t.put_canonical("b", _kv(2)) and t.stats.rejected_reasons == {"pinned": 1}
    assert t.put_canonical("a", _kv(4))                                         # replacing the pinned one is fine
    assert t.stats.bytes_written == 2 * NB


def test_removals_tell_evictions_from_drops(tmp_path):
    pol = RecLRU()
    s = ChunkStore(tmp_path / "s", budget_bytes=2 * NB, policy=pol, layout=LAY)
    for k in ("a", "b", "c"):
        s.put_canonical(k, _kv(ord(k)))
    assert pol.removed == [(("c", "a", ""), True)] and s.stats.evictions == 1
    s.put_canonical("b", _kv(9))                                               # a replacement is no eviction
    assert pol.removed[-1] == (("c", "b", ""), False)
    pnb = (5 + 4) * 4 + (5 + 3) * 4                                            # a rank-1 patch of _kv(): 68 bytes
    for ctx in ("x", "y"):
        s.put_patch("d", ctx, patch_from_deficit(_kv(5), 1))                  # x evicts "c"; y fits
    s.put_patch("e", "x", patch_from_deficit(_kv(6), 1))                      # evicts "b"
    assert pol.removed[2:] == [(("c", "c", ""), True), (("c", "b", ""), True)] and s.stats.evictions == 3
    assert s.nbytes == 3 * pnb and s.keys() == []
    s.close()


def test_drop_counts_and_scopes():
    pol = RecLRU()
    s = ChunkStore(policy=pol, layout=LAY)
    s.put_canonical("k", _kv(1))
    for ctx in ("c1", "c2"):
        s.put_patch("k", ctx, patch_from_deficit(_kv(2), 1))
    s.put_canonical("other", _kv(3))
    assert s.drop("k", "c1") == 1                                               # that one patch only
    assert s.has_canonical("k") and s.patches("k") == ["c2"] and pol.removed == [(("p", "k", "c1"), False)]
    assert s.drop("k", "c1") == 0
    s.put_patch("k", "c1", patch_from_deficit(_kv(2), 1))
    assert s.drop("k") == 3 and len(s) == 1 and s.keys() == ["other"]
    assert all(ev is False for _, ev in pol.removed) and s.stats.evictions == 0


def test_unpin_releases_the_named_entry_only():
    s = ChunkStore(layout=LAY)
    s.pin("k")
    s.pin("k", "c")
    s.unpin("k", "c")
    assert s.is_pinned("k") and not s.is_pinned("k", "c")


def test_reads_on_another_device_and_copies():
    s = ChunkStore(layout=LAY)
    kv, p = _kv(1), patch_from_deficit(_kv(2), 2)
    s.put_canonical("k", kv)
    s.put_patch("k", "c", p)
    assert s.get_canonical("k", device="meta").layers[0][0].device.type == "meta"
    assert s.get_patch("k", "c", device="meta").factors[(0, 0)][0].device.type == "meta"
    got = s.get_patch("k", "c")                                                # a copy by default
    got.factors[(0, 0)][0].add_(1.0)
    assert torch.equal(s.get_patch("k", "c").factors[(0, 0)][0], p.factors[(0, 0)][0])
    shared = EmbeddedBackend()
    ChunkStore(model_fingerprint="fp", layout=LAY, shared=shared).put_canonical("k", kv)
    b = ChunkStore(model_fingerprint="fp", layout=LAY, shared=shared)
    assert b.get_canonical("k", device="meta").layers[0][0].device.type == "meta"   # via the shared tier


def test_disk_counters_and_checks(tmp_path):
    pol = RecLRU()
    s = ChunkStore(tmp_path / "s", memory_budget_bytes=0, on_corrupt="miss", policy=pol, layout=LAY)
    s.put_canonical("a", _kv(1))
    s.put_canonical("b", _kv(2))
    sizes = [os.path.getsize(s.entry_path(k)) for k in ("a", "b")]
    assert s.stats.disk_bytes_written == sum(sizes) and s.stats.bytes_written == 2 * NB
    assert _same(s.get_canonical("a"), _kv(1)) and _same(s.get_canonical("b"), _kv(2))
    assert (s.stats.disk_reads, s.stats.disk_bytes_read, s.stats.memory_hits) == (2, sum(sizes), 0)
    assert s.stats.bytes_read == 2 * NB and s.stats.hits == 2
    for k in ("a", "b"):
        _flip(s.entry_path(k))
        assert s.get_patch(k, "none") is None
        with pytest.raises(ChunkNotFoundError):
            s.get_canonical(k)                                                 # dropped, a counted miss
    assert s.stats.corrupt_dropped == 2 and s.stats.misses == 4 and len(s) == 0
    assert pol.removed == [(("c", "a", ""), False), (("c", "b", ""), False)]
    s.close()
    r = ChunkStore(tmp_path / "r", memory_budget_bytes=0, layout=LAY)
    r.put_canonical("k", _kv(1))
    r.put_patch("k", "ctx", patch_from_deficit(_kv(2), 1))
    _flip(r.entry_path("k"))
    _flip(r.entry_path("k", "ctx"))
    with pytest.raises(StoreCorruptError, match=r"^store entry c/k/ dropped: "):
        r.get_canonical("k")
    with pytest.raises(StoreCorruptError, match=r"^store entry p/k/ctx dropped: "):
        r.get_patch("k", "ctx")
    r.close()


def test_memory_cache_takes_an_entry_of_exactly_its_budget(tmp_path):
    s = ChunkStore(tmp_path, memory_budget_bytes=NB, layout=LAY)
    s.put_canonical("k", _kv(1))
    assert s.memory_nbytes == NB and _same(s.get_canonical("k"), _kv(1))
    assert (s.stats.memory_hits, s.stats.disk_reads) == (1, 0)
    assert s.drop("k") == 1 and s.memory_nbytes == 0 and s.nbytes == 0
    s.close()


def test_verify_counts_each_dropped_entry(tmp_path):
    assert ChunkStore(layout=LAY).verify() == 0
    for key, field_ in ((None, "corrupt_dropped"), (KEY, "auth_failures")):
        pol = RecLRU()
        path = tmp_path / field_
        s = ChunkStore(path, policy=pol, layout=LAY, auth_key=key)
        for k in ("a", "b", "c"):
            s.put_canonical(k, _kv(ord(k)))
        _flip(s.entry_path("a"))
        _flip(s.entry_path("b"))
        assert s.verify() == 2 and s.keys() == ["c"] and getattr(s.stats, field_) == 2
        other = "auth_failures" if field_ == "corrupt_dropped" else "corrupt_dropped"
        assert getattr(s.stats, other) == 0 and all(ev is False for _, ev in pol.removed)
        s.close()


def test_a_keyed_disk_tier_authenticates_and_counts(tmp_path):
    pol = RecLRU()
    s = ChunkStore(tmp_path / "k", memory_budget_bytes=0, policy=pol, layout=LAY, auth_key=KEY)
    s.put_canonical("k", _kv(1))
    s.put_patch("k", "c", patch_from_deficit(_kv(2), 1))
    s.put_canonical("ok", _kv(3))
    _flip(s.entry_path("k"))
    _flip(s.entry_path("k", "c"))
    with pytest.raises(ChunkNotFoundError):
        s.get_canonical("k")
    assert s.get_patch("k", "c") is None                                       # forged: a miss, never an error
    assert (s.stats.auth_failures, s.stats.misses, s.stats.corrupt_dropped) == (2, 2, 0) and len(s) == 1
    assert pol.removed == [(("c", "k", ""), False), (("p", "k", "c"), False)]
    assert len(list((tmp_path / "k" / "objects").glob("*.safetensors"))) == 1
    s.close()
    with pytest.raises(AuthKeyError):
        ChunkStore(tmp_path / "k", layout=LAY)                                 # the folder is bound to its key
    ChunkStore(tmp_path / "d", layout=LAY, cache_salt="t1").close()
    t = ChunkStore(tmp_path / "d", layout=LAY, cache_salt="t1")
    t.put_canonical("k", _kv(1))
    t.close()
    with pytest.raises(TrustDomainError):
        ChunkStore(tmp_path / "d", layout=LAY, cache_salt="t2")                # and to its trust domain


def test_compress_counts_reads_writes_and_keeps_the_marks(tmp_path):
    s = ChunkStore(tmp_path / "s", memory_budget_bytes=0, layout=WIDE)
    s.put_canonical("a", _wide(1), {"tokens": 64})
    s.put_canonical("b", _wide(2))
    written = s.stats.disk_bytes_written
    size_a = os.path.getsize(s.entry_path("a"))
    saved_a = s.compress("a", COLD)
    assert saved_a > 0 and (s.stats.disk_reads, s.stats.disk_bytes_read) == (1, size_a)
    assert s.stats.disk_bytes_written == written + os.path.getsize(s.entry_path("a"))
    assert s.compress("a", COLD) == 0 and s.stats.cold_compressed == 1       # already cold: nothing to do,
    assert s.stats.disk_reads == 1                                             # not even a read
    size_b = os.path.getsize(s.entry_path("b"))
    saved_b = s.compress("b", COLD)
    assert (s.stats.disk_reads, s.stats.disk_bytes_read) == (2, size_a + size_b)
    assert s.stats.cold_bytes_saved == saved_a + saved_b and s.stats.cold_compressed == 2
    meta = s.meta("a")
    assert meta["tokens"] == 64 and "approx" in meta and "approx" not in meta["cold"]
    assert meta["cold"]["exact_bytes"] == _wide(1).nbytes
    s.close()
    r = ChunkStore(tmp_path / "s", layout=WIDE)                                # the cold marks are on disk too
    assert r.is_cold("a") and r.meta("a") == meta
    r.put_canonical("a", _wide(1), r.meta("a"))                                 # an exact put drops them
    assert r.meta("a") == {"tokens": 64} and not r.is_cold("a")
    r.close()


def test_compress_keeps_the_cold_form_in_the_memory_cache(tmp_path):
    s = ChunkStore(tmp_path, layout=WIDE)
    m = ChunkStore(layout=WIDE)
    for st in (s, m):
        st.put_canonical("a", _wide(1))
        assert st.compress("a", COLD) > 0
    got = s.get_canonical("a")
    assert (s.stats.memory_hits, s.stats.disk_reads) == (1, 0)
    assert _same(got, m.get_canonical("a")) and s.memory_nbytes == s.nbytes < _wide(1).nbytes
    s.close()


def test_compress_of_a_corrupt_entry(tmp_path):
    pol = RecLRU()
    s = ChunkStore(tmp_path / "r", memory_budget_bytes=0, policy=pol, layout=WIDE)
    s.put_canonical("a", _wide(1))
    _flip(s.entry_path("a"))
    with pytest.raises(StoreCorruptError, match=r"^store entry c/a/ dropped: "):
        s.compress("a", COLD)
    assert len(s) == 0 and s.stats.corrupt_dropped == 1 and pol.removed == [(("c", "a", ""), False)]
    s.put_canonical("b", _wide(2))
    _flip(s.entry_path("b"))
    s.on_corrupt = "miss"
    assert s.compress("b", COLD) == 0 and len(s) == 0 and s.stats.corrupt_dropped == 2
    s.close()


def test_budget_pressure_drops_a_corrupt_victim_and_goes_on(tmp_path):
    pol = RecLRU()
    pnb = patch_from_deficit(_wide(5), 1).nbytes
    big, a = _wide(3), _wide(1, s=48)
    s = ChunkStore(tmp_path, budget_bytes=big.nbytes + pnb - 1, memory_budget_bytes=0, policy=pol, layout=WIDE,
                   cold=COLD, on_corrupt="miss")
    s.put_canonical("z", _wide(9, s=8))
    _flip(s.entry_path("z"))
    with pytest.raises(ChunkNotFoundError):
        s.get_canonical("z")                                                   # one corrupt entry dropped by a get
    pol.removed.clear()
    s.put_canonical("a", a)
    s.put_patch("p", "c", patch_from_deficit(_wide(5), 1))
    _flip(s.entry_path("a"))
    assert s.put_canonical("big", big)          # needs both out: "a" is corrupt (dropped), the patch is evicted
    assert s.keys() == ["big"] and s.patches("p") == [] and s.nbytes == big.nbytes
    assert s.stats.corrupt_dropped == 2 and s.stats.evictions == 1 and s.stats.cold_compressed == 0
    assert pol.removed == [(("c", "a", ""), False), (("p", "p", "c"), True)]
    s.close()


def test_the_shared_tier_wire_format(tmp_path):
    shared = RecBackend()
    a = ChunkStore(model_fingerprint="fp", layout=LAY, shared=shared)
    p = patch_from_deficit(_kv(2), 2)
    a.put_canonical("k", _kv(1), {"tokens": 5})
    a.put_patch("k", "ctx", p)
    assert [c for c in shared.calls if c[0] == "put"] == [("put", "c/k/"), ("put", "p/k/ctx")]
    data, smeta = EmbeddedBackend.get(shared, "c/k/")
    assert smeta == {"format": "windowkit-shared/1", "kind": "c", "key": "k", "ctx": "", "model_fingerprint": "fp",
                     "nbytes": NB, "meta": {"tokens": 5}, "layout": layout_to_json(LAY)}
    b = ChunkStore(model_fingerprint="fp", layout=LAY, shared=shared)
    assert b.has_canonical("k") and b.has_patch("k", "ctx") and not b.has_canonical("x")
    assert ("exists", "c/k/") in shared.calls and ("exists", "p/k/ctx") in shared.calls
    assert _same(b.get_canonical("k"), _kv(1)) and b.meta("k") == {"tokens": 5}   # the writer's meta, kept
    assert b.get_patch("k", "ctx").meta == p.meta
    got = b.get_patch("k", "ctx")                                               # now from b's own memory tier
    assert got.rank == 2 and all(torch.equal(got.factors[k][0], p.factors[k][0]) for k in p.factors)
    assert b.stats.shared_puts == 0 and shared.stats["puts"] == 2               # what it read is not written back
    assert (b.stats.hits, b.stats.shared_hits) == (3, 2)
    pnb = sum(u.numel() * 4 + v.numel() * 4 for u, v in p.factors.values())
    assert b.stats.shared_bytes_read == NB + pnb
    # salted: the address is a hash of the trust domain and the entry id, by the documented recipe
    sb = RecBackend()
    ChunkStore(model_fingerprint="fp", layout=LAY, shared=sb, cache_salt="t1").put_canonical("k", _kv(1))
    salted = hashlib.sha256(json.dumps(["domain", "t1", "c", "k", ""], separators=(",", ":")).encode()).hexdigest()
    assert sb.calls == [("put", f"c/d-{salted[:32]}/")]
    st = ChunkStore(model_fingerprint="fp", cache_salt="t1")
    assert st.chunk_key("abc") == digest(["chunk", "abc", "fp", "t1"]) != chunk_key("abc", "fp")


def test_shared_bytes_read_are_the_writers_payload_bytes():
    shared = EmbeddedBackend()
    a = ChunkStore(model_fingerprint="fp", layout=LAY, shared=shared)
    a.put_canonical("k1", _kv(1))
    a.put_canonical("k2", _kv(2, s=6))
    b = ChunkStore(model_fingerprint="fp", layout=LAY, shared=shared)
    b.get_canonical("k1")
    b.get_canonical("k2")
    n2 = (1 * 6 * 4 + 1 * 6 * 3) * 4
    assert (b.stats.bytes_read, b.stats.shared_bytes_read, b.stats.hits, b.stats.shared_hits) == \
        (NB + n2, NB + n2, 2, 2)
    addr = next(k for k in shared.data if k.endswith("c/k1/"))
    # a writer that leaves nbytes out: served, 0 bytes counted
    c = ChunkStore(model_fingerprint="fp", layout=LAY, shared=shared)
    raw = EmbeddedBackend(namespace="fp")
    raw.data = shared.data
    _reput(raw, "c/k1/", nbytes=None)
    assert addr in shared.data
    assert _same(c.get_canonical("k1"), _kv(1)) and c.stats.bytes_read == 0 and c.stats.shared_bytes_read == 0


def test_a_shared_store_without_a_fingerprint_reads_its_own_entries():
    shared = EmbeddedBackend()
    ChunkStore(layout=LAY, shared=shared).put_canonical("k", _kv(1))
    b = ChunkStore(layout=LAY, shared=shared)
    assert _same(b.get_canonical("k"), _kv(1)) and b.stats.shared_fallbacks == 0


def test_shared_values_naming_another_entry_or_model_are_refused():
    shared = EmbeddedBackend(namespace="fp")
    ChunkStore(model_fingerprint="fp", layout=LAY, shared=shared).put_canonical("k", _kv(1))
    for change in ({"key": "other"}, {"model_fingerprint": "other"}, {"domain": "ab"}):
        _reput(shared, "c/k/", **change)
        b = ChunkStore(model_fingerprint="fp", layout=LAY, shared=shared)
        with pytest.raises(ChunkNotFoundError):
            b.get_canonical("k")
        assert b.stats.shared_fallback_reasons == {"corrupt": 1} and b.stats.shared_hits == 0
        assert not shared.exists("c/k/")                                        # removed: nobody should read it
        ChunkStore(model_fingerprint="fp", layout=LAY, shared=shared).put_canonical("k", _kv(1))


def test_shared_faults_are_counted_misses_by_reason():
    shared = RecBackend()
    a = ChunkStore(model_fingerprint="fp", layout=LAY, shared=shared)
    a.put_canonical("k", _kv(1))
    shared.faults = {"get": SharedStoreError("slow", reason="timeout"),
                     "exists": SharedStoreError("down", reason="unavailable"),
                     "put": SharedStoreError("no room", reason="full")}
    b = ChunkStore(model_fingerprint="fp", layout=LAY, shared=shared)
    for _ in range(2):
        with pytest.raises(ChunkNotFoundError):
            b.get_canonical("k")
    assert not b.has_canonical("k") and not b.has_patch("k", "c")
    assert b.put_canonical("k2", _kv(2)) and b.stats.shared_puts == 0          # kept locally all the same
    assert b.stats.misses == 2 and b.stats.shared_misses == 0 and b.stats.shared_fallbacks == 5
    assert b.stats.shared_fallback_reasons == {"timeout": 2, "unavailable": 2, "full": 1}
    # two corrupt values: "corrupt", counted twice
    shared.faults = {}
    a.put_canonical("k2", _kv(2))
    c = ChunkStore(model_fingerprint="fp", layout=LAY, shared=shared)
    for k in ("k", "k2"):
        addr = next(x for x in shared.data if x.endswith(f"c/{k}/"))
        shared.data[addr] = shared.data[addr][:-1] + bytes([shared.data[addr][-1] ^ 1])
        with pytest.raises(ChunkNotFoundError):
            c.get_canonical(k)
    assert c.stats.shared_fallback_reasons == {"corrupt": 2} and c.stats.misses == 2


def test_two_forged_shared_values_count_two_auth_failures():
    shared = EmbeddedBackend()
    a = ChunkStore(model_fingerprint="fp", layout=LAY, shared=shared, auth_key=KEY)
    a.put_canonical("k1", _kv(1))
    a.put_canonical("k2", _kv(2))
    for addr, blob in list(shared.data.items()):
        shared.data[addr] = blob[:-1] + bytes([blob[-1] ^ 1])
    b = ChunkStore(model_fingerprint="fp", layout=LAY, shared=shared, auth_key=KEY)
    for k in ("k1", "k2"):
        with pytest.raises(ChunkNotFoundError):
            b.get_canonical(k)
    assert b.stats.auth_failures == 2 and b.stats.shared_fallback_reasons == {"auth": 2}


def test_a_store_of_another_layout_leaves_the_shared_value_alone():
    shared = EmbeddedBackend()
    ChunkStore(model_fingerprint="fp", layout=LAY, shared=shared).put_canonical("k", _kv(1))
    other = ChunkStore(model_fingerprint="fp", layout=KVLayout("gqa", 1, ((1, 4), (1, 4)), 0), shared=shared)
    with pytest.raises(ChunkNotFoundError):
        other.get_canonical("k")
    assert other.stats.shared_fallback_reasons == {"layout": 1} and other.stats.misses == 1
    assert len(shared.data) == 1                                                # still there for the others
    assert _same(ChunkStore(model_fingerprint="fp", layout=LAY, shared=shared).get_canonical("k"), _kv(1))


def test_shared_backends_without_auth(monkeypatch):
    import windowkit.store.auth as auth

    with pytest.raises(AuthKeyError, match=r"^NoAuthBackend cannot authenticate entries \(it has no 'auth' "
                                           r"attribute\): use EmbeddedBackend or MooncakeBackend, or open without "
                                           r"auth_key$"):
        ChunkStore(shared=NoAuthBackend(), auth_key=KEY)
    monkeypatch.setattr(auth, "_warned", False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ChunkStore(model_fingerprint="fp", shared=EmbeddedBackend())          # in-process: no warning
        assert w == [] and auth._warned is False
        s = ChunkStore(model_fingerprint="fp", layout=LAY, shared=NoAuthBackend())
    assert len(w) == 1 and w[0].category is UnauthenticatedStoreWarning
    assert str(w[0].message).startswith("the shared store tier (NoAuthBackend) is used without an auth key")
    assert s.put_canonical("k", _kv(1)) and not s.authenticated


def test_shared_mooncake_is_built_from_the_environment_and_owned(monkeypatch):
    import windowkit.store.mooncake as mc

    made = []

    def fake_from_env(cls, namespace=None, auth_key=None, **kw):
        made.append((namespace, auth_key))
        b = RecBackend(namespace=namespace, auth_key=auth_key)
        made.append(b)
        return b

    monkeypatch.setattr(mc.MooncakeBackend, "from_env", classmethod(fake_from_env))
    s = ChunkStore(model_fingerprint="fp", layout=LAY, shared="mooncake", auth_key=KEY)
    (ns, key), backend = made
    assert ns == "fp" and key is not None and key.key_id == EntryAuth(KEY).key_id and s.shared is backend
    s.close()
    assert backend.closed == 1                                                  # built here, so closed here
    mine = RecBackend()
    ChunkStore(model_fingerprint="fp", shared=mine).close()
    assert mine.closed == 0                                                     # the caller's: left open


# ----------------------------------------------------------------------------------------------- disk.py survivors
# The disk format by its documented recipes (windowkit/store/disk.py's module doc): file names, header, the
# index's sha256 / HMAC column; files and index rows are edited by hand with sqlite3 to reach each check.

import re  # noqa: E402
import sqlite3  # noqa: E402

from windowkit.store import disk as disk_mod  # noqa: E402
from windowkit.store.disk import CorruptEntry, header_metadata  # noqa: E402


def _index_row(path, kind, key, ctx):
    db = sqlite3.connect(str(Path(path) / "index.sqlite"))
    try:
        return db.execute("SELECT file, sha256, file_bytes, nbytes, meta, seq FROM entries WHERE kind = ? AND key = ? "
                          "AND ctx = ?", (kind, key, ctx)).fetchone()
    finally:
        db.close()


def _set_index(path, kind, key, sha, file_bytes):
    db = sqlite3.connect(str(Path(path) / "index.sqlite"))
    try:
        db.execute("UPDATE entries SET sha256 = ?, file_bytes = ? WHERE kind = ? AND key = ?",
                   (sha, file_bytes, kind, key))
        db.commit()
    finally:
        db.close()


def test_header_metadata_bounds_and_messages():
    with pytest.raises(CorruptEntry, match=r"^file shorter than a safetensors header$"):
        header_metadata(b"\0" * 7)
    with pytest.raises(CorruptEntry, match=r"^unreadable safetensors header: "):
        header_metadata(b"\0" * 8)                                            # 8 bytes: a header of length 0
    assert header_metadata((2).to_bytes(8, "little") + b"{}") == {}          # the header fills the file exactly
    with pytest.raises(CorruptEntry, match=r"^safetensors header runs past the end of the file$"):
        header_metadata((3).to_bytes(8, "little") + b"{}")


def test_file_names_header_and_sequence(tmp_path):
    from safetensors import safe_open

    s = ChunkStore(tmp_path, layout=LAY)                                       # no fingerprint
    for i, k in enumerate(("a", "b", "c"), start=1):
        s.put_canonical(k, _kv(i))
        stem = hashlib.sha256(json.dumps(["c", k, ""]).encode()).hexdigest()[:32]
        assert Path(s.entry_path(k)).name == f"{stem}-{i}.safetensors"
    with safe_open(s.entry_path("a"), framework="pt") as f:
        hdr = f.metadata()
    assert hdr["format"] == "windowkit-store/1" and hdr["model_fingerprint"] == "" and hdr["kind"] == "c"
    s.close()


def test_the_index_holds_the_documented_hmac(tmp_path):
    for fp in ("fp", None):
        path = tmp_path / str(fp)
        s = ChunkStore(path, model_fingerprint=fp, layout=LAY, auth_key=KEY, cache_salt="t1")
        meta = {"z": [1, 2], "a": {"y": 1, "b": 2}}
        s.put_canonical("k", _kv(1), meta)
        data = Path(s.entry_path("k")).read_bytes()
        file, sha, fbytes, nbytes, _, _ = _index_row(path, "c", "k", "")
        ident = json.dumps([fp or "", domain_tag("t1"), "c", "k", "", NB]).encode()
        mb = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
        assert sha == "hmac:" + EntryAuth(KEY).mac(ident, mb, data) and fbytes == len(data) and nbytes == NB
        s.close()
    u = ChunkStore(tmp_path / "u", layout=LAY)
    u.put_canonical("k", _kv(1))
    want = hashlib.sha256(Path(u.entry_path("k")).read_bytes()).hexdigest()
    assert _index_row(tmp_path / "u", "c", "k", "")[1] == want
    u.close()


def test_a_new_version_of_an_entry_replaces_its_file(tmp_path):
    s = ChunkStore(tmp_path, layout=WIDE)
    s.put_canonical("a", _wide(1))
    old = Path(s.entry_path("a"))
    assert s.compress("a", COLD) > 0                                           # rewrites the same entry id
    new = Path(s.entry_path("a"))
    assert new != old and not old.exists() and sorted((tmp_path / "objects").iterdir()) == [new]
    s.put_canonical("b", _wide(2))
    Path(s.entry_path("b")).unlink()                                           # its file vanished; the cache
    assert s.compress("b", COLD) > 0 and Path(s.entry_path("b")).exists()     # still holds it: compressed
    s.close()


def test_a_failed_write_raises_its_own_error_and_leaves_no_temp_file(tmp_path, monkeypatch):
    s = ChunkStore(tmp_path, layout=LAY)

    def no_space(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk_mod, "open", no_space, raising=False)
    with pytest.raises(OSError, match="No space left on device"):
        s.put_canonical("k", _kv(1))
    monkeypatch.undo()
    assert list((tmp_path / "objects").iterdir()) == []
    s.close()


def test_missing_and_misplaced_files(tmp_path):
    s = ChunkStore(tmp_path / "s", layout=LAY)
    for i, k in enumerate(("a", "b", "c")):
        s.put_canonical(k, _kv(i))
    s.close()
    for p in (tmp_path / "s" / "objects").iterdir():
        if not p.name.endswith("-2.safetensors"):
            p.unlink()
    r = ChunkStore(tmp_path / "s", layout=LAY)                                 # the rows of missing files go
    assert r.keys() == ["b"] and r.stats.corrupt_dropped == 2
    r.close()
    m = ChunkStore(tmp_path / "m", memory_budget_bytes=0, layout=LAY)
    m.put_canonical("a", _kv(1))
    Path(m.entry_path("a")).unlink()
    with pytest.raises(StoreCorruptError, match=r"^store entry c/a/ dropped: cannot read "):
        m.get_canonical("a")
    # b's row pointing at a's bytes (a's content, a valid checksum): the header names another entry
    m.put_canonical("a", _kv(1))
    m.put_canonical("b", _kv(2))
    data = Path(m.entry_path("a")).read_bytes()
    Path(m.entry_path("b")).write_bytes(data)
    _set_index(tmp_path / "m", "c", "b", hashlib.sha256(data).hexdigest(), len(data))
    m.close()
    m = ChunkStore(tmp_path / "m", memory_budget_bytes=0, layout=LAY)
    with pytest.raises(StoreCorruptError, match=r": holds c/a/, the index says c/b/$"):
        m.get_canonical("b")
    # a's header intact, its tensors cut short (a valid checksum): unreadable safetensors
    bad = data[:-8]
    Path(m.entry_path("a")).write_bytes(bad)
    m.close()
    _set_index(tmp_path / "m", "c", "a", hashlib.sha256(bad).hexdigest(), len(bad))
    m = ChunkStore(tmp_path / "m", memory_budget_bytes=0, layout=LAY)
    with pytest.raises(StoreCorruptError, match=r": unreadable safetensors: "):
        m.get_canonical("a")
    m.close()


def test_a_forged_file_says_hmac_mismatch(tmp_path):
    s = ChunkStore(tmp_path, memory_budget_bytes=0, layout=WIDE, auth_key=KEY)
    s.put_canonical("a", _wide(1))
    _flip(s.entry_path("a"))
    with pytest.raises(StoreCorruptError, match=r"HMAC mismatch \(forged, replaced, or written with another key\)$"):
        s.compress("a", COLD)
    s.close()


def _meta_table(path) -> dict:
    db = sqlite3.connect(str(Path(path) / "index.sqlite"))
    try:
        return dict(db.execute("SELECT k, v FROM meta").fetchall())
    finally:
        db.close()


def test_folder_meta_is_the_documented_one(tmp_path):
    ChunkStore(tmp_path / "a", model_fingerprint="fp", layout=LAY).close()
    assert _meta_table(tmp_path / "a") == {
        "format": "windowkit-store/1", "model_fingerprint": "fp",
        "layout": '{"family": "gqa", "num_layers": 1, "rope_slot": 0, "slot_shapes": [[1, 4], [1, 3]]}'}
    s = ChunkStore(tmp_path / "b", layout=LAY, cache_salt="t1", auth_key=KEY)
    s.put_canonical("k", _kv(1))
    s.close()
    m = _meta_table(tmp_path / "b")
    assert m["domain"] == domain_tag("t1") and m["auth_key_id"] == EntryAuth(KEY).key_id
    r = ChunkStore(tmp_path / "b", cache_salt="t1", auth_key=KEY)              # same domain, same key: reopens
    assert _same(r.get_canonical("k"), _kv(1))
    r.close()


def test_folder_refusals_say_what_to_do(tmp_path):
    p = tmp_path / "f"
    ChunkStore(p, model_fingerprint="m1", layout=LAY).close()
    with pytest.raises(ModelMismatchError, match=rf"^store {p} was written for model m1, not m2; open it with that "
                                                 r"model or use another path$"):
        ChunkStore(p, model_fingerprint="m2")
    other = KVLayout("gqa", 1, ((1, 4), (1, 4)), 0)
    with pytest.raises(KVShapeError, match="^" + re.escape(f"store {p} holds KV of layout {LAY.describe()}, not "
                                                           f"{other.describe()}") + "$"):
        ChunkStore(p, layout=other)
    s = ChunkStore(p)
    with pytest.raises(WindowkitError, match=rf"^store {p} is open elsewhere \(another ChunkStore or process\); "
                                             r"close it first$"):
        ChunkStore(p)
    s.close()
    s.close()                                                                  # closing twice is fine
    db = sqlite3.connect(str(p / "index.sqlite"))
    db.execute("UPDATE meta SET v = 'windowkit-store/0' WHERE k = 'format'")
    db.commit()
    db.close()
    with pytest.raises(WindowkitError, match=rf"^store {p} has format 'windowkit-store/0'; this windowkit reads "
                                             r"'windowkit-store/1'$"):
        ChunkStore(p)
    (tmp_path / "d" / "index.sqlite").mkdir(parents=True)                      # an index that cannot be opened
    with pytest.raises(StoreCorruptError, match=rf"^store index {tmp_path / 'd' / 'index.sqlite'} is unreadable: "):
        ChunkStore(tmp_path / "d")


def test_trust_refusals_say_what_to_do(tmp_path):
    def make(name, **kw):
        s = ChunkStore(tmp_path / name, layout=LAY, **kw)
        s.put_canonical("k", _kv(1))
        s.close()
        return tmp_path / name

    salted, keyed, plain = make("salted", cache_salt="t1"), make("keyed", auth_key=KEY), make("plain")
    with pytest.raises(TrustDomainError, match=rf"^store {salted} belongs to another trust domain \(cache_salt\) "
                                               r"than this one; open it with the cache_salt it was written with, or "
                                               r"use another path$"):
        ChunkStore(salted)
    kid = EntryAuth(KEY).key_id
    with pytest.raises(AuthKeyError, match=rf"^store {keyed} holds authenticated entries \(auth key id {kid}\): pass "
                                           r"that key \(auth_key=\.\.\., or WINDOWKIT_AUTH_KEY / "
                                           r"WINDOWKIT_AUTH_KEY_FILE\)$"):
        ChunkStore(keyed)
    with pytest.raises(AuthKeyError, match=rf"^store {plain} was written without an auth key, so its entries cannot "
                                           r"be authenticated: open it without auth_key, or give the keyed store a "
                                           r"new path$"):
        ChunkStore(plain, auth_key=KEY)
    other = b"another key of 16+ bytes"
    with pytest.raises(AuthKeyError, match=rf"^store {keyed} was written with auth key id {kid}, not this key "
                                           rf"\({EntryAuth(other).key_id}\): pass the key it was written with, or "
                                           r"give the new key a new path \(see docs/security\.md, rotation\)$"):
        ChunkStore(keyed, auth_key=other)


def test_unsalted_keyed_entries_mac_an_empty_domain(tmp_path):
    s = ChunkStore(tmp_path, layout=LAY, auth_key=KEY)
    s.put_canonical("k", _kv(1))
    data = Path(s.entry_path("k")).read_bytes()
    ident = json.dumps(["", "", "c", "k", "", NB]).encode()
    assert _index_row(tmp_path, "c", "k", "")[1] == "hmac:" + EntryAuth(KEY).mac(ident, b"{}", data)
    assert "domain" not in _meta_table(tmp_path)
    s.close()


def test_the_lock_file_and_connections_are_released(tmp_path):
    def fds_on(path):
        out = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                out.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass
        return [x for x in out if x.startswith(str(path))]

    old = os.umask(0o022)
    try:
        s = ChunkStore(tmp_path, layout=LAY)
    finally:
        os.umask(old)
    assert (tmp_path / "LOCK").stat().st_mode & 0o777 == 0o644
    assert fds_on(tmp_path)
    s.close()
    assert fds_on(tmp_path) == []                                              # index and lock both closed


def test_a_disk_store_is_used_from_other_threads(tmp_path):
    import threading

    s = ChunkStore(tmp_path, layout=LAY)
    err = []

    def work():
        try:
            s.put_canonical("k", _kv(1))
            assert _same(s.get_canonical("k"), _kv(1))
        except Exception as e:  # noqa: BLE001
            err.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert err == [] and s.keys() == ["k"]
    s.close()


# ----------------------------------------------------------------------------------------------- cold.py survivors
# ColdTierConfig's checks at their edges with their exact messages, min_rows_for by eq. (13) worked by hand,
# _pos1d, and the decompress_kv alias (compress_kv / decompress_tensors are decorated, so mutmut leaves them).

from windowkit.errors import KVShapeError  # noqa: E402
from windowkit.kv.rope import RopeSpec  # noqa: E402
from windowkit.store.cold import ColdTierConfig, _pos1d, compress_kv, decompress_kv, decompress_tensors  # noqa: E402


def _refused(exc, msg, fn, *a, **kw):
    with pytest.raises(exc) as e:
        fn(*a, **kw)
    assert str(e.value) == msg
    return e.value


def test_cold_config_edges_and_messages():
    C = ColdTierConfig
    assert C(rank=1).rank == 1  # the smallest rank is accepted
    _refused(WindowkitError, "ColdTierConfig.rank must be an int >= 1, got 0", C, rank=0)
    _refused(WindowkitError, "ColdTierConfig.rank must be an int >= 1, got '2'", C, rank="2")
    for name in ("protected_rows", "recent_rows"):
        assert getattr(C(rank=2, **{name: 0}), name) == 0 and getattr(C(rank=2, **{name: 1}), name) == 1
        _refused(WindowkitError, f"ColdTierConfig.{name} must be an int >= 0, got -1", C, rank=2, **{name: -1})
        _refused(WindowkitError, f"ColdTierConfig.{name} must be an int >= 0, got 1.5", C, rank=2, **{name: 1.5})
    assert C(rank=2, min_rows=1).min_rows == 1 and C(rank=2, min_rows=5).min_rows == 5
    for bad in (0, -3, 2.5, "4"):
        _refused(WindowkitError, f"ColdTierConfig.min_rows must be None or an int >= 1, got {bad!r}", C, rank=2,
                 min_rows=bad)
    for dt in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        assert C(rank=2, factor_dtype=dt).factor_dtype == dt
    _refused(WindowkitError, "ColdTierConfig.factor_dtype must be a float dtype, got torch.int8", C, rank=2,
             factor_dtype=torch.int8)
    msg = "ColdTierConfig.rope must be a 1-D RopeSpec (M-RoPE is not supported here)"
    _refused(WindowkitError, msg, C, rank=2, rope="rope")
    _refused(WindowkitError, msg, C, rank=2, rope=RopeSpec(torch.ones(4), mrope="blocked", mrope_section=(2, 1, 1)))
    one_d = RopeSpec(torch.ones(4))
    assert C(rank=2, rope=one_d).rope is one_d


def test_cold_min_rows_for_by_hand():
    # eq. (13): the first n with n(d - r) > r(d + 1); d = 16, r = 2: n * 14 > 34, so n = 3
    assert ColdTierConfig(rank=2).min_rows_for(16) == 3
    # d = 64, r = 8: n * 56 > 520, so n = 10
    assert ColdTierConfig(rank=8).min_rows_for(64) == 10
    assert ColdTierConfig(rank=2, min_rows=7).min_rows_for(16) == 7  # given: used as is
    assert ColdTierConfig(rank=2, min_rows=1).min_rows_for(16) == 1
    assert ColdTierConfig(rank=16, min_rows=7).min_rows_for(16) is None  # rank >= width: never
    assert ColdTierConfig(rank=17).min_rows_for(16) is None


def test_cold_pos1d():
    assert torch.equal(_pos1d(None, 5), torch.tensor([0, 1, 2, 3, 4]))
    assert torch.equal(_pos1d(torch.tensor([[3, 4, 5]]), 3), torch.tensor([3, 4, 5]))
    _refused(KVShapeError, "pre-RoPE cold storage needs 1-D positions", _pos1d, torch.zeros(3, 4, dtype=torch.long), 4)


def test_decompress_kv_is_decompress_tensors():
    lay = KVLayout("gqa", 1, ((2, 8), (2, 8)), 0)
    g = torch.Generator().manual_seed(7)
    kv = ChunkKV([tuple(torch.randn(2, 40, 8, generator=g) for _ in range(2))], lay, torch.arange(40)[None])
    tensors, facts = compress_kv(kv, ColdTierConfig(rank=2, protected_rows=2, recent_rows=3,
                                                    factor_dtype=torch.float32))
    assert facts["slots_cold"] == 2
    a, b = decompress_kv(tensors, lay), decompress_tensors(tensors, lay)
    assert a.layout == lay and torch.equal(a.positions, kv.positions) and _same(a, b)
    assert torch.equal(a.layers[0][0][:, :2], kv.layers[0][0][:, :2])  # exact rows as stored


# ----------------------------------------------------------------------------------------------- backend.py survivors
# The shared-value envelope and the storage keys by the documented recipes (windowkit/store/backend.py's module
# doc and docs/security.md), built here with struct / json / hashlib / hmac; every refusal with its exact message
# and exception type; EmbeddedBackend's counters worked out from the envelopes' lengths.

import re  # noqa: E402

from windowkit.errors import StoreAuthError, StoreCorruptError  # noqa: E402
from windowkit.store.backend import (MAGIC, MAGIC_AUTH, namespace_prefix, new_stats, pack, storage_key,  # noqa: E402
                                     storage_prefix, unpack)

_U32 = struct.Struct("<I")


def _jd(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _envelope(value: bytes, meta: dict) -> bytes:
    """MAGIC | u32 header length | {meta, sha256, size} | value, the sha256 over the meta JSON + value."""
    sha = _hl.sha256(_jd(meta) + value).hexdigest()
    header = b'{"meta":' + _jd(meta) + b',"sha256":"' + sha.encode() + b'","size":' + str(len(value)).encode() + b"}"
    return b"WKSV1\n" + _U32.pack(len(header)) + header + value


def _mac_of(ns: str, key: str, header: bytes, value: bytes) -> bytes:
    ident = _U32.pack(len(ns.encode())) + ns.encode() + key.encode()
    body = _U32.pack(len(ident)) + ident + _U32.pack(len(header)) + header + value
    return hmac.new(_derive(b"mac"), body, _hl.sha256).digest()


def _auth_envelope(value: bytes, meta, ns: str, key: str, header: bytes = None) -> bytes:
    """MAGIC_AUTH | HMAC | u32 header length | {meta, size} | value (or a given header, MAC'd all the same)."""
    if header is None:
        header = b'{"meta":' + _jd(meta) + b',"size":' + str(len(value)).encode() + b"}"
    return b"WKSA1\n" + _mac_of(ns, key, header, value) + _U32.pack(len(header)) + header + value


def _addr(*parts: str) -> str:
    body = b"".join(_U32.pack(len(p.encode())) + p.encode() for p in parts)
    return hmac.new(_derive(b"addr"), body, _hl.sha256).hexdigest()[:32]


def test_envelope_by_the_documented_format():
    meta = {"tokens": 64, "b": [1, 2], "a": {"z": 1, "y": "x"}}  # unsorted keys: the JSON is sorted and compact
    assert MAGIC == b"WKSV1\n" and MAGIC_AUTH == b"WKSA1\n"
    assert pack(b"value", meta) == _envelope(b"value", meta)
    assert pack(bytearray(b"value"), meta) == pack(memoryview(b"value"), meta) == _envelope(b"value", meta)
    assert pack(b"value") == pack(b"value", {}) == _envelope(b"value", {})  # no meta: {}
    assert unpack(_envelope(b"value", meta)) == (b"value", meta)
    assert unpack(_envelope(b"", {})) == (b"", {})  # an empty value ends exactly at the header's end
    a = EntryAuth(KEY)
    assert pack(b"value", meta, auth=a, namespace="fp", key="c/k") == _auth_envelope(b"value", meta, "fp", "c/k")
    assert pack(b"value", auth=a) == _auth_envelope(b"value", {}, "", "")  # no namespace, key "" by default
    assert pack(b"v", auth=a, namespace="fp") == _auth_envelope(b"v", {}, "fp", "")
    assert unpack(_auth_envelope(b"value", meta, "fp", "c/k"), auth=a, namespace="fp", key="c/k") == (b"value", meta)
    assert unpack(_auth_envelope(b"v", {}, "fp", ""), auth=a, namespace="fp") == (b"v", {})
    assert unpack(_auth_envelope(b"", {}, "", ""), auth=a) == (b"", {})
    # the MAC binds the namespace and the key
    for ns, key in (("fp", "c/x"), ("fq", "c/k"), ("", "c/k")):
        _refused(StoreAuthError, "shared value HMAC mismatch (forged, replayed from another key, or written with "
                 "another auth key)", unpack, _auth_envelope(b"value", meta, "fp", "c/k"), auth=a, namespace=ns or None,
                 key=key)


def test_pack_refusals():
    _refused(WindowkitError, "a shared value is bytes, got str", pack, "text")
    _refused(WindowkitError, "a shared value is bytes, got NoneType", pack, None)
    with pytest.raises(WindowkitError) as e:
        pack(b"x", {"a": object()})
    assert str(e.value).startswith("shared value meta must be JSON-serialisable: ") and "object" in str(e.value)


def test_unpack_refusals_unkeyed():
    good = _envelope(b"abcd", {"k": 1})
    C = StoreCorruptError
    _refused(C, "shared value is not a windowkit envelope (5 bytes)", unpack, b"short")
    _refused(C, "shared value is not a windowkit envelope (25 bytes)", unpack, b"NOTANENVELOPE-but-long-ok")
    # exactly MAGIC + length: an envelope, with an empty (unreadable) header
    with pytest.raises(C) as e:
        unpack(MAGIC + _U32.pack(0))
    assert type(e.value) is C and str(e.value).startswith("unreadable shared value header: ")
    _refused(C, "shared value header runs past its end (truncated?)", unpack, MAGIC + _U32.pack(50) + b"{}")
    _refused(C, "unreadable shared value header: 'size'", unpack, MAGIC + _U32.pack(2) + b"{}")
    _refused(C, "shared value has 3 bytes, its header says 4 (partial?)", unpack, good[:-1])
    _refused(C, "shared value sha256 mismatch", unpack, good[:-1] + b"D")
    _refused(C, "shared value sha256 mismatch", unpack, good.replace(b'"k":1', b'"k":2'))
    err = _refused(StoreAuthError, "shared value is authenticated with a key this client does not hold: pass the "
                   "deployment's auth_key (or WINDOWKIT_AUTH_KEY / WINDOWKIT_AUTH_KEY_FILE)", unpack,
                   _auth_envelope(b"abcd", {}, "", ""))
    assert isinstance(err, StoreCorruptError)


def test_unpack_refusals_keyed():
    a, A = EntryAuth(KEY), StoreAuthError
    _refused(A, "shared value is not authenticated (written without an auth key, or forged)", unpack,
             _envelope(b"abcd", {}), auth=a)
    _refused(A, "shared value is not a windowkit envelope (7 bytes)", unpack, b"garbage", auth=a)
    _refused(A, "authenticated shared value truncated (16 bytes)", unpack, MAGIC_AUTH + b"0123456789", auth=a)
    # 6 + 32 + 4 bytes is long enough to hold a MAC and a length: it gets to the MAC check
    mismatch = "shared value HMAC mismatch (forged, replayed from another key, or written with another auth key)"
    _refused(A, mismatch, unpack, MAGIC_AUTH + bytes(32) + _U32.pack(0), auth=a)
    _refused(A, "authenticated shared value header runs past its end (truncated?)", unpack,
             MAGIC_AUTH + bytes(32) + _U32.pack(100) + b"ab", auth=a)
    good = _auth_envelope(b"abcd", {"k": 1}, "fp", "c/k")
    _refused(A, mismatch, unpack, good[:-1] + b"D", auth=a, namespace="fp", key="c/k")
    _refused(A, mismatch, unpack, good, auth=EntryAuth(b"another key, sixteen bytes+"), namespace="fp", key="c/k")
    # authentic (the MAC checks) but not a well-formed envelope: a key holder's bug, a plain StoreCorruptError
    for header in (b"not json", b'{"meta":{}}'):
        with pytest.raises(StoreCorruptError) as e:
            unpack(_auth_envelope(b"abcd", None, "fp", "c/k", header=header), auth=a, namespace="fp", key="c/k")
        assert type(e.value) is StoreCorruptError and str(e.value).startswith("unreadable shared value header: ")
    for header in (b'{"meta":{},"size":5}', b'{"meta":[1],"size":4}', b'{"meta":null,"size":4}'):
        with pytest.raises(StoreCorruptError) as e:
            unpack(_auth_envelope(b"abcd", None, "fp", "c/k", header=header), auth=a, namespace="fp", key="c/k")
        assert type(e.value) is StoreCorruptError
        assert str(e.value) == "authenticated shared value does not match its header"


def test_storage_keys_by_the_documented_recipe():
    h16 = lambda s: _hl.sha256(s.encode()).hexdigest()[:16]  # noqa: E731
    assert namespace_prefix("fp") == f"wk/{h16('fp')}/" and namespace_prefix(None) == f"wk/{h16('')}/"
    assert namespace_prefix("") == namespace_prefix(None)
    assert storage_key("fp", "c/k") == f"wk/{h16('fp')}/c/k" and storage_key(None, "c/k") == f"wk/{h16('')}/c/k"
    assert storage_prefix("fp") == f"wk/{h16('fp')}/" and storage_prefix(None) == f"wk/{h16('')}/"
    a = EntryAuth(KEY)
    assert storage_key("fp", "c/k", a) == f"wk/{_addr('ns', 'fp')[:16]}/{_addr('key', 'fp', 'c/k')}"
    assert storage_key(None, "c/k", a) == f"wk/{_addr('ns', '')[:16]}/{_addr('key', '', 'c/k')}"
    assert storage_prefix("fp", a) == f"wk/{_addr('ns', 'fp')[:16]}/"
    assert storage_prefix(None, a) == f"wk/{_addr('ns', '')[:16]}/"
    assert re.fullmatch(r"wk/[0-9a-f]{16}/[0-9a-f]{32}", storage_key("fp", "c/k", a))


def test_embedded_backend_counters_by_hand():
    assert new_stats() == {"puts": 0, "gets": 0, "hits": 0, "misses": 0, "corrupt": 0, "forged": 0, "errors": 0,
                           "bytes_written": 0, "bytes_read": 0}
    b = EmbeddedBackend(namespace="fp")
    assert b.stats == new_stats() and repr(b) == "EmbeddedBackend(entries=0)"
    e1, e2 = _envelope(b"one", {"t": 1}), _envelope(b"second", {})
    b.put("c/1", b"one", {"t": 1})
    b.put_batch([("c/2", b"second", None), ("c/3", b"x", {"u": [2]})])
    e3 = _envelope(b"x", {"u": [2]})
    h16 = _hl.sha256(b"fp").hexdigest()[:16]
    assert b.data == {f"wk/{h16}/c/1": e1, f"wk/{h16}/c/2": e2, f"wk/{h16}/c/3": e3}
    assert b.stats["puts"] == 3 and b.stats["bytes_written"] == len(e1) + len(e2) + len(e3)
    assert b.get("c/1") == (b"one", {"t": 1}) and b.get("c/9") is None and b.get("c/1") == (b"one", {"t": 1})
    assert b.get_batch(["c/2", "c/8", "c/3"]) == [(b"second", {}), None, (b"x", {"u": [2]})]
    assert b.exists_batch(["c/1", "c/8", "c/2"]) == [True, False, True] and b.exists("c/3")
    b.data[f"wk/{h16}/c/3"] = e3[:-1] + b"y"  # a flipped byte: counted, removed, never served
    assert b.get_batch(["c/3", "c/1"]) == [None, (b"one", {"t": 1})] and not b.exists("c/3")
    want = {"puts": 3, "gets": 8, "hits": 5, "misses": 2, "corrupt": 1, "forged": 0, "errors": 0,
            "bytes_written": len(e1) + len(e2) + len(e3), "bytes_read": 3 * len(e1) + len(e2) + len(e3)}
    assert b.stats == want
    b.data[f"wk/{h16}/c/2"] = b"junk"
    _refused(StoreCorruptError, "shared value is not a windowkit envelope (4 bytes)", b.get, "c/2")
    assert not b.exists("c/2") and b.stats["corrupt"] == 2 and b.stats["gets"] == 9
    assert b.remove("c/1") is True and b.remove("c/1") is False and b.data == {}
    b.put("c/4", b"4"), b.put("c/5", b"5")
    assert b.remove_batch(["c/4", "c/6", "c/5"]) == 2 and b.remove_batch(["c/4"]) == 0 and b.data == {}
    b.close()


def test_a_keyed_embedded_backend_stores_under_hmac_addresses_and_counts_forgeries():
    b = EmbeddedBackend(namespace="fp", auth_key=KEY)
    assert b.auth is not None and b.auth.key_id == EntryAuth(KEY).key_id
    b.put("c/k", b"value", {"t": 2})
    where = f"wk/{_addr('ns', 'fp')[:16]}/{_addr('key', 'fp', 'c/k')}"
    assert b.data == {where: _auth_envelope(b"value", {"t": 2}, "fp", "c/k")}
    assert b.get("c/k") == (b"value", {"t": 2}) and b.exists("c/k") and b.exists_batch(["c/k", "c/j"]) == [True, False]
    b.data[where] = _envelope(b"value", {"t": 2})  # an unauthenticated value under the address: forged
    _refused(StoreAuthError, "shared value is not authenticated (written without an auth key, or forged)", b.get, "c/k")
    assert not b.exists("c/k") and b.stats["forged"] == 1 and b.stats["corrupt"] == 0
    b.put("c/k", b"value", {"t": 2})
    b.data[where] = b.data[where][:-1] + b"X"
    assert b.get_batch(["c/k"]) == [None] and b.stats["forged"] == 2 and b.stats["corrupt"] == 0
    # without a namespace the MAC and the address use ""
    n = EmbeddedBackend(auth_key=KEY)
    n.put("c/k", b"v")
    assert n.data == {f"wk/{_addr('ns', '')[:16]}/{_addr('key', '', 'c/k')}": _auth_envelope(b"v", {}, "", "c/k")}
    assert n.remove_batch(["c/k"]) == 1
