"""Planning cost of the dependency graph (windowkit.graph): microseconds per op, no tensor work.

    PYTHONPATH=. .venv/bin/python bench/bench_plan.py                 # writes bench/results/plan.json
    PYTHONPATH=. .venv/bin/python bench/bench_plan.py --quick         # fewer chunks and reps (smoke)

A stream of N chunks (default 10,000) slides through a window of W (default 64): each chunk enters at the tail
with a patch formed on its antecedents, the head is evicted when the window is full. Two conditioning shapes:

  dense   each patch is formed on the whole window before the chunk (up to W-1 antecedents): the worst case,
          every later chunk depends on every earlier one, so a recall near the head cascades through the window
  local   each patch is formed on the 4 chunks just before it (a typical short-range binding)

Measured per op (median / p95 / max over many reps, perf_counter_ns around the single call, gc off). The JSON
also records the machine's load and a reference loop (sum(range(1000))) so numbers can be compared across boxes.

  on_evict         evict a chunk from the middle of the window (its dependents turn stale)
  on_recall        recall it at the same place: un-stale + the full costed cascade
  cascade          plan-only cascade for the window's 2nd chunk (the longest cascade: ids, indices, costs)
  cascade + steps  the same, then its CascadeStep records with via / depth (built lazily, for display)
  reuse_decision   patch formed on the W-1 antecedents vs the context after a one-chunk slide / a reorder /
                   a one-chunk superset
  refresh_order    rank the window's stale worn patches (after evicting the window's 2nd chunk) by divergence
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from windowkit.graph import DependencyGraph, reuse_decision  # noqa: E402

TARGET_US = 100.0


def build(n: int, window: int, local: int | None) -> tuple[DependencyGraph, list[str]]:
    g = DependencyGraph()
    win: list[str] = []
    for i in range(n):
        cid = f"c{i}"
        if len(win) == window:
            g.on_evict(win.pop(0))
        ante = win if local is None else win[-local:]
        g.add_patch(cid, f"ctx{i}", ante, tokens=256, nbytes=256 * 4096)
        win.append(cid)
    return g, win


def timeit(fn, reps: int, setup=None) -> list[float]:
    out = []
    gc.disable()
    try:
        for _ in range(reps):
            if setup is not None:
                setup()
            t0 = time.perf_counter_ns()
            fn()
            out.append((time.perf_counter_ns() - t0) / 1e3)
    finally:
        gc.enable()
    return out


def summary(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median_us": statistics.median(xs), "p95_us": xs[min(len(xs) - 1, int(0.95 * len(xs)))],
            "max_us": xs[-1], "reps": len(xs)}


def bench_shape(name: str, n: int, window: int, local: int | None, reps: int) -> list[dict]:
    t0 = time.perf_counter()
    g, win = build(n, window, local)
    build_s = time.perf_counter() - t0
    rows = []

    def row(op, samples, **extra):
        r = {"shape": name, "op": op, **summary(samples), **extra}
        rows.append(r)
        return r

    mid = win[window // 2]
    ev, rc = [], []
    casc_len = 0
    for _ in range(reps):  # alternate evict / recall of the same chunk: the state returns each pair
        t = time.perf_counter_ns()
        g.on_evict(mid)
        ev.append((time.perf_counter_ns() - t) / 1e3)
        t = time.perf_counter_ns()
        c = g.on_recall(mid, win)
        rc.append((time.perf_counter_ns() - t) / 1e3)
        casc_len = len(c)
    row("on_evict", ev, deg=len(g.dependents(mid)))
    row("on_recall (un-stale + cascade)", rc, cascade=casc_len)

    head = win[1]
    c = g.cascade(head, win)
    row("cascade (plan only, longest)", timeit(lambda: g.cascade(head, win), reps), cascade=len(c), depth=c.depth)
    row("cascade + steps (via, depth)", timeit(lambda: g.cascade(head, win).steps, max(reps // 4, 50)),
        cascade=len(c))

    formed = tuple(win[:-1])
    slide = list(win[1:-1])
    rev = list(reversed(formed))
    sup = list(formed) + ["new"]
    for label, cur in (("slide", slide), ("reorder", rev), ("superset", sup)):
        score, rebuild = reuse_decision(formed, cur)
        row(f"reuse_decision ({label})", timeit(lambda cur=cur: reuse_decision(formed, cur), reps),
            score=round(score, 4), rebuild=rebuild)

    g.on_evict(head)
    stale = [g.current_patch(x) for x in win if g.current_patch(x) is not None and g.is_stale(g.current_patch(x))]
    rest = [x for x in win if x != head]
    row("refresh_order (stale worn patches)", timeit(lambda: g.refresh_order(stale, rest), max(reps // 10, 20)),
        patches=len(stale))
    g.on_recall(head, win)

    for r in rows:
        r.update(chunks=len(g), patches=g.num_patches, edges=g.graph.number_of_edges(), window=window,
                 build_s=round(build_s, 3))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=10_000)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--quick", action="store_true", help="1,000 chunks, 200 reps (smoke run)")
    ap.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "plan.json"))
    a = ap.parse_args(argv)
    if a.quick:
        a.chunks, a.reps = 1000, 200
    calib = summary(timeit(lambda: sum(range(1000)), 2000))["median_us"]  # machine-speed reference
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    rows = bench_shape("dense", a.chunks, a.window, None, a.reps) + bench_shape("local", a.chunks, a.window, 4, a.reps)
    result = {"bench": "plan", "target_us": TARGET_US, "chunks": a.chunks, "window": a.window, "reps": a.reps,
              "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
              "calib_sum_range_1000_us": round(calib, 2), "loadavg_1min": load,
              "command": "PYTHONPATH=. .venv/bin/python bench/bench_plan.py" + (" --quick" if a.quick else ""),
              "rows": rows}
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    print(f"windowkit.graph planning cost: {a.chunks} chunks in the graph, window {a.window}, {a.reps} reps "
          f"(target < {TARGET_US:.0f} us/op)")
    print(f"machine: {os.cpu_count()} cpus, load {load if load is None else round(load, 2)}, "
          f"sum(range(1000)) = {calib:.1f} us (a quiet modern core: ~5-10 us)\n")
    print("| shape | op | median us | p95 us | max us | detail |")
    print("|---|---|---:|---:|---:|---|")
    skip = {"shape", "op", "median_us", "p95_us", "max_us", "reps", "chunks", "patches", "edges", "window", "build_s"}
    for r in rows:
        detail = ", ".join(f"{k}={v}" for k, v in r.items() if k not in skip)
        print(f"| {r['shape']} | {r['op']} | {r['median_us']:.1f} | {r['p95_us']:.1f} | {r['max_us']:.0f} | {detail} |")
    for shape in ("dense", "local"):
        r = next(x for x in rows if x["shape"] == shape)
        print(f"\n{shape}: {r['chunks']} chunks, {r['patches']} patches, {r['edges']} edges, built in {r['build_s']} s")
    worst = max(r["p95_us"] for r in rows if r["op"].split()[0] in ("on_evict", "on_recall", "reuse_decision")
                or r["op"].startswith("cascade (plan"))
    print(f"\nworst per-op p95 (evict / recall / cascade plan / reuse_decision): {worst:.1f} us "
          f"({'under' if worst < TARGET_US else 'OVER'} the {TARGET_US:.0f} us target)")
    if a.json:
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
