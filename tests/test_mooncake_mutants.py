"""Tests written against surviving mutants of windowkit/store/mooncake.py (make mutate; docs/testing.md, "Mutation
testing").

Most of them hand ``MooncakeBackend`` a stand-in for Mooncake's client (its ``client=`` argument, documented for
tests): a dict that answers the return codes a test gives it (Mooncake's ErrorCode values from
mooncake-store/include/types.h: -900 RPC_FAIL, -901 RPC_TIMEOUT, -200 NO_AVAILABLE_HANDLE, -704 OBJECT_NOT_FOUND)
and records every call, so each fault path and counter can be checked by hand. Stored keys and envelopes are
rebuilt here from the documented recipes (hashlib / hmac / struct / json), never read back from windowkit. The
last tests run ``LocalMooncake`` itself (a real loopback master and holder).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import windowkit.store.mooncake as mcmod
from windowkit.errors import SharedStoreError, StoreAuthError, StoreCorruptError, WindowkitError
from windowkit.store.mooncake import ENV_PREFIX, LocalMooncake, MooncakeBackend, MooncakeConfig

SECRET = b"0123456789abcdef0123456789abcdef"
RPC_FAIL, RPC_TIMEOUT, NO_HANDLE, NOT_FOUND = -900, -901, -200, -704
U32 = struct.Struct("<I")


# ------------------------------------------------------------------ the documented recipes
def nskey(ns, key: str) -> str:
    """Unkeyed stored key: ``wk/<16 hex of sha256(namespace)>/<key>``."""
    return "wk/" + hashlib.sha256((ns or "").encode()).hexdigest()[:16] + "/" + key


# the shared-value envelope, rebuilt from the documented recipe (tests/test_store_mutants.py, "backend.py survivors")
from test_store_mutants import _envelope as envelope, _jd  # noqa: E402


def _derive(label: bytes) -> bytes:
    return hmac.new(SECRET, b"windowkit/v1/" + label, hashlib.sha256).digest()


def _addr(*parts: str) -> str:
    body = b"".join(U32.pack(len(p.encode())) + p.encode() for p in parts)
    return hmac.new(_derive(b"addr"), body, hashlib.sha256).hexdigest()


def keyed_key(ns: str, key: str) -> str:
    """Keyed stored key: ``wk/<16 hex HMAC(ns)>/<32 hex HMAC(ns, key)>``."""
    return f"wk/{_addr('ns', ns)[:16]}/{_addr('key', ns, key)[:32]}"


def auth_envelope(value: bytes, meta: dict, ns: str, key: str) -> bytes:
    header = b'{"meta":' + _jd(meta) + b',"size":' + str(len(value)).encode() + b"}"
    ident = U32.pack(len(ns.encode())) + ns.encode() + key.encode()
    body = U32.pack(len(ident)) + ident + U32.pack(len(header)) + header + value
    tag = hmac.new(_derive(b"mac"), body, hashlib.sha256).digest()
    return b"WKSA1\n" + tag + U32.pack(len(header)) + header + value


def zero_stats(**kw) -> dict:
    s = {"puts": 0, "gets": 0, "hits": 0, "misses": 0, "corrupt": 0, "forged": 0, "errors": 0,
         "bytes_written": 0, "bytes_read": 0}
    s.update(kw)
    return s


# ------------------------------------------------------------------ a client that answers given codes
class FakeClient:
    """The part of ``MooncakeDistributedStore`` MooncakeBackend calls. ``rc[method]`` overrides the answer (a list
    for the batch calls); every call is logged with the thread that made it."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.rc: dict = {}
        self.calls: list[tuple] = []
        self.threads: list[str] = []
        self.closed = 0
        self.raise_: BaseException | None = None
        self.block: threading.Event | None = None

    def _log(self, *call) -> None:
        self.calls.append(call)
        self.threads.append(threading.current_thread().name)
        if self.block is not None:
            self.block.wait(30)
        if self.raise_ is not None:
            raise self.raise_

    def upsert(self, k, v):
        self._log("upsert", k, v)
        rc = self.rc.get("upsert", 0)
        if rc == 0:
            self.data[k] = bytes(v)
        return rc

    def get(self, k):
        self._log("get", k)
        return self.data.get(k, b"")

    def is_exist(self, k):
        self._log("is_exist", k)
        return self.rc.get("is_exist", 1 if k in self.data else 0)

    def remove(self, k, force):
        self._log("remove", k, force)
        if "remove" in self.rc:
            return self.rc["remove"]
        return 0 if self.data.pop(k, None) is not None else NOT_FOUND

    def upsert_batch(self, ks, vs):
        self._log("upsert_batch", list(ks), list(vs))
        rc = self.rc.get("upsert_batch", 0)
        if rc == 0:
            self.data.update(zip(ks, (bytes(v) for v in vs)))
        return rc

    def get_batch(self, ks):
        self._log("get_batch", list(ks))
        return [self.data.get(k, b"") for k in ks]

    def batch_is_exist(self, ks):
        self._log("batch_is_exist", list(ks))
        return self.rc.get("batch_is_exist", [1 if k in self.data else 0 for k in ks])

    def batch_remove(self, ks, force):
        self._log("batch_remove", list(ks), force)
        if "batch_remove" in self.rc:
            return self.rc["batch_remove"]
        return [0 if self.data.pop(k, None) is not None else NOT_FOUND for k in ks]

    def remove_by_regex(self, pattern, force):
        self._log("remove_by_regex", pattern, force)
        if "remove_by_regex" in self.rc:
            return self.rc["remove_by_regex"]
        gone = [k for k in self.data if re.search(pattern, k)]
        for k in gone:
            del self.data[k]
        return len(gone)

    def close(self):
        self.closed += 1


