"""What each survivor repair rule costs on the traces where the default misses the planner's target.

The default rule's cost over the floor on the recorded agent traces (small chunks, 3-5 entries) is its repair:
``head:128`` recomputes a whole first survivor per slide, as large as what the step prefills. This runs the same
Window with other rules of the measured cost/fidelity front (``simulate(repair=...)``, ``windowkit simulate
--repair``) on those traces and on the generated sliding windows, under both built-in profiles, and marks which
meet the target in force (0.6x radix, or 1.15x the floor where the floor is above 0.6x radix). What each rule
keeps of the answers is measured on real weights, not here (docs/window.md, docs/real-weights.md): the table's
note repeats those numbers so cost and fidelity sit side by side.

    PYTHONPATH=. .venv/bin/python bench/bench_front.py          # ~1 min, 1 thread

Writes ``bench/results/front.json`` and ``bench/results/front.md``.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench._meta import short_commit, utc_stamp
from windowkit.trace.simulate import load_trace_arg, simulate

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ("h100-kamera", "cpu-tiny")
# None: the Window's default rule (fidelity="balanced"); then cheaper points of the front, and the exact end
RULES = (None, "head:64", "head:32", "sink:5", "none", "all")
# measured on SmolLM2-135M, the sliding stream at k = 8 (tasks version 1, seed 2, N = 200; docs/real-weights.md):
# answer = exact, mean KL. The default there also spends its query:96 focus (not simulated: docs/simulation.md).
REAL_WEIGHTS = {"default": "0.900 / 0.0027", "sink:5": "0.820 / 0.0113", "none": "0.835 / 0.0118",
                "all": "1.000 / 0"}


def traces() -> list[str]:
    recorded = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "bench/traces/recorded").glob("*.jsonl"))
    return ["sliding-3", "sliding-3-clipped"] + recorded


def run(specs: list[str]) -> list[dict]:
    rows = []
    for spec in specs:
        trace = load_trace_arg(str(ROOT / spec) if spec.endswith(".jsonl") else spec)
        for prof in PROFILES:
            row = {"trace": spec, "profile": prof, "rules": {}}
            for rule in RULES:
                res = simulate(trace, prof, ["radix", "windowkit", "floor"], progress=False, repair=rule)
                s = res.summary()
                tot = s["strategies"]
                name = rule or "default"
                row["rules"][name] = {"rule": res.meta["windowkit_repair"],
                                      "windowkit/radix": s["ratios"]["windowkit/radix"],
                                      "windowkit/floor": s["ratios"]["windowkit/floor"],
                                      "prefill_tokens": tot["windowkit"]["prefill_tokens"],
                                      "meets": bool(s["meets_target"]["windowkit"])}
                row["target"], row["floor/radix"] = s["target"], s["ratios"]["floor/radix"]
            rows.append(row)
            print(f"{spec:48s} {prof:12s} " + "  ".join(f"{k} {v['windowkit/radix']:.3f}{'*' if v['meets'] else ''}"
                                                      for k, v in row["rules"].items()), flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    names = [r or "default" for r in RULES]
    head = ["trace", "profile", "floor/radix", "target"] + [f"`{n}`" for n in names]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---:|---|" + "---:|" * len(names)]
    for r in rows:
        cells = [r["trace"].split("/")[-1], r["profile"], f"{r['floor/radix']:.3f}", r["target"]]
        for n in names:
            v = r["rules"][n]
            x = f"{v['windowkit/radix']:.3f}"
            cells.append(f"**{x}**" if v["meets"] else x)
        lines.append("| " + " | ".join(cells) + " |")
    ran = sorted({r["rules"]["default"]["rule"] for r in rows})  # by position on the visual traces (a VLM's Window)
    default_rule = "` / `".join(ran) if ran else "?"
    meets = {n: sum(r["rules"][n]["meets"] for r in rows) for n in names}
    counts = ", ".join(f"`{n}` {k}/{len(rows)}" for n, k in meets.items())
    lines += ["", f"windowkit / radix (modeled time) per repair rule; **bold**: meets the target in force. `default` "
                  f"runs `{default_rule}` (the query part by position on traces with visual chunks: a VLM reads no "
                  f"query attention; text: its focus is not modeled). Rows meeting it: {counts}.",
              "", "The same rules on real weights (SmolLM2-135M, sliding stream k = 8, tasks version 1, N = 200; "
                  "answer = exact / mean KL): " + ", ".join(f"`{k}` {v}" for k, v in REAL_WEIGHTS.items())
              + " (docs/real-weights.md)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=str(ROOT / "bench/results/front.json"))
    ap.add_argument("--md", default=str(ROOT / "bench/results/front.md"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    rows = run(traces())
    md = (f"Repair rules on the traces where the default misses (commit {short_commit()}, {utc_stamp()}, "
          f"{time.time() - t0:.0f} s)\n\n" + markdown(rows))
    Path(a.json).write_text(json.dumps({"commit": short_commit(), "rules": [r or "default" for r in RULES],
                                        "rows": rows}, indent=1))
    Path(a.md).write_text(md)
    print("\n" + md)


if __name__ == "__main__":
    main()
