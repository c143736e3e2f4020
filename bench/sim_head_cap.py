"""The default repair rule with its head capped (head:N) on every simulator trace, both profiles (modelled).

    PYTHONPATH=. .venv/bin/python bench/sim_head_cap.py     # ~3 min; prints one line per trace and profile

Each line: every strategy's time over radix and over the floor, the target in force and who meets it.
"""
from windowkit.trace.generators import GENERATORS
from windowkit.trace.simulate import WindowkitStrategy, load_trace_arg, make_strategies, simulate

RULES = ["head+sink:5+query:96"] + [f"head:{n}+sink:5+query:96" for n in (512, 384, 256, 192, 128)]

if __name__ == "__main__":
    for spec in list(GENERATORS) + ["videotree:60"]:
        trace = load_trace_arg(spec)
        for profile in ("h100-kamera", "cpu-tiny"):
            strategies = make_strategies(["radix", "floor"]) + [WindowkitStrategy(name=r, repair=r) for r in RULES]
            s = simulate(trace, profile, strategies=strategies).summary()
            ratios = {k: round(v, 3) for k, v in s["ratios"].items() if k.endswith(("/radix", "/floor"))}
            print(spec, profile, ratios, s.get("target"), s.get("meets_target"), flush=True)