@pytest.fixture
def fake():
    c = FakeClient()
    backends: list[MooncakeBackend] = []

    def make(ns="m", **cfg) -> MooncakeBackend:
        auth = cfg.pop("auth_key", None)
        b = MooncakeBackend(MooncakeConfig(**{"timeout_s": 30.0, **cfg}), namespace=ns, client=c, auth_key=auth)
        backends.append(b)
        return b

    c.make = make
    yield c
    if c.block is not None:  # a test that failed while a call was held: let it return before closing
        c.block.set()
    c.block = None
    for b in backends:
        b._closed = False
        b.close()


def raises(exc, fn, reason=None, match=None):
    with pytest.raises(exc) as e:
        fn()
    if reason is not None:
        assert e.value.reason == reason, (e.value.reason, str(e.value))
    if match is not None:
        assert str(e.value) == match, str(e.value)
    return e.value


# ================================================================== config
def test_config_checks_each_field_at_its_edge_with_its_message():
    c = MooncakeConfig()
    assert (c.master, c.local_hostname, c.metadata_server, c.protocol, c.rdma_devices, c.segment_bytes,
            c.buffer_bytes, c.timeout_s, c.retry_after_s, c.workers) == \
        ("127.0.0.1:50051", "127.0.0.1", "P2PHANDSHAKE", "tcp", "", 0, 32 * 2**20, 2.0, 5.0, 8)
    both = "MooncakeConfig: segment_bytes >= 0, buffer_bytes > 0, workers >= 1, retry_after_s >= 0"
    raises(WindowkitError, lambda: MooncakeConfig(master="nohostport"),
           match="MooncakeConfig.master is 'host:port', got 'nohostport'")
    raises(WindowkitError, lambda: MooncakeConfig(master=5), match="MooncakeConfig.master is 'host:port', got 5")
    raises(WindowkitError, lambda: MooncakeConfig(timeout_s=0),
           match="MooncakeConfig.timeout_s must be > 0 or None, got 0")
    raises(WindowkitError, lambda: MooncakeConfig(timeout_s=-1.0))
    assert MooncakeConfig(timeout_s=None).timeout_s is None and MooncakeConfig(timeout_s=1e-9).timeout_s == 1e-9
    for bad in ({"segment_bytes": -1}, {"buffer_bytes": 0}, {"workers": 0}, {"retry_after_s": -0.5}):
        raises(WindowkitError, lambda: MooncakeConfig(**bad), match=both)
    edge = MooncakeConfig(segment_bytes=0, buffer_bytes=1, workers=1, retry_after_s=0)  # each at its edge: fine
    assert (edge.segment_bytes, edge.buffer_bytes, edge.workers, edge.retry_after_s) == (0, 1, 1, 0)


def test_config_from_env_parses_every_field_kind():
    env = {ENV_PREFIX + "MASTER": "h:1", ENV_PREFIX + "LOCAL_HOSTNAME": "10.0.0.7",
           ENV_PREFIX + "METADATA_SERVER": "etcd://x", ENV_PREFIX + "PROTOCOL": "rdma",
           ENV_PREFIX + "RDMA_DEVICES": "mlx5_0", ENV_PREFIX + "SEGMENT_BYTES": " 3 KiB ",
           ENV_PREFIX + "BUFFER_BYTES": "2t", ENV_PREFIX + "TIMEOUT_S": "None", ENV_PREFIX + "RETRY_AFTER_S": "0.25",
           ENV_PREFIX + "WORKERS": "4"}
    assert ENV_PREFIX == "WINDOWKIT_MOONCAKE_"
    c = MooncakeConfig.from_env(env)
    assert (c.master, c.local_hostname, c.metadata_server, c.protocol, c.rdma_devices) == \
        ("h:1", "10.0.0.7", "etcd://x", "rdma", "mlx5_0")
    assert (c.segment_bytes, c.buffer_bytes, c.timeout_s, c.retry_after_s, c.workers) == (3 * 1024, 2 * 2**40, None, 0.25, 4)
    # an empty value counts as unset; keywords win over the variables; the dict given, not os.environ, is read
    c = MooncakeConfig.from_env({ENV_PREFIX + "MASTER": "", ENV_PREFIX + "WORKERS": "4"}, workers=2)
    assert c.master == "127.0.0.1:50051" and c.workers == 2
    assert MooncakeConfig.from_env({}).timeout_s == 2.0 and MooncakeConfig.from_env({ENV_PREFIX + "TIMEOUT_S": "7"}).timeout_s == 7.0
    for raw, want in (("4096", 4096), ("1K", 1024), ("1kb", 1024), ("1KiB", 1024), ("64MiB", 64 << 20),
                      ("1GB", 1 << 30), ("5 g", 5 << 30), ("1TB", 1 << 40), ("0", 0), ("12B", 12)):
        assert MooncakeConfig.from_env({ENV_PREFIX + "SEGMENT_BYTES": raw}).segment_bytes == want, raw
    for field, raw in (("SEGMENT_BYTES", "1.5GB"), ("SEGMENT_BYTES", "1 PB"), ("SEGMENT_BYTES", "GB"),
                       ("SEGMENT_BYTES", "1 KBB"), ("WORKERS", "many"), ("TIMEOUT_S", "soon")):
        raises(WindowkitError, lambda: MooncakeConfig.from_env({ENV_PREFIX + field: raw}),
               match=f"{ENV_PREFIX}{field}={raw!r} is not a number")


def test_config_from_env_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv(ENV_PREFIX + "MASTER", "10.9.8.7:6000")
    monkeypatch.setenv(ENV_PREFIX + "WORKERS", "3")
    c = MooncakeConfig.from_env()
    assert (c.master, c.workers) == ("10.9.8.7:6000", 3)


