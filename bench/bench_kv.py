"""KV operator benchmark (thin wrapper): reuse (relocate + rank-m patch) vs re-prefill.

    PYTHONPATH=. .venv/bin/python bench/bench_kv.py --quick --json bench/results/kv_quick.json
    PYTHONPATH=. .venv/bin/python bench/bench_kv.py --device cuda --json bench/results/kv_full.json

Same as ``windowkit bench kv ...``; all logic lives in ``windowkit.benchmarks.kv``. See docs/benchmarks.md.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from windowkit.benchmarks.kv import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
