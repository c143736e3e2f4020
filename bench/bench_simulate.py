"""Benchmark the trace simulator: throughput (simulated steps per minute, one core) and a table of modeled
total time per strategy on the VideoTree trace and on each generated access pattern.

    PYTHONPATH=. .venv/bin/python bench/bench_simulate.py            # writes bench/results/simulate.json
    PYTHONPATH=. .venv/bin/python bench/bench_simulate.py --quick    # smaller sizes (smoke test)

Throughput uses a sliding window of 64 chunks (one long episode of ``sliding_window(k=64)``, generated once;
shorter runs take its first steps). The analytic strategies (recompute, radix, blind, blend) are timed
together; the windowkit strategy (the real Window on the cost-model backend: the one copy of the planner's
rules) is profiled on its first steps (where its time goes), then timed unprofiled on the whole trace in both
forms. Wall times come from ``simulate``'s per-strategy clock; CPU seconds of the whole ``simulate`` call
(``time.process_time``) are reported beside them, since the machine may be shared. The table also runs the
``windowkit-lazy`` and ``windowkit-eager`` strategies.
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


def throughput(steps: int, wk_steps: int, full_steps: int) -> dict:
    n = max(steps, wk_steps, full_steps)
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

    # unprofiled, on the whole trace, in both forms
    full = {"steps": full_steps}
    for form in ("lazy", "eager"):
        c0, t0 = time.process_time(), time.perf_counter()
        res = simulate(trace, "h100-kamera", [WindowkitStrategy(form=form)], progress=False, max_steps=full_steps)
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        full[form] = {"steps_per_min_strategy_only": full_steps / res.wall_s["windowkit"] * 60,
                      "steps_per_min_cpu": full_steps / cpu * 60, "wall_s": wall, "cpu_s": cpu,
                      "total_ms": res.totals("windowkit")["total_ms"]}
    out["windowkit_full"] = full
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
    a, f = (out["throughput"][k] for k in ("analytic", "windowkit_full"))
    print(f"throughput, 64-chunk window: analytic {a['steps_per_min']:.0f} steps/min; windowkit (the real Window) "
          f"{f['lazy']['steps_per_min_strategy_only']:.0f} steps/min wall ({f['lazy']['steps_per_min_cpu']:.0f} per "
          f"CPU-minute; form eager {f['eager']['steps_per_min_strategy_only']:.0f}) over {f['steps']} steps", flush=True)
    vt_n = 10 if q else 50
    all_s = ANALYTIC + ["windowkit", "windowkit-lazy"]
    traces = {
        f"videotree[:{vt_n}]": (load_videotree(max_questions=vt_n), all_s),
        "videotree (all 500)": (load_videotree(), ANALYTIC + ["windowkit", "windowkit-eager"]),
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
