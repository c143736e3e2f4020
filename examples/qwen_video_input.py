"""Long-video agent on Qwen-style input: qwen-vl-utils sampling, OpenCV reading, one chunk per temporal patch.

    PYTHONPATH=. .venv/bin/python examples/qwen_video_input.py                          # tiny Qwen2.5-VL, fps=2
    PYTHONPATH=. .venv/bin/python examples/qwen_video_input.py --model tiny-qwen3-vl --nframes 12
    PYTHONPATH=. .venv/bin/python examples/qwen_video_input.py --video clip.mp4 --fps 1 --max-pixels 200704 \\
        --model /path/to/Qwen2.5-VL-3B-Instruct

Builds the messages a Qwen2.5-VL / Qwen3-VL user passes (``{"type": "video", "video": path, "fps": ...,
"max_pixels": ...}``; without ``--video`` a synthetic mp4 of moving shapes written by OpenCV into a temporary
folder), turns them into position-free video chunks with ``LongVideoAgent.load_qwen_video`` (frames picked and
resized by qwen-vl-utils' rules, read by OpenCV, pixels by transformers' video processor), prints what was
sampled, checks the Window's KV against the model's own forward over the processor-laid inputs (``--check``, on
by default for the tiny models), then slides a ``--window``-chunk window over the video with the question at the
tail (the long-video agent's table, docs/agents.md).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def check_against_model(model, chunks) -> float:
    """Max |KV difference| between a Window holding ``chunks`` and the model's own forward over the same input laid
    out as the Qwen processors lay it out (Qwen3-VL: the whole video as one grid; Qwen2.5-VL: one-patch videos)."""
    import torch

    from windowkit.backends.hf import HFBackend
    from windowkit.window import Window

    win = Window(HFBackend(model), mode="patch")
    win.assign(chunks)
    kv = win.window_kv()
    cfg = model.config
    ids = torch.cat([c.input_ids for c in chunks])[None]
    types = torch.zeros_like(ids, dtype=torch.int)
    types[ids == cfg.video_token_id] = 2
    grid = torch.cat([c.video_grid_thw for c in chunks])
    kw = dict(input_ids=ids, mm_token_type_ids=types,
              pixel_values_videos=torch.cat([c.pixel_values_videos for c in chunks]))
    if cfg.model_type == "qwen3_vl":
        kw["video_grid_thw"] = torch.tensor([[len(chunks), *grid[0, 1:].tolist()]])
    else:
        kw["video_grid_thw"] = grid
        kw["second_per_grid_ts"] = torch.cat([c.second_per_grid_ts for c in chunks])
    model.model.rope_deltas = None
    with torch.no_grad():
        out = model(**kw, use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    return max(max(float((k - layer.keys[0]).abs().max()), float((v - layer.values[0]).abs().max()))
               for (k, v), layer in zip(kv.layers, cache.layers))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-qwen2.5-vl", help="tiny-qwen2.5-vl | tiny-qwen3-vl | local checkpoint")
    ap.add_argument("--video", default=None, help="a video file (default: a synthetic mp4 written by OpenCV)")
    ap.add_argument("--fps", type=float, default=None, help="qwen-vl-utils fps (default 2.0 unless --nframes)")
    ap.add_argument("--nframes", type=int, default=None, help="qwen-vl-utils nframes (instead of --fps)")
    ap.add_argument("--min-pixels", type=int, default=None, help="per-frame min_pixels (default: 4 merged tokens)")
    ap.add_argument("--max-pixels", type=int, default=None, help="per-frame max_pixels (default: 12 merged tokens)")
    ap.add_argument("--window", type=int, default=3, help="video chunks (temporal patches) in the window per step")
    ap.add_argument("--check", choices=("auto", "yes", "no"), default="auto",
                    help="compare the Window's KV with the model's own forward (auto: tiny models only)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args(argv)

    import torch

    from agents.long_video import LongVideoAgent, format_step_table, format_summary, make_plan
    from agents.video_io import write_synthetic_video
    from windowkit.models.load import load_model
    from windowkit.errors import WindowkitError

    torch.set_num_threads(max(1, args.threads))
    t0 = time.perf_counter()
    tmp = tempfile.TemporaryDirectory(prefix="wk-qwen-video-")
    try:
        model = load_model(args.model)
        model_path = args.model if os.path.isdir(args.model) else None
        vc = model.config.vision_config
        factor = int(vc.patch_size) * int(vc.spatial_merge_size)
        video = args.video or write_synthetic_video(os.path.join(tmp.name, "shapes.mp4"), n_frames=60, fps=10.0,
                                                    size=(128, 96))
        ele = {"type": "video", "video": video,
               "min_pixels": args.min_pixels or 4 * factor * factor,
               "max_pixels": args.max_pixels or 12 * factor * factor}
        if args.nframes is not None:
            ele["nframes"] = args.nframes
        else:
            ele["fps"] = 2.0 if args.fps is None else args.fps
        messages = [{"role": "user", "content": [ele, {"type": "text", "text": "What moves, and where does it go?"}]}]
        agent = LongVideoAgent(model, window=args.window, model_path=model_path, max_new_tokens=2)
        chunks = agent.load_qwen_video(messages)
        c0 = chunks[0]
        print(f"model {args.model} | video {args.video or 'synthetic 128x96 mp4 @ 10 fps, 60 frames'} | "
              f"{ {k: v for k, v in ele.items() if k not in ('type', 'video')} }")
        print(f"sampled {2 * len(chunks)} frames at {c0.meta['sample_fps']:.3f} fps -> {len(chunks)} chunks (one per "
              f"temporal patch of 2 frames), grid {c0.video_grid_thw.tolist()[0]}, {len(c0)} tokens each")
        for c in chunks:
            secs = f", second_per_grid_ts {float(c.second_per_grid_ts):.3f}" if c.second_per_grid_ts is not None else ""
            print(f"  {c.id:<9} frames {c.meta['frame_indices']}  t = {c.meta['time_s']:.2f} s{secs}")
        if args.check == "yes" or (args.check == "auto" and model_path is None):
            err = check_against_model(model, chunks)
            print(f"window KV vs the model's own forward over the processor-laid input: max |diff| {err:.2e}")
        question = list(range(20, 28))
        steps = len(chunks)
        plan = make_plan(len(chunks), window=args.window, steps=steps)
        report = agent.run(chunks, plan, question, [31, 32])
        print(format_step_table(report.steps))
        print()
        print(format_summary(report))
    except WindowkitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        tmp.cleanup()
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
