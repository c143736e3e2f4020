"""Tests for windowkit.store: content keys, round trips (memory, disk, another process), corruption,
model/layout mismatch, the byte budget under random operation sequences, pins and the disk format.

KV is small random tensors built directly (no model). Ground truth is the tensors that were put, compared
with torch.equal (bit-identical), never the store's own output.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from windowkit.errors import ChunkNotFoundError, KVShapeError, ModelMismatchError, StoreCorruptError, WindowkitError
from windowkit.kv.layout import ChunkKV, KVLayout
from windowkit.kv.patch import Patch
from windowkit.store import ChunkStore, chunk_key, context_hash, orbit_context_hash

ROOT = Path(__file__).resolve().parents[1]
GQA = KVLayout("gqa", 2, ((2, 4), (2, 4)), 0)
MLA = KVLayout("mla", 3, ((1, 8), (1, 4)), 1)


def make_kv(seed: int = 0, tokens: int = 3, dtype: torch.dtype = torch.float32, layout: KVLayout = GQA) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    return ChunkKV([tuple(torch.randn(h, tokens, d, generator=g).to(dtype) for h, d in layout.slot_shapes)
                    for _ in range(layout.num_layers)], layout)


def make_patch(seed: int = 0, tokens: int = 3, rank: int = 2, dtype: torch.dtype = torch.float32,
               layout: KVLayout = GQA) -> Patch:
    g = torch.Generator().manual_seed(seed)
    factors, energy = {}, {}
    for l in range(layout.num_layers):
        for s, (h, d) in enumerate(layout.slot_shapes):
            factors[(l, s)] = (torch.randn(tokens, rank, generator=g).to(dtype),
                               torch.randn(rank, h * d, generator=g).to(dtype))
            energy[(l, s)] = (float(torch.rand(1, generator=g)), 1.0 + l + 0.1 * s)
    return Patch(factors, layout, tokens, rank, rank, energy, {"kind": "orbit", "seed": str(seed)})


def kv_equal(a: ChunkKV, b: ChunkKV) -> bool:
    if (a.positions is None) != (b.positions is None) or (a.positions is not None
                                                          and not torch.equal(a.positions, b.positions)):
        return False
    return a.layout == b.layout and all(
        x.dtype == y.dtype and torch.equal(x, y) for pa, pb in zip(a.layers, b.layers) for x, y in zip(pa, pb))


def patch_equal(a: Patch, b: Patch) -> bool:
    return (a.layout == b.layout and a.num_tokens == b.num_tokens and a.rank == b.rank
            and a.rope_rank == b.rope_rank and a.energy == b.energy and a.meta == b.meta
            and a.factors.keys() == b.factors.keys()
            and all(u.dtype == a.factors[k][0].dtype and torch.equal(u, a.factors[k][0])
                    and torch.equal(v, a.factors[k][1]) for k, (u, v) in b.factors.items()))


def object_files(path: Path) -> list[Path]:
    return sorted((path / "objects").glob("*.safetensors"))


# -------------------------------------------------------------------- keys
def test_keys() -> None:
    assert chunk_key("abc", "fp1") == chunk_key("abc", "fp1")
    assert chunk_key("abc", "fp1") != chunk_key("abc", "fp2") != chunk_key("abd", "fp2")
    assert len(chunk_key("abc", None)) == 32
    a, b, c = "ka", "kb", "kc"
    assert context_hash([a, b]) != context_hash([b, a])
    assert context_hash([a, b], prefix="sys") != context_hash([a, b])
    assert context_hash(["ab"]) != context_hash(["a", "b"])  # no concatenation collisions
    assert orbit_context_hash([a, b, c]) == orbit_context_hash([c, a, b])
    assert orbit_context_hash([a, b]) != context_hash(sorted([a, b]))
    assert orbit_context_hash([a, a, b]) != orbit_context_hash([a, b])
    assert context_hash([]) != context_hash([], prefix="p")
    with pytest.raises(TypeError):
        context_hash("ka")
    store = ChunkStore(model_fingerprint="fp1")
    assert store.chunk_key("abc") == chunk_key("abc", "fp1")


# -------------------------------------------------------------------- memory tier
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_memory_round_trip_and_no_aliasing(dtype: torch.dtype) -> None:
    kv = make_kv(1, dtype=dtype)
    keep = kv.clone()
    store = ChunkStore()
    assert store.put_canonical("k", kv, {"tokens": 3})
    kv.layers[0][0].zero_()  # the caller edits its tensors in place after the put
    got = store.get_canonical("k")
    assert kv_equal(got, keep)
    got.layers[1][1].zero_()  # ... or the ones it got
    assert kv_equal(store.get_canonical("k"), keep)
    view1, view2 = store.get_canonical("k", copy=False), store.get_canonical("k", copy=False)
    assert view1.layers[0][0].data_ptr() == view2.layers[0][0].data_ptr()  # copy=False: shared, read-only
    assert store.meta("k") == {"tokens": 3}
    assert store.stats.hits == 4 and store.stats.bytes_read == 4 * keep.nbytes
    assert store.nbytes == keep.nbytes == store.memory_nbytes and len(store) == 1 and "k" in store


def test_positions_round_trip_and_count(tmp_path: Path) -> None:
    kv = make_kv(7, tokens=4)
    kv = ChunkKV(kv.layers, kv.layout, torch.arange(12).reshape(3, 4))  # 3-D (M-RoPE) positions
    with ChunkStore(tmp_path, memory_budget_bytes=0) as s:
        s.put_canonical("k", kv)
        assert s.nbytes == kv.nbytes + 3 * 4 * 8  # the budget counts every stored tensor
        got = s.get_canonical("k")
    assert kv_equal(got, kv)
    mem = ChunkStore()
    mem.put_canonical("k", kv)
    got = mem.get_canonical("k")
    got.positions.add_(100)  # the copy does not alias the store's positions either
    assert kv_equal(mem.get_canonical("k"), kv)


def test_patch_round_trip_memory_and_mla_layout() -> None:
    store = ChunkStore()
    ctx = context_hash(["a", "b"])
    p = make_patch(3, layout=MLA, dtype=torch.bfloat16)
    assert store.put_patch("k", ctx, p, {"formed_at": 12})
    got = store.get_patch("k", ctx)
    assert patch_equal(p, got) and got is not p
    assert store.get_patch("k", context_hash(["b", "a"])) is None
    assert store.patches("k") == [ctx] and store.keys() == [] and store.has_patch("k", ctx)
    assert store.meta("k", ctx) == {"formed_at": 12}


def test_unknown_key_and_bad_inputs() -> None:
    store = ChunkStore()
    with pytest.raises(ChunkNotFoundError, match="nope"):
        store.get_canonical("nope")
    with pytest.raises(KeyError):  # ChunkNotFoundError is a KeyError too
        store.get_canonical("nope")
    with pytest.raises(ChunkNotFoundError):
        store.meta("nope")
    assert store.get_patch("nope", "ctx") is None
    assert store.stats.misses == 3 and store.stats.hits == 0
    with pytest.raises(ChunkNotFoundError):
        store.get_canonical("")
    with pytest.raises(KVShapeError):
        store.put_canonical("k", make_patch())  # type: ignore[arg-type]
    with pytest.raises(WindowkitError, match="JSON"):
        store.put_canonical("k", make_kv(), {"bad": object()})
    with pytest.raises(WindowkitError):
        ChunkStore(policy="nope")
    with pytest.raises(WindowkitError):
        ChunkStore(memory_budget_bytes=10)  # needs a disk tier


def test_layout_mismatch_on_put() -> None:
    store = ChunkStore(layout=GQA)
    with pytest.raises(KVShapeError, match="layout"):
        store.put_canonical("k", make_kv(layout=MLA))
    with pytest.raises(KVShapeError, match="layout"):
        store.put_patch("k", "c", make_patch(layout=MLA))
    lazy = ChunkStore()  # no layout given: the first put fixes it
    lazy.put_canonical("a", make_kv(layout=MLA))
    assert lazy.layout == MLA
    with pytest.raises(KVShapeError):
        lazy.put_canonical("b", make_kv())


# -------------------------------------------------------------------- budget, eviction, pins
def test_budget_eviction_follows_policy() -> None:
    size = make_kv().nbytes
    store = ChunkStore(budget_bytes=3 * size)  # LRU
    for k in "abc":
        store.put_canonical(k, make_kv(ord(k)))
    store.get_canonical("a")
    store.put_canonical("d", make_kv(4))  # b is least recently used
    assert sorted(store.keys()) == ["a", "c", "d"] and store.stats.evictions == 1
    fifo = ChunkStore(budget_bytes=3 * size, policy="fifo")
    for k in "abc":
        fifo.put_canonical(k, make_kv(ord(k)))
    fifo.get_canonical("a")
    fifo.put_canonical("d", make_kv(4))  # a went in first
    assert sorted(fifo.keys()) == ["b", "c", "d"]


def test_pins_refusals_and_drop() -> None:
    size = make_kv().nbytes
    store = ChunkStore(budget_bytes=2 * size)
    assert not store.put_canonical("huge", make_kv(tokens=7))  # alone larger than the budget
    assert store.stats.rejected_reasons == {"too_large": 1}
    store.pin("a")  # a pin may come before the put it protects
    store.put_canonical("a", make_kv(1))
    store.put_canonical("b", make_kv(2))
    store.put_canonical("c", make_kv(3))  # a is LRU but pinned: b goes
    assert sorted(store.keys()) == ["a", "c"]
    store.pin("c"); store.pin("c")  # pins count
    assert not store.put_canonical("d", make_kv(4))  # everything is pinned: refused, nothing evicted
    assert store.stats.rejected_reasons == {"too_large": 1, "pinned": 1}
    assert sorted(store.keys()) == ["a", "c"] and store.pinned_nbytes == 2 * size
    assert store.put_canonical("a", make_kv(5))  # replacing a pinned entry frees its own bytes first
    assert kv_equal(store.get_canonical("a"), make_kv(5)) and store.is_pinned("a")
    store.unpin("c")
    assert not store.put_canonical("d", make_kv(4))  # c still holds one pin
    store.unpin("c"); store.unpin("c")  # the extra unpin is a no-op
    assert store.put_canonical("d", make_kv(4)) and sorted(store.keys()) == ["a", "d"]
    store.put_patch("a", "x", make_patch(tokens=1, rank=1))
    assert store.nbytes <= store.budget_bytes
    assert store.drop("a") >= 1 and not store.has_canonical("a") and store.patches("a") == []
    assert store.drop("a") == 0


def test_pin_after_put_and_patch_pins() -> None:
    size = make_kv().nbytes
    store = ChunkStore(budget_bytes=2 * size)
    store.put_canonical("a", make_kv(1))
    store.put_canonical("b", make_kv(2))
    store.pin("a")  # a is the LRU victim, but pinned now
    store.put_canonical("c", make_kv(3))
    assert sorted(store.keys()) == ["a", "c"]
    store.unpin("a")  # a release counts as a use under LRU: c is older now
    store.get_canonical("c")
    store.put_canonical("d", make_kv(4))
    assert sorted(store.keys()) == ["c", "d"]
    p = make_patch(tokens=1, rank=1)
    ps = ChunkStore(budget_bytes=2 * p.nbytes)
    ps.put_patch("k", "x", p); ps.put_patch("k", "y", p)
    ps.pin("k", "x")  # pins a patch, not the chunk's canonical or its other patches
    assert ps.is_pinned("k", "x") and not ps.is_pinned("k")
    ps.put_patch("k", "z", p)
    assert ps.patches("k") == ["x", "z"]


def test_a_policy_reads_one_pin_ledger() -> None:
    """A policy handed to a store reads the store's ledger; a second ``use_pins`` would split the pins."""
    from windowkit.errors import PolicyError
    from windowkit.store.eviction import LRU, PinLedger

    policy, first, second = LRU(), PinLedger(), PinLedger()
    policy.use_pins(first)
    assert policy.pin_ledger is first
    with pytest.raises(PolicyError):
        policy.use_pins(second)
    first.pin("a")
    policy.insert("a", 1); policy.insert("b", 1)
    assert policy.victim() == "b"  # a is pinned in the ledger the policy reads
    store = ChunkStore(budget_bytes=1 << 20)
    assert store._policy.pin_ledger is store._pins


