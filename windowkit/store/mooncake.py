"""MooncakeBackend: a ``StoreBackend`` on Mooncake Store, so several worker processes share one KV tier.

    from windowkit.store import ChunkStore
    from windowkit.store.mooncake import MooncakeBackend, MooncakeConfig

    shared = MooncakeBackend(MooncakeConfig(master="127.0.0.1:50051"), namespace=backend.fingerprint())
    shared = MooncakeBackend.from_env(namespace=backend.fingerprint())   # WINDOWKIT_MOONCAKE_* variables
    store = ChunkStore(model_fingerprint=backend.fingerprint(), shared=shared)

Mooncake Store (``pip install -r requirements-mooncake.txt``, Debian ``libibverbs1 librdmacm1``) is a
master (``mooncake_master``: metadata, placement) plus clients that mount memory *segments* holding the
values. A value lives in some client's segment: run one or more holders (``mooncake_client
--global_segment_size=4GB ...``) next to the master, or let workers mount memory themselves
(``segment_bytes``); a segment leaves with its process, and its values become misses. See docs/store.md.

Every call goes through one guard: a timeout (``timeout_s``; the call runs on a daemon worker thread and is
abandoned if it does not answer in time) and a breaker: after an "unavailable" or "timeout" fault the
backend answers ``SharedStoreError("unavailable")`` at once for ``retry_after_s`` seconds, so a dead master
costs one timeout, not one per chunk. ``mooncake`` is imported on first use only.

Authentication: ``MooncakeBackend(..., auth_key=secret)`` (``from_env`` reads ``WINDOWKIT_AUTH_KEY`` or
``WINDOWKIT_AUTH_KEY_FILE``) MACs every value and derives every Mooncake key with the secret, so a client of
the same master without it can neither forge an entry nor find one (see docs/security.md).
"""
from __future__ import annotations

import atexit
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from windowkit.errors import SharedStoreError, StoreAuthError, StoreCorruptError, WindowkitError
from windowkit.store.auth import EntryAuth, KeySpec, as_auth, auth_key_from_env
from windowkit.store.backend import Got, Item, new_stats, pack, storage_key, storage_prefix, unpack

ENV_PREFIX = "WINDOWKIT_MOONCAKE_"
# Mooncake ErrorCode values (mooncake-store/include/types.h); the Python binding returns them as ints
_NO_AVAILABLE_HANDLE, _RPC_FAIL, _RPC_TIMEOUT = -200, -900, -901


def _reason(rc: int) -> str:
    return {_RPC_FAIL: "unavailable", _RPC_TIMEOUT: "timeout", _NO_AVAILABLE_HANDLE: "full"}.get(int(rc), "error")


