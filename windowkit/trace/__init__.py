"""windowkit.trace: agent access traces, cost profiles, a cost-model backend and the simulator.

    from windowkit.trace import load_videotree, sliding_window, simulate
    res = simulate(sliding_window(steps=100, k=3), "h100-kamera")
    print(res.table()); res.summary()["ratios"]

The Window itself is imported only when a windowkit strategy runs.
"""
from windowkit.trace.costs import CostProfile, available_profiles, load_profile
from windowkit.trace.generators import GENERATORS, append_zoom, grow_interleave, random_lookback, sliding_window
from windowkit.trace.backend import CostLedger, CostModelBackend
from windowkit.trace.io import iter_steps, read_trace, write_trace
from windowkit.trace.record import TraceRecorder
from windowkit.trace.schema import ChunkRef, Step, Trace
# the simulator, by concept in strategies / floor / orders / result / run / placement / cli; its names through
# the ``simulate`` module, which this import also loads first: ``windowkit.trace.simulate`` stays the function
from windowkit.trace.simulate import STRATEGIES, SimResult, StepCost, resolve_orders, simulate
from windowkit.trace.videotree import load_videotree


__all__ = ["ChunkRef", "Step", "Trace", "iter_steps", "read_trace", "write_trace", "TraceRecorder", "load_videotree",
           "sliding_window", "grow_interleave", "append_zoom", "random_lookback", "GENERATORS", "CostProfile",
           "load_profile", "available_profiles", "CostModelBackend", "CostLedger", "simulate", "SimResult",
           "StepCost", "STRATEGIES", "resolve_orders"]
