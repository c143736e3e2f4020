"""A text agent on real weights: a Window of k log entries slides over a generated log, one question per step.

    PYTHONPATH=. .venv/bin/python examples/text_agent.py                    # SmolLM2-135M, k=5, 10 steps
    PYTHONPATH=. .venv/bin/python examples/text_agent.py --steps 20 --k 6
    PYTHONPATH=. .venv/bin/python examples/text_agent.py --model /path/to/local/chat-checkpoint

Every step is answered on the windowkit window (patch mode, the Window's defaults), on exact re-prefill and on a
prefix cache; the table shows the answers, KL(exact || windowkit), prefill tokens and wall time (agents/text_reader.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 (default) | a local checkpoint folder with a tokenizer")
    ap.add_argument("--k", type=int, default=5, help="log entries in the window")
    ap.add_argument("--steps", type=int, default=10, help="agent steps (one question each)")
    ap.add_argument("--seed", type=int, default=0, help="which generated log")
    ap.add_argument("--lookback-every", type=int, default=3, help="every n-th step recalls an evicted entry")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    args = ap.parse_args(argv)
    if args.k < 1 or args.steps < 1 or args.lookback_every < 2 or args.threads < 1:
        ap.error("--k, --steps and --threads must be >= 1 and --lookback-every >= 2")
    if args.model != "smollm2" and not os.path.isdir(args.model):
        ap.error(f"--model must be 'smollm2' or a local checkpoint folder, got {args.model!r}")

    import torch

    from agents.text_reader import TextReaderAgent, format_table, make_log
    from windowkit.errors import WindowkitError

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    try:
        if args.model == "smollm2":
            from windowkit.backends.hf import load_model
            from windowkit.models import smollm2

            model, tok = load_model("smollm2"), smollm2.load_tokenizer()
        else:
            import transformers

            model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
            tok = transformers.AutoTokenizer.from_pretrained(args.model)
        agent = TextReaderAgent(model, tok, k=args.k)
        log = make_log(args.seed, args.steps, args.k, lookback_every=args.lookback_every)
        print(f"model {args.model} | log of {len(log.texts)} entries | window k={args.k} | {args.steps} steps, "
              f"a look-back every {args.lookback_every}")
        report = agent.run(log)
    except (WindowkitError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(report))
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