def test_mixed_sizes_size_aware_policy() -> None:
    small, big = make_kv(tokens=1), make_kv(tokens=6)
    store = ChunkStore(budget_bytes=big.nbytes + 2 * small.nbytes, policy="size")
    store.put_canonical("big", big)
    store.put_canonical("s1", small)
    store.put_canonical("s2", small)
    store.put_canonical("s3", small)  # the largest bytes per hit goes first
    assert sorted(store.keys()) == ["s1", "s2", "s3"]


def test_threads_share_a_store() -> None:
    size = make_kv().nbytes
    store = ChunkStore(budget_bytes=5 * size)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(60):
                k = f"k{(i * 7 + t) % 12}"
                store.put_canonical(k, make_kv(i))
                try:
                    store.get_canonical(k)
                except ChunkNotFoundError:
                    pass
                assert store.nbytes <= 5 * size
        except BaseException as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and store.nbytes <= 5 * size


# -------------------------------------------------------------------- property: random operation sequences
KEYS = ["k0", "k1", "k2", "k3", "k4", "k5"]
CTXS = ["x", "y"]
# puts weigh most: budget pressure is where evictions, refusals and pin bugs show
KINDS = ["put"] * 5 + ["putp"] * 2 + ["get", "getp", "pin", "pin", "unpin", "drop"]
OP = st.tuples(st.sampled_from(KINDS), st.sampled_from(KEYS), st.sampled_from([1, 2, 3, 9]),
               st.sampled_from(CTXS), st.integers(1, 3), st.integers(0, 999))
