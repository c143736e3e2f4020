"""Command line: ``windowkit verify`` (fidelity table), ``windowkit bench kv`` (operator benchmark),
``windowkit simulate`` (trace replay and report) and ``windowkit calibrate`` (cost profile of this machine).

    windowkit verify --model tiny-llama
    windowkit bench kv --quick --json bench/results/kv_quick.json
    windowkit simulate videotree:50 --profile cpu-tiny --out report/
    windowkit calibrate --out windowkit-profile.json
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from windowkit.errors import WindowkitError

USAGE = """usage: windowkit <command> [options]

commands:
  verify      fidelity table per model (relocation error, KL to re-prefill, eta, patch bytes)
  bench kv    KV operator benchmark (reuse vs re-prefill, forming cost, break-even, bandwidth)
  bench real  real-weights fidelity benchmark on SmolLM2-135M (KL, answer agreement, accuracy, cost per strategy)
  simulate    replay an access trace through reuse strategies (recompute, radix, blind, blend, windowkit);
              --out DIR writes summary.json, PNG plots and a self-contained report.html
  calibrate   measure a cost profile on this machine (--out PATH, default ./windowkit-profile.json);
              use it with `windowkit simulate TRACE --profile PATH`
  eval-binding  accuracy of the trained binding model per reuse strategy and question kind
              (--n N items per kind, --json PATH)
  train-binding reproduce the binding model's checkpoint (CPU, ~17 min)

`windowkit <command> --help` lists a command's options.
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
            from windowkit.trace.cli import main as simulate_main

            return int(simulate_main(rest) or 0)
        if cmd == "calibrate":
            from windowkit.trace.calibrate import main as calibrate_main

            return int(calibrate_main(rest) or 0)
        if cmd == "eval-binding":
            from windowkit.models.binding.eval import main as eval_binding_main

            return int(eval_binding_main(rest) or 0)
        if cmd == "train-binding":
            from windowkit.models.binding.train import main as train_binding_main

            return int(train_binding_main(rest) or 0)
        if cmd == "bench":
            if rest and rest[0] == "real":
                from windowkit.benchmarks.real import main as bench_real_main

                return int(bench_real_main(rest[1:]) or 0)
            if not rest or rest[0] != "kv":
                print("usage: windowkit bench kv [--quick] [--json PATH] | windowkit bench real [--n N] [--json PATH]",
                      file=sys.stderr)
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
