"""Command line: ``windowkit verify`` (fidelity table) and ``windowkit bench kv`` (operator benchmark).

    windowkit verify --model tiny-llama
    windowkit bench kv --quick --json bench/results/kv_quick.json
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from windowkit.errors import WindowkitError

USAGE = """usage: windowkit <command> [options]

commands:
  verify      fidelity table per model (relocation error, KL to re-prefill, eta, patch bytes)
  bench kv    KV operator benchmark (reuse vs re-prefill, forming cost, break-even, bandwidth)
  simulate    replay an access trace through reuse strategies (recompute, radix, blind, blend, windowkit)
"""


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    cmd, rest = args[0], args[1:]
    try:
        if cmd == "verify":
            from windowkit.verify import main as verify_main

            return verify_main(rest)
        if cmd == "simulate":
            from windowkit.trace.simulate import main as simulate_main

            return int(simulate_main(rest) or 0)
        if cmd == "bench":
            if not rest or rest[0] != "kv":
                print("usage: windowkit bench kv [--quick] [--json PATH]", file=sys.stderr)
                return 2
            from windowkit.benchmarks.kv import main as bench_main

            return int(bench_main(rest[1:]) or 0)
    except WindowkitError as e:
        print(f"windowkit: error: {e}", file=sys.stderr)
        return 1
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
