"""Where the default's answers differ from exact re-prefill: the decode margins of both, step by step.

    PYTHONPATH=. .venv/bin/python bench/stream_margins.py --k 8 --seed 2 --n 104     # ~7 min, one thread

Runs ``windowkit bench real``'s stream task (the same logs, plans and questions as the N = 200 runs of
docs/real-weights.md for the same seed and k) with exact re-prefill, the prefix cache and one Window strategy,
and records at every decoded token the margin between the top two next-token log-probabilities (nats), for the
exact reference (``greedy_answer``) and for the Window (``Window.generate``). Both decode functions are run as
their own source with one recording statement added after the greedy choice (nothing else changes). Writes
``--json`` (per step: the bench row, and (token, margin) per decoded token of each) and ``--md`` (how the steps
whose answer differs from exact's sit against exact's own margin at the answer's first digit).
"""
from __future__ import annotations

import argparse
import inspect
import json
import sys
import textwrap
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import windowkit.benchmarks.real as R  # noqa: E402
import windowkit.window.window as W  # noqa: E402

WINDOW_MARGINS: list[list] = []
EXACT_MARGINS: list[list] = []


def margin(logits: torch.Tensor) -> float:
    top = torch.log_softmax(logits.float().reshape(-1), -1).topk(2).values
    return float(top[0] - top[1])


def _recording(fn, module, sink_name: str, choice: str):
    """``fn`` compiled from its own source with the (token, margin) of each greedy choice appended to a list."""
    src = textwrap.dedent(inspect.getsource(fn))
    var = choice.split("int(")[1].split(".argmax")[0]  # the logits expression of the choice
    for old, new in ((choice, f"{choice}; _m.append((tok, margin({var})))"),
                     ("out: list[int] = []", f"out: list[int] = []; _m = []; {sink_name}.append(_m)")):
        if src.count(old) != 1:
            raise RuntimeError(f"{fn.__qualname__}: cannot find {old!r} once in its source (the probe needs updating)")
        src = src.replace(old, new)
    ns = dict(vars(module), margin=margin, WINDOW_MARGINS=WINDOW_MARGINS, EXACT_MARGINS=EXACT_MARGINS)
    exec(compile(src, inspect.getsourcefile(fn), "exec"), ns)
    return ns[fn.__name__]


def first_digit(dec: list) -> float:
    """The margin at the answer's first digit (the answers open with a space; the token after it)."""
    return dec[1][1] if len(dec) > 1 else dec[0][1]


def summary(data: dict, near_tie: float) -> list[str]:
    steps, meta = data["steps"], data["meta"]
    tie = [s for s in steps if first_digit(s["exact"]) < near_tie]
    sure = [s for s in steps if first_digit(s["exact"]) >= near_tie]
    differ = lambda xs: sum(1 for s in xs if not s["row"]["agree"])  # noqa: E731
    lost = sum(1 for s in steps if s["row"]["exact_correct"] and not s["row"]["correct"])
    gained = sum(1 for s in steps if s["row"]["correct"] and not s["row"]["exact_correct"])
    md = [f"Stream task, k = {meta['k']}, seed {meta['seed']}, {len(steps)} steps, `{data['strategy']}` against exact "
          "re-prefill (SmolLM2-135M-Instruct fp32, `bench/stream_margins.py`). Margin = top-1 minus top-2 next-token "
          "log-prob (nats) at the answer's first digit, in exact's own decode.", "",
          "| steps | n | answer differs from exact |", "|---|---:|---:|",
          f"| exact's first-digit margin < {near_tie} (near ties) | {len(tie)} | {differ(tie)} |",
          f"| exact's first-digit margin >= {near_tie} | {len(sure)} | {differ(sure)} |",
          f"| all | {len(steps)} | {differ(steps)} (right answers lost {lost}, gained {gained}) |", "",
          "Steps whose answer differs: exact's first-digit margin / the window's: " + ", ".join(
              f"{first_digit(s['exact']):.2f} / {first_digit(s['window']):.2f}" for s in steps if not s["row"]["agree"]),
          "", "A gate the window could apply itself (it knows only its own decode): escalate a step whose smallest "
          "margin over the answer's tokens after the first is under t.", "",
          "| t (nats) | steps flagged | differing steps among them | right answers lost among them |",
          "|---:|---:|---:|---:|"]
    for t in (0.25, 0.5, 1.0, 1.5):
        low = [s for s in steps if min(m for _, m in (s["window"][1:] or s["window"])) < t]
        md.append(f"| {t} | {len(low)} ({len(low) / len(steps):.0%}) | {differ(low)} of {differ(steps)} | "
                  f"{sum(1 for s in low if s['row']['exact_correct'] and not s['row']['correct'])} of {lost} |")
    return md


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--n", type=int, default=104, help="scored steps (8 per log)")
    ap.add_argument("--strategy", default="repair-head:128+sink:5+query:96")
    ap.add_argument("--near-tie", type=float, default=0.6, help="exact's first-digit margin under which a step is a near tie")
    ap.add_argument("--json", default=str(ROOT / "bench/results/stream_margins_k8.json"))
    ap.add_argument("--md", default=str(ROOT / "bench/results/stream_margins_k8.md"))
    ap.add_argument("--tasks-version", type=int, default=1, help="of the seeded tasks (1: the logs of the runs it studied)")
    ap.add_argument("--from-json", default=None, help="only summarize a JSON this script wrote")
    a = ap.parse_args()
    if a.from_json:
        data = json.loads(Path(a.from_json).read_text())
    else:
        W.Window.generate = _recording(W.Window.generate, W, "WINDOW_MARGINS", "tok = int(logits.argmax())")
        R.greedy_answer = _recording(R.greedy_answer, R, "EXACT_MARGINS", "tok = int(res.logits.argmax())")
        res = R.run(a.n, ["stream"], ["exact", "prefix-cache", a.strategy], ["slide"], a.seed, a.k, 4, 8, threads=1,
                    task_version=a.tasks_version)
        rows = res["raw"]["stream"]["slide+look-back"]
        if not (len(rows) == len(EXACT_MARGINS) == len(WINDOW_MARGINS)):
            raise RuntimeError(f"{len(rows)} steps but {len(EXACT_MARGINS)} / {len(WINDOW_MARGINS)} decodes recorded")
        steps = [dict(row=r[a.strategy], exact=e, window=w) for r, e, w in zip(rows, EXACT_MARGINS, WINDOW_MARGINS)]
        data = {"meta": res["meta"], "strategy": a.strategy, "steps": steps}
        Path(a.json).write_text(json.dumps(data, indent=1))
    md = summary(data, a.near_tie)
    Path(a.md).write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