# ================================================================== the worker threads
def test_worker_runs_calls_on_its_named_daemon_threads_and_hands_back_results_and_errors():
    w = mcmod._Worker(3)
    try:
        names = set()
        for _ in range(12):
            names.add(w.run(lambda: (threading.current_thread().name, threading.current_thread().daemon), 30.0))
        assert {n for n, _ in names} <= {"windowkit-mooncake-0", "windowkit-mooncake-1", "windowkit-mooncake-2"}
        assert all(d for _, d in names)
        assert w.run(lambda: None, 30.0) is None  # a None result is a result, not a missing one
        with pytest.raises(KeyError) as e:
            w.run(lambda: {}["x"], 30.0)
        assert e.value.args == ("x",)
        assert w.drain(5.0) is True and w._busy == 0  # every call counted out again, errors too
        assert w in mcmod._WORKERS
    finally:
        w.stop()


def test_worker_timeout_abandons_the_call_and_drain_waits_for_it():
    w = mcmod._Worker(1)
    go, started = threading.Event(), threading.Event()

    def slow():
        started.set()
        go.wait(30)
        return 1

    try:
        with pytest.raises(TimeoutError):
            w.run(slow, 0.05)  # the call blocks until go is set: any finite timeout fires
        assert started.wait(30)
        assert w._busy == 1 and w.drain(0.05) is False  # still in flight
        go.set()
        assert w.drain(30) is True and w._busy == 0
        assert w.run(lambda: 7, 30) == 7  # the thread is free again
    finally:
        go.set()
        w.stop()


def test_worker_counts_every_call_in_flight():
    """Two calls in flight at once: drain waits until both are done, not only the first."""
    w = mcmod._Worker(2)
    first, second = threading.Event(), threading.Event()
    try:
        for ev in (first, second):
            with pytest.raises(TimeoutError):
                w.run(lambda ev=ev: ev.wait(30), 0.001)  # abandoned, still running
        in_flight = w._busy
        assert in_flight == 2
        first.set()
        for _ in range(3000):  # until the first call is counted out
            if w._busy < in_flight:
                break
            threading.Event().wait(0.01)
        assert w._busy == 1 and w.drain(0.05) is False  # the second is still running
        second.set()
        assert w.drain(30) is True
    finally:
        first.set()
        second.set()
        w.stop()


def test_worker_stop_ends_every_thread():
    before = set(threading.enumerate())
    w = mcmod._Worker(4)
    mine = [t for t in threading.enumerate() if t not in before]
    assert sorted(t.name for t in mine) == [f"windowkit-mooncake-{i}" for i in range(4)]
    w.stop()
    for t in mine:
        t.join(30)
    assert not any(t.is_alive() for t in mine)


def test_drain_all_waits_for_every_worker(monkeypatch):
    seen = []

    class W:
        def drain(self, timeout=None):
            seen.append(timeout)

    a, b = W(), W()
    monkeypatch.setattr(mcmod, "_WORKERS", [a, b])
    mcmod._drain_all()
    assert seen == [None, None]


# ================================================================== the guard: timeout, breaker, errors
def test_calls_run_on_the_worker_threads_unless_timeout_is_none(fake):
    b = fake.make(timeout_s=30.0, workers=2)
    b.exists("k")
    assert fake.threads[-1] in ("windowkit-mooncake-0", "windowkit-mooncake-1")
    b2 = fake.make(timeout_s=None)
    b2.exists("k")
    assert fake.threads[-1] == threading.current_thread().name  # called directly, no thread hop


def test_a_call_that_does_not_answer_times_out_and_opens_the_breaker(fake):
    b = fake.make(timeout_s=0.05, retry_after_s=3600.0)
    fake.block = threading.Event()
    raises(SharedStoreError, lambda: b.exists("k"), "timeout", "mooncake call took longer than 0.05 s")
    assert b.stats == zero_stats(errors=1)
    fake.block.set()
    assert b._worker.drain(30)
    fake.block = None
    n = len(fake.calls)
    # open for an hour: answered at once, the client is not called, nothing more counted
    raises(SharedStoreError, lambda: b.exists("k"), "unavailable",
           "mooncake tier skipped: it failed recently (breaker open)")
    raises(SharedStoreError, lambda: b.put("k", b"v"), "unavailable")
    assert len(fake.calls) == n and b.stats == zero_stats(errors=1)


def test_the_breaker_closes_after_retry_after_s(fake, monkeypatch):
    b = fake.make(retry_after_s=5.0)
    fake.rc["is_exist"] = RPC_FAIL
    now = [1000.0]
    monkeypatch.setattr(mcmod.time, "monotonic", lambda: now[0])
    raises(SharedStoreError, lambda: b.exists("k"), "unavailable", "mooncake exists of 'k' failed (rc=-900)")
    assert b._down_until == 1005.0
    del fake.rc["is_exist"]
    now[0] = 1004.999
    raises(SharedStoreError, lambda: b.exists("k"), "unavailable",
           "mooncake tier skipped: it failed recently (breaker open)")
    now[0] = 1005.0  # exactly retry_after_s later: tried again
    assert b.exists("k") is False


def test_binding_errors_are_shared_store_errors_and_windowkit_errors_pass_through(fake):
    b = fake.make()
    fake.raise_ = RuntimeError("boom")
    raises(SharedStoreError, lambda: b.exists("k"), "error", "mooncake call failed: RuntimeError: boom")
    assert b.stats == zero_stats(errors=1) and b._down_until == 0.0  # counted, no breaker
    fake.raise_ = OSError("again")
    raises(SharedStoreError, lambda: b.get("k"), "error", "mooncake call failed: OSError: again")
    assert b.stats == zero_stats(errors=2)  # each fault counted
    mine = WindowkitError("mine")
    fake.raise_ = mine
    with pytest.raises(WindowkitError) as e:
        b.exists("k")
    assert e.value is mine and b.stats == zero_stats(errors=2)  # re-raised as is, not counted