BUDGET = 1000  # fp32 GQA above: a canonical is 128 B per token (8+ tokens: too large), a rank-r patch 176 r B


def run_ops(store: ChunkStore, ops) -> None:
    """Apply ``ops``, checking after each: budget, pinned entries survive, and reads return what was put."""
    expected: dict[tuple, object] = {}  # eid -> last accepted value
    pins: dict[str, int] = {}
    for op in ops:
        before = {e for e in expected if _present(store, e)}
        pinned_before = {e for e in before if e[0] == "c" and pins.get(e[1], 0) > 0}
        kind, k, tokens, ctx, rank, seed = op
        if kind == "put":
            kv = make_kv(seed, tokens)
            held = sum(_nbytes(expected[e]) for e in pinned_before if e != ("c", k))
            ok = store.put_canonical(k, kv)
            assert ok == (kv.nbytes <= BUDGET and held + kv.nbytes <= BUDGET)  # refused only when it cannot fit
            if ok:
                expected[("c", k)] = kv
        elif kind == "putp":
            p = make_patch(seed, rank=rank)
            if store.put_patch(k, ctx, p):
                expected[("p", k, ctx)] = p
        elif kind == "get":
            if _present(store, ("c", k)):
                assert kv_equal(store.get_canonical(k), expected[("c", k)])
            else:
                with pytest.raises(ChunkNotFoundError):
                    store.get_canonical(k)
        elif kind == "getp":
            got = store.get_patch(k, ctx)
            assert (got is None) == (not _present(store, ("p", k, ctx)))
            if got is not None:
                assert patch_equal(expected[("p", k, ctx)], got)
        elif kind == "pin":
            store.pin(k); pins[k] = pins.get(k, 0) + 1
        elif kind == "unpin":
            store.unpin(k); pins[k] = max(pins.get(k, 0) - 1, 0)
        elif kind == "drop":
            store.drop(k)
            for e in [e for e in expected if e[1] == k]:
                del expected[e]
        store.check_integrity()  # the store's own accounting invariants (tiers, policy, pin ledger, budget)
        assert store.nbytes <= BUDGET
        present = {e for e in expected if _present(store, e)}
        assert len(store) == len(present)  # nothing unexpected is stored
        assert store.nbytes == sum(_nbytes(expected[e]) for e in present)
        if kind != "drop":
            assert pinned_before <= present, "a pinned entry was evicted"
    for e in [e for e in expected if _present(store, e)]:  # every survivor reads back bit-identical
        if e[0] == "c":
            assert kv_equal(store.get_canonical(e[1]), expected[e])
        else:
            assert patch_equal(expected[e], store.get_patch(e[1], e[2]))


