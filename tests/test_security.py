"""A shared store you can trust (docs/security.md): trust domains (``cache_salt``), authenticated entries
(``auth_key``), and the hostile-input cases, on a real loopback ``mooncake_master`` (started here) for the
shared tier and a real folder for the disk tier.

Attacks are played by a client that can write the shared tier (or the disk folder) but does not hold the
secret. To make the attacker as strong as possible the tests hand it the exact stored keys of the victim's
entries (which it could not compute), and check that no forged byte is ever served: answers are compared to
transformers' own forward over the same tokens (exact re-prefill), stored tensors to the originals.
"""
from __future__ import annotations

import hashlib
import json
import sqlite3
import sys
import warnings

import pytest
import torch
from _need import need
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

import windowkit as wk
from windowkit.errors import (AuthKeyError, StoreAuthError, StoreCorruptError, TrustDomainError,
                              UnauthenticatedStoreWarning, WindowkitError)
from windowkit.kv.layout import ChunkKV
from windowkit.kv.patch import Patch
from windowkit.store import ChunkStore, EmbeddedBackend, chunk_key, context_hash, orbit_context_hash
from windowkit.store import auth as auth_mod
from windowkit.store.auth import EntryAuth, auth_key_from_env
from windowkit.store.backend import MAGIC, MAGIC_AUTH, namespace_prefix, pack, unpack
from windowkit.store.disk import header_metadata
from windowkit.store.mooncake import MooncakeBackend