@dataclass
class MooncakeConfig:
    """Where the master is and how this client joins. Every field has a ``WINDOWKIT_MOONCAKE_<FIELD>`` variable.

        MooncakeConfig(master="10.0.0.5:50051", local_hostname="10.0.0.7")
        MooncakeConfig.from_env(timeout_s=0.5)   # WINDOWKIT_MOONCAKE_MASTER=... etc., keywords win
    """

    master: str = "127.0.0.1:50051"  # mooncake_master's --rpc_address:--rpc_port
    local_hostname: str = "127.0.0.1"  # this client's address as the other clients reach it
    metadata_server: str = "P2PHANDSHAKE"  # no separate metadata server (peers exchange it directly)
    protocol: str = "tcp"  # "tcp" (works anywhere) or "rdma"
    rdma_devices: str = ""
    segment_bytes: int = 0  # memory this worker lends to the store (0: it only reads and writes holders')
    buffer_bytes: int = 32 << 20  # local transfer buffer (bounds one value's size in flight)
    timeout_s: Optional[float] = 2.0  # per call; None waits as long as Mooncake does (about 30 s on a frozen master)
    retry_after_s: float = 5.0  # breaker: after an outage, skip the tier this long before trying again
    workers: int = 8  # daemon threads running calls (concurrent calls beyond this queue)

    @classmethod
    def from_env(cls, environ: Optional[dict] = None, **overrides: Any) -> "MooncakeConfig":
        env = os.environ if environ is None else environ
        kw: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is None or raw == "":
                continue
            kw[f.name] = _parse(f.name, raw, f.type)
        kw.update(overrides)
        return cls(**kw)

    def __post_init__(self) -> None:
        if not isinstance(self.master, str) or ":" not in self.master:
            raise WindowkitError(f"MooncakeConfig.master is 'host:port', got {self.master!r}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise WindowkitError(f"MooncakeConfig.timeout_s must be > 0 or None, got {self.timeout_s}")
        if self.segment_bytes < 0 or self.buffer_bytes <= 0 or self.workers < 1 or self.retry_after_s < 0:
            raise WindowkitError("MooncakeConfig: segment_bytes >= 0, buffer_bytes > 0, workers >= 1, "
                                 "retry_after_s >= 0")


def _parse(name: str, raw: str, typ: Any) -> Any:
    t = str(typ)
    try:
        if "float" in t:
            return None if raw.lower() == "none" else float(raw)
        if "int" in t:
            return int(_bytes(raw))
    except ValueError:
        raise WindowkitError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a number") from None
    return raw


def _bytes(raw: str) -> int:
    """'64MiB', '1GB', '4096' -> bytes (binary units for both spellings, as Mooncake reads them)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(i?B)?\s*", raw, re.IGNORECASE)
    if m is None:
        raise ValueError(raw)
    return int(m.group(1)) << (10 * " KMGT".index((m.group(2) or " ").upper()))


class _Worker:
    """A few daemon threads running blocking calls, so a caller can stop waiting (a frozen master blocks a
    Mooncake call for about 30 s; a dead one, a few seconds of reconnects).

    An abandoned call keeps running. A native call that returns while the interpreter shuts down aborts the
    process ("terminate called without an active exception"), so ``close`` and an atexit hook wait for
    calls in flight (bounded by ``DRAIN_S``) before the client or the interpreter goes away."""

    DRAIN_S = 60.0

    def __init__(self, n: int) -> None:
        self._q: "queue.Queue[tuple[Callable[[], Any], dict, threading.Event]]" = queue.Queue()
        self._busy = 0
        self._idle = threading.Condition()
        self._n = n
        for i in range(n):
            threading.Thread(target=self._loop, name=f"windowkit-mooncake-{i}", daemon=True).start()
        _WORKERS.add(self)

    def _loop(self) -> None:
        while True:
            job = self._q.get()
            if job is None:  # stop()
                return
            fn, box, done = job
            try:
                box["value"] = fn()
            except BaseException as e:  # handed back to the waiting caller
                box["error"] = e
            with self._idle:
                self._busy -= 1
                self._idle.notify_all()
            done.set()

    def drain(self, timeout: float = DRAIN_S) -> bool:
        """Wait until no call is in flight (True), or ``timeout`` seconds (False)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._busy == 0, timeout)

    def stop(self) -> None:
        """End the threads once the calls queued before this one are done."""
        for _ in range(self._n):
            self._q.put(None)  # type: ignore[arg-type]

    def run(self, fn: Callable[[], Any], timeout: Optional[float]) -> Any:
        box: dict = {}
        done = threading.Event()
        with self._idle:
            self._busy += 1
        self._q.put((fn, box, done))
        if not done.wait(timeout):
            raise TimeoutError
        if "error" in box:
            raise box["error"]
        return box["value"]


_WORKERS: "weakref.WeakSet[_Worker]" = weakref.WeakSet()


@atexit.register
def _drain_all() -> None:
    for w in list(_WORKERS):
        w.drain()