def test_a_closed_backend_refuses_calls_and_leaves_a_borrowed_client_open(fake):
    b = fake.make()  # client= passed in: borrowed, its owner closes it (an owned one: the connect test below)
    b.close()
    assert fake.closed == 0
    b.close()
    assert fake.closed == 0  # idempotent
    raises(WindowkitError, lambda: b.exists("k"), match="the Mooncake backend is closed")
    assert not isinstance(pytest.raises(WindowkitError, b.get, "k").value, SharedStoreError)
    assert fake.calls == []


def test_close_waits_for_a_call_in_flight(fake):
    b = fake.make(timeout_s=0.05)
    b._owns_client = True  # as if it had connected the client itself: close() closes it, after the call in flight
    fake.block = threading.Event()
    raises(SharedStoreError, lambda: b.exists("k"), "timeout")
    closer = threading.Thread(target=b.close)
    closer.start()
    closer.join(0.2)
    assert fake.closed == 0  # the abandoned call still uses the client: close waits for it
    fake.block.set()
    closer.join(30)
    assert fake.closed == 1


@pytest.mark.parametrize("rc, reason, trips", [(RPC_FAIL, "unavailable", True), (RPC_TIMEOUT, "timeout", True),
                                               (NO_HANDLE, "full", False), (-1, "error", False),
                                               (NOT_FOUND, "error", False), (7, "error", False)])
def test_return_codes_map_to_reasons_and_only_outages_open_the_breaker(fake, rc, reason, trips):
    b = fake.make(retry_after_s=3600.0)
    fake.rc["upsert"] = rc
    raises(SharedStoreError, lambda: b.put("k", b"v"), reason, f"mooncake put of 'k' failed (rc={rc})")
    assert b.stats == zero_stats(errors=1)  # counted once, nothing put
    assert (b._down_until > 0) == trips
    if not trips:
        fake.rc.clear()
        b.put("k", b"v")  # the tier is still used


# ================================================================== the protocol, call by call
def test_put_and_get_by_the_documented_key_and_envelope(fake):
    b = fake.make(ns="model-a")
    b.put("c/k/", b"value", {"tokens": 5})
    want = envelope(b"value", {"tokens": 5})
    assert fake.calls == [("upsert", nskey("model-a", "c/k/"), want)]
    assert b.key("c/k/") == nskey("model-a", "c/k/")
    assert b.stats == zero_stats(puts=1, bytes_written=len(want))
    b.put("x", b"")  # no meta: {}
    assert fake.data[nskey("model-a", "x")] == envelope(b"", {})
    assert b.get("c/k/") == (b"value", {"tokens": 5})
    assert fake.calls[-1] == ("get", nskey("model-a", "c/k/"))  # a hit asks nothing more
    assert b.stats == zero_stats(puts=2, bytes_written=len(want) + len(envelope(b"", {})), gets=1, hits=1,
                                 bytes_read=len(want))


def test_get_tells_a_miss_from_an_unreadable_value_and_an_outage(fake):
    b = fake.make(retry_after_s=3600.0)
    assert b.get("nope") is None
    assert fake.calls == [("get", nskey("m", "nope")), ("is_exist", nskey("m", "nope"))]
    assert b.stats == zero_stats(gets=1, misses=1)
    fake.rc["is_exist"] = 1  # listed by the master, no value read: the holder is gone
    raises(SharedStoreError, lambda: b.get("gone"), "missing", "mooncake lists 'gone' but its value cannot be read")
    assert b.stats == zero_stats(gets=2, misses=1, errors=1) and b._down_until == 0.0
    fake.rc["is_exist"] = NO_HANDLE
    raises(SharedStoreError, lambda: b.get("x"), "full", "mooncake get of 'x' failed (rc=-200)")
    assert b.stats == zero_stats(gets=3, misses=1, errors=2) and b._down_until == 0.0
    fake.rc["is_exist"] = RPC_TIMEOUT
    raises(SharedStoreError, lambda: b.get("x"), "timeout", "mooncake get of 'x' failed (rc=-901)")
    assert b.stats == zero_stats(gets=4, misses=1, errors=3) and b._down_until > 0


def test_a_corrupt_or_forged_value_is_counted_removed_and_raised(fake):
    b = fake.make()
    fake.data[nskey("m", "k")] = b"not an envelope"
    with pytest.raises(StoreCorruptError) as e:
        b.get("k")
    assert not isinstance(e.value, StoreAuthError)
    assert fake.calls[-1] == ("remove", nskey("m", "k"), True) and nskey("m", "k") not in fake.data
    assert b.stats == zero_stats(gets=1, corrupt=1)
    kb = fake.make(ns="m", auth_key=SECRET)
    fake.data[keyed_key("m", "k")] = envelope(b"v", {})  # unauthenticated: refused by a keyed reader
    pytest.raises(StoreAuthError, kb.get, "k")
    assert fake.calls[-1] == ("remove", keyed_key("m", "k"), True)
    assert kb.stats == zero_stats(gets=1, forged=1)


def test_a_failed_removal_of_a_corrupt_value_still_raises_the_corruption(fake):
    b = fake.make(retry_after_s=3600.0)
    fake.data[nskey("m", "k")] = b"junk"
    fake.rc["remove"] = RPC_FAIL  # _drop's removal fails: swallowed, the corruption is what the caller sees
    pytest.raises(StoreCorruptError, b.get, "k")
    fake.raise_ = None
    b2 = fake.make(ns="n")
    fake.data[nskey("n", "k")] = b"junk"
    orig = fake.remove

    def remove_raises(k, force):
        fake.calls.append(("remove", k, force))
        raise RuntimeError("down")

    fake.remove = remove_raises
    pytest.raises(StoreCorruptError, b2.get, "k")
    assert fake.calls[-1] == ("remove", nskey("n", "k"), True) and b2.stats["errors"] == 1
    fake.remove = orig
    b2._closed = True
    b2._drop(nskey("n", "k"))  # closed: the WindowkitError is swallowed as well
    b2._closed = False