hypothesis = need("hypothesis", "pip install hypothesis (or: make venv)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from store_helpers import CHUNKS, LAYOUT, QUERY, be, kl, mc, reference_logits, text  # noqa: E402,F401  (tests/store_helpers.py; be, mc: module-scoped fixtures)

KEY = b"windowkit-test-key-0123456789abcdef"  # 35 bytes: the deployment's secret
KEY_OLD = b"windowkit-old-key-0123456789abcdef"  # the key before a rotation
KEY_ATTACKER = b"attacker-own-key-0123456789abcdef"  # a key the attacker made up
FP = "fp-security"


# ------------------------------------------------------------------ helpers
def rand_kv(seed: int, n: int = 5) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    return ChunkKV([tuple(torch.randn(2, n, 8, generator=g) for _ in range(2)) for _ in range(2)], LAYOUT)


def rand_patch(seed: int, n: int = 5) -> Patch:
    g = torch.Generator().manual_seed(seed)
    factors = {(l, s): (torch.randn(n, 3, generator=g), torch.randn(3, 16, generator=g)) for l in range(2) for s in range(2)}
    return Patch(factors, LAYOUT, n, 3, 3, {(l, s): (1.0, 2.0) for l in range(2) for s in range(2)}, {"kind": "fresh"})


def same_kv(a: ChunkKV, b: ChunkKV) -> bool:
    return all(torch.equal(x, y) for la, lb in zip(a.layers, b.layers) for x, y in zip(la, lb))


def same_patch(a: Patch, b: Patch) -> bool:
    return a.factors.keys() == b.factors.keys() and all(
        torch.equal(a.factors[k][0], b.factors[k][0]) and torch.equal(a.factors[k][1], b.factors[k][1]) for k in a.factors)


def split_envelope(blob: bytes) -> tuple[dict, bytes]:
    """(header, value) of an envelope, keyed or not, parsed by hand as an attacker would (no key needed)."""
    off = len(MAGIC) + (32 if blob.startswith(MAGIC_AUTH) else 0)  # a keyed envelope has its tag first
    n = int.from_bytes(blob[off:off + 4], "little")
    return json.loads(blob[off + 4:off + 4 + n]), blob[off + 4 + n:]


def keyed_envelope(tag: bytes, header: dict, value: bytes) -> bytes:
    """A keyed envelope with a given tag (e.g. one lifted from a genuine entry)."""
    h = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return MAGIC_AUTH + tag + len(h).to_bytes(4, "little") + h + value


def add_noise(value: bytes, scale: float = 0.5, seed: int = 0) -> bytes:
    """The issue's attack: decode the safetensors payload, add noise to its tensors, keep its metadata."""
    g = torch.Generator().manual_seed(seed)
    tensors = {k: (t + scale * torch.randn(t.shape, generator=g).to(t.dtype)) if t.is_floating_point() else t
               for k, t in st_load(value).items()}
    return st_save(tensors, metadata=header_metadata(value))


def envelope(header: dict, value: bytes) -> bytes:
    h = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return MAGIC + len(h).to_bytes(4, "little") + h + value


def mooncake_keys(store: ChunkStore) -> dict[tuple, str]:
    """Every entry of ``store`` -> its stored Mooncake key (handed to the attacker by the test)."""
    return {eid: store.shared.key(store._shared_key(eid)) for eid in store._entries}


# ------------------------------------------------------------------ fixtures
def moon(mc, **kw) -> MooncakeBackend:
    return MooncakeBackend(mc.config(timeout_s=10.0), **kw)


@pytest.fixture(autouse=True)
def _no_warning_state(monkeypatch):
    monkeypatch.setattr(auth_mod, "_warned", False)  # the warn-once flag, per test


# ================================================================== keys and defaults
def test_salt_is_mixed_into_every_key_and_the_empty_salt_is_todays_key():
    for salt in ("", None):
        s = ChunkStore(model_fingerprint=FP, cache_salt=salt)
        assert s.chunk_key("h") == chunk_key("h", FP) and s.cache_salt == ""
    a, b = ChunkStore(model_fingerprint=FP, cache_salt="tenant-a"), ChunkStore(model_fingerprint=FP, cache_salt="tenant-b")
    ka, kb = a.chunk_key("h"), b.chunk_key("h")
    assert len({ka, kb, chunk_key("h", FP)}) == 3 and ka == chunk_key("h", FP, salt="tenant-a")
    assert context_hash(["k"], salt="tenant-a") != context_hash(["k"]) == context_hash(["k"], salt="")
    assert orbit_context_hash(["k"], salt="tenant-a") != orbit_context_hash(["k"]) == orbit_context_hash(["k"], salt="")
    with pytest.raises(WindowkitError):
        ChunkStore(cache_salt=7)  # type: ignore[arg-type]


def test_auth_keys_from_code_env_and_file_errors_say_what_to_do(tmp_path):
    assert auth_key_from_env({}) is None
    assert auth_key_from_env({"WINDOWKIT_AUTH_KEY": KEY.decode()}) == KEY
    f = tmp_path / "key"
    f.write_bytes(KEY + b"\n")
    assert auth_key_from_env({"WINDOWKIT_AUTH_KEY_FILE": str(f)}) == KEY  # the trailing newline is dropped
    for env, words in [({"WINDOWKIT_AUTH_KEY": "short"}, "secrets.token_hex"),
                       ({"WINDOWKIT_AUTH_KEY_FILE": str(tmp_path / "nope")}, "cannot be read"),
                       ({"WINDOWKIT_AUTH_KEY": KEY.decode(), "WINDOWKIT_AUTH_KEY_FILE": str(f)}, "not both")]:
        with pytest.raises(AuthKeyError, match=words):
            auth_key_from_env(env)
    with pytest.raises(AuthKeyError, match="at least 16 bytes"):
        ChunkStore(auth_key=b"short")
    assert "windowkit" not in repr(EntryAuth(KEY)) and EntryAuth(KEY).key_id == EntryAuth(KEY.decode()).key_id
    # a store and a backend holding different keys refuse to work together
    with pytest.raises(AuthKeyError, match="same key"):
        ChunkStore(model_fingerprint=FP, shared=EmbeddedBackend(auth_key=KEY_OLD), auth_key=KEY)


def test_unkeyed_shared_tier_warns_once_embedded_and_keyed_do_not(mc):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ChunkStore(model_fingerprint=FP, shared=EmbeddedBackend())  # local use: no key, no warning
        keyed = moon(mc)
        ChunkStore(model_fingerprint=FP, shared=keyed, auth_key=KEY)  # the store's key goes to the backend
        assert keyed.auth is not None and keyed.auth.key_id == EntryAuth(KEY).key_id
        assert not [x for x in w if issubclass(x.category, UnauthenticatedStoreWarning)]
        plain = moon(mc)
        ChunkStore(model_fingerprint=FP, shared=plain)
        ChunkStore(model_fingerprint=FP, shared=plain)
        got = [x for x in w if issubclass(x.category, UnauthenticatedStoreWarning)]
        assert len(got) == 1 and "auth_key" in str(got[0].message) and "WINDOWKIT_AUTH_KEY" in str(got[0].message)
    keyed.close()
    plain.close()


class _UnkeyedBackend:
    """A StoreBackend that is not in-process and holds no key (what a MooncakeBackend without auth_key is)."""

    namespace = None
    auth = None

    def __init__(self) -> None:
        self.stats: dict = {}

    def put(self, key, value, meta=None):
        pass

    def get(self, key):
        return None

    def exists(self, key):
        return False

    def remove(self, key):
        return False

    def put_batch(self, items):
        pass

    def get_batch(self, keys):
        return [None for _ in keys]

    def exists_batch(self, keys):
        return [False for _ in keys]

    def remove_batch(self, keys):
        return 0

    def close(self):
        pass


def test_the_unauthenticated_warning_names_the_line_that_opened_the_store():
    # stacklevel: the warning points at the caller's ChunkStore(...) line, not into windowkit. (Not in the
    # store's mutation selection: under mutmut the trampoline around warn_unauthenticated adds a frame.)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        ChunkStore(model_fingerprint=FP, shared=_UnkeyedBackend())
    got = [x for x in w if issubclass(x.category, UnauthenticatedStoreWarning)]
    assert len(got) == 1 and got[0].filename == __file__ and got[0].lineno == line


def test_from_env_reads_the_key_and_a_keyed_store_needs_no_change_elsewhere(mc, monkeypatch):
    monkeypatch.setenv("WINDOWKIT_MOONCAKE_MASTER", mc.master)
    monkeypatch.setenv("WINDOWKIT_MOONCAKE_TIMEOUT_S", "10")
    monkeypatch.setenv("WINDOWKIT_AUTH_KEY", KEY.decode())
    with ChunkStore(model_fingerprint="env", layout=LAYOUT, shared="mooncake") as a:
        assert a.shared.auth.key_id == EntryAuth(KEY).key_id and a.authenticated
        a.put_canonical("k", rand_kv(0))
        with ChunkStore(model_fingerprint="env", layout=LAYOUT, shared=moon(mc, auth_key=KEY)) as b:
            assert same_kv(b.get_canonical("k"), rand_kv(0)) and b.stats.shared_hits == 1
            b.shared.close()
        a.shared.clear()


# ================================================================== forgeries
def test_1000_forgeries_on_mooncake_are_never_served(mc):
    """Canonicals, patches and orbit patches of a keyed domain, forged six ways, 1,008 forgeries in all: every
    one is a counted miss and removed, and the honest entries, once rewritten, read back bit-identical."""
    n = 8  # chunks; each has a canonical, a patch and an orbit patch: 24 victim entries per round
    writer = ChunkStore(model_fingerprint=FP, layout=LAYOUT, shared=moon(mc, auth_key=KEY), cache_salt="tenant-a")
    other_domain = ChunkStore(model_fingerprint=FP, layout=LAYOUT, shared=moon(mc, auth_key=KEY), cache_salt="tenant-b")
    old_key = ChunkStore(model_fingerprint=FP, layout=LAYOUT, shared=moon(mc, auth_key=KEY_OLD), cache_salt="tenant-a")
    attacker = EntryAuth(KEY_ATTACKER)
    truth: dict[tuple, object] = {}

    def write_all(store: ChunkStore) -> None:
        for i in range(n):
            key = f"key{i}"
            for eid, obj in ((("c", key, ""), rand_kv(i)), (("p", key, context_hash([f"key{i + 1}"])), rand_patch(i)),
                             (("p", key, orbit_context_hash([f"key{i + 1}", f"key{i + 2}"])), rand_patch(100 + i))):
                truth[eid] = obj
                if eid[0] == "c":
                    store.put_canonical(key, obj)
                else:
                    store.put_patch(key, eid[2], obj)

    for s in (writer, other_domain, old_key):
        write_all(s)
    client = writer.shared._client
    addr = mooncake_keys(writer)
    eids = sorted(addr)
    assert len(eids) == 3 * n
    good = {e: client.get(addr[e]) for e in eids}
    foreign = {e: client.get(k) for e, k in mooncake_keys(other_domain).items()}
    stale = {e: client.get(k) for e, k in mooncake_keys(old_key).items()}

    def forgeries(e: tuple, j: int) -> list[bytes]:
        """Six forgeries of entry ``e`` (``j`` varies the noise and the replayed neighbour)."""
        header, value = split_envelope(good[e])
        noisy = add_noise(value, seed=j)
        nb = eids[(eids.index(e) + 1 + j) % len(eids)]  # another entry of the same domain
        return [
            pack(noisy, header["meta"]),  # re-enveloped with a fresh (unkeyed) envelope, metadata kept
            keyed_envelope(good[e][6:38], {**header, "size": len(noisy)}, noisy),  # the real MAC kept, noisy value
            pack(noisy, header["meta"], auth=attacker, namespace=FP, key=writer._shared_key(e)),  # a made-up key
            good[nb],  # a genuine entry replayed under another key
            foreign[e],  # the same entry of another domain (same secret)
            stale[e],  # the same entry written under the old key, replayed after a rotation
        ]

    reader = ChunkStore(model_fingerprint=FP, layout=LAYOUT, shared=moon(mc, auth_key=KEY), cache_salt="tenant-a")
    tried = 0
    for j in range(7):  # 7 rounds x 24 entries x 6 forgeries = 1008
        fs = {e: forgeries(e, j) for e in eids}
        for kind in range(6):
            assert client.upsert_batch([addr[e] for e in eids], [fs[e][kind] for e in eids]) == 0
            for e in eids:
                if e[0] == "c":
                    with pytest.raises(wk.ChunkNotFoundError):
                        reader.get_canonical(e[1])
                else:
                    got = reader.get_patch(e[1], e[2])
                    assert got is None
                assert client.is_exist(addr[e]) == 0  # removed: nobody reads it again
                tried += 1
    st = reader.stats
    assert tried >= 1000 and st.auth_failures == tried and st.shared_hits == 0 and len(reader) == 0
    assert st.shared_fallback_reasons == {"auth": tried} and reader.shared.stats["forged"] == tried
    # the honest writer puts again: the reader now gets exactly the original tensors
    write_all(writer)
    for e in eids:
        got = reader.get_canonical(e[1]) if e[0] == "c" else reader.get_patch(e[1], e[2])
        assert same_kv(got, truth[e]) if e[0] == "c" else same_patch(got, truth[e])
    assert reader.stats.shared_hits == len(eids)
    for s in (writer, other_domain, old_key, reader):
        s.shared.clear()
        s.shared.close()


def test_forged_window_entries_are_refused_and_the_answer_is_exact(mc, be):
    """The issue's attack end to end: every entry a Window wrote gets noise on its tensors, keeps its metadata
    and a fresh envelope. Unkeyed, a second Window serves them and drifts from re-prefill (what the attack
    does); keyed, it refuses every one, re-encodes, and equals re-prefill."""
    chunks = [text(*c) for c in CHUNKS]
    ref = reference_logits(be, chunks)
    results = {}
    for keyed in (False, True):
        kw = {"auth_key": KEY} if keyed else {}
        shared = moon(mc, **kw)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnauthenticatedStoreWarning)
            store = ChunkStore(model_fingerprint=be.fingerprint(), layout=be.layout, shared=shared, **kw)
            win = wk.Window(be, store=store, rank=None, form="eager")
            for c in chunks:
                win.admit(c)
            forged = 0
            for eid, mkey in mooncake_keys(store).items():
                header, value = split_envelope(shared._client.get(mkey))
                assert shared._client.upsert(mkey, pack(add_noise(value, 0.3), header["meta"])) == 0
                forged += 1
            store2 = ChunkStore(model_fingerprint=be.fingerprint(), layout=be.layout, shared=moon(mc, **kw), **kw)
            win2 = wk.Window(be, store=store2, rank=None, form="eager")
            for c in chunks:
                win2.admit(c)
            results[keyed] = (kl(ref, win2.forward(QUERY)), win2.stats.encodes, store2.stats, forged)
            store2.shared.close()
        shared.clear()
        shared.close()
    drift, encodes, st, forged = results[False]
    assert encodes == 0 and st.shared_hits > 0 and drift > 1e-4  # unkeyed: the forgeries were served
    exact, encodes, st, forged = results[True]
    assert forged >= 5 and encodes == len(CHUNKS) and st.shared_hits == 0
    assert st.auth_failures >= 3 and st.shared_fallback_reasons.get("auth") == st.auth_failures
    assert exact < 1e-6  # the keyed Window equals re-prefill


