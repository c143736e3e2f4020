"""``windowkit simulate``: the command line of the simulator (``windowkit/cli.py`` dispatches here).

    windowkit simulate sliding-3 --profile cpu-tiny --json out.json
    windowkit simulate videotree:50 --out report/          # report/report.html, summary.json, *.png
    windowkit simulate grow-interleave-set --policy greedy --policy belady --store-budget 200000
    windowkit simulate run.jsonl --strategy radix --strategy windowkit --repair sink:5    # another repair rule

The names it accepts come from the registries: strategies from ``windowkit.trace.run.STRATEGIES``, generated
traces from ``windowkit.trace.generators.GENERATORS``, placement and refresh policies from
``windowkit.registry.names``, store eviction policies from ``windowkit.store.eviction.eviction_names`` (plus the
simulator's aliases, ``windowkit.trace.strategies.STORE_POLICY_ALIASES``).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional, Sequence

from windowkit.errors import WindowkitError
from windowkit.registry import names
from windowkit.store.eviction import eviction_names
from windowkit.trace.generators import GENERATORS
from windowkit.trace.io import read_trace
from windowkit.trace.report import write_report
from windowkit.trace.run import DEFAULT_STRATEGIES, STRATEGIES, simulate
from windowkit.trace.schema import Trace
from windowkit.trace.strategies import STORE_POLICY_ALIASES
from windowkit.trace.videotree import load_videotree


def store_policy_names() -> list[str]:
    """The eviction policies a bounded windowkit store takes by name: the registry's, then the aliases of those."""
    known = eviction_names()
    return known + [a for a, target in STORE_POLICY_ALIASES.items() if target in known and a not in known]


def load_trace_arg(spec: str) -> Trace:
    """A trace from a CLI argument: a JSONL path, ``videotree[:N]`` (first N questions), ``videotree-set[:N]`` (the
    same, unordered: placement policies may choose) or a generator name (``GENERATORS``: ``sliding-3``,
    ``grow-interleave``, ``append-zoom``, ``random-lookback``, ``grow-interleave-set``, ...)."""
    if spec.startswith("videotree"):
        name, _, n = spec.partition(":")
        return load_videotree(max_questions=int(n) if n else None, ordered=name != "videotree-set")
    if spec in GENERATORS:
        return GENERATORS[spec]()
    return read_trace(spec)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``windowkit simulate``."""
    placements, stores, refreshes = names("placement"), store_policy_names(), names("refresh")
    parser.add_argument("trace", help="JSONL trace path, videotree[:N], videotree-set[:N], or a generator: "
                                      + ", ".join(GENERATORS))
    parser.add_argument("--profile", default="h100-kamera", help="cost profile name or JSON path (default h100-kamera)")
    parser.add_argument("--strategy", action="append", choices=list(STRATEGIES),
                        help=f"strategy to run (repeatable; default: {' '.join(DEFAULT_STRATEGIES)})")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the summary JSON here")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="write a report here: summary.json, PNG plots and a self-contained report.html")
    parser.add_argument("--policy", action="append", default=[], metavar="NAME",
                        help=f"any policy by name (repeatable), routed to its family: placement ({' '.join(placements)}), "
                             f"store eviction ({' '.join(stores)}), refresh ({' '.join(refreshes)}; NAME:ARG passes "
                             "an argument, e.g. threshold:0.3, budget:2)")
    parser.add_argument("--placement", default=None, choices=placements,
                        help="order of ordered:false steps (default: listed, or the previous order if the set is unchanged)")
    parser.add_argument("--store-budget", type=int, default=None,
                        help="bound windowkit's store to this many bytes (default: unbounded)")
    parser.add_argument("--store-policy", default=None, choices=stores,
                        help="eviction policy of the bounded store (belady: offline OPT from the trace)")
    parser.add_argument("--refresh", default=None,
                        help=f"patch refresh policy: {' | '.join(refreshes)} (NAME:ARG passes an argument, e.g. "
                             "threshold:0.3, budget:2)")
    parser.add_argument("--repair", default=None, metavar="SPEC",
                        help="survivor repair rule of the windowkit strategies that keep the default rule "
                             "(Window(repair=SPEC): none, sink:N, head, head:N, all, joined by '+', e.g. sink:5): "
                             "another point of the cost/fidelity front (docs/window.md has each one's measured "
                             "fidelity on real weights)")
    parser.add_argument("--no-progress", action="store_true")


def _route_policy(args: argparse.Namespace, name: str) -> None:
    """``--policy NAME``: set the placement, store policy or refresh policy it names (one of each at most)."""
    placements, stores, refreshes = names("placement"), store_policy_names(), names("refresh")
    fam = ("placement" if name in placements else "store_policy" if name in stores
           else "refresh" if name.split(":")[0] in refreshes else None)
    if fam is None:
        raise WindowkitError(f"--policy {name!r}: not a placement ({', '.join(placements)}), store policy "
                             f"({', '.join(stores)}) or refresh policy ({', '.join(refreshes)}; NAME:ARG passes an "
                             "argument)")
    if getattr(args, fam) not in (None, name):
        raise WindowkitError(f"--policy {name!r}: the {fam.replace('_', ' ')} is already {getattr(args, fam)!r}")
    setattr(args, fam, name)


def run_cli(args: argparse.Namespace) -> int:
    """``windowkit simulate``: print the totals table and ratios; optionally write the summary JSON (``--json``)
    and a report directory (``--out``: summary.json, plots, report.html; see ``windowkit.trace.report``)."""
    for name in args.policy:
        _route_policy(args, name)
    trace = load_trace_arg(args.trace)
    res = simulate(trace, args.profile, args.strategy, max_steps=args.max_steps,
                   progress=False if args.no_progress else None, placement=args.placement,
                   store_budget_bytes=args.store_budget, store_policy=args.store_policy, refresh=args.refresh,
                   repair=args.repair)
    s = res.summary()
    rules = {k[:-len("_repair")]: v for k, v in res.meta.items() if k.endswith("_repair")}
    print(f"{s['trace']}: {s['steps']} steps, profile {s['profile']}"
          + (f"; survivor repair: {', '.join(f'{k} {v}' for k, v in rules.items())}" if rules else ""))
    print(res.table())
    for k, v in s["ratios"].items():
        print(f"{k}: {v:.3f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(s, indent=2) + "\n", encoding="utf-8")
    if args.out:
        print(f"writing the report to {args.out} ...", flush=True)
        paths = write_report(res, args.out, trace=trace)
        print(f"report: {paths['html']}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point for ``windowkit simulate ...`` (``windowkit/cli.py`` dispatches ``main(rest)``).

        main(["sliding-3", "--profile", "cpu-tiny", "--json", "out.json"])
        main(["videotree:50", "--out", "report/"])     # report/report.html, summary.json, *.png
    """
    p = argparse.ArgumentParser(prog="windowkit simulate",
                                description="replay an access trace through reuse strategies under a cost profile")
    add_arguments(p)
    return run_cli(p.parse_args(None if argv is None else list(argv)))


__all__ = ["main", "add_arguments", "run_cli", "load_trace_arg", "store_policy_names"]
