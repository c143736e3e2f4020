"""The floor of every trace the simulator knows, beside every default strategy, and the planner's target.

For each trace (every generator in ``windowkit.trace.generators.GENERATORS``, every trace recorded from the example
agents in ``bench/traces/recorded/``, ``videotree`` and ``videotree-set``, each built exactly as
``windowkit simulate NAME`` builds it: ``simulate.load_trace_arg``, default placement) on
each built-in profile (``h100-kamera``, ``cpu-tiny``): total modeled ms and prefill tokens of every default
strategy (``simulate.DEFAULT_STRATEGIES``: recompute, radix, blind, blend, windowkit, floor), the ratios
windowkit/radix, windowkit/floor, floor/radix, the target in force ("0.6x radix", or "1.15x floor" where the
floor is above 0.6x radix) and which strategies meet it.

    PYTHONPATH=. .venv/bin/python bench/bench_floor.py            # all 500 VideoTree questions: ~1 min, 1 thread
    PYTHONPATH=. .venv/bin/python bench/bench_floor.py --quick    # VideoTree's first 30 questions (~1-2 min)

Writes ``bench/results/floor.json`` (``--json``) and ``bench/results/floor.md`` (the table printed at the end).
The last three columns: ``windowkit-ahead``, the same Window driven by an agent that prepares each next step's
surviving chunks between steps (``prefetch(next=...)``, ``WindowkitStrategy(anticipate=True)``): its steps' cost,
and in parentheses the preparation's, which is not in its time (``idle_ms``, ``idle_tokens``). The three after them:
``windowkit-slide``, the same Window prepared between steps by a guess policy that reads only the window's history
(``policies.guess.SlideGuess``: the last slide again), its wrong guesses' prefill ("wasted") included in the
preparation.
windowkit is the real Window (``WindowkitStrategy``) with the Window's current defaults: the JSON records the
commit and a digest of ``windowkit/window/window.py`` so a number can be tied to the Window it came from.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from windowkit.trace.generators import GENERATORS
from windowkit.trace.simulate import DEFAULT_STRATEGIES, WindowkitStrategy, load_trace_arg, make_strategies, simulate

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ("h100-kamera", "cpu-tiny")
# the defaults, and windowkit with the agent's between-steps preparation (its step's cost; the preparation apart):
# told the next step by the agent (ahead), or guessed from the window's history by policies.guess "slide" (slide)
STRATEGY_NAMES = tuple(DEFAULT_STRATEGIES) + ("windowkit-ahead", "windowkit-slide")


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def provenance() -> dict:
    files = ["windowkit/window/window.py", "windowkit/trace/strategies.py", "windowkit/trace/run.py",
             "windowkit/trace/result.py", "windowkit/trace/floor.py", "windowkit/backends/hf.py"]
    return {"commit": _git("rev-parse", "HEAD"), "dirty": _git("status", "--porcelain", "--", *files).splitlines(),
            "sha256": {f: hashlib.sha256((ROOT / f).read_bytes()).hexdigest()[:16]
                       for f in files if (ROOT / f).is_file()},
            "python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "load_avg_1min_before": os.getloadavg()[0]}


RECORDED = ROOT / "bench/traces/recorded"  # traces recorded from the example agents (bench/traces/README.md)


def trace_specs(videotree: int | None) -> list[str]:
    """Every generator, the recorded traces (JSONL paths relative to the checkout), then VideoTree (ordered, set)."""
    vt = "" if videotree is None else f":{videotree}"
    recorded = [str(p.relative_to(ROOT)) for p in sorted(RECORDED.glob("*.jsonl"))]
    return list(GENERATORS) + recorded + [f"videotree{vt}", f"videotree-set{vt}"]


def _guess_counters(strats) -> dict:
    """The guess policy's counters of ``windowkit-slide`` after the run (guesses, prepared, hits, wasted tokens)."""
    return next((st.guess_counters for st in strats if isinstance(st, WindowkitStrategy) and st.guess is not None), {})


def _window_stats(strats) -> dict:
    """The real Window's ``WindowStats`` after the run (``repaired_tokens``, ``fallbacks``, ...: what it counts)."""
    for st in strats:
        if isinstance(st, WindowkitStrategy) and st.name == "windowkit":
            return {k: v for k, v in vars(st.win.stats).items() if isinstance(v, (int, float))}
    return {}