def test_keyed_backend_uses_derived_keys_and_authenticated_envelopes(fake):
    b = fake.make(ns="fp", auth_key=SECRET)
    b.put("c/k/", b"abc", {"t": 1})
    want = auth_envelope(b"abc", {"t": 1}, "fp", "c/k/")
    assert fake.calls[-1] == ("upsert", keyed_key("fp", "c/k/"), want)
    assert b.get("c/k/") == (b"abc", {"t": 1})
    b.put_batch([("a", b"1", None), ("b", b"22", {"x": 2})])
    assert fake.calls[-1] == ("upsert_batch", [keyed_key("fp", "a"), keyed_key("fp", "b")],
                              [auth_envelope(b"1", {}, "fp", "a"), auth_envelope(b"22", {"x": 2}, "fp", "b")])
    assert b.get_batch(["a", "b"]) == [(b"1", {}), (b"22", {"x": 2})]
    fake.data["other"] = b"x"
    assert b.clear() == 3 and fake.data == {"other": b"x"}
    assert fake.calls[-1] == ("remove_by_regex", "^" + re.escape(f"wk/{_addr('ns', 'fp')[:16]}/"), True)


def test_exists_and_remove_read_their_codes(fake):
    b = fake.make(retry_after_s=3600.0)
    fake.data[nskey("m", "k")] = b"x"
    assert b.exists("k") is True and b.exists("z") is False
    assert fake.calls[-1] == ("is_exist", nskey("m", "z"))
    fake.rc["is_exist"] = 2  # any code but 1 that is not a fault: not there
    assert b.exists("k") is False
    fake.rc["is_exist"] = -1
    raises(SharedStoreError, lambda: b.exists("k"), "error", "mooncake exists of 'k' failed (rc=-1)")
    del fake.rc["is_exist"]
    assert b.remove("k") is True and fake.calls[-1] == ("remove", nskey("m", "k"), True)
    assert b.remove("k") is False  # OBJECT_NOT_FOUND: nothing removed, no fault
    for rc in (NO_HANDLE, -1, 1):
        fake.rc["remove"] = rc
        assert b.remove("k") is False
    assert b._down_until == 0.0 and b.stats["errors"] == 1  # the exists fault above only
    fake.rc["remove"] = RPC_TIMEOUT
    raises(SharedStoreError, lambda: b.remove("k"), "timeout", "mooncake remove of 'k' failed (rc=-901)")
    b._down_until = 0.0
    fake.rc["remove"] = RPC_FAIL
    raises(SharedStoreError, lambda: b.remove("k"), "unavailable", "mooncake remove of 'k' failed (rc=-900)")


def test_put_batch(fake):
    b = fake.make()
    b.put_batch([])
    assert fake.calls == []
    items = [("a", b"1", {"i": 1}), ("b", b"22", None), ("c", b"", {})]
    b.put_batch(items)
    blobs = [envelope(b"1", {"i": 1}), envelope(b"22", {}), envelope(b"", {})]
    assert fake.calls == [("upsert_batch", [nskey("m", "a"), nskey("m", "b"), nskey("m", "c")], blobs)]
    assert b.stats == zero_stats(puts=3, bytes_written=sum(map(len, blobs)))
    fake.rc["upsert_batch"] = NO_HANDLE
    raises(SharedStoreError, lambda: b.put_batch(items), "full", "mooncake put_batch of 3 failed (rc=-200)")
    assert b.stats == zero_stats(puts=3, bytes_written=sum(map(len, blobs)), errors=1)


def test_get_batch_hits_misses_unreadable_corrupt_and_faults(fake):
    b = fake.make(retry_after_s=3600.0)
    assert b.get_batch([]) == [] and fake.calls == []
    good = envelope(b"vv", {"a": 1})
    fake.data[nskey("m", "h1")] = good
    fake.data[nskey("m", "h2")] = envelope(b"", {})
    fake.data[nskey("m", "bad")] = b"junk"
    got = b.get_batch(["h1", "miss", "bad", "h2"])
    assert got == [(b"vv", {"a": 1}), None, None, (b"", {})]
    assert fake.calls[:2] == [("get_batch", [nskey("m", k) for k in ("h1", "miss", "bad", "h2")]),
                              ("batch_is_exist", [nskey("m", "miss")])]  # only the empty answers are asked
    assert fake.calls[2] == ("remove", nskey("m", "bad"), True) and nskey("m", "bad") not in fake.data
    assert b.stats == zero_stats(gets=4, hits=2, misses=1, corrupt=1,
                                 bytes_read=len(good) + len(envelope(b"", {})))
    fake.calls.clear()
    assert b.get_batch(["h1"]) == [(b"vv", {"a": 1})] and [c[0] for c in fake.calls] == ["get_batch"]
    # listed but unreadable (holder gone): misses, counted as errors
    fake.rc["batch_is_exist"] = [1, 0, 1]
    assert b.get_batch(["x", "y", "z"]) == [None, None, None]
    s = zero_stats(gets=8, hits=3, misses=4, corrupt=1, errors=2, bytes_read=2 * len(good) + len(envelope(b"", {})))
    assert b.stats == s
    fake.rc["batch_is_exist"] = [1]  # every empty answer listed
    assert b.get_batch(["x"]) == [None]
    s = zero_stats(gets=9, hits=3, misses=5, corrupt=1, errors=3, bytes_read=2 * len(good) + len(envelope(b"", {})))
    assert b.stats == s
    fake.rc["batch_is_exist"] = [0, NO_HANDLE, RPC_FAIL]  # the first negative code is the one reported
    raises(SharedStoreError, lambda: b.get_batch(["x", "y", "z"]), "full", "mooncake get_batch of 3 failed (rc=-200)")
    assert b._down_until == 0.0
    fake.rc["batch_is_exist"] = [RPC_FAIL, 1]
    raises(SharedStoreError, lambda: b.get_batch(["x", "y"]), "unavailable", "mooncake get_batch of 2 failed (rc=-900)")
    assert b._down_until > 0


