"""Web/GUI agent window on windowkit: a task chunk plus the last k screenshots; planner + grounder share them.

    PYTHONPATH=. .venv/bin/python examples/web_agent_window.py                      # tiny random Qwen2.5-VL
    PYTHONPATH=. .venv/bin/python examples/web_agent_window.py --model /path/to/Qwen2.5-VL-3B-Instruct --steps 12
    PYTHONPATH=. .venv/bin/python examples/web_agent_window.py --record web.jsonl  # also write the steps as a trace
    PYTHONPATH=. .venv/bin/python examples/web_agent_window.py --clip --anticipate  # WebVoyager's rule, prepared

Draws ``--steps`` synthetic screenshots (header bar, buttons, a coloured box moving per step), and at each
step admits the new screenshot (evicting the oldest beyond ``--window``), runs the planner
(``win.generate``) and the grounder (``win.forward``) on the same window, and compares the planner's
next-token logits with an exact re-prefill window. Prints one row per step and a summary (docs/agents.md).
``--clip``: WebVoyager's own rule, a screenshot leaving the window is clipped to its text where it stood (a short
text chunk per screenshot); ``--anticipate``: between steps the agent writes that clip and prepares the next
window with it (``win.prefetch(next=...)``), so each step prefills only its new screenshot.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _prompts(model, model_path):
    """(task, planner, grounder) ids: the tokenizer's when a local checkpoint has one, else synthetic."""
    import torch

    if model_path:
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(model_path, local_files_only=True)

            def enc(s):
                return tok(s, add_special_tokens=False)["input_ids"]

            return (enc("Task: find the cheapest red item on shop.example and add it to the cart."),
                    enc(" Thought and next action:"), enc(" Click at element:"))
        except Exception as e:  # no tokenizer files: fall back to synthetic ids
            print(f"(no tokenizer at {model_path}: {type(e).__name__}; using synthetic ids)", file=sys.stderr)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    g = torch.Generator().manual_seed(0)
    hi = min(vocab, 1000)
    return (torch.randint(10, hi, (16,), generator=g).tolist(), torch.randint(10, hi, (3,), generator=g).tolist(),
            torch.randint(10, hi, (2,), generator=g).tolist())


def _clip_fn(model, model_path):
    """``clip(i)``: screenshot i's text (the tokenizer's when a local checkpoint has one, else 8 synthetic ids)."""
    import torch

    if model_path:
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
            return lambda i: tok(f" Observation {i}: the page after action {i}.", add_special_tokens=False)["input_ids"]
        except Exception:  # no tokenizer files: synthetic ids (_prompts said so already)
            pass
    hi = min(int(model.get_output_embeddings().weight.shape[0]), 1000)
    return lambda i: torch.randint(10, hi, (8,), generator=torch.Generator().manual_seed(1000 + i)).tolist()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-qwen2.5-vl", help="tiny-qwen2.5-vl | tiny-qwen3-vl | local checkpoint")
    ap.add_argument("--steps", type=int, default=8, help="agent steps (one new screenshot each)")
    ap.add_argument("--window", type=int, default=3, help="screenshots kept in the window")
    ap.add_argument("--size", default="168x112", help="screenshot (viewport) size WxH")
    ap.add_argument("--rank", type=int, default=32, help="patch rank m")
    ap.add_argument("--form", default=None, choices=("eager", "lazy"),
                    help="Window form (docs/window.md; default: the Window's, lazy)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is kind to a shared CPU)")
    ap.add_argument("--no-reference", action="store_true", help="skip the exact re-prefill reference window")
    ap.add_argument("--clip", action="store_true", help="clip screenshots leaving the window to their text, in place")
    ap.add_argument("--anticipate", action="store_true", help="between steps, prepare the next window (prefetch(next=...))")
    ap.add_argument("--record", default=None, metavar="PATH", help="write each step's window as a JSONL trace (replay: windowkit simulate PATH)")
    args = ap.parse_args(argv)

    import torch

    from agents.video_io import parse_size
    from agents.web import WebAgent, format_step_header, format_step_row, format_summary, synthetic_screenshot
    from windowkit.models.load import load_model
    from windowkit.errors import WindowkitError

    torch.set_num_threads(max(1, args.threads))
    t_start = time.perf_counter()
    w, h = parse_size(args.size, ap)
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    try:
        model = load_model(args.model)
        model_path = args.model if os.path.isdir(args.model) else None
        agent = WebAgent(model, window=args.window, viewport=(w, h), rank=args.rank, form=args.form,
                         reference=not args.no_reference, model_path=model_path, record=args.record,
                         clip=_clip_fn(model, model_path) if args.clip else None, anticipate=args.anticipate)
        task, planner, grounder = _prompts(model, model_path)
        shots = [synthetic_screenshot(i, agent.viewport) for i in range(args.steps)]
        n_tok = len(agent.screenshot_chunk(shots[0], 0))
        print(f"model {args.model} | {args.steps} screenshots {agent.viewport[0]}x{agent.viewport[1]}, {n_tok} tokens "
              f"each | window: task ({len(task)} tokens) + {'clipped older observations + ' if args.clip else ''}last "
              f"{args.window} screenshots | rank {args.rank}, form {agent.win.form}"
              + (" | the next window prepared between steps" if args.anticipate else ""))
        print(format_step_header())
        report = agent.run(shots, task, planner, grounder, on_step=lambda r: print(format_step_row(r), flush=True))
    except WindowkitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print()
    print(format_summary(report))
    print(f"\ntotal {time.perf_counter() - t_start:.1f} s (model build, screenshots, {args.steps} steps)")
    if args.record:
        print(f"trace: {len(report.steps)} steps written to {args.record} (replay: windowkit simulate {args.record})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
