"""windowkit.trace: agent access traces, cost profiles, a cost-model backend and the simulator.

    from windowkit.trace import GENERATORS, load_videotree, simulate
    res = simulate(GENERATORS["sliding-3"](), "h100-kamera")     # or a recorded trace: read_trace("run.jsonl")
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


# the public names (docs/api.md); the others imported above stay importable from here and from their modules
__all__ = ["ChunkRef", "Step", "Trace", "read_trace", "write_trace", "TraceRecorder", "load_videotree", "GENERATORS",
           "load_profile", "CostModelBackend", "simulate", "SimResult", "STRATEGIES"]