def _present(store: ChunkStore, e: tuple) -> bool:
    return store.has_canonical(e[1]) if e[0] == "c" else store.has_patch(e[1], e[2])


def _nbytes(x) -> int:
    return x.nbytes


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "size"])
@settings(max_examples=40, deadline=None)
@given(ops=st.lists(OP, min_size=10, max_size=40))
def test_property_memory(policy: str, ops) -> None:
    run_ops(ChunkStore(budget_bytes=BUDGET, policy=policy), ops)


@settings(max_examples=15, deadline=None)
@given(ops=st.lists(OP, min_size=5, max_size=25), mem=st.sampled_from([None, 0, 600]))
def test_property_disk(ops, mem) -> None:
    with tempfile.TemporaryDirectory() as d:
        with ChunkStore(d, budget_bytes=BUDGET, memory_budget_bytes=mem) as store:
            run_ops(store, ops)
            assert store.memory_nbytes <= (BUDGET if mem is None else mem)
            n, names = len(store), store.keys()
        assert len(object_files(Path(d))) == n  # one file per entry, no leftovers
        with ChunkStore(d, budget_bytes=BUDGET) as again:
            assert sorted(again.keys()) == sorted(names) and len(again) == n


# -------------------------------------------------------------------- disk tier
CHILD = textwrap.dedent("""
    import hashlib, json, sys, torch
    from windowkit.store import ChunkStore
    from windowkit.kv.layout import ChunkKV
    def digest(ts):
        return [[str(t.dtype), list(t.shape), hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()]
                for t in ts]
    out = {}
    with ChunkStore(sys.argv[1], model_fingerprint="fp-A") as s:
        for k in sorted(s.keys()):
            kv = s.get_canonical(k)
            out[k] = digest([t for pair in kv.layers for t in pair])
        p = s.get_patch("k32", sys.argv[2])
        out["patch"] = digest([t for k in sorted(p.factors) for t in p.factors[k]])
        out["patch_meta"] = [p.rank, p.num_tokens, {f"{l}.{s_}": e for (l, s_), e in p.energy.items()}, p.meta]
        out["stats"] = s.stats.as_dict()
        # and write one entry back for the parent to read
        s.put_canonical("from-child", ChunkKV.from_tensors({f"{l}.{i}": t * 2 for l, pair in enumerate(kv.layers)
                                                            for i, t in enumerate(pair)}, kv.layout))
    print(json.dumps(out))
""")