class MooncakeBackend:
    """``StoreBackend`` on a Mooncake Store client. Keys are ``wk/<namespace hash>/<key>``; values are envelopes.

    Args:
        config: a ``MooncakeConfig`` (default: ``MooncakeConfig.from_env()``).
        namespace: the model fingerprint; None lets ``ChunkStore(shared=...)`` set it to the store's.
        client: an already set-up ``MooncakeDistributedStore`` to use instead of connecting (tests, sharing, e.g.
            ``client=other.client``); a client passed in is borrowed: ``close()`` leaves it open for its owner.
        auth_key: the deployment's secret (bytes or str, >= 16 bytes): values are HMAC-authenticated and keys
            derived with it. None (default): unauthenticated, as before (``ChunkStore`` warns once).

    Raises ``WindowkitError`` if the ``mooncake`` package is missing and ``SharedStoreError`` if the master
    cannot be reached at construction.
    """

    def __init__(self, config: Optional[MooncakeConfig] = None, namespace: Optional[str] = None,
                 client: Any = None, auth_key: KeySpec = None) -> None:
        self.config = config if config is not None else MooncakeConfig.from_env()
        self.namespace = namespace
        self.auth: Optional[EntryAuth] = as_auth(auth_key)
        self.stats = new_stats()
        self._worker = _Worker(self.config.workers)
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._closed = False
        self._owns_client = client is None
        if client is None:
            client = self._connect()
        self._client = client

    @property
    def client(self) -> Any:
        """The Mooncake Store client this backend calls (pass it as ``client=`` to share it)."""
        return self._client

    @classmethod
    def from_env(cls, namespace: Optional[str] = None, auth_key: KeySpec = None,
                 **overrides: Any) -> "MooncakeBackend":
        """A backend configured from ``WINDOWKIT_MOONCAKE_*`` variables (keywords override them); its auth key
        is ``auth_key`` or else ``WINDOWKIT_AUTH_KEY`` / ``WINDOWKIT_AUTH_KEY_FILE`` (none: unauthenticated)."""
        auth = as_auth(auth_key) if auth_key is not None else as_auth(auth_key_from_env())  # key errors first
        return cls(MooncakeConfig.from_env(**overrides), namespace=namespace, auth_key=auth)

    def _connect(self) -> Any:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise WindowkitError("MooncakeBackend needs Mooncake Store: pip install -r requirements-mooncake.txt "
                                 f"(and Debian libibverbs1 librdmacm1): {e}") from None
        c = self.config
        host, _, port = c.master.rpartition(":")
        # Mooncake's setup holds the GIL while it retries an absent master (about 90 s): no timeout can fire
        # meanwhile, so make sure something listens there first
        try:
            socket.create_connection((host, int(port)), timeout=c.timeout_s or 10.0).close()
        except (OSError, ValueError) as e:
            raise SharedStoreError(f"no mooncake master at {c.master}: {e}", "unavailable") from None
        client = MooncakeDistributedStore()
        try:
            rc = self._worker.run(lambda: client.setup(c.local_hostname, c.metadata_server, c.segment_bytes,
                                                       c.buffer_bytes, c.protocol, c.rdma_devices, c.master),
                                  max(c.timeout_s or 0, 10.0))  # setup may retry for a while: give it 10 s
        except TimeoutError:
            raise SharedStoreError(f"mooncake master {c.master} did not answer setup", "timeout") from None
        if rc != 0:
            raise SharedStoreError(f"mooncake setup against master {c.master} failed (rc={rc})", "unavailable")
        return client

    # ---------------------------------------------------------------- guard
    def key(self, key: str) -> str:
        """The Mooncake key of ``key``: namespaced by the model fingerprint (with ``auth``: both derived with
        the secret, see ``storage_key``)."""
        return storage_key(self.namespace, key, self.auth)

    def _call(self, fn: Callable[[], Any]) -> Any:
        if self._closed:
            raise WindowkitError("the Mooncake backend is closed")
        if time.monotonic() < self._down_until:
            raise SharedStoreError("mooncake tier skipped: it failed recently (breaker open)", "unavailable")
        try:
            return fn() if self.config.timeout_s is None else self._worker.run(fn, self.config.timeout_s)
        except TimeoutError:
            self._trip()
            raise SharedStoreError(f"mooncake call took longer than {self.config.timeout_s} s", "timeout") from None
        except WindowkitError:
            raise
        except Exception as e:  # the binding's own errors: a fault of the tier, never the caller's crash
            with self._lock:
                self.stats["errors"] += 1
            raise SharedStoreError(f"mooncake call failed: {type(e).__name__}: {e}", "error") from None

    def _trip(self) -> None:
        with self._lock:
            self._down_until = time.monotonic() + self.config.retry_after_s
            self.stats["errors"] += 1

    def _fail(self, what: str, rc: int) -> SharedStoreError:
        reason = _reason(rc)
        if reason in ("unavailable", "timeout"):
            self._trip()
        else:
            with self._lock:
                self.stats["errors"] += 1
        return SharedStoreError(f"mooncake {what} failed (rc={rc})", reason)

    def _count(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self.stats[k] += v

    # ---------------------------------------------------------------- protocol
    def put(self, key: str, value: bytes, meta: Optional[dict] = None) -> None:
        """Store ``value`` (+ ``meta``) under ``key``, replacing any value there."""
        blob = pack(value, meta, auth=self.auth, namespace=self.namespace, key=key)
        rc = self._call(lambda: self._client.upsert(self.key(key), blob))
        if rc != 0:
            raise self._fail(f"put of {key!r}", rc)
        self._count(puts=1, bytes_written=len(blob))

    def get(self, key: str) -> Got:
        """(value, meta), or None on a miss; ``StoreCorruptError`` (value removed) if it fails its checksum."""
        k = self.key(key)
        blob = self._call(lambda: self._client.get(k))
        self._count(gets=1)
        if not blob:  # Mooncake answers b"" for a miss and for a failed read alike: ask which
            rc = self._call(lambda: self._client.is_exist(k))
            if rc == 0:
                self._count(misses=1)
                return None
            if rc == 1:  # listed by the master but unreadable: e.g. the holder of its memory is gone
                self._count(errors=1)
                raise SharedStoreError(f"mooncake lists {key!r} but its value cannot be read", "missing")
            raise self._fail(f"get of {key!r}", rc)
        try:
            got = unpack(blob, auth=self.auth, namespace=self.namespace, key=key)
        except StoreCorruptError as e:
            self._count(**{"forged" if isinstance(e, StoreAuthError) else "corrupt": 1})
            self._drop(k)
            raise
        self._count(hits=1, bytes_read=len(blob))
        return got

    def exists(self, key: str) -> bool:
        rc = self._call(lambda: self._client.is_exist(self.key(key)))
        if rc < 0:
            raise self._fail(f"exists of {key!r}", rc)
        return rc == 1

    def remove(self, key: str) -> bool:
        """Remove ``key`` (leases ignored: the value is wrong or unwanted). True if something was removed."""
        rc = self._call(lambda: self._client.remove(self.key(key), True))
        if rc in (_RPC_FAIL, _RPC_TIMEOUT):
            raise self._fail(f"remove of {key!r}", rc)
        return rc == 0

    def put_batch(self, items: Sequence[Item]) -> None:
        if not items:
            return
        keys = [self.key(k) for k, _, _ in items]
        blobs = [pack(v, m, auth=self.auth, namespace=self.namespace, key=k) for k, v, m in items]
        rc = self._call(lambda: self._client.upsert_batch(keys, blobs))
        if rc != 0:
            raise self._fail(f"put_batch of {len(items)}", rc)
        self._count(puts=len(items), bytes_written=sum(len(b) for b in blobs))

    def get_batch(self, keys: Sequence[str]) -> list[Got]:
        """Results in key order: (value, meta) or None (a miss, or a corrupt value: removed and counted)."""
        if not keys:
            return []
        ks = [self.key(k) for k in keys]
        blobs = self._call(lambda: self._client.get_batch(ks))
        empty = [i for i, b in enumerate(blobs) if not b]
        if empty:  # misses, or a failed read: tell them apart as get does
            rcs = self._call(lambda: self._client.batch_is_exist([ks[i] for i in empty]))
            if any(rc < 0 for rc in rcs):
                raise self._fail(f"get_batch of {len(keys)}", next(rc for rc in rcs if rc < 0))
            if any(rc == 1 for rc in rcs):  # listed but unreadable (holder gone): misses, counted as errors
                self._count(errors=sum(rc == 1 for rc in rcs))
        out: list[Got] = []
        for key, k, b in zip(keys, ks, blobs):
            if not b:
                out.append(None)
                continue
            try:
                out.append(unpack(b, auth=self.auth, namespace=self.namespace, key=key))
            except StoreCorruptError as e:
                self._count(**{"forged" if isinstance(e, StoreAuthError) else "corrupt": 1})
                self._drop(k)
                out.append(None)
                continue
            self._count(hits=1, bytes_read=len(b))
        self._count(gets=len(keys), misses=len(empty))
        return out

    def exists_batch(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        rcs = self._call(lambda: self._client.batch_is_exist([self.key(k) for k in keys]))
        bad = [rc for rc in rcs if rc < 0]
        if bad:
            raise self._fail(f"exists_batch of {len(keys)}", bad[0])
        return [rc == 1 for rc in rcs]

    def remove_batch(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        rcs = self._call(lambda: self._client.batch_remove([self.key(k) for k in keys], True))
        if any(rc in (_RPC_FAIL, _RPC_TIMEOUT) for rc in rcs):
            raise self._fail(f"remove_batch of {len(keys)}", next(rc for rc in rcs if rc in (_RPC_FAIL, _RPC_TIMEOUT)))
        return sum(rc == 0 for rc in rcs)

    def clear(self) -> int:
        """Remove every value of this namespace (all workers'). Returns how many Mooncake reports removed."""
        rc = self._call(lambda: self._client.remove_by_regex("^" + re.escape(storage_prefix(self.namespace, self.auth)), True))
        if rc < 0:
            raise self._fail("clear", rc)
        return int(rc)

    def _drop(self, mkey: str) -> None:
        try:  # best effort: a corrupt value must not be read again by anyone
            self._call(lambda: self._client.remove(mkey, True))
        except (SharedStoreError, WindowkitError):
            pass

    def close(self) -> None:
        """Leave the store (about a second: Mooncake's client winds down its threads). Later calls raise.

        Synchronous on purpose: a native call still running when the interpreter exits aborts the process."""
        if self._closed:
            return
        self._closed = True
        self._worker.drain()  # an abandoned call may still use the client
        self._worker.stop()
        if self._owns_client:  # a borrowed client is closed by its owner
            self._client.close()

    def __repr__(self) -> str:
        return (f"MooncakeBackend(master={self.config.master!r}, namespace={self.namespace!r}, "
                f"auth={'key ' + self.auth.key_id if self.auth else 'none'})")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary(name: str) -> str:
    """A Mooncake entry point: next to this interpreter (a venv's bin/) or on PATH."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)

    found = shutil.which(name)
    if found is None:
        raise WindowkitError(f"{name} not found: pip install -r requirements-mooncake.txt")
    return found


class LocalMooncake:
    """A loopback Mooncake Store for tests, benchmarks and one-machine runs: a master and one holder process
    lending ``segment_bytes`` of memory, addressed on free ports of 127.0.0.1. The master listens on
    127.0.0.1 only; Mooncake's transfer engine (holder and clients) also opens handshake/data ports on all
    interfaces, with no bind option we found in 0.3.13.

        with LocalMooncake() as mc:
            shared = MooncakeBackend(mc.config(timeout_s=1.0), namespace=fp)
            ...
            mc.stop_master()        # a real outage (SIGKILL); mc.freeze_master() for a hang (SIGSTOP)

    The same two commands run a shared store for several machines (with real addresses); see docs/store.md.
    """

    def __init__(self, segment_bytes: int = 256 << 20, log_dir: Optional[str] = None) -> None:
        self.port, self.metrics_port, self.holder_port = _free_port(), _free_port(), _free_port()
        self.master = f"127.0.0.1:{self.port}"
        self._own_logs = log_dir is None  # a temporary folder, removed by close()
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="windowkit-mooncake-"))
        self._master_log = self.log_dir / "master.log"
        self._holder_log = self.log_dir / "holder.log"
        self._master = subprocess.Popen(
            [_binary("mooncake_master"), f"--rpc_port={self.port}", "--rpc_address=127.0.0.1",
             f"--metrics_port={self.metrics_port}", "--metrics_host=127.0.0.1", "--enable_metric_reporting=false"],
            stdout=open(self._master_log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
        self._holder: Optional[subprocess.Popen] = None
        try:
            self._wait(lambda: _listening(self.port), "master", self._master)
            self._holder = subprocess.Popen(
                [_binary("mooncake_client"), f"--master_server_address={self.master}", "--metadata_server=P2PHANDSHAKE",
                 f"--global_segment_size={segment_bytes}", "--host=127.0.0.1", f"--port={self.holder_port}",
                 "--protocol=tcp"],
                stdout=open(self._holder_log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
            self._wait(lambda: b"Mounting segment" in self._holder_log.read_bytes(), "holder", self._holder)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _wait(ready: Callable[[], bool], what: str, proc: subprocess.Popen, timeout: float = 20.0) -> None:
        t0 = time.monotonic()
        while not ready():
            if proc.poll() is not None:
                raise SharedStoreError(f"mooncake {what} exited with {proc.returncode}", "unavailable")
            if time.monotonic() - t0 > timeout:
                raise SharedStoreError(f"mooncake {what} not ready after {timeout} s", "timeout")
            time.sleep(0.05)

    def config(self, **overrides: Any) -> MooncakeConfig:
        """A client config for this store (keywords as in ``MooncakeConfig``)."""
        return MooncakeConfig(**{"master": self.master, **overrides})

    def stop_master(self) -> None:
        """Kill the master now (SIGKILL): clients see a real outage."""
        if self._master.poll() is None:
            self._master.kill()
        self._master.wait()

    def stop_holder(self) -> None:
        """Kill the holder (SIGKILL): the values in its memory are lost while the master may still list them."""
        if self._holder is not None and self._holder.poll() is None:
            self._holder.kill()
            self._holder.wait()

    def freeze_master(self) -> None:
        """Stop the master (SIGSTOP) without closing its sockets: client calls hang until their timeout."""
        os.kill(self._master.pid, signal.SIGSTOP)

    def thaw_master(self) -> None:
        os.kill(self._master.pid, signal.SIGCONT)

    def close(self) -> None:
        for p in (self._holder, self._master):
            if p is not None and p.poll() is None:
                p.kill()  # SIGKILL also ends a SIGSTOPped master
                p.wait()
        if self._own_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> "LocalMooncake":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 0.2).close()
        return True
    except OSError:
        return False


__all__ = ["MooncakeBackend", "MooncakeConfig", "LocalMooncake", "ENV_PREFIX"]
