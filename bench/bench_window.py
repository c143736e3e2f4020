"""Window planning and materialize costs (issue: planning under 100 µs per op with 64 chunks in the window
and 10,000 in the store; materialize time proportional to bytes moved).

    PYTHONPATH=. .venv/bin/python bench/bench_window.py --json bench/results/window.json

Planning = the bookkeeping of an edit without tensor work: ``Window.plan()``, the dependency-graph updates of
an eviction and the recall cascade, and the store lookups a recall does. Materialize = building the window's
KV after every chunk moved (an eviction at the head relocates all survivors).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import windowkit as wk
from windowkit.backends.tiny import build


def _us(fn, reps: int) -> tuple[float, float]:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        ts.append((time.perf_counter_ns() - t0) / 1e3)
    ts.sort()
    return statistics.median(ts), ts[int(0.95 * (len(ts) - 1))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--store-entries", type=int, default=10_000)
    ap.add_argument("--window", type=int, default=64)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    be = wk.HFBackend(build("tiny-llama"))
    store = wk.ChunkStore(model_fingerprint=be.fingerprint(), layout=be.layout)
    one = be.encode(wk.Chunk.text(torch.tensor([11])))
    for i in range(args.store_entries):  # 10,000 small canonicals: the store is big, tensors are not the point
        store.put_canonical(f"filler-{i}", one)
    g = torch.Generator().manual_seed(0)
    chunks = [wk.Chunk.text(torch.randint(10, be.vocab_size, (4,), generator=g), id=f"w{i}")
              for i in range(args.window + 1)]
    win = wk.Window(be, store=store, mode="patch", rank=4)
    for c in chunks[:args.window]:
        win.admit(c)
    win.window_kv()
    rows = {}
    rows["plan() with 64 chunks"] = _us(win.plan, 2000)
    rows["graph.on_evict + on_recall (w10)"] = _us(lambda: (win.graph.on_evict("w10"), win.graph.on_recall("w10", win.ids)), 500)
    rows["graph.cascade preview (head chunk)"] = _us(lambda: win.graph.cascade("w0", win.ids), 500)
    key5 = store.chunk_key(win.chunk("w5").content_hash())  # w5's store key and the context its KV was formed on
    ctx5 = win.graph.current_patch("w5").ctx
    rows["store.get_patch hit (copy=False)"] = _us(lambda: store.get_patch(key5, ctx5, copy=False), 2000)
    rows["store.has_canonical miss"] = _us(lambda: store.has_canonical("nope"), 2000)
    rows["Window.starts() (64)"] = _us(win.starts, 2000)

    # materialize after an eviction at the head: every survivor relocates; time vs bytes moved
    mat = []
    for n in (8, 16, 32, 64):
        cs = [wk.Chunk.text(torch.randint(10, be.vocab_size, (32,), generator=g), id=f"m{n}-{i}") for i in range(n + 1)]
        w = wk.Window(be, store=store, mode="blind")
        for c in cs:
            w.admit(c)
        w.window_kv()
        w.evict("head")
        moved = sum(w.plan()[i].est_bytes for i in range(len(w.plan())))
        t0 = time.perf_counter()
        kv = w.window_kv()
        dt = (time.perf_counter() - t0) * 1e3
        mat.append({"chunks": n, "tokens": kv.num_tokens, "bytes_moved": moved, "ms": dt,
                    "ms_per_MiB": dt / (moved / 2**20)})
    out = {"env": {"torch": torch.__version__, "threads": 1, "cpu": platform.processor() or platform.machine()},
           "planning_us": {k: {"median": v[0], "p95": v[1]} for k, v in rows.items()}, "materialize": mat}
    print("| planning op (64 chunks in the window, %d in the store) | median µs | p95 µs |" % args.store_entries)
    print("|---|---:|---:|")
    for k, (m, p) in rows.items():
        print(f"| {k} | {m:.1f} | {p:.1f} |")
    print("\n| chunks relocated | tokens | MiB moved | materialize ms | ms per MiB |\n|---:|---:|---:|---:|---:|")
    for r in mat:
        print(f"| {r['chunks']} | {r['tokens']} | {r['bytes_moved'] / 2**20:.2f} | {r['ms']:.2f} | {r['ms_per_MiB']:.2f} |")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