def _digest(ts) -> list:
    return [[str(t.dtype), list(t.shape), hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()]
            for t in ts]


def test_reopen_in_another_process_bit_identical(tmp_path: Path) -> None:
    kv32, kv16 = make_kv(1, tokens=5), make_kv(2, tokens=4, dtype=torch.bfloat16)
    ctx = orbit_context_hash(["k16", "k32"])
    patch = make_patch(4, tokens=5, dtype=torch.bfloat16)
    with ChunkStore(tmp_path, model_fingerprint="fp-A", budget_bytes=1 << 20) as s:
        assert s.put_canonical("k32", kv32, {"kind": "text"})
        assert s.put_canonical("k16", kv16)
        assert s.put_patch("k32", ctx, patch)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), ctx], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["k32"] == _digest([t for pair in kv32.layers for t in pair])
    assert out["k16"] == _digest([t for pair in kv16.layers for t in pair])
    assert out["patch"] == _digest([t for k in sorted(patch.factors) for t in patch.factors[k]])
    assert out["patch_meta"] == [patch.rank, patch.num_tokens,
                                 {f"{l}.{s_}": list(e) for (l, s_), e in patch.energy.items()}, patch.meta]
    assert out["stats"]["disk_reads"] == 3 and out["stats"]["corrupt_dropped"] == 0
    with ChunkStore(tmp_path) as s:  # no fingerprint given: adopts the stored one
        assert s.model_fingerprint == "fp-A" and s.layout == GQA
        assert kv_equal(s.get_canonical("k32"), kv32) and kv_equal(s.get_canonical("k16"), kv16)
        assert patch_equal(patch, s.get_patch("k32", ctx))
        assert kv_equal(s.get_canonical("from-child"), kv32.map(lambda l, i, t: t * 2))
        assert s.meta("k32") == {"kind": "text"}


