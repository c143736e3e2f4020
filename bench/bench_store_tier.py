"""Latency per chunk: local tiers (memory, disk) vs the shared tier (Mooncake on loopback), put and get.

    PYTHONPATH=. .venv/bin/python bench/bench_store_tier.py --json bench/results/store_tier.json
    PYTHONPATH=. .venv/bin/python bench/bench_store_tier.py --quick          # fewer repeats, smaller sizes

Starts its own loopback Mooncake Store (master + a holder lending memory; ``LocalMooncake``), so nothing
else is needed but ``requirements-mooncake.txt``. Chunks are random fp16 canonical KVs of a Qwen2-7B-like
layout (28 layers, 4 KV heads x 128) with 16 / 64 / 256 tokens (56 KiB per token); ``--quick`` uses a 4-layer
layout. Each row is the median (and p90) of ``--repeats`` calls on one chunk:

  put  memory          ChunkStore() put (private copy of the tensors)
  put  disk            ChunkStore(path) put: safetensors file, fsync, SQLite row
  put  memory+shared   ChunkStore(shared=...) put: the local put plus the write-through (serialise, sha256, upsert)
  get  memory          memory hit
  get  disk            disk hit with the memory cache off (read, sha256, parse)
  get  shared          local miss served by Mooncake (get, sha256, parse, kept locally; dropped again between calls)

Loopback only: one machine, TCP through the kernel, no network; the numbers bound software overhead, not a
cluster's bandwidth.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from windowkit.kv.layout import ChunkKV, KVLayout
from windowkit.store import ChunkStore
from windowkit.store.mooncake import LocalMooncake, MooncakeBackend


def chunk(layout: KVLayout, tokens: int, seed: int) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    return ChunkKV([tuple(torch.randn(h, tokens, d, generator=g).to(torch.float16) for h, d in layout.slot_shapes)
                    for _ in range(layout.num_layers)], layout)


def timed(fn, repeats: int, between=None) -> list[float]:
    out = []
    for i in range(repeats):
        if between is not None:
            between(i)
        t0 = time.perf_counter()
        fn(i)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def summary(ms: list[float]) -> dict:
    s = sorted(ms)
    return {"median_ms": statistics.median(s), "p90_ms": s[min(len(s) - 1, int(0.9 * len(s)))], "n": len(s)}


def run(sizes: list[int], layers: int, repeats: int) -> dict:
    layout = KVLayout("qwen2", layers, ((4, 128), (4, 128)), 0)
    rows = []
    with LocalMooncake(segment_bytes=1 << 30) as mc, tempfile.TemporaryDirectory() as tmp:
        shared = MooncakeBackend(mc.config(timeout_s=30.0), namespace="bench")
        try:
            for tokens in sizes:
                kv = chunk(layout, tokens, tokens)
                nbytes = kv.nbytes
                mem = ChunkStore(layout=layout)
                disk = ChunkStore(Path(tmp) / f"d{tokens}", layout=layout, memory_budget_bytes=0)
                wt = ChunkStore(layout=layout, model_fingerprint="bench", shared=shared)
                reader = ChunkStore(layout=layout, model_fingerprint="bench", shared=shared)
                res = {
                    ("put", "memory"): timed(lambda i: mem.put_canonical(f"k{i}", kv), repeats),
                    ("put", "disk"): timed(lambda i: disk.put_canonical(f"k{i}", kv), repeats),
                    ("put", "memory+shared"): timed(lambda i: wt.put_canonical(f"k{i}", kv), repeats),
                    ("get", "memory"): timed(lambda i: mem.get_canonical(f"k{i}"), repeats),
                    ("get", "disk"): timed(lambda i: disk.get_canonical(f"k{i}"), repeats),
                    # drop the local copy first, so every get is served by the shared tier
                    ("get", "shared"): timed(lambda i: reader.get_canonical(f"k{i}"), repeats,
                                             between=lambda i: reader.drop(f"k{i}")),
                }
                assert reader.stats.shared_hits == repeats and reader.stats.shared_fallbacks == 0
                assert wt.stats.shared_puts == repeats
                got = reader.get_canonical("k0")
                assert all(torch.equal(a, b) for la, lb in zip(got.layers, kv.layers) for a, b in zip(la, lb))
                for (op, tier), ms in res.items():
                    rows.append({"op": op, "tier": tier, "tokens": tokens, "bytes": nbytes, **summary(ms),
                                 "MB_per_s": nbytes / 1e6 / (statistics.median(ms) / 1e3)})
                disk.close()
                shared.clear()
        finally:
            shared.close()
    return {"layout": {"layers": layers, "kv_heads": 4, "head_dim": 128, "dtype": "float16"},
            "repeats": repeats, "rows": rows,
            "machine": {"python": platform.python_version(), "cpu_count": __import__("os").cpu_count(),
                        "torch": torch.__version__,
                        "load_avg": list(__import__("os").getloadavg())},
            "note": "loopback Mooncake (master + one holder, tcp); medians of repeated calls on one chunk"}


def table(result: dict) -> str:
    lines = ["| op | tier | tokens | bytes | median ms | p90 ms | MB/s |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['op']} | {r['tier']} | {r['tokens']} | {r['bytes']:,} | {r['median_ms']:.3f} | "
                     f"{r['p90_ms']:.3f} | {r['MB_per_s']:,.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--quick", action="store_true", help="4 layers, 16/64 tokens, 10 repeats")
    ap.add_argument("--repeats", type=int, default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    sizes, layers, repeats = ([16, 64], 4, 10) if a.quick else ([16, 64, 256], 28, 30)
    result = run(sizes, layers, a.repeats or repeats)
    print(table(result))
    print(f"load average during the run: {result['machine']['load_avg']}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