# ================================================================== trust domains
def test_two_domains_on_one_tier_share_nothing_one_domain_shares_as_before(mc, be):
    chunks = [text(*c) for c in CHUNKS]
    ref = reference_logits(be, chunks)
    for kw in ({"auth_key": KEY}, {}):  # with and without a key: isolation comes from the salt
        shared = moon(mc, **kw)

        def window(salt: str) -> tuple[wk.Window, ChunkStore]:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UnauthenticatedStoreWarning)
                s = ChunkStore(model_fingerprint=be.fingerprint(), layout=be.layout, shared=shared, cache_salt=salt, **kw)
            w = wk.Window(be, store=s, rank=None, form="eager")
            for c in chunks:
                w.admit(c)
            return w, s

        wa, sa = window("tenant-a")
        wb, sb = window("tenant-b")  # the same documents, another domain: computes everything itself
        assert sb.stats.shared_hits == 0 and wb.stats.encodes == len(CHUNKS) and sb.stats.shared_fallbacks == 0
        wa2, sa2 = window("tenant-a")  # the same domain: reuses as an unsalted store does today
        assert wa2.stats.encodes == 0 and sa2.stats.shared_hits > 0 and sa2.stats.shared_fallbacks == 0
        for w in (wa, wb, wa2):
            assert kl(ref, w.forward(QUERY)) < 1e-6
        assert set(mooncake_keys(sa).values()).isdisjoint(mooncake_keys(sb).values())
        shared.clear()
        shared.close()


