"""Long-video QA agent on a windowkit Window: slide over a video, look back, compare with exact re-prefill.

    PYTHONPATH=. .venv/bin/python examples/long_video_qa.py                       # tiny random Qwen2.5-VL
    PYTHONPATH=. .venv/bin/python examples/long_video_qa.py --model /path/to/Qwen2.5-VL-3B-Instruct --video clip.mp4
    PYTHONPATH=. .venv/bin/python examples/long_video_qa.py --record run.jsonl     # also write the steps as a trace

Writes a synthetic video of moving shapes with OpenCV (into a temporary folder, removed at exit) unless
``--video`` is given, samples it at ``--fps``, and runs ``--steps`` agent steps with ``--window`` frames
plus the question chunk; look-back steps (``--lookback``) hold frames t-10..t-8 first. Prints one row
per step and a summary (see docs/agents.md for the columns).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _question(model, model_path):
    """(question ids, answer-prompt ids): the tokenizer's when a local checkpoint has one, else synthetic."""
    import torch

    if model_path:
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
            q = tok("Which coloured shape was closest to the top-left corner ten frames ago?",
                    add_special_tokens=False)["input_ids"]
            return q, tok(" Answer:", add_special_tokens=False)["input_ids"]
        except Exception as e:  # no tokenizer files: fall back to synthetic ids
            print(f"(no tokenizer at {model_path}: {type(e).__name__}; using synthetic question ids)", file=sys.stderr)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    g = torch.Generator().manual_seed(1)
    hi = min(vocab, 1000)
    return torch.randint(10, hi, (12,), generator=g).tolist(), torch.randint(10, hi, (2,), generator=g).tolist()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-qwen2.5-vl", help="tiny-qwen2.5-vl | tiny-qwen3-vl | local checkpoint")
    ap.add_argument("--video", default=None, help="a video file (default: a synthetic one)")
    ap.add_argument("--frames", type=int, default=24, help="most frames to sample from the video")
    ap.add_argument("--window", type=int, default=6, help="frames in the window per step")
    ap.add_argument("--fps", type=float, default=4.0, help="sampling rate (frames per second of video)")
    ap.add_argument("--steps", type=int, default=18, help="agent steps (step s ends at sampled frame s)")
    ap.add_argument("--lookback", default="auto",
                    help="comma-separated look-back steps (frames s-10..s-8 first); 'auto': two; '' none")
    ap.add_argument("--size", default="112x84", help="frame size WxH before patching")
    ap.add_argument("--rank", type=int, default=32, help="patch rank m")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is kind to a shared CPU)")
    ap.add_argument("--no-reference", action="store_true", help="skip the exact re-prefill reference window")
    ap.add_argument("--record", default=None, metavar="PATH", help="write each step's window as a JSONL trace (replay: windowkit simulate PATH)")
    args = ap.parse_args(argv)

    import torch
    from tqdm import tqdm

    from agents.long_video import (LongVideoAgent, format_step_row, format_step_table, format_summary, lookback_steps,
                                   make_plan, sample_video)
    from windowkit.backends.hf import load_model
    from windowkit.errors import WindowkitError

    torch.set_num_threads(max(1, args.threads))
    t_start = time.perf_counter()
    try:
        w, h = (int(x) for x in args.size.lower().split("x"))
    except ValueError:
        ap.error(f"--size must be WxH, got {args.size!r}")
    try:
        model = load_model(args.model)
        model_path = args.model if os.path.isdir(args.model) else None
        agent = LongVideoAgent(model, window=args.window, rank=args.rank, frame_size=(w, h),
                               reference=not args.no_reference, model_path=model_path, record=args.record)
        frames = sample_video(agent, args.video, args.fps, args.frames)
        steps = min(args.steps, len(frames))
        lookback = lookback_steps(args.lookback, steps)
        plan = make_plan(len(frames), args.window, steps, lookback)
        question, prompt = _question(model, model_path)
        print(f"model {args.model} | video {args.video or 'synthetic 96x72 @ 8 fps'} | {len(frames)} frames sampled at "
              f"{args.fps:g} fps, {len(frames[0])} tokens each | window {args.window} + question "
              f"({len(question)} tokens) | {steps} steps, look-back at {lookback or 'none'} | rank {args.rank}")
        print(format_step_table([], header=True))
        bar = tqdm(total=len(plan), desc="steps", unit="step", leave=False, file=sys.stderr,
                   disable=not sys.stderr.isatty())

        def on_step(row):
            tqdm.write(format_step_row(row))
            bar.update(1)

        def on_phase(name):  # progress inside a step: with a real checkpoint one step can take a while
            bar.set_postfix_str(name, refresh=True)

        report = agent.run(frames, plan, question, prompt, on_step=on_step, on_phase=on_phase)
        bar.close()
    except WindowkitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print()
    print(format_summary(report))
    print(f"\ntotal {time.perf_counter() - t_start:.1f} s (model build, video, {len(plan)} steps on windowkit"
          + (", exact and prefix-cache windows)" if not args.no_reference else ")"))
    if args.record:
        print(f"trace: {len(report.steps)} steps written to {args.record} (replay: windowkit simulate {args.record})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