def test_model_mismatch_refused(tmp_path: Path) -> None:
    with ChunkStore(tmp_path, model_fingerprint="model-A") as s:
        s.put_canonical("k", make_kv())
    with pytest.raises(ModelMismatchError, match="model-A"):
        ChunkStore(tmp_path, model_fingerprint="model-B")
    with ChunkStore(tmp_path, model_fingerprint="model-A") as s:  # the refused open released the lock
        assert s.has_canonical("k")


def test_layout_mismatch_on_open(tmp_path: Path) -> None:
    ChunkStore(tmp_path, layout=GQA).close()
    with pytest.raises(KVShapeError):
        ChunkStore(tmp_path, layout=MLA)
    with ChunkStore(tmp_path) as s:
        assert s.layout == GQA


def _flip_last_byte(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x01  # a tensor payload byte: the file still parses, only the checksum can tell
    f.write_bytes(bytes(data))


def test_flipped_byte_is_dropped_never_served(tmp_path: Path) -> None:
    with ChunkStore(tmp_path) as s:
        s.put_canonical("k", make_kv(1))
        s.put_canonical("ok", make_kv(2))
    with ChunkStore(tmp_path) as s:
        f = Path(s.entry_path("k"))
    _flip_last_byte(f)
    with ChunkStore(tmp_path) as s:
        assert s.has_canonical("k")  # size is right: only a read can tell
        with pytest.raises(StoreCorruptError, match="sha256"):
            s.get_canonical("k")
        assert not s.has_canonical("k") and not f.exists() and s.stats.corrupt_dropped == 1
        with pytest.raises(ChunkNotFoundError):  # next time a plain miss: recompute and put again
            s.get_canonical("k")
        assert kv_equal(s.get_canonical("ok"), make_kv(2))


def test_corruption_while_open_miss_mode(tmp_path: Path) -> None:
    ctx = context_hash(["a"])
    with ChunkStore(tmp_path, memory_budget_bytes=0, on_corrupt="miss") as s:  # no memory cache: reads hit disk
        s.put_patch("k", ctx, make_patch())
        s.put_canonical("k", make_kv())
        for f in object_files(tmp_path):
            _flip_last_byte(f)
        assert s.get_patch("k", ctx) is None
        with pytest.raises(ChunkNotFoundError):
            s.get_canonical("k")
        assert s.stats.corrupt_dropped == 2 and len(s) == 0 and object_files(tmp_path) == []
        assert s.verify() == 0


def test_truncated_file_detected(tmp_path: Path) -> None:
    with ChunkStore(tmp_path, memory_budget_bytes=0) as s:
        s.put_canonical("a", make_kv(1))
        s.put_canonical("b", make_kv(2))
        fa, fb = Path(s.entry_path("a")), Path(s.entry_path("b"))
        fb.write_bytes(fb.read_bytes()[:-10])  # truncated under an open store
        with pytest.raises(StoreCorruptError, match="truncated"):
            s.get_canonical("b")
        assert s.has_canonical("a") and not s.has_canonical("b")
    fa.write_bytes(fa.read_bytes()[:20])  # truncated while closed: caught on open by the size check
    with ChunkStore(tmp_path) as s:
        assert len(s) == 0 and s.stats.corrupt_dropped == 1 and object_files(tmp_path) == []


def test_verify_scans_everything(tmp_path: Path) -> None:
    with ChunkStore(tmp_path) as s:
        for i in range(3):
            s.put_canonical(f"k{i}", make_kv(i))
        _flip_last_byte(object_files(tmp_path)[0])
        assert s.verify() == 1 and len(s) == 2


def test_disk_budget_reopen_smaller_and_memory_cache(tmp_path: Path) -> None:
    size = make_kv().nbytes
    with ChunkStore(tmp_path, budget_bytes=4 * size, memory_budget_bytes=2 * size) as s:
        for i in range(4):
            s.put_canonical(f"k{i}", make_kv(i))
        assert s.memory_nbytes == 2 * size and s.stats.memory_evictions == 2
        assert kv_equal(s.get_canonical("k0"), make_kv(0))  # from disk, then cached
        assert s.stats.disk_reads == 1 and s.stats.memory_hits == 0
        s.get_canonical("k0")
        assert s.stats.memory_hits == 1 and s.stats.disk_reads == 1
        assert s.stats.disk_bytes_written > s.stats.bytes_written  # headers cost a little
    with ChunkStore(tmp_path, budget_bytes=2 * size) as s:  # a smaller budget evicts on open, oldest first
        assert sorted(s.keys()) == ["k2", "k3"] and s.stats.evictions == 2
    assert len(object_files(tmp_path)) == 2


def test_one_opener_at_a_time_and_closed_store(tmp_path: Path) -> None:
    s = ChunkStore(tmp_path)
    with pytest.raises(WindowkitError, match="open elsewhere"):
        ChunkStore(tmp_path)
    s.close()
    with pytest.raises(WindowkitError, match="closed"):
        s.get_canonical("k")
    ChunkStore(tmp_path).close()


def test_crash_leftovers_cleaned_and_bad_index(tmp_path: Path) -> None:
    with ChunkStore(tmp_path) as s:
        s.put_canonical("k", make_kv())
    (tmp_path / "objects" / ".tmp-deadbeef").write_bytes(b"half a write")
    (tmp_path / "objects" / "0123-9.safetensors").write_bytes(b"orphan: its index row never committed")
    with ChunkStore(tmp_path) as s:
        assert s.has_canonical("k") and len(object_files(tmp_path)) == 1
        assert sorted(p.name for p in (tmp_path / "objects").iterdir()) == [object_files(tmp_path)[0].name]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "index.sqlite").write_bytes(b"not a database at all" * 100)
    with pytest.raises(StoreCorruptError):
        ChunkStore(bad)