class CallLog:
    """A Mooncake client wrapper recording (call, stored key, result) of a prober's calls."""

    def __init__(self, client) -> None:
        self.client, self.calls = client, []

    def __getattr__(self, name):
        fn = getattr(self.client, name)

        def call(*args):
            out = fn(*args)
            self.calls.append((name, args[0] if args else None, out if not isinstance(out, bytes) else len(out)))
            return out
        return call


def test_a_client_without_the_secret_cannot_probe_another_domains_entries(mc):
    """Membership: a prober knows the documents and the model, not the secret. For entries another domain
    holds and entries nobody holds it gets the same answers and makes the same Mooncake calls with the same
    results, on keys the owner never wrote. Same calls and same (empty) replies means a get does the same work
    either way, which a wall-clock comparison on this shared 2-core machine could only approximate."""
    owner = ChunkStore(model_fingerprint=FP, layout=LAYOUT, shared=moon(mc, auth_key=KEY), cache_salt="tenant-a")
    present = [owner.chunk_key(f"doc{i}") for i in range(20)]
    absent = [owner.chunk_key(f"never{i}") for i in range(20)]
    for i, k in enumerate(present):
        owner.put_canonical(k, rand_kv(i))
    owned = set(mooncake_keys(owner).values())
    probers = {"no key": moon(mc), "another key": moon(mc, auth_key=KEY_ATTACKER)}
    for name, backend in probers.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnauthenticatedStoreWarning)
            for salt in ("tenant-a", "tenant-b", None):  # it may even guess the owner's salt
                log = CallLog(backend._client)
                backend._client = log
                prober = ChunkStore(model_fingerprint=FP, layout=LAYOUT, shared=backend, cache_salt=salt)
                seen = {}
                for group, keys in (("present", present), ("absent", absent)):
                    log.calls.clear()
                    exists = [prober.has_canonical(k) for k in keys]
                    gets = [prober.get_patch(k, context_hash([])) for k in keys]  # patch: a get, no raise
                    for k in keys:
                        with pytest.raises(wk.ChunkNotFoundError):
                            prober.get_canonical(k)
                    seen[group] = (exists, [g is None for g in gets], [(c, r) for c, _, r in log.calls])
                    assert owned.isdisjoint(key for _, key, _ in log.calls), name
                assert seen["present"] == seen["absent"], (name, salt)
                assert not any(seen["present"][0]) and all(seen["present"][1])
                backend._client = log.client
        # the raw, unkeyed address of each document is empty too (the owner's keys derive from the secret)
        assert not any(backend._client.is_exist(namespace_prefix(FP) + f"c/{k}/") for k in present)
    for b in probers.values():
        b.close()
    owner.shared.clear()
    owner.shared.close()


