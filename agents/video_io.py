"""Video I/O for the agents: a synthetic video writer and a frame sampler, both with OpenCV.

    path = write_synthetic_video("/tmp/shapes.mp4", n_frames=48, fps=8, size=(96, 72))
    frames = read_frames(path, fps=2.0)          # list of Frame(index, time_s, rgb uint8 [H, W, 3])

Errors are windowkit's own (``VideoError`` is a ``ChunkError``): a missing file, a file OpenCV cannot
decode, or a video with no frames raise before anything is built. The writer writes to a temporary file
next to the target and renames it into place only when every frame was written, so a failed write
leaves nothing behind.
"""
from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass
from typing import Optional

import numpy as np

from windowkit.errors import ChunkError


class VideoError(ChunkError):
    """A video file is missing, unreadable, or holds no frames."""


def _cv2():
    try:
        import cv2
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise VideoError("the video agent needs OpenCV: pip install opencv-python-headless") from e
    return cv2


@dataclass
class Frame:
    """One sampled frame: its index in the source video, its time in seconds, and RGB pixels [H, W, 3]."""

    index: int
    time_s: float
    rgb: np.ndarray


# BGR colours (OpenCV order) of the moving shapes
_COLOURS = [(40, 40, 230), (40, 200, 40), (230, 120, 30), (30, 220, 230), (200, 40, 200)]


def synthetic_frame(i: int, size: tuple[int, int] = (96, 72), n_shapes: int = 3) -> np.ndarray:
    """Frame ``i`` (BGR uint8 [H, W, 3]) of a deterministic video of coloured shapes moving on a dark
    background: circles and squares on Lissajous paths, so every frame differs from its neighbours."""
    cv2 = _cv2()
    w, h = size
    img = np.full((h, w, 3), 24, dtype=np.uint8)
    r = max(3, min(w, h) // 8)
    for k in range(n_shapes):
        cx = int(w / 2 + (w / 2 - r - 1) * math.sin(0.21 * (k + 1) * i + k))
        cy = int(h / 2 + (h / 2 - r - 1) * math.cos(0.17 * (k + 2) * i + 2 * k))
        colour = _COLOURS[k % len(_COLOURS)]
        if k % 2 == 0:
            cv2.circle(img, (cx, cy), r, colour, thickness=-1)
        else:
            cv2.rectangle(img, (cx - r, cy - r), (cx + r, cy + r), colour, thickness=-1)
    cv2.putText(img, str(i % 100), (2, h - 3), cv2.FONT_HERSHEY_SIMPLEX, 0.3, (200, 200, 200), 1)
    return img


def write_synthetic_video(path: str, n_frames: int = 48, fps: float = 8.0, size: tuple[int, int] = (96, 72),
                          n_shapes: int = 3) -> str:
    """Write a small video of moving coloured shapes to ``path`` (MJPG in .avi, mp4v otherwise).

    Written to a temporary file first and renamed into place: a failure leaves no partial file.
    Returns ``path``.
    """
    cv2 = _cv2()
    if n_frames < 1:
        raise VideoError(f"n_frames must be >= 1, got {n_frames}")
    if fps <= 0:
        raise VideoError(f"fps must be > 0, got {fps}")
    w, h = int(size[0]), int(size[1])
    if w < 8 or h < 8:
        raise VideoError(f"size must be at least 8x8, got {w}x{h}")
    ext = os.path.splitext(path)[1].lower() or ".avi"
    fourcc = cv2.VideoWriter_fourcc(*("MJPG" if ext == ".avi" else "mp4v"))
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=ext, prefix=".partial-", dir=folder)
    os.close(fd)
    writer = None
    try:
        writer = cv2.VideoWriter(tmp, fourcc, float(fps), (w, h))
        if not writer.isOpened():
            raise VideoError(f"OpenCV cannot write {ext} video (codec unavailable)")
        for i in range(int(n_frames)):
            writer.write(synthetic_frame(i, (w, h), n_shapes))
        writer.release()
        writer = None
        if os.path.getsize(tmp) == 0:
            raise VideoError(f"OpenCV wrote an empty {ext} file")
        os.replace(tmp, path)
    finally:
        if writer is not None:
            writer.release()
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def read_frames(path: str, fps: Optional[float] = None, max_frames: Optional[int] = None,
                size: Optional[tuple[int, int]] = None) -> list[Frame]:
    """Decode ``path`` and sample frames at ``fps`` (None: every frame), at most ``max_frames``.

    ``size=(w, h)`` resizes each sampled frame. Raises ``VideoError`` for a missing or unreadable file
    or a video with no frames; everything is decoded before anything is returned.
    """
    cv2 = _cv2()
    if not isinstance(path, (str, os.PathLike)):
        raise VideoError(f"video path must be a string or path, got {type(path).__name__}")
    path = os.fspath(path)
    if not os.path.exists(path):
        raise VideoError(f"video file not found: {path}")
    if not os.path.isfile(path):
        raise VideoError(f"not a file: {path}")
    if fps is not None and fps <= 0:
        raise VideoError(f"fps must be > 0, got {fps}")
    if max_frames is not None and max_frames < 1:
        raise VideoError(f"max_frames must be >= 1, got {max_frames}")
    cap = cv2.VideoCapture(path)
    try:
        if not cap.isOpened():
            raise VideoError(f"OpenCV cannot open video {path} (not a video or unsupported codec)")
        src_fps = float(cap.get(cv2.CAP_PROP_FPS) or 0.0)
        if not src_fps > 0 or not math.isfinite(src_fps):
            src_fps = 25.0
        step = 1.0 if fps is None else max(src_fps / float(fps), 1.0)
        out: list[Frame] = []
        i, next_take = 0, 0.0
        while True:
            ok, bgr = cap.read()
            if not ok or bgr is None:
                break
            if i + 1e-9 >= next_take:
                next_take += step
                if size is not None:
                    bgr = cv2.resize(bgr, (int(size[0]), int(size[1])), interpolation=cv2.INTER_AREA)
                out.append(Frame(i, i / src_fps, cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)))
                if max_frames is not None and len(out) >= max_frames:
                    break
            i += 1
    finally:
        cap.release()
    if not out:
        raise VideoError(f"video {path} has no decodable frames")
    return out


__all__ = ["VideoError", "Frame", "synthetic_frame", "write_synthetic_video", "read_frames"]