def test_replace_rewrites_file(tmp_path: Path) -> None:
    with ChunkStore(tmp_path) as s:
        s.put_canonical("k", make_kv(1))
        s.put_canonical("k", make_kv(2))
        assert len(object_files(tmp_path)) == 1 and len(s) == 1
    with ChunkStore(tmp_path) as s:
        assert kv_equal(s.get_canonical("k"), make_kv(2))


def test_files_are_plain_safetensors_with_self_describing_header(tmp_path: Path) -> None:
    from safetensors import safe_open

    with ChunkStore(tmp_path, model_fingerprint="fp") as s:
        s.put_patch("k", "ctx", make_patch())
    (f,) = object_files(tmp_path)
    with safe_open(str(f), "pt") as fh:
        meta = fh.metadata()
        assert meta["kind"] == "p" and meta["key"] == "k" and meta["ctx"] == "ctx" and meta["model_fingerprint"] == "fp"
        assert json.loads(meta["patch.energy"]) and "0.0.us" in fh.keys()


# -------------------------------------------------------------------- hygiene
STORE_SOURCES = sorted((ROOT / "windowkit" / "store").glob("*.py")) + [ROOT / "policies" / "eviction.py"]


def test_no_pickle_and_layering() -> None:
    for path in STORE_SOURCES:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for n in names:
                assert n.split(".")[0] not in ("pickle", "dill", "cloudpickle", "joblib"), (path, n)
                assert not n.startswith(("windowkit.window", "windowkit.graph", "windowkit.backends", "backends")), \
                    (path, n)
                if path.parent.name == "policies":  # eviction policies stay pure Python on windowkit's protocol
                    assert not n.startswith("windowkit") or n in ("windowkit.store.eviction", "windowkit.errors"), \
                        (path, n)
                else:  # one way: windowkit never imports policies
                    assert n.split(".")[0] != "policies", (path, n)
            if isinstance(node, ast.Attribute) and node.attr == "load" and getattr(node.value, "id", "") == "torch":
                raise AssertionError(f"{path}: torch.load (pickle) is not allowed")