# ================================================================== disk tier
def test_disk_tier_entries_are_authenticated_and_folders_bound_to_key_and_domain(tmp_path):
    path = tmp_path / "store"
    s = ChunkStore(path, model_fingerprint=FP, layout=LAYOUT, auth_key=KEY, cache_salt="tenant-a")
    keys = [f"k{i}" for i in range(6)]
    for i, k in enumerate(keys):
        s.put_canonical(k, rand_kv(i), {"i": i})
    s.put_patch("k0", "ctx", rand_patch(0))
    rows = {eid[1] + eid[2]: s._disk.row(eid) for eid in s._entries}
    s.close()
    s = ChunkStore(path, model_fingerprint=FP, layout=LAYOUT, auth_key=KEY, cache_salt="tenant-a", memory_budget_bytes=0)
    assert same_kv(s.get_canonical("k1"), rand_kv(1)) and same_patch(s.get_patch("k0", "ctx"), rand_patch(0))
    assert s.stats.auth_failures == 0 and s.authenticated
    s.close()
    # forge, as someone who can write the folder: noise on k2's file (same size, its sha256 put in the index
    # as an unkeyed store would have it), k3 replayed from k4 (file and MAC), k5's meta edited in the index,
    # k1's file noised for verify() to find
    objects = path / "objects"
    data = (objects / rows["k2"].file).read_bytes()
    noisy = add_noise(data)
    assert len(noisy) == len(data)
    (objects / rows["k2"].file).write_bytes(noisy)
    (objects / rows["k3"].file).write_bytes((objects / rows["k4"].file).read_bytes())
    (objects / rows["k1"].file).write_bytes(add_noise((objects / rows["k1"].file).read_bytes()))
    db = sqlite3.connect(str(path / "index.sqlite"), isolation_level=None)
    db.execute("UPDATE entries SET sha256 = ? WHERE key = 'k2'", (hashlib.sha256(noisy).hexdigest(),))
    db.execute("UPDATE entries SET sha256 = (SELECT sha256 FROM entries WHERE key = 'k4') WHERE key = 'k3'")
    db.execute("UPDATE entries SET meta = ? WHERE key = 'k5'", (json.dumps({"i": 99}),))
    db.close()
    s = ChunkStore(path, model_fingerprint=FP, layout=LAYOUT, auth_key=KEY, cache_salt="tenant-a", memory_budget_bytes=0)
    for k in ("k2", "k3", "k5"):
        with pytest.raises(wk.ChunkNotFoundError):  # a counted miss whatever on_corrupt says: never served
            s.get_canonical(k)
        assert not s.has_canonical(k)  # removed
    assert s.stats.auth_failures == 3 and same_kv(s.get_canonical("k4"), rand_kv(4))
    assert s.verify() == 1 and s.stats.auth_failures == 4 and not s.has_canonical("k1")  # read-all finds k1
    assert s.stats.corrupt_dropped == 0 and sorted(s.keys()) == ["k0", "k4"]
    s.close()
    # wrong key, no key, another domain: refused with what to do; an unkeyed folder does not take a key
    for kw, err, words in [({"auth_key": KEY_OLD, "cache_salt": "tenant-a"}, AuthKeyError, "written with auth key"),
                           ({"cache_salt": "tenant-a"}, AuthKeyError, "pass that key"),
                           ({"auth_key": KEY, "cache_salt": "tenant-b"}, TrustDomainError, "cache_salt"),
                           ({"auth_key": KEY}, TrustDomainError, "cache_salt")]:
        with pytest.raises(err, match=words):
            ChunkStore(path, model_fingerprint=FP, **kw)
    plain = ChunkStore(tmp_path / "plain", model_fingerprint=FP, layout=LAYOUT)
    plain.put_canonical("k", rand_kv(0))
    plain.close()
    with pytest.raises(AuthKeyError, match="without an auth key"):
        ChunkStore(tmp_path / "plain", model_fingerprint=FP, auth_key=KEY)
    # an unkeyed folder's rows still hold the plain sha256 (defaults unchanged)
    sha = sqlite3.connect(str(tmp_path / "plain" / "index.sqlite")).execute("SELECT sha256 FROM entries").fetchone()[0]
    assert len(sha) == 64 and not sha.startswith("hmac:")