def test_get_batch_counts_a_forged_value(fake):
    b = fake.make(ns="fp", auth_key=SECRET)
    fake.data[keyed_key("fp", "a")] = envelope(b"v", {})
    assert b.get_batch(["a"]) == [None] and b.stats == zero_stats(gets=1, forged=1)


def test_exists_batch_and_remove_batch(fake):
    b = fake.make(retry_after_s=3600.0)
    assert b.exists_batch([]) == [] and b.remove_batch([]) == 0 and fake.calls == []
    fake.data[nskey("m", "a")] = fake.data[nskey("m", "c")] = b"x"
    assert b.exists_batch(["a", "b", "c"]) == [True, False, True]
    assert fake.calls[-1] == ("batch_is_exist", [nskey("m", k) for k in "abc"])
    fake.rc["batch_is_exist"] = [2, 0]
    assert b.exists_batch(["a", "b"]) == [False, False]
    fake.rc["batch_is_exist"] = [1, -1, RPC_FAIL]
    raises(SharedStoreError, lambda: b.exists_batch(["a", "b", "c"]), "error",
           "mooncake exists_batch of 3 failed (rc=-1)")
    assert b._down_until == 0.0
    del fake.rc["batch_is_exist"]
    assert b.remove_batch(["a", "b", "c"]) == 2
    assert fake.calls[-1] == ("batch_remove", [nskey("m", k) for k in "abc"], True)
    fake.rc["batch_remove"] = [0, NO_HANDLE, -1, 1, 0]
    assert b.remove_batch(list("vwxyz")) == 2 and b.stats["errors"] == 1  # the exists_batch fault above only
    fake.rc["batch_remove"] = [0, RPC_TIMEOUT, RPC_FAIL]
    raises(SharedStoreError, lambda: b.remove_batch(list("xyz")), "timeout",
           "mooncake remove_batch of 3 failed (rc=-901)")
    b._down_until = 0.0
    fake.rc["batch_remove"] = [RPC_FAIL]
    raises(SharedStoreError, lambda: b.remove_batch(["x"]), "unavailable",
           "mooncake remove_batch of 1 failed (rc=-900)")


def test_clear_removes_this_namespace_only(fake):
    b = fake.make(ns="a.b")
    fake.data[nskey("a.b", "k1")] = fake.data[nskey("a.b", "k2")] = b"x"
    fake.data[nskey("other", "k1")] = b"x"
    fake.data["x" + nskey("a.b", "k1")] = b"x"  # the prefix not at the start: not this namespace's
    assert b.clear() == 2
    assert fake.calls[-1] == ("remove_by_regex", "^" + re.escape(nskey("a.b", "")), True)
    assert sorted(fake.data) == sorted([nskey("other", "k1"), "x" + nskey("a.b", "k1")])
    fake.rc["remove_by_regex"] = 0
    assert b.clear() == 0
    fake.rc["remove_by_regex"] = -1
    raises(SharedStoreError, lambda: b.clear(), "error", "mooncake clear failed (rc=-1)")


def test_repr_and_namespace_none(fake):
    b = fake.make(ns=None, master="h:9")
    assert repr(b) == "MooncakeBackend(master='h:9', namespace=None, auth=none)"
    b.put("k", b"v")
    assert fake.calls[-1][1] == "wk/" + hashlib.sha256(b"").hexdigest()[:16] + "/k"
    kb = fake.make(ns="fp", auth_key=SECRET)
    assert repr(kb) == f"MooncakeBackend(master='127.0.0.1:50051', namespace='fp', auth=key {_derive(b'id').hex()[:16]})"
    assert kb.auth is not None and b.auth is None and kb.namespace == "fp" and kb.config.master == "127.0.0.1:50051"


def test_backend_from_env_reads_config_and_key(monkeypatch):
    made = []

    def fake_init(self, config=None, namespace=None, client=None, auth_key=None):
        made.append((config, namespace, client, auth_key))

    monkeypatch.setattr(MooncakeBackend, "__init__", fake_init)
    monkeypatch.setenv(ENV_PREFIX + "MASTER", "10.0.0.1:7")
    monkeypatch.setenv("WINDOWKIT_AUTH_KEY", SECRET.decode())
    MooncakeBackend.from_env(namespace="fp", workers=3)
    config, ns, client, auth = made[-1]
    assert (config.master, config.workers, ns, client) == ("10.0.0.1:7", 3, "fp", None)
    assert auth.key_id == _derive(b"id").hex()[:16]
    other = b"x" * 32
    MooncakeBackend.from_env(auth_key=other)
    assert made[-1][3].key_id == hmac.new(other, b"windowkit/v1/id", hashlib.sha256).digest().hex()[:16]
    monkeypatch.delenv("WINDOWKIT_AUTH_KEY")
    MooncakeBackend.from_env()
    assert made[-1][1] is None and made[-1][3] is None and made[-1][0].master == "10.0.0.1:7"


def test_backend_default_config_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(ENV_PREFIX + "MASTER", "10.0.0.2:8")
    monkeypatch.setenv(ENV_PREFIX + "WORKERS", "2")
    c = FakeClient()
    b = MooncakeBackend(client=c)
    try:
        assert b.config.master == "10.0.0.2:8" and b.namespace is None and b.auth is None
        assert b._worker._n == 2 and b.stats == zero_stats() and b._client is c and b._closed is False
        assert b._down_until == 0.0
    finally:
        b.close()


# ================================================================== connecting
class _Listener:
    """Something listening on a free loopback port (what _connect probes before Mooncake's setup)."""

    def __enter__(self):
        self.s = socket.socket()
        self.s.bind(("127.0.0.1", 0))
        self.s.listen(8)
        self.port = self.s.getsockname()[1]
        return self

    def __exit__(self, *a):
        self.s.close()


