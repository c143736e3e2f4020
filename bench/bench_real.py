"""Real-weights fidelity benchmark (SmolLM2-135M): writes bench/results/real.json, real.md and the Pareto plot.

    PYTHONPATH=. .venv/bin/python bench/bench_real.py --n 40      # the session run (see docs/real-weights.md)
    PYTHONPATH=. .venv/bin/python bench/bench_real.py --n 200     # the full run (N >= 200)

The same as ``windowkit bench real --n N --json bench/results/real.json --md bench/results/real.md
--plot docs/img/real_pareto.png``; extra options (``--tasks``, ``--strategies``, ``--histories``, ``--k``,
``--threads``) are passed through.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from windowkit.benchmarks.real import main  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def defaults(argv: list[str]) -> list[str]:
    out = list(argv)
    for flag, path in (("--json", "bench/results/real.json"), ("--md", "bench/results/real.md"),
                       ("--plot", "docs/img/real_pareto.png")):
        if flag not in out:
            out += [flag, os.path.join(ROOT, path)]
    return out


if __name__ == "__main__":
    sys.exit(main(defaults(sys.argv[1:])))