# ================================================================== hostile bytes (fuzzed)
@pytest.fixture(scope="module")
def fuzz_tier(mc):
    """A keyed and an unkeyed reader on Mooncake, each with one genuine entry to mangle."""
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnauthenticatedStoreWarning)
        for name, kw in (("keyed", {"auth_key": KEY}), ("plain", {})):
            s = ChunkStore(model_fingerprint="fuzz-" + name, layout=LAYOUT, shared=moon(mc, **kw), on_corrupt="miss", **kw)
            s.put_canonical("k", rand_kv(0))
            mkey = s.shared.key(s._shared_key(("c", "k", "")))
            out[name] = (s, mkey, s.shared._client.get(mkey))
    yield out
    for s, _, _ in out.values():
        s.shared.clear()
        s.shared.close()


def mangle(blob: bytes, how: str, at: int, data: bytes) -> bytes:
    header, value = split_envelope(blob)
    if how == "flip":
        b = bytearray(blob)
        b[at % len(b)] ^= 1 + data[0] % 255 if data else 1
        return bytes(b)
    if how == "truncate":
        return blob[:at % len(blob)]
    if how == "random":
        return data
    if how == "huge_header":  # a header length far past the blob, or a huge but well-formed header
        off = len(MAGIC) + (32 if blob.startswith(MAGIC_AUTH) else 0)
        return blob[:off] + (0xFFFFFFF0).to_bytes(4, "little") + blob[off + 4:] if at % 2 else \
            envelope({**header, "pad": "x" * (1 << 16)}, value)
    # safetensors payload: hostile bytes inside a valid-looking (re-enveloped, unkeyed) envelope
    if how == "st_random":
        payload = data
    elif how == "st_huge_header":
        payload = (len(value) * 1000).to_bytes(8, "little") + value[8:]
    else:  # st_flip: a byte of the safetensors header (a flipped tensor byte is a forgery: see above)
        b = bytearray(value)
        b[at % (8 + int.from_bytes(value[:8], "little"))] ^= 0xFF
        payload = bytes(b)
    return pack(payload, header["meta"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          derandomize=True)
@given(how=st.sampled_from(["flip", "truncate", "random", "huge_header", "st_random", "st_huge_header", "st_flip"]),
       at=st.integers(0, 1 << 20), data=st.binary(min_size=0, max_size=512), keyed=st.booleans())
def test_hostile_bytes_are_refused_with_windowkit_errors_and_never_served(fuzz_tier, how, at, data, keyed):
    store, mkey, good = fuzz_tier["keyed" if keyed else "plain"]
    bad = mangle(good, how, at, data)
    client = store.shared._client
    # the envelope alone: a windowkit error, or (keyed) exactly the genuine value, nothing else
    genuine = split_envelope(good)[1]
    try:
        value, _ = unpack(bad, auth=store.shared.auth, namespace=store.shared.namespace,
                          key=store._shared_key(("c", "k", "")))
        assert value == genuine or not keyed, "a keyed reader accepted an altered value"
    except StoreCorruptError:
        pass
    # through the store on Mooncake: refused (counted, removed from the tier) or the genuine tensors; never
    # anything else, never an exception that is not windowkit's
    if bad:  # Mooncake stores no empty values
        assert client.upsert(mkey, bad) == 0
        store.drop("k")
        before = store.stats.shared_fallbacks
        try:
            assert same_kv(store.get_canonical("k"), rand_kv(0))
        except wk.ChunkNotFoundError:
            assert store.stats.shared_fallbacks == before + 1 and client.is_exist(mkey) == 0
    assert client.upsert(mkey, good) == 0
    store.drop("k")
    assert same_kv(store.get_canonical("k"), rand_kv(0))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          derandomize=True)