def _fake_store_class(rc, log):
    class Store:
        def setup(self, *args):
            log.append(("setup", threading.current_thread().name) + args)
            return rc

        def close(self):
            log.append(("close",))

    return Store


def test_connect_calls_setup_with_the_config_in_mooncakes_order(monkeypatch):
    import mooncake.store

    log: list = []
    monkeypatch.setattr(mooncake.store, "MooncakeDistributedStore", _fake_store_class(0, log))
    with _Listener() as ls:
        cfg = MooncakeConfig(master=f"127.0.0.1:{ls.port}", local_hostname="10.1.1.1", metadata_server="meta",
                             segment_bytes=123, buffer_bytes=456, protocol="rdma", rdma_devices="mlx5_1",
                             timeout_s=30.0, workers=1)
        b = MooncakeBackend(cfg, namespace="n")
        try:
            assert log == [("setup", "windowkit-mooncake-0", "10.1.1.1", "meta", 123, 456, "rdma", "mlx5_1",
                            f"127.0.0.1:{ls.port}")]
            assert b._client.__class__.__name__ == "Store"
        finally:
            b.close()
        assert log[-1] == ("close",)
        b.close()  # idempotent: the client it connected is closed once
        assert log.count(("close",)) == 1


def test_connect_failures_say_why(monkeypatch):
    import mooncake.store

    log: list = []
    with _Listener() as ls:
        master = f"127.0.0.1:{ls.port}"
        monkeypatch.setattr(mooncake.store, "MooncakeDistributedStore", _fake_store_class(-1, log))
        raises(SharedStoreError, lambda: MooncakeBackend(MooncakeConfig(master=master)), "unavailable",
               f"mooncake setup against master {master} failed (rc=-1)")
        seen = []

        def no_answer(self, fn, timeout):
            seen.append(timeout)
            raise TimeoutError

        monkeypatch.setattr(mcmod._Worker, "run", no_answer)
        for t, want in ((2.0, 10.0), (None, 10.0), (25.0, 25.0)):
            raises(SharedStoreError, lambda: MooncakeBackend(MooncakeConfig(master=master, timeout_s=t)), "timeout",
                   f"mooncake master {master} did not answer setup")
            assert seen[-1] == want  # setup gets at least 10 s
    port = mcmod._free_port()
    e = raises(SharedStoreError, lambda: MooncakeBackend(MooncakeConfig(master=f"127.0.0.1:{port}")), "unavailable")
    assert str(e).startswith(f"no mooncake master at 127.0.0.1:{port}: ")
    e = raises(SharedStoreError, lambda: MooncakeBackend(MooncakeConfig(master="127.0.0.1:notaport")), "unavailable")
    assert str(e).startswith("no mooncake master at 127.0.0.1:notaport: ")


def test_connect_probes_the_master_with_the_configured_timeout(monkeypatch):
    import mooncake.store

    seen = []

    def probe(addr, timeout=None):
        seen.append((addr, timeout))
        raise OSError("refused")

    monkeypatch.setattr(mcmod.socket, "create_connection", probe)
    monkeypatch.setattr(mooncake.store, "MooncakeDistributedStore", _fake_store_class(0, []))
    for t, want in ((0.5, 0.5), (None, 10.0)):
        raises(SharedStoreError, lambda: MooncakeBackend(MooncakeConfig(master="host.example:4321", timeout_s=t)),
               "unavailable", "no mooncake master at host.example:4321: refused")
        assert seen[-1] == (("host.example", 4321), want)
    raises(SharedStoreError, lambda: MooncakeBackend(MooncakeConfig(master="::1:4321", timeout_s=0.5)), "unavailable")
    assert seen[-1] == (("::1", 4321), 0.5)  # the port is what follows the last colon


def test_connect_without_mooncake_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # import fails
    e = raises(WindowkitError, lambda: MooncakeBackend(MooncakeConfig()))
    assert not isinstance(e, SharedStoreError)
    assert str(e).startswith("MooncakeBackend needs Mooncake Store: pip install -r requirements-mooncake.txt "
                             "(and Debian libibverbs1 librdmacm1): ")


# ================================================================== helpers and LocalMooncake
def test_free_port_binary_and_listening(tmp_path, monkeypatch):
    p = mcmod._free_port()
    assert 0 < p < 65536 and mcmod._listening(p) is False
    with socket.socket() as s:  # the port is free: it can be bound on 127.0.0.1
        s.bind(("127.0.0.1", p))
        s.listen(1)
        assert mcmod._listening(p) is True
    here = Path(sys.executable).parent / "mooncake_master"
    if here.exists():
        assert mcmod._binary("mooncake_master") == str(here)
    tool = tmp_path / "wk_fake_tool"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert mcmod._binary("wk_fake_tool") == str(tool)
    raises(WindowkitError, lambda: mcmod._binary("wk_no_such_tool"),
           match="wk_no_such_tool not found: pip install -r requirements-mooncake.txt")


def test_wait_reports_an_exit_and_a_timeout():
    class Proc:
        def __init__(self, rc):
            self.returncode = rc

        def poll(self):
            return self.returncode

    raises(SharedStoreError, lambda: LocalMooncake._wait(lambda: False, "master", Proc(3)), "unavailable",
           "mooncake master exited with 3")
    raises(SharedStoreError, lambda: LocalMooncake._wait(lambda: False, "holder", Proc(None), timeout=0.0),
           "timeout", "mooncake holder not ready after 0.0 s")
    calls = []
    LocalMooncake._wait(lambda: calls.append(1) or len(calls) >= 3, "x", Proc(None))  # polls until ready
    assert len(calls) == 3
    LocalMooncake._wait(lambda: True, "x", Proc(0))  # ready wins over an exited process


