"""Web agent on real pages: headless Chromium renders a local shop, the Window keeps the task + last k observations.

    PYTHONPATH=. .venv/bin/python examples/web_agent_browser.py                   # tiny Qwen2.5-VL, keyword policy
    PYTHONPATH=. .venv/bin/python examples/web_agent_browser.py --model smollm2   # SmolLM2 chooses every link
    PYTHONPATH=. .venv/bin/python examples/web_agent_browser.py --plot docs/img/web_agent_browser.png --record web.jsonl

Serves ``agents.web_browser.demo_site()`` on 127.0.0.1 (a free port; the server stops itself), starts Debian's
headless Chromium, and from /index.html runs ``--steps`` agent steps: each step takes the page's real screenshot
(an image chunk; Qwen-VL models only) and its text (DOM ``innerText`` or, with ``--text ax``, an accessibility-tree
dump; a text chunk), assigns ``[task] + last --window observations`` to the Window, reads it once with a query
listing the page's links, and follows the link the policy picks: ``keyword`` (default for VL models: task-word
overlap, unvisited pages first) or ``model`` (default for text models: the model's own log-probability of each
label). Prints one row per step; ``--plot`` draws the screenshots above the window timeline of the recorded trace.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-qwen2.5-vl",
                    help="tiny-qwen2.5-vl | tiny-qwen3-vl | smollm2 | a local checkpoint folder")
    ap.add_argument("--steps", type=int, default=5, help="pages visited (one observation each)")
    ap.add_argument("--window", type=int, default=2, help="observations kept in the window after the task")
    ap.add_argument("--policy", default=None, choices=("keyword", "model"),
                    help="who picks the link (default: keyword for VL models, model for text models)")
    ap.add_argument("--text", default="dom", choices=("dom", "ax"),
                    help="page text: DOM innerText or accessibility tree")
    ap.add_argument("--text-tokens", type=int, default=64, help="page-text tokens kept per observation")
    ap.add_argument("--size", default="336x224", help="browser viewport WxH")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is kind to a shared CPU)")
    ap.add_argument("--no-reference", action="store_true", help="skip the exact re-prefill reference window")
    ap.add_argument("--record", default=None, metavar="PATH", help="write each step's window as a JSONL trace")
    ap.add_argument("--plot", default=None, metavar="PNG", help="draw the screenshots beside the window timeline")
    args = ap.parse_args(argv)

    import torch

    from agents.web_browser import (CHATML, DEMO_TASK, BrowserAgent, Chromium, KeywordPolicy, LocalSite, ModelPolicy,
                                    Prompts, demo_site, format_step_header, format_step_row, plot_run)
    from agents.video_io import parse_size
    from windowkit.models.load import load_model
    from windowkit.errors import WindowkitError
    from windowkit.trace import read_trace

    torch.set_num_threads(max(1, args.threads))
    t_start = time.perf_counter()
    w, h = parse_size(args.size, ap)
    record = args.record
    tmp = None
    if args.plot and not record:
        tmp = tempfile.TemporaryDirectory(prefix="wk-web-")
        record = os.path.join(tmp.name, "web.jsonl")
    try:
        model = load_model(args.model)
        tokenize, prompts, model_path = None, Prompts(), None
        if args.model == "smollm2":
            from windowkit.models import smollm2

            tok = smollm2.load_tokenizer()
            tokenize, prompts = (lambda s: tok(s, add_special_tokens=False)["input_ids"]), CHATML
        elif os.path.isdir(args.model):
            model_path, prompts = args.model, CHATML
        agent = BrowserAgent(model, window=args.window, viewport=(w, h), tokenize=tokenize, text=args.text,
                             text_tokens=args.text_tokens, model_path=model_path, reference=not args.no_reference,
                             record=record, prompts=prompts)
        kind = args.policy or ("keyword" if agent.vision else "model")
        policy = KeywordPolicy(DEMO_TASK) if kind == "keyword" else ModelPolicy()
        with LocalSite(demo_site(), max_requests=10 * args.steps + 20, timeout_s=600) as site, \
                Chromium(viewport=agent.viewport) as browser:
            print(f"model {args.model} | {'screenshot + ' if agent.vision else ''}{args.text} text per observation | "
                  f"window: task + last {args.window} | policy {kind} | site {site.url('/index.html')}")
            print(f"task: {DEMO_TASK}")
            print(format_step_header())
            report = agent.run(browser, site.url("/index.html"), DEMO_TASK, args.steps, policy,
                               on_step=lambda r: print(format_step_row(r), flush=True))
        t = report.totals()
        print(f"\n{len(report.steps)} steps: vision calls {report.vision_calls}, encodes {t['encodes']}, relocations "
              f"{t['relocations']}, prefill tokens windowkit {t['prefill_tokens']} / prefix cache "
              f"{sum(r.prefix_cache_tokens for r in report.steps)} / exact "
              f"{sum(r.window_tokens for r in report.steps)}")
        if kind == "model":
            for r in report.steps:
                scores = ", ".join(f"{k} {v:.2f}" for k, v in r.scores.items())
                print(f"  step {r.index} ({r.title}): mean log-prob per link: {scores}")
        if args.plot:
            out = plot_run(report, read_trace(record), args.plot,
                           title=f"{args.model}: task + last {args.window} observations (screenshot + page text)")
            print(f"plot: {out}")
    except WindowkitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if tmp is not None:
            tmp.cleanup()
    print(f"total {time.perf_counter() - t_start:.1f} s")
    if args.record:
        print(f"trace: written to {args.record} (replay: windowkit simulate {args.record})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
