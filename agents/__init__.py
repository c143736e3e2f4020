"""Agents built on windowkit's Window (not part of the installed ``windowkit`` package).

    from agents.long_video import LongVideoAgent, make_plan      # long-video QA: slide + look back
    from agents.video_io import write_synthetic_video, read_frames

See docs/agents.md.
"""
