"""Record an agent trace (or load one), then replay it through the reuse strategies under a cost profile.

    PYTHONPATH=. .venv/bin/python examples/simulate_trace.py                         # record + replay, ~1 min on CPU
    PYTHONPATH=. .venv/bin/python examples/simulate_trace.py --trace sliding-3       # a generated trace
    PYTHONPATH=. .venv/bin/python examples/simulate_trace.py --trace videotree:20 --profile cpu-tiny
    PYTHONPATH=. .venv/bin/python examples/simulate_trace.py --model /path/to/Qwen2.5-VL-3B-Instruct --out report/

By default the long-video agent (agents/long_video.py) runs on a synthetic OpenCV video with the tiny random
Qwen2.5-VL (or ``--model``, a local checkpoint), sliding a ``--window``-frame window with two look-backs, and
``TraceRecorder`` writes each step's window (frame and question chunks, their token counts) to ``--record``.
``--trace`` skips the recording: a JSONL path, ``videotree[:N]`` or a generator name (``windowkit.trace.GENERATORS``;
``--help`` lists them). The trace is then replayed with ``windowkit.trace.simulate`` under ``--profile`` (default
``h100-kamera``) through the strategies of ``windowkit.trace.STRATEGIES`` (``--help`` lists them and the default
set: full recompute, prefix/radix cache, blind reuse, token blending, a windowkit Window on the cost-model backend
and the trace's floor). Prints the totals table and the ratios; ``--out DIR`` writes the report there (summary.json, plots, report.html; docs/report.md). The costs are *modeled* from the profile; the recorded token counts are the model's own.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def record_trace(args, path: str) -> str:
    """Run the long-video agent (no exact reference window: only the contents matter) and record its steps."""
    import torch

    from agents.long_video import LongVideoAgent, lookback_steps, make_plan, sample_video
    from examples.long_video_qa import question_and_prompt
    from windowkit.models.load import load_model

    torch.set_num_threads(max(1, args.threads))
    try:
        w, h = (int(x) for x in args.size.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--size must be WxH, got {args.size!r}")
    model = load_model(args.model)
    model_path = args.model if os.path.isdir(args.model) else None
    agent = LongVideoAgent(model, window=args.window, rank=args.rank, frame_size=(w, h), reference=False,
                           model_path=model_path, record=path, max_new_tokens=1)
    frames = sample_video(agent, args.video, args.fps, args.frames)
    steps = min(args.steps, len(frames))
    lookback = lookback_steps(args.lookback, steps)
    plan = make_plan(len(frames), args.window, steps, lookback)
    question, prompt = question_and_prompt(model, model_path)
    t0 = time.perf_counter()

    def progress(row):
        print(f"  recorded step {row.index:>3} {row.kind:<9} frames {row.frames}", file=sys.stderr, flush=True)

    agent.run(frames, plan, question, prompt, on_step=progress)
    print(f"recorded {len(plan)} steps of the long-video agent ({args.model}, {len(frames[0])} tokens per frame, "
          f"window {args.window} + question, look-back at {lookback or 'none'}) in {time.perf_counter() - t0:.1f} s "
          f"-> {path}" + ("" if args.record else " (temporary: --record PATH keeps it)"))
    return path


def write_out(res, trace, out_dir: str) -> None:
    """``windowkit.trace.report.write_report``: summary.json, PNG plots and a self-contained report.html."""
    from windowkit.trace.report import write_report  # matplotlib only when a report is asked for

    paths = write_report(res, out_dir, trace=trace)
    print(f"\nwrote the report to {out_dir}: {', '.join(sorted(os.path.basename(str(p)) for p in paths.values()))}")


def main(argv=None) -> int:
    from windowkit.errors import WindowkitError
    from windowkit.trace import GENERATORS, STRATEGIES, read_trace, simulate
    from windowkit.trace.cli import load_trace_arg
    from windowkit.trace.run import DEFAULT_STRATEGIES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=None, metavar="PATH|videotree:N|sliding-3",
                    help="replay this trace instead of recording one from the long-video agent: a JSONL path, "
                         "videotree[:N], videotree-set[:N] or a generator: " + ", ".join(GENERATORS))
    ap.add_argument("--profile", default="h100-kamera", help="cost profile name or JSON path (default h100-kamera)")
    ap.add_argument("--strategy", action="append", default=None, choices=list(STRATEGIES),
                    help=f"strategy to replay (repeatable; default: {' '.join(DEFAULT_STRATEGIES)})")
    ap.add_argument("--max-steps", type=int, default=None, help="replay only the first steps")
    ap.add_argument("--out", default=None, metavar="DIR", help="write summary.json (and the report, if available)")
    rec = ap.add_argument_group("recording (when --trace is not given)")
    rec.add_argument("--model", default="tiny-qwen2.5-vl", help="tiny-qwen2.5-vl | tiny-qwen3-vl | local checkpoint")
    rec.add_argument("--video", default=None, help="a video file (default: a synthetic one)")
    rec.add_argument("--record", default=None, metavar="PATH", help="where to write the trace (default: a temp file)")
    rec.add_argument("--frames", type=int, default=16, help="most frames to sample")
    rec.add_argument("--fps", type=float, default=4.0, help="sampling rate")
    rec.add_argument("--window", type=int, default=4, help="frames in the window per step")
    rec.add_argument("--steps", type=int, default=16, help="agent steps")
    rec.add_argument("--lookback", default="auto", help="look-back steps (comma-separated), 'auto' or ''")
    rec.add_argument("--size", default="112x84", help="frame size WxH before patching (sets tokens per frame)")
    rec.add_argument("--rank", type=int, default=32, help="patch rank m")
    rec.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args(argv)
    try:
        with tempfile.TemporaryDirectory(prefix="wk-trace-") as tmp:
            if args.trace is None:
                path = record_trace(args, args.record or os.path.join(tmp, "long_video.jsonl"))
                trace = read_trace(path)
            else:
                trace = load_trace_arg(args.trace)
        st = trace.stats()
        print(f"trace {trace.name or args.trace}: {st['steps']} steps, {st['distinct_chunks']} distinct chunks, "
              f"{st['mean_chunks_per_step']:.1f} chunks / {st['mean_tokens_per_step']:.0f} tokens per step")
        res = simulate(trace, args.profile, args.strategy, max_steps=args.max_steps)
    except WindowkitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    s = res.summary()
    print(f"\nreplayed {s['steps']} steps under profile {s['profile']} (modeled ms)")
    print(res.table())
    print()
    for k, v in s["ratios"].items():
        print(f"{k}: {v:.3f}")
    if args.out:
        write_out(res, trace, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
