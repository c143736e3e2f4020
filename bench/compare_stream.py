"""Paired comparison of stream-task runs of ``windowkit bench real`` that share a seed and k: the same logs and
questions in the same order, so rows line up step by step; every strategy is scored on the first n steps that
all the given files hold (a run cut short still counts for the steps it finished).

    PYTHONPATH=. .venv/bin/python bench/compare_stream.py --out bench/results/real_stream_k8_paired.md \
        bench/results/real_stream_k8.json bench/results/real_stream_k8_query_partial.json \
        bench/results/real_stream_k8_focus.json

Columns: mean first-token KL vs exact, greedy answer = exact, the same where exact is right, accuracy minus
exact's (points; right answers lost / gained), prefill tokens on the critical path / the prefix cache's.
A strategy name found in several files is taken from the first (``--label`` tags each file's rows instead).
The accuracy column carries the paired 95% interval of the difference (``windowkit.kv.metrics.paired_delta``).

``--pool``: the files are runs of other seeds (other logs): every step of every file is pooled per strategy
(a strategy counts only where all files hold it), e.g. the default at k = 8 over seeds 2, 3 and 4:

    PYTHONPATH=. .venv/bin/python bench/compare_stream.py --pool --out bench/results/real_stream_k8_pooled.md \
        bench/results/real_stream_k8_default2.json bench/results/real_stream_k8_s3.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from windowkit.benchmarks.real import summarize  # noqa: E402


def stream_rows(path: str, alias: dict[str, str] | None = None) -> list[dict]:
    """The stream steps of one result file, each {strategy: row}; ``alias`` renames strategies (old -> new)."""
    raw = json.loads(Path(path).read_text())["raw"]["stream"]
    out: list[dict] = []
    for x in (raw if isinstance(raw, list) else raw.values()):
        out += x if isinstance(x, list) else [x]
    if alias:
        out = [{alias.get(k, k): v for k, v in r.items()} for r in out]
    return out


def score(rows: list[dict], s: str) -> dict:
    """Strategy ``s`` over ``rows`` ({strategy: row} per step), from ``bench real``'s own ``summarize``."""
    r = summarize([x[s] for x in rows])
    return {"n": r["n"], "kl": r["kl_mean"], "agree": r["agree"],
            "agree_where_exact_right": r["agree_where_exact_right"] or 0.0,
            "accuracy_minus_exact_points": 100 * r["accuracy_minus_exact"],
            "accuracy_minus_exact_ci95_points": [100 * x for x in r["accuracy_minus_exact_ci95"]],
            "exact_accuracy": r["exact_accuracy"],
            "lost": r["lost"], "gained": r["gained"],
            "cost_vs_prefix_cache": r["cost_share_vs_prefix_cache"]}


def _answers(rows: list[dict], s: str) -> list[tuple]:
    return [(r[s]["text"], r[s]["tokens"], round(r[s]["kl"], 9)) for r in rows]


def compare(files: list[str], labels: list[str]) -> tuple[int, dict[str, dict]]:
    data = [stream_rows(f) for f in files]
    n = min(len(d) for d in data)
    out: dict[str, dict] = {}
    for f, (rows, label) in enumerate(zip(data, labels)):
        for s in rows[0]:
            if s in ("exact", "prefix-cache"):
                continue
            # a strategy an earlier file already holds with the same answers and costs is a re-run: shown once
            if any(s in d[0] and _answers(d[:n], s) == _answers(rows[:n], s) for d in data[:f]):
                continue
            name = f"{s} ({label})" if label else s
            if name not in out:
                out[name] = score(rows[:n], s)
    return n, out


def pool(files: list[str], alias: dict[str, str] | None = None) -> tuple[int, dict[str, dict]]:
    """Every step of every file (runs of other seeds), pooled per strategy held by all files."""
    data = [stream_rows(f, alias) for f in files]
    names = [s for s in data[0][0] if s not in ("exact", "prefix-cache") and all(s in d[0] for d in data)]
    rows = [r for d in data for r in d]
    return len(rows), {s: score(rows, s) for s in names}


def markdown(n: int, res: dict[str, dict], pooled: bool = False) -> str:
    what = f"Pooled: {n} steps of runs of other seeds." if pooled else f"Paired on the first {n} steps of every file."
    lines = [what, "",
             "| strategy | mean KL | answer = exact | = exact where exact right | exact's accuracy | accuracy - exact, "
             "points [95% CI] (lost / gained) | tokens vs prefix cache |", "|---|---:|---:|---:|---:|---|---:|"]
    for s, r in sorted(res.items(), key=lambda kv: kv[1]["cost_vs_prefix_cache"]):
        lo, hi = r["accuracy_minus_exact_ci95_points"]
        lines.append(f"| {s} | {r['kl']:.4f} | {r['agree']:.3f} | {r['agree_where_exact_right']:.3f} | "
                     f"{r['exact_accuracy']:.3f} | {r['accuracy_minus_exact_points']:+.1f} [{lo:+.1f}, {hi:+.1f}] "
                     f"({r['lost']} / {r['gained']}) | "
                     f"{r['cost_vs_prefix_cache']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="bench real --tasks stream JSON files (same seed and k)")
    ap.add_argument("--label", action="append", default=None, help="a tag per file for its strategies' names")
    ap.add_argument("--out", default=None, help="write the markdown table here (and the numbers as .json)")
    ap.add_argument("--pool", action="store_true", help="the files are runs of other seeds: pool all their steps")
    ap.add_argument("--alias", action="append", default=[], metavar="OLD=NEW",
                    help="read strategy OLD as NEW (e.g. default=repair-head:128+query:96, to pool a run that "
                         "named the default by its rule)")
    a = ap.parse_intermixed_args()
    labels = a.label or [""] * len(a.files)
    if len(labels) != len(a.files):
        ap.error("give one --label per file, or none")
    if any("=" not in x for x in a.alias):
        ap.error("--alias takes OLD=NEW")
    alias = dict(x.split("=", 1) for x in a.alias)
    n, res = pool(a.files, alias) if a.pool else compare(a.files, labels)
    md = markdown(n, res, a.pool)
    print(md)
    if a.out:
        Path(a.out).write_text(md)
        Path(a.out).with_suffix(".json").write_text(json.dumps({"steps": n, "files": a.files, "strategies": res},
                                                               indent=1))


if __name__ == "__main__":
    main()
