"""The simulator's names in one place, for callers of ``windowkit.trace.simulate`` (tests, benchmarks, examples).

The simulator lives in modules by concept, each importing only those below it (no module of ``windowkit.trace``
imports this one):

  strategies  ``StepCost``, the ``Strategy`` contract and the reuse strategies: recompute, radix, blind, blend,
              windowkit (``WindowkitStrategy``, a real Window on the CostModelBackend)
  floor       ``FloorStrategy`` (the lower bound) and the planner's target (``target_for``, ``meets``)
  orders      the order each step is replayed in: ``resolve_orders``, ``resolve_placement``
  result      ``SimResult``: per-step costs, totals, ratios, the target, the markdown table
  run         ``simulate`` (the run loop) and the strategies by name: ``STRATEGIES``, ``DEFAULT_STRATEGIES``,
              ``make_strategies``
  placement   ``compare_placements``, ``placement_table``: one run per placement policy
  cli         ``windowkit simulate``: ``main``, ``add_arguments``, ``run_cli``, ``load_trace_arg``

    from windowkit.trace.simulate import simulate, compare_placements, placement_table
    res = simulate(sliding_window(steps=50), "h100-kamera")
    res.summary()["ratios"]            # {"windowkit/radix": ..., "windowkit/recompute": ...}
"""
from __future__ import annotations

from windowkit.trace.cli import add_arguments, load_trace_arg, main, run_cli
from windowkit.trace.orders import resolve_orders, resolve_placement
from windowkit.trace.placement import compare_placements, placement_table
from windowkit.trace.result import SimResult
from windowkit.trace.run import DEFAULT_STRATEGIES, STRATEGIES, make_strategies, simulate
from windowkit.trace.strategies import (BlindReuse, FullRecompute, RadixCache, StepCost, Strategy, TokenBlend,
                                        WindowkitStrategy)

__all__ = ["main", "StepCost", "Strategy", "FullRecompute", "RadixCache", "BlindReuse", "TokenBlend", "WindowkitStrategy",
           "STRATEGIES", "DEFAULT_STRATEGIES", "make_strategies", "resolve_orders", "SimResult", "simulate",
           "load_trace_arg", "add_arguments", "run_cli", "resolve_placement", "compare_placements", "placement_table"]
