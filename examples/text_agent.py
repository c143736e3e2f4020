"""A text agent on real weights: a Window of k log entries slides over a generated log, one question per step.

    PYTHONPATH=. .venv/bin/python examples/text_agent.py                    # SmolLM2-135M, k=5, 10 steps
    PYTHONPATH=. .venv/bin/python examples/text_agent.py --steps 20 --k 6
    PYTHONPATH=. .venv/bin/python examples/text_agent.py --anticipate       # each next step prepared between steps
    PYTHONPATH=. .venv/bin/python examples/text_agent.py --guess slide      # ... guessed by a policy, not told
    PYTHONPATH=. .venv/bin/python examples/text_agent.py --record text.jsonl   # also write the steps as a trace
    PYTHONPATH=. .venv/bin/python examples/text_agent.py --model /path/to/local/chat-checkpoint
    PYTHONPATH=. .venv/bin/python examples/text_agent.py --engine sglang --steps 4 --k 3   # a live SGLang Engine

With ``--engine sglang`` the windowkit column is answered by a real SGLang Engine started on this CPU
(``SGLangBackend.launch_cpu``, the windowkit linker and plugin; needs ``make .venv/.windowkit-sglang-installed``):
the Window's plans are restored into SGLang's KV pool and SGLang prefills only the question. Exact re-prefill and
the prefix cache still run on transformers, so the table compares the engine's answers with exact ones.

Every step is answered on the windowkit window (patch mode, the Window's defaults), on exact re-prefill and on a
prefix cache; the table shows the answers, KL(exact || windowkit), prefill tokens and wall time (agents/text_reader.py).
With ``--anticipate`` the agent prepares, after each answer, the entries the next step keeps
(``win.prefetch(next=...)``): each step then prefills only its new entry and the question, exactly; the work moved
between steps is printed apart. With ``--guess slide`` the agent tells the Window nothing of its next step: a guess
policy (``policies/guess.py``) guesses it from the window's history (the last slide again) and prepares it; its
wrong guesses cost idle prefill, counted on the last line.
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
    ap.add_argument("--anticipate", action="store_true",
                    help="between steps, prepare the entries the next step keeps (win.prefetch(next=...))")
    ap.add_argument("--guess", default=None, choices=("slide", "none"),
                    help="between steps, a guess policy prepares the next step from the window's history alone")
    ap.add_argument("--engine", choices=("hf", "sglang"), default="hf",
                    help="what answers on the windowkit window: transformers (default) or a live SGLang Engine on CPU")
    ap.add_argument("--page-size", type=int, default=16, help="SGLang's page size (with --engine sglang)")
    ap.add_argument("--record", default=None, metavar="PATH",
                    help="write each step's window as a JSONL trace (replay: windowkit simulate PATH)")
    args = ap.parse_args(argv)
    if args.k < 1 or args.steps < 1 or args.lookback_every < 2 or args.threads < 1 or args.page_size < 1:
        ap.error("--k, --steps, --threads and --page-size must be >= 1 and --lookback-every >= 2")
    if args.anticipate and args.guess:
        ap.error("--anticipate and --guess exclude each other: the agent tells its next step, or a policy guesses it")
    if args.model != "smollm2" and not os.path.isdir(args.model):
        ap.error(f"--model must be 'smollm2' or a local checkpoint folder, got {args.model!r}")

    import torch

    from agents.text_reader import TextReaderAgent, format_table, make_log
    from windowkit.errors import WindowkitError

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    engine = None
    try:
        if args.model == "smollm2":
            from windowkit.models.load import load_model
            from windowkit.models import smollm2

            model, tok = load_model("smollm2"), smollm2.load_tokenizer()
            folder = str(smollm2.checkpoint_dir())
        else:
            import transformers

            model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
            tok = transformers.AutoTokenizer.from_pretrained(args.model)
            folder = args.model
        if args.engine == "sglang":
            from windowkit.backends.hf import HFBackend
            from windowkit.backends.sglang import SGLangBackend

            print(f"starting an SGLang Engine on CPU for {folder} (page size {args.page_size}) ...", flush=True)
            engine = SGLangBackend.launch_cpu(folder, HFBackend(model), page_size=args.page_size)
            print(f"engine ready in {engine.engine.info.get('start_s', 0):.0f} s (sglang "
                  f"{engine.engine.info.get('sglang')}, log {engine.engine.log_path})", flush=True)
        agent = TextReaderAgent(model, tok, k=args.k, engine=engine, anticipate=args.anticipate, guess=args.guess)
        log = make_log(args.seed, args.steps, args.k, lookback_every=args.lookback_every)
        print(f"model {args.model} | engine {args.engine} | log of {len(log.texts)} entries | window k={args.k} | "
              f"{args.steps} steps, a look-back every {args.lookback_every}"
              + (" | each next step prepared between steps" if args.anticipate else "")
              + (f" | a '{args.guess}' guess policy prepares each next step" if args.guess else ""))
        if args.record:
            from windowkit.trace import TraceRecorder

            with TraceRecorder(args.record) as agent.recorder:
                report = agent.run(log)
            print(f"trace: {len(report.steps)} steps written to {args.record} (replay: windowkit simulate {args.record})")
        else:
            report = agent.run(log)
    except (WindowkitError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if engine is not None:
            engine.shutdown()
    print(format_table(report))
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
