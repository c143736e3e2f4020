"""Agents built on windowkit's Window (not part of the installed ``windowkit`` package).

    from agents.long_video import LongVideoAgent, make_plan      # long-video QA: slide + look back
    from agents.web import WebAgent, synthetic_screenshot        # web agent: task + last k screenshots
    from agents.video_io import write_synthetic_video, read_frames

    agent = LongVideoAgent(model, window=6, record="run.jsonl")  # record= writes each step as a trace

See docs/agents.md.
"""
