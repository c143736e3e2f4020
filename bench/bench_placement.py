"""How much do placement policies add over arrival order? Unordered traces through radix, blind and windowkit.

Runs every placement (``policies.placement.PLACEMENTS``: listed, arrival, greedy, orbit, optimal) on the
unordered traces (``ordered: false`` steps): the generated set variants and an unordered VideoTree, under one
cost profile. Strategies: radix and blind for reference, windowkit (the Window's default keep-as-is), and
windowkit-refresh (``refresh="always"``: every survivor whose antecedents changed is re-conditioned, so
binding is kept, which is what the placement cost model assumes). Writes bench/results/placement.json and
prints markdown tables (modeled total ms; gain = (arrival - x) / arrival, positive is cheaper).

Two smaller tables ride along: the store eviction policies (lru, size = GDS, belady) on a bounded windowkit store
(random-lookback-set, arrival order), and the patch-refresh policies on grow-interleave-set in listed order
(where survivors' antecedents change every step).

    PYTHONPATH=. .venv/bin/python bench/bench_placement.py            # ~1.5 min CPU (2-3 min wall, shared box)
    PYTHONPATH=. .venv/bin/python bench/bench_placement.py --quick    # smaller traces, ~30 s
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from windowkit.trace.generators import GENERATORS
from windowkit.trace.simulate import WindowkitStrategy, compare_placements, simulate
from windowkit.trace.videotree import load_videotree

OUT = Path(__file__).parent / "results" / "placement.json"
STRATS = ["radix", "blind", "windowkit", "windowkit-refresh"]


def strategies():
    return ["radix", "blind", "windowkit", WindowkitStrategy(refresh="always", name="windowkit-refresh")]


def traces(quick: bool, videotree: int):
    g = GENERATORS
    yield g["grow-interleave-set-small"](episodes=20 if quick else 50)
    yield g["grow-interleave-set"](episodes=20 if quick else 50)
    yield g["random-lookback-set"](steps=50 if quick else 100)
    yield load_videotree(max_questions=10 if quick else videotree, ordered=False)


def table(results: list[dict]) -> str:
    cols = []
    for s in STRATS:
        cols += [s, "gain"]
    lines = ["| trace | steps | placement | " + " | ".join(cols) + " | wk binding_risk | model_ms | optimal search |",
             "|---" * (len(cols) + 6) + "|"]
    for r in results:
        pl = r["placements"]
        base = pl["arrival"]["strategies"]
        for name, row in pl.items():
            cells = []
            for s in STRATS:
                t, b = row["strategies"][s]["total_ms"], base[s]["total_ms"]
                cells += [f"{t / 1000:.1f} s", f"{(b - t) / b:+.1%}" if b else "-"]
            c = row["counters"]
            search = (f"exact {c['exact_components']}, budget {c['budget_components']}, fallback steps "
                      f"{c['fallback_steps']}" if name == "optimal" else "")
            same = f" (= {row['same_orders_as']})" if row.get("same_orders_as") else ""
            lines.append(f"| {r['trace']} | {r['steps']} | {name}{same} | " + " | ".join(cells)
                         + f" | {row['strategies']['windowkit']['binding_risk']} | {row['model_ms'] / 1000:.1f} s"
                           f" | {search} |")
    return "\n".join(lines)


BUDGETS = [None, 300_000, 100_000, 50_000]  # fake store bytes (16 per KV token); None: unbounded
REFRESH = ["never", "threshold:0.5", "threshold:0.2", "budget:2", "always"]


def store_rows(profile: str, quick: bool) -> list[dict]:
    trace = GENERATORS["random-lookback-set"](steps=50 if quick else 100)
    rows = []
    for b in BUDGETS:
        for pol in (["lru"] if b is None else ["lru", "size", "belady"]):
            res = simulate(trace, profile, ["windowkit"], placement="arrival", store_budget_bytes=b,
                           store_policy=pol, progress=False)
            t = res.totals("windowkit")
            st = res.meta.get("windowkit_store", {})
            rows.append({"trace": trace.name, "steps": len(trace), "budget_bytes": b, "policy": pol,
                         "total_ms": t["total_ms"], "encodes": t["encodes"], "patch_forms": t["patch_forms"],
                         "evictions": st.get("evictions", 0), "rejected": st.get("rejected", 0)})
    return rows


def store_table(rows: list[dict]) -> str:
    lines = ["| budget | policy | total_ms | encodes | patch_forms | evictions | rejected puts |", "|---" * 7 + "|"]
    for r in rows:
        b = "unbounded" if r["budget_bytes"] is None else f"{r['budget_bytes'] / 1000:.0f} kB"
        lines.append(f"| {b} | {r['policy']} | {r['total_ms'] / 1000:.1f} s | {r['encodes']} | {r['patch_forms']} | "
                     f"{r['evictions']} | {r['rejected']} |")
    return "\n".join(lines)


def refresh_rows(profile: str, quick: bool) -> list[dict]:
    trace = GENERATORS["grow-interleave-set"](episodes=10 if quick else 20)
    rows = []
    for ref in REFRESH:
        res = simulate(trace, profile, ["windowkit"], placement="listed", refresh=ref, progress=False)
        t = res.totals("windowkit")
        rows.append({"trace": trace.name, "steps": len(trace), "refresh": ref, "total_ms": t["total_ms"],
                     "prefill_tokens": t["prefill_tokens"], "binding_risk": t["binding_risk"],
                     "refreshed": res.meta["windowkit_refresh"]["refreshed"]})
    return rows


def refresh_table(rows: list[dict]) -> str:
    lines = ["| refresh | total_ms | prefill_tokens | refreshed | binding_risk |", "|---" * 5 + "|"]
    for r in rows:
        lines.append(f"| {r['refresh']} | {r['total_ms'] / 1000:.1f} s | {r['prefill_tokens']} | {r['refreshed']} | "
                     f"{r['binding_risk']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--profile", default="h100-kamera")
    ap.add_argument("--videotree", type=int, default=30, help="VideoTree questions (default 30)")
    ap.add_argument("--json", default=str(OUT))
    args = ap.parse_args()
    torch.set_num_threads(1)
    results, t0 = [], time.perf_counter()
    for tr in traces(args.quick, args.videotree):
        t1 = time.perf_counter()
        r = compare_placements(tr, profile=args.profile, strategies=strategies())
        r["wall_s"] = round(time.perf_counter() - t1, 2)
        results.append(r)
        print(f"{r['trace']}: {r['steps']} steps, {r['wall_s']} s", flush=True)
    store = store_rows(args.profile, args.quick)
    refresh = refresh_rows(args.profile, args.quick)
    out = {"bench": "placement", "profile": args.profile, "quick": args.quick, "strategies": STRATS,
           "wall_s": round(time.perf_counter() - t0, 1), "results": results, "store": store, "refresh": refresh}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(f"\nprofile {args.profile}; total_ms per strategy, gain over arrival ((arrival - x) / arrival)\n")
    print(table(results))
    print("\nstore eviction policies: windowkit, random-lookback-set, arrival order\n")
    print(store_table(store))
    print("\npatch refresh policies: windowkit, grow-interleave-set, listed order\n")
    print(refresh_table(refresh))


if __name__ == "__main__":
    main()