@given(how=st.sampled_from(["flip", "truncate", "random", "st_huge_header", "noise"]), at=st.integers(0, 1 << 20),
       data=st.binary(min_size=0, max_size=512))
def test_hostile_disk_files_are_never_served_with_a_key(tmp_path_factory, how, at, data):
    path = tmp_path_factory.mktemp("fuzz-disk")
    s = ChunkStore(path, model_fingerprint=FP, layout=LAYOUT, auth_key=KEY, memory_budget_bytes=0, on_corrupt="miss")
    s.put_canonical("k", rand_kv(0))
    f = path / "objects" / s._disk.row(("c", "k", "")).file
    good = f.read_bytes()
    if how == "flip":
        b = bytearray(good)
        b[at % len(b)] ^= 1 + (data[0] % 255 if data else 0)
        bad = bytes(b)
    elif how == "truncate":
        bad = good[:at % len(good)]
    elif how == "random":
        bad = data
    elif how == "st_huge_header":
        bad = (len(good) * 1000).to_bytes(8, "little") + good[8:]
    else:  # well-formed safetensors, same size, other tensor values: only the MAC can tell
        bad = add_noise(good, seed=at)
    f.write_bytes(bad)
    got = s.get_patch("k", "none")  # a miss that touches nothing
    assert got is None
    try:
        assert same_kv(s.get_canonical("k"), rand_kv(0)) and bad == good
    except wk.ChunkNotFoundError:
        assert not s.has_canonical("k") and s.stats.auth_failures + s.stats.corrupt_dropped == 1
    s.close()


