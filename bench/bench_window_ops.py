"""Per-op planning cost of the real Window on the cost-model backend (issue "Cheap and still right": at most
100 us per Window op on a 64-chunk window), and the simulator's steps per minute through the real Window (the one
copy of the planner's rules) on the same sliding trace and on the whole VideoTree trace.

    PYTHONPATH=. .venv/bin/python bench/bench_window_ops.py      # writes bench/results/window_ops.{json,md}

A sliding step is ``evict("head")``, ``admit(new)`` at the tail, ``forward(query)``; each op is timed on its own
(perf_counter around the call), medians and p90 over the measured steps after a warm-up. Each measured section
starts after a ``gc.collect()``: a full collection walks every object of the process (torch's included, ~0.1 s
here), and whether one lands inside a 0.1 s simulation would otherwise decide its steps/min. The store grows by one
chunk per step (unbounded). Every figure is the median of ``--repeat`` runs (default 3, each on a fresh Window;
the JSON lists every run): this machine's timings swing up to 2x between runs. The JSON records the load average
before and after: on a shared machine, compare ratios within one run.

The store-size sweep runs the same k = 64 sliding loop on a store pre-filled with 1e3, 1e4 and 1e5 other entries
(through the public store API: ``put_canonical`` of a one-token KV under fresh chunk keys, half of them as
conditioned KV of a context), so "flat in the store size" is measured, not assumed.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._meta import short_commit  # noqa: E402
import windowkit as wk  # noqa: E402
from windowkit.store import ChunkStore, chunk_key, conditioned_key, context_hash  # noqa: E402
from windowkit.trace import load_videotree, simulate  # noqa: E402
from windowkit.trace.backend import CostModelBackend  # noqa: E402
from windowkit.trace.costs import load_profile  # noqa: E402
from windowkit.trace.generators import sliding_window  # noqa: E402
from windowkit.trace.simulate import WindowkitStrategy  # noqa: E402

TARGET_US = 100.0
STORE_SIZES = (1_000, 10_000, 100_000)


def filled_store(be: CostModelBackend, n: int) -> ChunkStore:
    """A memory store (as the Window makes its own) holding ``n`` entries unrelated to the trace: one-token KVs,
    half under chunk keys, half as conditioned KV of a chunk behind a one-chunk context."""
    store = ChunkStore(model_fingerprint=be.fingerprint(), layout=be.layout)
    kv = be.encode(be.chunk("__fill__", 1, "text"))
    fp = be.fingerprint()
    for i in range(n):
        key = chunk_key(f"fill-{i}", fp)
        if i % 2:
            key = conditioned_key(key, context_hash([chunk_key(f"fill-ctx-{i}", fp)]))
        store.put_canonical(key, kv, {"chunk_id": f"fill-{i}"})
    return store


def ops(k: int, steps: int, warmup: int = 50, store_fill: int = 0) -> dict:
    """Median / p90 microseconds of evict, admit and forward on a ``k``-chunk sliding window (on a store already
    holding ``store_fill`` other entries)."""
    be = CostModelBackend(load_profile("h100-kamera"))
    win = wk.Window(be, store=filled_store(be, store_fill)) if store_fill else wk.Window(be)
    for i in range(k):
        win.admit(be.chunk(f"c{i}", 64, "text"))
    win.forward([1, 2])
    chunks = [be.chunk(f"c{k + s}", 64, "text") for s in range(warmup + steps)]
    times: dict[str, list[float]] = {"evict": [], "admit": [], "forward": []}
    gc.collect()
    for s, c in enumerate(chunks):
        t0 = time.perf_counter()
        win.evict("head")
        t1 = time.perf_counter()
        win.admit(c)
        t2 = time.perf_counter()
        win.forward([1, 2])
        t3 = time.perf_counter()
        if s >= warmup:
            times["evict"].append(t1 - t0)
            times["admit"].append(t2 - t1)
            times["forward"].append(t3 - t2)
    out = {}
    for op, ts in times.items():
        ts.sort()
        out[op] = {"median_us": statistics.median(ts) * 1e6, "p90_us": ts[int(0.9 * len(ts))] * 1e6}
    per_op = [x for ts in times.values() for x in ts]
    out["all_ops"] = {"median_us": statistics.median(per_op) * 1e6,
                      "mean_us": statistics.fmean(per_op) * 1e6}
    out["store_entries_after"] = len(win.store)
    return out


def sim(trace, steps: int, repeat: int = 1) -> dict:
    """Simulated steps per minute through the real Window (the default strategy) on one trace: the median of
    ``repeat`` whole runs (each a fresh Window; every run is listed)."""
    rates, total = [], None
    for _ in range(repeat):
        gc.collect()
        t = time.perf_counter()
        r = simulate(trace, strategies=[WindowkitStrategy()], progress=False)
        dt = time.perf_counter() - t
        rates.append(steps / dt * 60)
        total = r.summary()["strategies"]["windowkit"]["total_ms"]
    return {"steps": steps, "steps_per_min": statistics.median(rates), "runs_steps_per_min": rates,
            "total_ms": total}


def ops_median(k: int, steps: int, repeat: int, store_fill: int = 0) -> dict:
    """``ops`` run ``repeat`` times (a fresh Window each): the run whose all-ops median is the median one, with
    every run's all-ops median listed (a shared machine's noise shows as their spread)."""
    runs = sorted((ops(k, steps, store_fill=store_fill) for _ in range(repeat)),
                  key=lambda r: r["all_ops"]["median_us"])
    out = runs[len(runs) // 2]
    out["runs_all_ops_median_us"] = [r["all_ops"]["median_us"] for r in runs]
    return out


def sliding(k: int, steps: int):
    return sliding_window(steps=steps, k=k, episode_len=(10 ** 6, 10 ** 6), shot_tokens=64)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=3, help="runs per figure; the median run is reported")
    ap.add_argument("--json", default=str(ROOT / "bench/results/window_ops.json"))
    ap.add_argument("--md", default=str(ROOT / "bench/results/window_ops.md"))
    a = ap.parse_args(argv)
    load0 = os.getloadavg()[0]
    rows = {k: ops_median(k, a.steps, a.repeat) for k in (8, 64)}
    sims = {k: sim(sliding(k, a.steps), a.steps, a.repeat) for k in (8, 64)}
    vt = load_videotree()  # 1353 steps, windows of 42 chunks on average (up to 111), a new episode every few steps
    vt_mean = sum(len(s.context) for s in vt) / len(vt)
    sims["videotree"] = sim(vt, len(vt))
    sweep = {n: ops_median(64, a.steps, a.repeat, store_fill=n) for n in STORE_SIZES}
    out = {"bench": "window_ops", "target_us": TARGET_US, "steps": a.steps, "repeat": a.repeat,
           "python": platform.python_version(),
           "cpus": os.cpu_count(), "loadavg_before": load0, "loadavg_after": os.getloadavg()[0],
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "command": "PYTHONPATH=. .venv/bin/python bench/bench_window_ops.py", "commit": short_commit(), "ops": rows, "simulate": sims,
           "store_sweep": {"k": 64, "rows": sweep}}
    Path(a.json).write_text(json.dumps(out, indent=1))
    lines = [f"Window ops on the cost-model backend ({a.steps} sliding steps after 50 warm-up; the median of "
             f"{a.repeat} runs per figure; load average {load0:.1f} before, {out['loadavg_after']:.1f} after; "
             f"{out['date']}, commit {short_commit()})", "",
             "| k | evict median / p90 us | admit median / p90 us | forward median / p90 us | all ops median us | "
             "simulated steps/min (real Window) |", "|---|---|---|---|---|---|"]
    for k in rows:
        r, s = rows[k], sims[k]
        lines.append(f"| {k} | {r['evict']['median_us']:.0f} / {r['evict']['p90_us']:.0f} | "
                     f"{r['admit']['median_us']:.0f} / {r['admit']['p90_us']:.0f} | "
                     f"{r['forward']['median_us']:.0f} / {r['forward']['p90_us']:.0f} | {r['all_ops']['median_us']:.0f} | "
                     f"{s['steps_per_min']:.0f} |")
    v = sims["videotree"]
    lines += ["", f"The whole VideoTree trace ({v['steps']} steps, {vt_mean:.0f} chunks per window on average, most of "
              f"them new at each episode's first step): {v['steps_per_min']:.0f} simulated steps/min (real Window)."]
    lines += ["", f"Store-size sweep: k = 64, the same sliding loop on a store pre-filled with other entries "
              "(medians / p90 us)", "",
              "| stored entries before | evict | admit | forward | all ops median us | entries after |",
              "|---|---|---|---|---|---|"]
    for n, r in sweep.items():
        lines.append(f"| {n:,} | {r['evict']['median_us']:.0f} / {r['evict']['p90_us']:.0f} | "
                     f"{r['admit']['median_us']:.0f} / {r['admit']['p90_us']:.0f} | "
                     f"{r['forward']['median_us']:.0f} / {r['forward']['p90_us']:.0f} | "
                     f"{r['all_ops']['median_us']:.0f} | {r['store_entries_after']:,} |")
    Path(a.md).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
