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
