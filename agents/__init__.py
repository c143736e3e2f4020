"""Agents built on windowkit's Window (not part of the installed ``windowkit`` package).

    from agents.long_video import LongVideoAgent, make_plan      # long-video QA: slide + look back
    from agents.web import WebAgent, synthetic_screenshot        # web agent: task + last k screenshots
    from agents.video_io import write_synthetic_video, read_frames, sample_qwen_video   # + Qwen-style sampling
    from agents.web_browser import BrowserAgent, Chromium, LocalSite, demo_site  # real pages in headless Chromium

    chunks = LongVideoAgent(model).load_qwen_video(messages)    # Qwen messages -> one chunk per temporal patch

    agent = LongVideoAgent(model, window=6, record="run.jsonl")  # record= writes each step as a trace

See docs/agents.md and docs/real-inputs.md.
"""
