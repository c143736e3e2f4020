"""The store's compressed cold tier (windowkit/store/cold.py): exact edge rows, SVD-tail error, bytes, budget,
reopen in a new process, and off by default."""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from windowkit.errors import ChunkNotFoundError, WindowkitError
from windowkit.kv.isvd import break_even_rows, persistent_bytes
from windowkit.kv.layout import ChunkKV, KVLayout
from windowkit.kv.rope import RopeSpec, relocate_keys
from windowkit.store import ChunkStore, ColdTierConfig
from windowkit.store.cold import compress_kv

ROOT = Path(__file__).resolve().parents[1]
GQA = KVLayout("gqa", 2, ((2, 8), (2, 8)), 0)  # d = 16 per slot
MLA = KVLayout("mla", 2, ((1, 16), (1, 8)), 1)
ROPE = RopeSpec(1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)))  # 4 freqs, 8 rotary dims


def make_kv(seed: int = 0, tokens: int = 64, dtype: torch.dtype = torch.float32, layout: KVLayout = GQA,
            positions: bool = True) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(layout.num_layers):
        pair = []
        for h, d in layout.slot_shapes:  # low rank + a little noise, like real KV
            base = torch.randn(tokens, 3, generator=g) @ torch.randn(3, h * d, generator=g)
            x = base + 0.1 * torch.randn(tokens, h * d, generator=g)
            pair.append(x.reshape(tokens, h, d).permute(1, 0, 2).contiguous().to(dtype))
        layers.append(tuple(pair))
    return ChunkKV(layers, layout, torch.arange(tokens)[None] if positions else None)


def digest(kv: ChunkKV) -> str:
    h = hashlib.sha256()
    for pair in kv.layers:
        for t in pair:
            h.update(str(t.dtype).encode() + str(tuple(t.shape)).encode())
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    h.update(b"none" if kv.positions is None else kv.positions.numpy().tobytes())
    return h.hexdigest()


def kv_equal(a: ChunkKV, b: ChunkKV) -> bool:
    return digest(a) == digest(b)