def test_keyed_batches_verify_and_unfit_backends_are_refused(mc):
    b = moon(mc, namespace="batch", auth_key=KEY)
    items = [(f"k{i}", bytes([i]) * 100, {"i": i}) for i in range(10)]
    b.put_batch(items)
    assert b.get_batch([k for k, _, _ in items]) == [(v, m) for _, v, m in items]
    header, value = split_envelope(b._client.get(b.key("k3")))
    b._client.upsert(b.key("k3"), pack(b"\x00" * 100, header["meta"]))  # re-enveloped without the key
    b._client.upsert(b.key("k4"), b._client.get(b.key("k5")))  # replayed from another key
    got = b.get_batch([k for k, _, _ in items])
    assert got[3] is None and got[4] is None and got[5] == (items[5][1], items[5][2]) and b.stats["forged"] == 2
    assert not b.exists("k3") and not b.exists("k4")  # removed
    with pytest.raises(StoreAuthError):
        unpack(pack(b"v", {}), auth=EntryAuth(KEY))  # an unkeyed envelope to a keyed reader
    with pytest.raises(StoreAuthError, match="auth_key"):
        unpack(pack(b"v", {}, auth=EntryAuth(KEY)))  # a keyed envelope to a reader without the key
    b.clear()
    b.close()

    class NoAuth(EmbeddedBackend):  # a third-party backend that cannot authenticate
        def __getattribute__(self, name):
            if name == "auth":
                raise AttributeError(name)
            return super().__getattribute__(name)

    with pytest.raises(AuthKeyError, match="cannot authenticate"):
        ChunkStore(model_fingerprint=FP, shared=NoAuth(), auth_key=KEY)


def test_window_passes_salt_and_key_to_its_own_store(be, tmp_path):
    """Window(cache_salt=, auth_key=) configures the store it makes; with a store given, they belong on that
    store (a WindowkitError says so, rather than silently ignoring them)."""
    win = wk.Window(be, cache_salt="tenant-a", auth_key=KEY)
    assert win.store.cache_salt == "tenant-a" and win.store._auth is not None
    plain = wk.Window(be).store
    assert plain.cache_salt == "" and plain._auth is None
    with pytest.raises(wk.WindowkitError, match="store="):
        wk.Window(be, store=ChunkStore(model_fingerprint=be.fingerprint()), cache_salt="tenant-a")
