"""Benchmark the trace simulator: throughput (simulated steps per minute, one core) and a table of modeled
total time per strategy on the VideoTree trace and on each generated access pattern.

    PYTHONPATH=. .venv/bin/python bench/bench_simulate.py            # writes bench/results/simulate.json
    PYTHONPATH=. .venv/bin/python bench/bench_simulate.py --quick    # smaller sizes (smoke test)

Throughput uses a sliding window of 64 chunks (one long episode of ``sliding_window(k=64)``, generated once;
shorter runs take its first steps). The analytic strategies (recompute, radix, blind, blend) are timed
together; the windowkit strategy (a real Window on the cost-model backend) is timed on its first steps and
profiled (where its time goes); ``WindowkitFast`` (``windowkit/trace/fastsim.py``, the same costs from
bookkeeping only) is timed on the whole trace, checked equal to the real Window step by step on the steps the
real one ran, and profiled. Wall times come from ``simulate``'s per-strategy clock; CPU seconds of the whole
``simulate`` call (``time.process_time``) are reported beside them, since the machine may be shared. The table
also runs the opt-in ``windowkit-lazy`` strategy (``Window(form="lazy")``) and, on the full VideoTree trace,
where the real Window is too slow, ``windowkit-fast`` / ``windowkit-fast-lazy``.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import time
from dataclasses import asdict
from pathlib import Path

import torch

from windowkit.trace import load_videotree, simulate
from windowkit.trace.fastsim import WindowkitFast
from windowkit.trace.generators import append_zoom, grow_interleave, random_lookback, sliding_window
from windowkit.trace.simulate import WindowkitStrategy

ANALYTIC = ["recompute", "radix", "blind", "blend"]


def _profile_top(prof: cProfile.Profile, n: int = 12) -> tuple[list, pstats.Stats]:
    st = pstats.Stats(prof, stream=io.StringIO())
    top = []
    for (fn, line, name), (cc, nc, tt, ct, _) in sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:n]:
        top.append({"function": f"{Path(fn).name}:{line}({name})", "calls": nc, "tottime_s": round(tt, 3),
                    "cumtime_s": round(ct, 3)})
    return top, st


def throughput(steps: int, wk_steps: int, fast_steps: int) -> dict:
    n = max(steps, wk_steps, fast_steps)
    t0 = time.perf_counter()
    trace = sliding_window(steps=n, k=64, shot_tokens=765, episode_len=(n, n), seed=0)
    out = {"window_chunks": 64, "trace": f"sliding_window(k=64, steps={n}, one episode); first N steps per run",
           "trace_build_s": time.perf_counter() - t0, "load_avg_1min_before": os.getloadavg()[0]}
    t0 = time.perf_counter()
    res = simulate(trace, "h100-kamera", ANALYTIC, progress=False, max_steps=steps)
    dt = time.perf_counter() - t0
    out["analytic"] = {"steps": steps, "wall_s": dt, "steps_per_min": steps / dt * 60,
                       "per_strategy_steps_per_min": {k: steps / v * 60 for k, v in res.wall_s.items()}}

    # the real Window, profiled, on the first wk_steps steps
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    res = simulate(trace, "h100-kamera", ["windowkit"], progress=False, max_steps=wk_steps)
    prof.disable()
    dt = time.perf_counter() - t0
    top, st = _profile_top(prof)
    cum = {}
    for (fn, line, name), (cc, nc, tt, ct, _) in st.stats.items():
        if "window.py" in fn and name in ("_refresh_known", "_condition", "_ctx", "_kv_upto", "window_kv", "plan",
                                          "assign", "evict", "_insert"):
            cum[name] = round(ct, 3)
    out["windowkit"] = {"steps": wk_steps, "wall_s_profiled": dt, "steps_per_min_profiled": wk_steps / dt * 60,
                        "steps_per_min_strategy_only": wk_steps / res.wall_s["windowkit"] * 60,
                        "top_tottime": top, "window_cumtime_s": cum}

    # WindowkitFast: equal to the real Window on those steps (unprofiled run of both), then timed on all of them
    both = simulate(trace, "h100-kamera", [WindowkitStrategy(), WindowkitFast()], progress=False, max_steps=wk_steps)
    diff = [i for i, (a, b) in enumerate(zip(both.steps["windowkit"], both.steps["windowkit-fast"]))
            if asdict(a) != asdict(b)]
    fast = {"steps": fast_steps, "equal_to_windowkit_steps": wk_steps, "unequal_steps": diff[:10],
            "windowkit_steps_per_min_unprofiled": wk_steps / both.wall_s["windowkit"] * 60}
    for form in ("eager", "lazy"):
        c0, t0 = time.process_time(), time.perf_counter()
        res = simulate(trace, "h100-kamera", [WindowkitFast(form=form)], progress=False, max_steps=fast_steps)
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        fast[form] = {"steps_per_min_strategy_only": fast_steps / res.wall_s["windowkit-fast"] * 60,
                      "steps_per_min_cpu": fast_steps / cpu * 60, "wall_s": wall, "cpu_s": cpu,
                      "total_ms": res.totals("windowkit-fast")["total_ms"]}
    prof = cProfile.Profile()
    prof.enable()
    simulate(trace, "h100-kamera", [WindowkitFast()], progress=False, max_steps=min(fast_steps, 5000))
    prof.disable()
    fast["profile_steps"] = min(fast_steps, 5000)
    fast["top_tottime"] = _profile_top(prof, 10)[0]
    out["windowkit_fast"] = fast
    return out


def table(traces: dict, profiles: list[str]) -> dict:
    rows = {}
    for tname, (trace, strategies) in traces.items():
        for prof in profiles:
            t0 = time.perf_counter()
            res = simulate(trace, prof, strategies, progress=False)
            s = res.summary()
            s["wall_s_total"] = time.perf_counter() - t0
            s["trace_stats"] = trace.stats()
            rows[f"{tname}|{prof}"] = s
            ms = {k: round(v["total_ms"], 1) for k, v in s["strategies"].items()}
            print(f"{tname:28s} {prof:12s} {ms} {({k: round(v, 3) for k, v in s['ratios'].items()})}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default="bench/results/simulate.json")
    args = ap.parse_args()
    torch.set_num_threads(1)  # "one core"
    q = args.quick
    out = {"python": platform.python_version(), "torch": torch.__version__, "threads": 1}
    out["throughput"] = throughput(2000 if q else 10000, 40 if q else 300, 2000 if q else 20000)
    a, w, f = (out["throughput"][k] for k in ("analytic", "windowkit", "windowkit_fast"))
    print(f"throughput, 64-chunk window: analytic {a['steps_per_min']:.0f} steps/min; windowkit "
          f"{w['steps_per_min_strategy_only']:.0f} steps/min; windowkit-fast {f['eager']['steps_per_min_strategy_only']:.0f} "
          f"steps/min wall ({f['eager']['steps_per_min_cpu']:.0f} per CPU-minute; lazy "
          f"{f['lazy']['steps_per_min_strategy_only']:.0f}), equal to windowkit on {f['equal_to_windowkit_steps']} steps: "
          f"{not f['unequal_steps']}", flush=True)
    vt_n = 10 if q else 50
    all_s = ANALYTIC + ["windowkit", "windowkit-lazy"]
    traces = {
        f"videotree[:{vt_n}]": (load_videotree(max_questions=vt_n), all_s),
        "videotree (all 500, analytic + fast)": (load_videotree(), ANALYTIC + [
            WindowkitFast(), WindowkitFast(form="lazy", name="windowkit-fast-lazy")]),
        "sliding-3": (sliding_window(steps=50 if q else 200, k=3, seed=0), all_s),
        "grow-interleave": (grow_interleave(episodes=20 if q else 100, seed=0), all_s),
        "append-zoom": (append_zoom(episodes=10 if q else 50, seed=0), all_s),
        "random-lookback": (random_lookback(steps=50 if q else 200, p=0.3, seed=0), all_s),
    }
    out["table"] = table(traces, ["h100-kamera", "cpu-tiny"])
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
