"""Long-video QA agent on a windowkit Window: slide over a video, look back, compare with exact re-prefill.

    PYTHONPATH=. .venv/bin/python examples/long_video_qa.py                       # the trained binding model
    PYTHONPATH=. .venv/bin/python examples/long_video_qa.py --model tiny-qwen2.5-vl   # tiny random Qwen2.5-VL
    PYTHONPATH=. .venv/bin/python examples/long_video_qa.py --model /path/to/Qwen2.5-VL-3B-Instruct --video clip.mp4
    PYTHONPATH=. .venv/bin/python examples/long_video_qa.py --record run.jsonl     # also write the steps as a trace
    PYTHONPATH=. .venv/bin/python examples/long_video_qa.py --guess slide          # next steps guessed and prepared

The default model is the trained binding model (``windowkit.models.binding``): it watches its own synthetic
video (four coloured objects, one changing shape every second frame), the window holds the last 3 frames
behind a BOS prefix, and every step asks a question it can answer ("which object changed shape in the
newest frame?" or "what shape is the red object in frame t?"); each step is scored on the windowkit
window, on exact re-prefill and on blind reuse, so the summary gives accuracies as well as KL.

With another model the script writes a synthetic video of moving shapes with OpenCV (into a temporary
folder, removed at exit) unless ``--video`` is given, samples it at ``--fps``, and runs ``--steps`` agent
steps with ``--window`` frames plus a (synthetic or tokenized) question chunk. Look-back steps
(``--lookback``) hold frames t-10..t-8 first (t-11, t-10 for the binding model: three distinct frame tags).
Prints one row per step and a summary (see docs/agents.md for the columns).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def question_and_prompt(model, model_path):
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
    ap.add_argument("--model", default="binding",
                    help="binding (trained, default) | tiny-qwen2.5-vl | tiny-qwen3-vl | local checkpoint")
    ap.add_argument("--video", default=None, help="a video file (default: a synthetic one)")
    ap.add_argument("--frames", type=int, default=None, help="most frames to sample from the video (24; binding: 60)")
    ap.add_argument("--window", type=int, default=None, help="frames in the window per step (6; binding: 3)")
    ap.add_argument("--fps", type=float, default=4.0, help="sampling rate (frames per second of video)")
    ap.add_argument("--steps", type=int, default=None, help="agent steps, step s ends at sampled frame s (18; binding: 60)")
    ap.add_argument("--seed", type=int, default=0, help="binding model: which synthetic video")
    ap.add_argument("--lookback", default="auto",
                    help="comma-separated look-back steps (frames s-10..s-8 first; binding: s-11, s-10); 'auto': two; '' none")
    ap.add_argument("--size", default="112x84", help="frame size WxH before patching")
    ap.add_argument("--rank", type=int, default=32, help="patch rank m")
    ap.add_argument("--refresh", default=None,
                    help="patch refresh for drifted survivors: always | threshold:TAU | budget:K (default: none)")
    ap.add_argument("--anticipate", action="store_true",
                    help="between steps, prepare the next slide's survivors (win.prefetch(next=...)): each slide then "
                         "prefills only its new frame; the idle work is reported apart")
    ap.add_argument("--guess", default=None, choices=("slide", "none"),
                    help="instead of --anticipate, a guess policy prepares the next step between steps from the "
                         "window's history alone (policies/guess.py)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is kind to a shared CPU)")
    ap.add_argument("--no-reference", action="store_true", help="skip the exact re-prefill reference window")
    ap.add_argument("--record", default=None, metavar="PATH", help="write each step's window as a JSONL trace (replay: windowkit simulate PATH)")
    args = ap.parse_args(argv)
    if args.anticipate and args.guess:
        ap.error("--anticipate and --guess exclude each other: the agent prepares its next step, or a policy guesses it")

    import torch
    from tqdm import tqdm

    from agents.long_video import (BINDING_LOOKBACK, LongVideoAgent, binding_video, format_step_row, format_step_table,
                                   format_summary, lookback_steps, make_plan, sample_video)
    from agents.video_io import parse_size
    from policies.refresh import make_refresh
    from windowkit.models.load import load_model
    from windowkit.models.binding.task import N_TAGS
    from windowkit.errors import WindowkitError

    torch.set_num_threads(max(1, args.threads))
    t_start = time.perf_counter()
    w, h = parse_size(args.size, ap)
    try:
        make_refresh(args.refresh)
    except ValueError as e:
        ap.error(f"--refresh: {e}")
    binding = args.model == "binding"
    n_frames = (60 if binding else 24) if args.frames is None else args.frames
    window = (3 if binding else 6) if args.window is None else args.window
    reach = BINDING_LOOKBACK if binding else (10, 8)
    try:
        if binding and args.video:
            raise WindowkitError("the binding model watches its own synthetic video (--seed); --video needs a "
                                 "Qwen-VL checkpoint (--model PATH)")
        if binding and window > N_TAGS:
            raise WindowkitError(f"the binding model names frames by {N_TAGS} tags (t mod {N_TAGS}): --window must be "
                                 f"at most {N_TAGS}, got {window}")
        model = load_model(args.model)
        model_path = args.model if os.path.isdir(args.model) else None
        ask, prefix = None, None
        if binding:  # its own video and per-step questions, scored; plus a blind window for the accuracy gap
            frames, ask, prefix = binding_video(n_frames, args.seed)
        agent = LongVideoAgent(model, window=window, rank=args.rank, frame_size=(w, h),
                               reference=not args.no_reference, model_path=model_path, record=args.record,
                               prefix=prefix, blind=binding, max_new_tokens=1 if binding else 4, refresh=args.refresh,
                               anticipate=args.anticipate, guess=args.guess)
        if not binding:
            frames = sample_video(agent, args.video, args.fps, n_frames)
        steps = min((n_frames if binding else 18) if args.steps is None else args.steps, len(frames))
        lookback = lookback_steps(args.lookback, steps, far=reach[0])
        plan = make_plan(len(frames), window, steps, lookback, lookback=reach)
        question, prompt = ((), ()) if binding else question_and_prompt(model, model_path)
        video = f"binding video {args.seed} (32x32, tags t mod 3)" if binding else \
            f"{args.video or 'synthetic 96x72 @ 8 fps'} sampled at {args.fps:g} fps"
        asked = "a scored question per step" if binding else f"question ({len(question)} tokens)"
        print(f"model {args.model} | video {video} | {len(frames)} frames, {len(frames[0])} tokens each | window "
              f"{window} + {asked} | {steps} steps, look-back at {lookback or 'none'} | rank {args.rank}")
        print(format_step_table([], header=True))
        bar = tqdm(total=len(plan), desc="steps", unit="step", leave=False, file=sys.stderr,
                   disable=not sys.stderr.isatty())

        def on_step(row):
            tqdm.write(format_step_row(row))
            bar.update(1)

        def on_phase(name):  # progress inside a step: with a real checkpoint one step can take a while
            bar.set_postfix_str(name, refresh=True)

        report = agent.run(frames, plan, question, prompt, on_step=on_step, on_phase=on_phase, ask=ask)
        bar.close()
    except WindowkitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print()
    print(format_summary(report))
    if agent.guesser is not None:
        g = agent.guesser.counters
        print(f"guesses: {g['guesses']} made, {g['prepared']} prepared, {g['hits']} right; {g['wasted']} tokens "
              "prefilled for wrong ones")
    print(f"\ntotal {time.perf_counter() - t_start:.1f} s (model build, video, {len(plan)} steps on windowkit"
          + (", exact and prefix-cache windows)" if not args.no_reference else ")"))
    if args.record:
        print(f"trace: {len(report.steps)} steps written to {args.record} (replay: windowkit simulate {args.record})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