def test_local_mooncake_runs_stops_and_cleans_up(tmp_path):
    with LocalMooncake(segment_bytes=16 << 20) as m:
        assert m.master == f"127.0.0.1:{m.port}" and len({m.port, m.metrics_port, m.holder_port}) == 3
        assert mcmod._listening(m.port)
        logs = m.log_dir
        assert logs.is_dir() and logs.name.startswith("windowkit-mooncake-")
        assert b"Mounting segment" in (logs / "holder.log").read_bytes()
        # the master's own log (glog writes to stderr, which goes to master.log) names the ports it was given
        assert f"Master service started on port {m.port}".encode() in (logs / "master.log").read_bytes()
        c = m.config(timeout_s=1.5)
        assert (c.master, c.timeout_s, c.workers) == (m.master, 1.5, 8)
        assert m.config(master="h:1").master == "h:1"  # keywords win
        master_cmd = m._master.args
        assert master_cmd[1:] == [f"--rpc_port={m.port}", "--rpc_address=127.0.0.1",
                                  f"--metrics_port={m.metrics_port}", "--metrics_host=127.0.0.1",
                                  "--enable_metric_reporting=false"]
        assert m._holder.args[1:] == [f"--master_server_address={m.master}", "--metadata_server=P2PHANDSHAKE",
                                      f"--global_segment_size={16 << 20}", "--host=127.0.0.1",
                                      f"--port={m.holder_port}", "--protocol=tcp"]
        assert os.getsid(m._master.pid) == m._master.pid and os.getsid(m._holder.pid) == m._holder.pid
        m.freeze_master()
        assert _state(m._master.pid, True) == "T"
        m.thaw_master()
        assert _state(m._master.pid, False) in ("S", "R")
        m.stop_holder()
        assert m._holder.returncode == -9
        m.stop_holder()  # already gone: nothing to do
        m.stop_master()
        assert m._master.returncode == -9 and not mcmod._listening(m.port)
        m.stop_master()
    assert not logs.exists()  # its own temporary folder is removed
    keep = tmp_path / "logs"
    keep.mkdir()
    with LocalMooncake(segment_bytes=16 << 20, log_dir=str(keep)) as m:
        assert m.log_dir == keep
        master, holder = m._master, m._holder
    assert master.returncode == -9 and holder.returncode == -9  # close kills both
    assert (keep / "master.log").exists() and (keep / "holder.log").exists()  # a given folder is kept


def _state(pid: int, stopped: bool) -> str:
    """The process state letter from /proc, polled until it is (or is not) stopped: signals arrive asynchronously."""
    for _ in range(500):
        st = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if (st in ("T", "t")) == stopped:
            break
        threading.Event().wait(0.01)
    return st


def test_local_mooncake_that_cannot_start_cleans_up(monkeypatch, tmp_path):
    real = subprocess.Popen
    started = []

    def popen(cmd, **kw):
        if "mooncake_client" in cmd[0]:
            cmd = [sys.executable, "-c", "raise SystemExit(5)"]  # a holder that exits at once
        p = real(cmd, **kw)
        started.append(p)
        return p

    monkeypatch.setattr(mcmod.subprocess, "Popen", popen)
    raises(SharedStoreError, lambda: LocalMooncake(segment_bytes=16 << 20), "unavailable", "mooncake holder exited with 5")
    assert len(started) == 2 and started[0].returncode == -9  # the master was killed on the way out


def test_local_mooncake_whose_master_cannot_start_cleans_up(monkeypatch):
    real = subprocess.Popen
    started = []

    def popen(cmd, **kw):
        assert "mooncake_master" in cmd[0]  # the holder is never started
        p = real([sys.executable, "-c", "raise SystemExit(4)"], **kw)
        started.append((p, Path(kw["stdout"].name)))
        return p

    monkeypatch.setattr(mcmod.subprocess, "Popen", popen)
    raises(SharedStoreError, lambda: LocalMooncake(), "unavailable", "mooncake master exited with 4")
    (p, log), = started
    assert log.name == "master.log" and not log.parent.exists()  # its temporary folder is removed


def test_wait_by_a_clock_it_is_given(monkeypatch):
    """_wait's bound, read on a fake clock: it gives up only once *more than* ``timeout`` (default 20 s) passed,
    polling every 0.05 s."""
    class Proc:
        returncode = None

        def poll(self):
            return None

    def run(times, ready_after, **kw):
        clock, sleeps, checks = iter(times), [], []
        monkeypatch.setattr(mcmod.time, "monotonic", lambda: next(clock))
        monkeypatch.setattr(mcmod.time, "sleep", sleeps.append)
        LocalMooncake._wait(lambda: checks.append(1) or len(checks) > ready_after, "holder", Proc(), **kw)
        return sleeps

    assert run([100.0, 105.0], 1, timeout=5.0) == [0.05]  # exactly 5 s later: not yet past the bound
    assert run([100.0, 120.0, 120.0], 2) == [0.05, 0.05]  # the default bound is 20 s
    with pytest.raises(SharedStoreError) as e:
        run([100.0, 120.5], 5)
    assert str(e.value) == "mooncake holder not ready after 20.0 s" and e.value.reason == "timeout"


def test_stop_and_close_with_nothing_left_to_stop(tmp_path):
    m = LocalMooncake.__new__(LocalMooncake)  # as a failed start leaves it: no holder, folder already gone
    m._holder, m._master, m._own_logs, m.log_dir = None, None, True, tmp_path / "gone"
    m.stop_holder()
    m.close()
    assert not m.log_dir.exists()


def test_listening_probes_loopback_with_a_short_timeout(monkeypatch):
    seen = []

    class Conn:
        def close(self):
            seen.append("closed")

    def probe(addr, timeout=None):
        seen.append((addr, timeout))
        if addr[1] == 1:
            raise ConnectionRefusedError
        return Conn()

    monkeypatch.setattr(mcmod.socket, "create_connection", probe)
    assert mcmod._listening(2) is True and seen == [(("127.0.0.1", 2), 0.2), "closed"]
    assert mcmod._listening(1) is False and seen[-1] == (("127.0.0.1", 1), 0.2)