def run(specs: list[str], profiles=PROFILES) -> list[dict]:
    rows = []
    for spec in specs:
        trace = load_trace_arg(str(ROOT / spec) if spec.endswith(".jsonl") else spec)
        for prof in profiles:
            t0 = time.perf_counter()
            strats = make_strategies(STRATEGY_NAMES)
            res = simulate(trace, prof, strats, progress=False)
            s = res.summary()
            tot = s["strategies"]
            wk = tot["windowkit"]["total_ms"]
            row = {"trace": spec, "name": s["trace"], "profile": prof, "steps": s["steps"],
                   "strategies": {n: {"total_ms": t["total_ms"], "prefill_tokens": t["prefill_tokens"],
                                      "idle_ms": t["idle_ms"], "idle_tokens": t["idle_tokens"]}
                                  for n, t in tot.items()},
                   "ratios": {k: s["ratios"][k] for k in ("windowkit/radix", "windowkit/floor", "floor/radix")},
                   "target": s["target"], "target_ms": s["target_ms"], "meets_target": s["meets_target"],
                   # windowkit's distance to the target: its time over the target's limit, minus one (> 0: fails)
                   "windowkit_over_target": wk / s["target_ms"] - 1 if s["target_ms"] > 0 else None,
                   # where windowkit's prefill above the floor goes: the Window's own counters after the run
                   "windowkit_window_stats": _window_stats(strats),
                   "slide_guess": _guess_counters(strats),
                   "windowkit_prefill_above_floor": tot["windowkit"]["prefill_tokens"] - tot["floor"]["prefill_tokens"],
                   "wall_s": time.perf_counter() - t0, "wall_s_per_strategy": s["wall_s"]}
            rows.append(row)
            r = row["ratios"]
            ahead = tot["windowkit-ahead"]["total_ms"] / tot["radix"]["total_ms"] if tot["radix"]["total_ms"] else 0.0
            slide = tot["windowkit-slide"]["total_ms"] / tot["radix"]["total_ms"] if tot["radix"]["total_ms"] else 0.0
            print(f"{spec:26s} {prof:12s} {row['steps']:5d} steps  wk/radix {r['windowkit/radix']:.3f}  wk/floor "
                  f"{r['windowkit/floor']:.3f}  floor/radix {r['floor/radix']:.3f}  target {row['target']}: windowkit "
                  f"{'meets' if row['meets_target']['windowkit'] else 'fails'} ({row['windowkit_over_target']:+.1%}), "
                  f"ahead {ahead:.3f}x radix {'meets' if row['meets_target']['windowkit-ahead'] else 'fails'}, "
                  f"slide {slide:.3f}x {'meets' if row['meets_target']['windowkit-slide'] else 'fails'}  "
                  f"[{row['wall_s']:.1f} s]", flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    names = list(DEFAULT_STRATEGIES)
    head = (["trace", "profile", "steps"] + [f"{n} s / tokens" for n in names]
            + ["windowkit/radix", "windowkit/floor", "floor/radix", "target", "windowkit meets", "windowkit vs target",
               "meeting it", "windowkit tokens above floor (repaired)",
               "windowkit-ahead: step s / tokens (+ between steps)", "ahead/radix", "ahead meets",
               "windowkit-slide: step s / tokens (+ between steps, of them wasted)", "slide/radix", "slide meets"])
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        st = r["strategies"]
        cells = [r["trace"], r["profile"], str(r["steps"])]
        cells += [f"{st[n]['total_ms'] / 1e3:,.1f} / {st[n]['prefill_tokens']:,}" for n in names]
        q = r["ratios"]
        over = r["windowkit_over_target"]
        cells += [f"{q['windowkit/radix']:.3f}", f"{q['windowkit/floor']:.3f}", f"{q['floor/radix']:.3f}", r["target"],
                  "yes" if r["meets_target"]["windowkit"] else "**no**", "-" if over is None else f"{over:+.1%}",
                  ", ".join(n for n in names if r["meets_target"][n]) or "none"]
        rep = r["windowkit_window_stats"].get("repaired_tokens")
        cells.append(f"{r['windowkit_prefill_above_floor']:,}" + ("" if rep is None else f" ({rep:,})"))
        a, rad = st["windowkit-ahead"], st["radix"]["total_ms"]
        cells += [f"{a['total_ms'] / 1e3:,.1f} / {a['prefill_tokens']:,} (+ {a['idle_ms'] / 1e3:,.1f} / "
                  f"{a['idle_tokens']:,})", f"{a['total_ms'] / rad:.3f}" if rad else "-",
                  "yes" if r["meets_target"]["windowkit-ahead"] else "**no**"]
        g, w = st["windowkit-slide"], r.get("slide_guess", {}).get("wasted", 0)
        cells += [f"{g['total_ms'] / 1e3:,.1f} / {g['prefill_tokens']:,} (+ {g['idle_ms'] / 1e3:,.1f} / "
                  f"{g['idle_tokens']:,}, {w:,})", f"{g['total_ms'] / rad:.3f}" if rad else "-",
                  "yes" if r["meets_target"]["windowkit-slide"] else "**no**"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="VideoTree's first 30 questions instead of all 500")
    ap.add_argument("--videotree", type=int, default=None, metavar="N", help="VideoTree's first N questions")
    ap.add_argument("--json", default=str(ROOT / "bench/results/floor.json"))
    ap.add_argument("--md", default=str(ROOT / "bench/results/floor.md"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    vt = args.videotree if args.videotree is not None else (30 if args.quick else None)
    t0 = time.perf_counter()
    out = {"provenance": provenance(), "strategies": list(DEFAULT_STRATEGIES), "profiles": list(PROFILES),
           "videotree_questions": vt or "all"}
    out["rows"] = run(trace_specs(vt))
    out["wall_s"] = time.perf_counter() - t0
    md = markdown(out["rows"])
    for path, text in ((args.json, json.dumps(out, indent=1) + "\n"), (args.md, md + "\n")):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text, encoding="utf-8")
    print()
    print(md)
    print(f"\nwrote {args.json} and {args.md} ({out['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