@pytest.mark.parametrize("layout", [GQA, MLA], ids=["gqa", "mla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_protected_and_recent_rows_exact(layout: KVLayout, dtype: torch.dtype) -> None:
    kv = make_kv(1, 64, dtype, layout)
    store = ChunkStore(cold=ColdTierConfig(rank=2, protected_rows=3, recent_rows=5))
    store.put_canonical("k", kv, {"tokens": 64})
    assert store.compress("k") > 0 and store.is_cold("k")
    got = store.get_canonical("k")
    assert got.dtype == dtype and got.num_tokens == 64
    assert torch.equal(got.positions, kv.positions)
    for (a, b), (ga, gb) in zip(kv.layers, got.layers):
        for x, y in ((a, ga), (b, gb)):
            assert y.shape == x.shape
            assert torch.equal(y[:, :3], x[:, :3]) and torch.equal(y[:, -5:], x[:, -5:])
            assert not torch.equal(y[:, 3:-5], x[:, 3:-5])  # the middle is approximate
    meta = store.meta("k")
    assert meta["tokens"] == 64 and 0 < meta["approx"] < 1 and meta["cold"]["exact_rows"] == [3, 5]
    # reads never alias the store, and a second read is the same reconstruction
    got.layers[0][0].zero_()
    assert kv_equal(store.get_canonical("k"), store.get_canonical("k"))
    assert store.compress("k") == 0  # already cold


@pytest.mark.parametrize("rope", [None, ROPE], ids=["post-rope", "pre-rope"])
def test_error_is_svd_tail(rope) -> None:
    """fp32 factors: each slot's middle error is the SVD tail of that block at the rank (eq. (2))."""
    rank, p, r = 2, 4, 6
    kv = make_kv(2, 80)
    cfg = ColdTierConfig(rank=rank, protected_rows=p, recent_rows=r, factor_dtype=torch.float32, rope=rope)
    store = ChunkStore(cold=cfg)
    store.put_canonical("k", kv)
    store.compress("k")
    got = store.get_canonical("k")
    num = den = 0.0
    for l, pair in enumerate(kv.layers):
        for s, x in enumerate(pair):
            y = got.layers[l][s]
            h, d = GQA.slot_shapes[s]
            mid, rec = x[:, p:-r].double(), y[:, p:-r].double()
            if rope is not None and s == GQA.rope_slot:  # the block factorized is the pre-RoPE one
                pos = kv.positions[0, p:-r]
                mid = relocate_keys(x[:, p:-r], -pos, rope, positions=pos).double()
                rec = relocate_keys(y[:, p:-r], -pos, rope, positions=pos).double()
            M = mid.permute(1, 0, 2).reshape(-1, h * d)
            tail = float(torch.linalg.svdvals(M)[rank:].pow(2).sum().sqrt())
            err = float(torch.linalg.matrix_norm((rec - mid).permute(1, 0, 2).reshape(-1, h * d)))
            assert err == pytest.approx(tail, rel=1e-4, abs=1e-5)
            num += float((y.double() - x.double()).pow(2).sum())
            den += float(x.double().pow(2).sum())
    assert store.meta("k")["approx"] == pytest.approx(math.sqrt(num / den), rel=1e-4)


def test_byte_accounting() -> None:
    rank, p, r, S = 3, 4, 8, 96
    kv = make_kv(3, S, torch.bfloat16)
    store = ChunkStore(cold=ColdTierConfig(rank=rank, protected_rows=p, recent_rows=r))
    store.put_canonical("k", kv)
    exact = kv.nbytes + kv.positions.numel() * 8
    assert store.nbytes == exact
    saved = store.compress("k")
    n, per_slot = S - p - r, []
    for h, d in GQA.slot_shapes:  # eq. (12): bf16 factors k(n + d + 1) + exact rows, all two bytes
        per_slot.append(persistent_bytes(n, h * d, rank, p + r, factor_bytes=2, exact_bytes=2))
    expect = GQA.num_layers * sum(per_slot) + kv.positions.numel() * 8
    assert store.nbytes == expect and saved == exact - expect
    assert store.stats.cold_compressed == 1 and store.stats.cold_bytes_saved == saved
    assert store.cold_stats() == {"entries": 1, "bytes": expect, "exact_bytes": exact, "bytes_saved": saved}
    meta = store.meta("k")["cold"]
    assert meta["bytes"] == expect and meta["exact_bytes"] == exact and meta["slots_cold"] == 4
    store.put_canonical("k", kv, store.meta("k"))  # a new put replaces it exactly (the cold marks are dropped)
    assert not store.is_cold("k") and store.nbytes == exact and "approx" not in store.meta("k")
    assert kv_equal(store.get_canonical("k"), kv) and store.cold_stats()["entries"] == 0
    assert store.compress("k") == saved and store.stats.cold_compressed == 2  # and it can go cold again


def test_below_break_even_stays_exact() -> None:
    d = 16
    need = break_even_rows(d, 3)
    cfg = ColdTierConfig(rank=3, protected_rows=4, recent_rows=4)
    short = make_kv(4, 8 + need - 1)  # middle block one row short of break-even
    store = ChunkStore(cold=cfg)
    store.put_canonical("short", short)
    assert store.compress("short") == 0 and not store.is_cold("short")
    assert kv_equal(store.get_canonical("short"), short) and "approx" not in store.meta("short")
    assert compress_kv(make_kv(4, 8 + need), cfg) is not None
    assert compress_kv(make_kv(5, 200), ColdTierConfig(rank=16)) is None  # rank >= d: never pays off
    # MLA with rank >= k_pe width: that slot stays dense, the latent goes cold
    out, facts = compress_kv(make_kv(6, 100, layout=MLA), ColdTierConfig(rank=8))
    assert facts["slots_cold"] == 2 and "0.1" in out and "cold.0.0.U" in out


def test_errors() -> None:
    store = ChunkStore()
    store.put_canonical("k", make_kv())
    with pytest.raises(WindowkitError, match="ColdTierConfig"):
        store.compress("k")
    with pytest.raises(ChunkNotFoundError):
        store.compress("absent", ColdTierConfig(rank=2))
    with pytest.raises(WindowkitError):
        ColdTierConfig(rank=0)
    with pytest.raises(WindowkitError):
        ChunkStore(cold={"rank": 2})  # type: ignore[arg-type]
    assert store.compress("k", ColdTierConfig(rank=2)) > 0  # an explicit config works on any store


def test_off_by_default(tmp_path: Path) -> None:
    kvs = [make_kv(i, 64) for i in range(4)]
    size = kvs[0].nbytes + 64 * 8
    for store in (ChunkStore(budget_bytes=2 * size), ChunkStore(tmp_path, budget_bytes=2 * size)):
        assert store.cold is None
        for i, kv in enumerate(kvs):
            assert store.put_canonical(f"k{i}", kv)
        assert store.keys() == ["k2", "k3"] and store.stats.evictions == 2
        assert store.stats.cold_compressed == 0 and store.cold_stats()["entries"] == 0
        assert kv_equal(store.get_canonical("k3"), kvs[3]) and "approx" not in store.meta("k3")
        store.close()


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_budget_never_exceeded_with_tier_on(tier: str, tmp_path: Path) -> None:
    cfg = ColdTierConfig(rank=2, protected_rows=2, recent_rows=4)
    kvs = {i: make_kv(i, 48 + 8 * (i % 5)) for i in range(12)}
    sizes = {i: kv.nbytes + kv.num_tokens * 8 for i, kv in kvs.items()}
    budget = 2 * max(sizes.values()) + max(sizes.values()) // 2
    store = ChunkStore(tmp_path if tier == "disk" else None, budget_bytes=budget, cold=cfg,
                       memory_budget_bytes=max(sizes.values()) if tier == "disk" else None)
    # pressure compresses before it evicts: 2.5 exact entries fill it, the next puts turn old ones cold
    for i in range(4):
        assert store.put_canonical(f"k{i}", kvs[i])
    assert store.stats.evictions == 0 and store.stats.cold_compressed >= 1 and len(store) == 4
    rng = random.Random(0)
    pinned: dict[str, int] = {}
    for step in range(120 if tier == "memory" else 50):
        op = rng.choice(["put", "put", "get", "pin", "unpin", "compress"])
        i = rng.randrange(12)
        key = f"k{i}"
        held = {k for k in pinned if store.has_canonical(k)}
        if op == "put":
            ok = store.put_canonical(key, kvs[i])
            assert ok or store.stats.rejected > 0
        elif op == "get" and store.has_canonical(key):
            got = store.get_canonical(key)
            if store.is_cold(key):
                x, y = kvs[i].layers[0][1], got.layers[0][1]
                assert torch.equal(y[:, :2], x[:, :2]) and torch.equal(y[:, -4:], x[:, -4:])
            else:
                assert kv_equal(got, kvs[i])
        elif op == "pin" and len(pinned) < 2:
            store.pin(key)
            pinned[key] = pinned.get(key, 0) + 1
        elif op == "unpin" and key in pinned:
            store.unpin(key)
            pinned[key] -= 1
            if not pinned[key]:
                del pinned[key]
        elif op == "compress" and store.has_canonical(key):
            store.compress(key)
        store.check_integrity()
        assert store.nbytes <= budget, step
        assert store.nbytes == sum(store.policy.size_of(e) for e in store._entries)
        assert all(store.has_canonical(k) for k in held)  # pinned entries are never evicted
        cs = store.cold_stats()
        assert cs["bytes_saved"] >= 0 and cs["entries"] == sum(store.is_cold(k) for k in store.keys())
    assert store.stats.cold_compressed > 0
    store.close()


def test_reopen_with_smaller_budget_compresses(tmp_path: Path) -> None:
    kvs = [make_kv(i, 64) for i in range(3)]
    with ChunkStore(tmp_path) as s:
        for i, kv in enumerate(kvs):
            s.put_canonical(f"k{i}", kv)
        total = s.nbytes
    with ChunkStore(tmp_path, budget_bytes=total - 1000, cold=ColdTierConfig(rank=2)) as s:
        assert len(s) == 3 and s.stats.evictions == 0 and s.nbytes <= total - 1000
        assert s.stats.cold_compressed >= 1


CHILD = textwrap.dedent("""
    import hashlib, json, sys
    import torch
    from windowkit.store import ChunkStore
    def digest(kv):
        h = hashlib.sha256()
        for pair in kv.layers:
            for t in pair:
                h.update(str(t.dtype).encode() + str(tuple(t.shape)).encode())
                h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
        h.update(b"none" if kv.positions is None else kv.positions.numpy().tobytes())
        return h.hexdigest()
    with ChunkStore(sys.argv[1]) as s:   # no cold config: a cold entry is self-describing
        out = {k: digest(s.get_canonical(k)) for k in sorted(s.keys())}
        out["meta"] = {k: s.meta(k) for k in sorted(s.keys())}
    print(json.dumps(out))
""")


def test_disk_reopen_in_new_process(tmp_path: Path) -> None:
    kv32, kv16, kvm = make_kv(7, 72), make_kv(8, 72, torch.bfloat16), make_kv(9, 72, layout=GQA, positions=False)
    with ChunkStore(tmp_path, model_fingerprint="fp-A", cold=ColdTierConfig(rank=2)) as s:
        s.put_canonical("c32", kv32)
        s.put_canonical("c16", kv16, {"src": "x"})
        s.put_canonical("rope", kvm)
        s.compress("c32")
        s.compress("c16")
        s.compress("rope", ColdTierConfig(rank=2, rope=ROPE, factor_dtype=torch.float32))
        here = {k: digest(s.get_canonical(k)) for k in ("c16", "c32", "rope")}
        metas = {k: s.meta(k) for k in ("c16", "c32", "rope")}
        assert metas["rope"]["cold"]["pre_rope"] is True
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for k in ("c16", "c32", "rope"):
        assert out[k] == here[k], k
        assert out["meta"][k] == metas[k]
    assert out["meta"]["c16"]["src"] == "x" and out["meta"]["c16"]["approx"] > 0
