"""Plots for docs/benchmarks.md from the benchmark JSON in bench/results (no benchmark is re-run).

    PYTHONPATH=. .venv/bin/python scripts/plot_benchmarks.py        # writes docs/img/bench_*.png

  bench_kv.png        bench/results/kv_quick.json: re-prefill vs reuse time per window length (log), and the
                      bandwidth a reuse reaches against a plain copy (with the rank-32 GEMM's own ceiling)
  bench_simulate.png  bench/results/simulate.json: modeled total time per strategy relative to full recompute,
                      per trace, profile h100-kamera
  bench_placement.png bench/results/placement.json: windowkit (+ refresh) total time per placement policy
                      relative to arrival order, per unordered trace
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
IMG = ROOT / "docs" / "img"
COLORS = {"recompute": "#7f7f7f", "radix": "#1f77b4", "blind": "#ff7f0e", "blend": "#d62728",
          "windowkit": "#2ca02c", "windowkit-lazy": "#98df8a", "windowkit-eager": "#98df8a",
          "windowkit-refresh": "#17becf"}


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def plot_kv(out: Path) -> Path:
    d = json.loads((RESULTS / "kv_quick.json").read_text())
    rows = d["rows"]
    L = [r["L"] for r in rows]
    fig = Figure(figsize=(10, 3.8))
    a, b = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    a.plot(L, [r["prefill_ms"] for r in rows], "o-", color=COLORS["recompute"], label="re-prefill")
    a.plot(L, [r["reuse_ms"] for r in rows], "o-", color=COLORS["windowkit"], label="reuse: relocate + rank-32 patch")
    a.plot(L, [r["reuse_blind_ms"] for r in rows], "o--", color=COLORS["blind"], label="relocate only (blind)")
    a.set_yscale("log")
    a.set_xlabel("chunk length L (tokens)")
    a.set_ylabel("ms (median)")
    a.set_title("reuse vs re-prefill (CPU, 1 thread)")
    a.legend(fontsize=8)
    b.plot(L, [100 * r["apply_bw_fraction"] for r in rows], "o-", color=COLORS["windowkit"], label="reuse (place)")
    b.plot(L, [100 * r["blind_bw_fraction"] for r in rows], "o--", color=COLORS["blind"], label="relocate only")
    b.plot(L, [100 * r["bw_fraction_ceiling_gemm"] for r in rows], "k:", label="rank-32 GEMM alone")
    b.axhline(50, color="#d62728", lw=0.8, label="target 50%")
    b.set_ylim(0, 100)
    b.set_xlabel("chunk length L (tokens)")
    b.set_ylabel("% of a plain copy's bandwidth")
    b.set_title("apply bandwidth (CPU)")
    b.legend(fontsize=8)
    m = d['config'].get('model', {})
    fig.suptitle(f"bench_kv --quick: {m.get('architecture', '')}, {m.get('layout', '')}; one run", fontsize=8)
    return _save(fig, out)


def plot_simulate(out: Path, profile: str = "h100-kamera") -> Path:
    d = json.loads((RESULTS / "simulate.json").read_text())
    rows = [(k.split("|")[0], v) for k, v in d["table"].items() if k.endswith("|" + profile)]
    # the real Window and its bookkeeping model give equal numbers: one bar for the pair per trace
    fig = Figure(figsize=(10, 4))
    ax = fig.add_subplot(1, 1, 1)
    shown = ["radix", "blind", "blend", "windowkit", "windowkit-lazy"]
    width = 0.8 / len(shown)
    for j, s in enumerate(shown):
        ys = []
        for _, v in rows:
            st = v["strategies"]
            t = st.get(s)
            ys.append(t["total_ms"] / st["recompute"]["total_ms"] if t else float("nan"))
        ax.bar([i + (j - (len(shown) - 1) / 2) * width for i in range(len(rows))], ys, width,
               color=COLORS[s], label=s)
    ax.axhline(1.0, color=COLORS["recompute"], lw=1, ls="--", label="full recompute")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([n for n, _ in rows], fontsize=8)
    ax.set_ylabel("modeled total time / recompute")
    ax.set_title(f"trace simulator, profile {profile} (lower is better; windowkit = the real Window or its "
                 "step-for-step bookkeeping model)", fontsize=9)
    ax.legend(fontsize=8, ncol=3)
    return _save(fig, out)


def plot_placement(out: Path) -> Path:
    d = json.loads((RESULTS / "placement.json").read_text())
    fig = Figure(figsize=(10, 3.8))
    ax = fig.add_subplot(1, 1, 1)
    results = d["results"]
    names = ["listed", "arrival", "greedy", "orbit", "optimal"]
    width = 0.8 / len(names)
    palette = ["#7f7f7f", "#1f77b4", "#ff7f0e", "#9467bd", "#2ca02c"]
    for j, p in enumerate(names):
        ys = []
        for r in results:
            pl = r["placements"]
            strat = "windowkit-refresh" if "windowkit-refresh" in pl["arrival"]["strategies"] else "windowkit"
            base = pl["arrival"]["strategies"][strat]["total_ms"]
            ys.append(pl[p]["strategies"][strat]["total_ms"] / base if p in pl else float("nan"))
        ax.bar([i + (j - (len(names) - 1) / 2) * width for i in range(len(results))], ys, width,
               color=palette[j], label=p)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(results)))
    ax.set_xticklabels([r["trace"] for r in results], fontsize=8)
    ax.set_ylabel("windowkit (+ refresh) time / arrival")
    ax.set_title(f"placement policies on unordered traces, profile {d['profile']} (lower is better)", fontsize=9)
    ax.legend(fontsize=8, ncol=5)
    return _save(fig, out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(IMG), help="folder for the PNGs (default docs/img)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for fn, name in ((plot_kv, "bench_kv.png"), (plot_simulate, "bench_simulate.png"),
                     (plot_placement, "bench_placement.png")):
        print(f"wrote {fn(out / name)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
