"""Video I/O for the agents: a synthetic video writer and a frame sampler, both with OpenCV.

    path = write_synthetic_video("/tmp/shapes.mp4", n_frames=48, fps=8, size=(96, 72))
    frames = read_frames(path, fps=2.0)          # list of Frame(index, time_s, rgb uint8 [H, W, 3])

Qwen-style sampling (what ``qwen_vl_utils.fetch_video`` does, with OpenCV as the reader):

    video = sample_qwen_video({"type": "video", "video": "clip.mp4", "fps": 2.0, "max_pixels": 128 * 28 * 28})
    video.frames          # float32 [T, 3, H, W], 0..255: fetch_video's output for the same element
    video.indices, video.sample_fps, video.timestamps()

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
from typing import Any, Optional

import numpy as np
import torch

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


def parse_size(text: str, ap: Any, flag: str = "--size") -> tuple[int, int]:
    """A command line's ``WxH`` (e.g. ``"336x224"``) as ``(w, h)``; anything else is a usage error of the
    ``argparse`` parser ``ap`` (``ap.error``: the message, exit status 2)."""
    try:
        w, h = (int(x) for x in text.lower().split("x"))
    except ValueError:
        ap.error(f"{flag} must be WxH, got {text!r}")
    return w, h


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


# ====================================================================== Qwen-style sampling (qwen-vl-utils)
#: the keys of a Qwen video element that ``sample_qwen_video`` understands (qwen-vl-utils 0.0.14's names)
QWEN_VIDEO_KEYS = ("type", "video", "fps", "nframes", "min_frames", "max_frames", "min_pixels", "max_pixels",
                   "total_pixels", "resized_height", "resized_width", "video_start", "video_end")
QWEN_VL_UTILS_INSTALL = "pip install qwen-vl-utils==0.0.14 (pinned in requirements.txt: make venv)"


def _qwen_vl_utils():
    """qwen-vl-utils' ``vision_process`` module (it imports torchvision at module level)."""
    try:
        from qwen_vl_utils import vision_process
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise VideoError(f"Qwen-style video input needs qwen-vl-utils ({type(e).__name__}: {e}): "
                         f"{QWEN_VL_UTILS_INSTALL}") from e
    return vision_process


@dataclass
class QwenVideo:
    """A video sampled and resized the way qwen-vl-utils does it, read by OpenCV.

    frames:       float32 [T, 3, H, W] in 0..255 (T even): ``qwen_vl_utils.fetch_video``'s output
    indices:      the source frame index of each sampled frame
    video_fps:    the file's frame rate; sample_fps: T / total_frames * video_fps (what qwen-vl-utils returns)
    total_frames: frames in the sampled range of the file
    """

    frames: Any
    indices: list[int]
    video_fps: float
    sample_fps: float
    total_frames: int
    path: str

    @property
    def size(self) -> tuple[int, int]:
        """(w, h) of every sampled frame after smart_resize."""
        return int(self.frames.shape[3]), int(self.frames.shape[2])

    def timestamps(self, temporal_patch_size: int = 2) -> list[float]:
        """Seconds of each temporal patch: the mean time of its first and last frame (Qwen3-VL's prompt rule,
        ``Qwen3VLProcessor._calculate_timestamps``).

            sample_qwen_video({"video": p, "nframes": 4}).timestamps()   # e.g. [0.25, 3.65]
        """
        idx = list(self.indices)
        while len(idx) % temporal_patch_size:
            idx.append(idx[-1])
        t = [i / self.video_fps for i in idx]
        return [(t[i] + t[i + temporal_patch_size - 1]) / 2 for i in range(0, len(t), temporal_patch_size)]

    def metadata(self) -> dict:
        """qwen-vl-utils' ``video_metadata`` (``return_video_metadata=True``), OpenCV as the backend."""
        return dict(fps=self.video_fps, frames_indices=list(self.indices), total_num_frames=self.total_frames,
                    video_backend="opencv")


def qwen_video_element(video: Any, **sampling: Any) -> dict:
    """The one video element of Qwen-style ``messages`` (or ``{"type": "video", "video": path, **sampling}`` for a
    path), checked: exactly one video, no images, only ``QWEN_VIDEO_KEYS``, and sampling arguments only with a path.

        qwen_video_element([{"role": "user", "content": [{"type": "video", "video": "a.mp4", "fps": 2.0},
                                                         {"type": "text", "text": "What happens?"}]}])
        qwen_video_element("a.mp4", nframes=8, max_pixels=64 * 28 * 28)
    """
    if isinstance(video, (str, os.PathLike)):
        ele: dict = {"type": "video", "video": os.fspath(video), **sampling}
    elif isinstance(video, dict) and "video" in video:
        if sampling:
            raise VideoError("pass sampling arguments inside the video element, not beside it")
        ele = dict(video)
    elif isinstance(video, (list, tuple)) and video and all(isinstance(m, dict) for m in video):
        if sampling:
            raise VideoError("pass sampling arguments inside the messages' video element, not beside them")
        try:
            infos = _qwen_vl_utils().extract_vision_info(list(video))
        except (KeyError, TypeError, AttributeError) as e:
            raise VideoError(f"messages must be [{{'role': ..., 'content': [...]}}, ...] (Qwen style): "
                             f"{type(e).__name__}: {e}") from None
        vids = [e for e in infos if "video" in e or e.get("type") == "video"]
        if len(vids) != 1 or len(infos) != 1:
            raise VideoError(f"the messages must hold exactly one video and no image, got {len(vids)} video(s) "
                             f"and {len(infos) - len(vids)} image(s)")
        ele = dict(vids[0])
    else:
        raise VideoError(f"expected a video path, a video element or Qwen-style messages, got {type(video).__name__}")
    bad = sorted(set(ele) - set(QWEN_VIDEO_KEYS))
    if bad:
        raise VideoError(f"unsupported video element keys {bad}; supported: {', '.join(QWEN_VIDEO_KEYS)}")
    if not isinstance(ele.get("video"), (str, os.PathLike)):
        raise VideoError(f"the video element's 'video' must be a file path, got {type(ele.get('video')).__name__} "
                         "(lists of frames: turn them into a file, or use read_frames + FrameEncoder)")
    path = os.fspath(ele["video"])
    if path.startswith(("http://", "https://")):
        raise VideoError(f"{path}: windowkit reads local files only (nothing is downloaded)")
    ele["video"] = path[len("file://"):] if path.startswith("file://") else path
    if "fps" in ele and "nframes" in ele:
        raise VideoError("pass either fps or nframes, not both (qwen-vl-utils' rule)")
    for k in ("fps", "nframes", "min_frames", "max_frames", "min_pixels", "max_pixels", "total_pixels",
              "resized_height", "resized_width"):
        if k in ele and (isinstance(ele[k], bool) or not isinstance(ele[k], (int, float)) or not ele[k] > 0
                         or not math.isfinite(ele[k])):
            raise VideoError(f"{k} must be a positive number, got {ele[k]!r}")
    for k in ("video_start", "video_end"):
        if k in ele and (isinstance(ele[k], bool) or not isinstance(ele[k], (int, float)) or ele[k] < 0):
            raise VideoError(f"{k} must be a number of seconds >= 0, got {ele[k]!r}")
    if ("resized_height" in ele) != ("resized_width" in ele):
        raise VideoError("pass resized_height and resized_width together")
    if "min_pixels" in ele and "max_pixels" in ele and ele["min_pixels"] > ele["max_pixels"]:
        raise VideoError(f"min_pixels {ele['min_pixels']} > max_pixels {ele['max_pixels']}")
    return ele


def _count_frames(cv2: Any, path: str) -> int:
    cap = cv2.VideoCapture(path)
    n = 0
    try:
        while cap.grab():
            n += 1
    finally:
        cap.release()
    return n


def _decode_at(cv2: Any, path: str, wanted: list[int]) -> list[np.ndarray]:
    """RGB uint8 frames at the (sorted, possibly repeated) indices ``wanted``, decoding sequentially."""
    cap = cv2.VideoCapture(path)
    out: dict[int, np.ndarray] = {}
    try:
        need = sorted(set(wanted))
        i, k = 0, 0
        while k < len(need):
            if not cap.grab():
                break
            if i == need[k]:
                ok, bgr = cap.retrieve()
                if not ok or bgr is None:
                    break
                out[i] = cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
                k += 1
            i += 1
    finally:
        cap.release()
    if len(out) != len(set(wanted)):
        missing = sorted(set(wanted) - set(out))
        raise VideoError(f"video {path}: frames {missing[:5]} of the {len(set(wanted))} sampled could not be decoded "
                         "(truncated or corrupt file)")
    return [out[i] for i in wanted]


def sample_qwen_video(video: Any, image_patch_size: int = 14, **sampling: Any) -> QwenVideo:
    """Sample and resize a video exactly as ``qwen_vl_utils.fetch_video`` (0.0.14) does, reading it with OpenCV.

    ``video`` is a path (sampling arguments as keywords), a Qwen video element, or Qwen-style messages holding one
    video element: ``fps`` or ``nframes``, ``min_frames`` / ``max_frames``, ``min_pixels`` / ``max_pixels`` /
    ``total_pixels``, ``resized_height`` / ``resized_width``, ``video_start`` / ``video_end``. qwen-vl-utils'
    own functions pick the frames (``calculate_video_frame_range``, ``smart_nframes``, the same ``linspace``
    indices) and the size (``smart_resize`` with its default budgets); the frames are resized with the same
    bicubic, antialiased torchvision resize. ``image_patch_size``: 14 for Qwen2.5-VL, 16 for Qwen3-VL.

        v = sample_qwen_video("clip.mp4", fps=2.0, max_pixels=64 * 28 * 28)
        v.frames.shape        # [T, 3, H, W], H and W multiples of 28

    Raises ``VideoError`` (nothing is returned, nothing written) for: a missing file or a folder, a file OpenCV
    cannot open or decode, a video with no frames (or fewer than 2, one temporal patch), an ``fps`` above the
    video's own frame rate, ``nframes`` above the frames there are, a bad time range, or a bad argument.
    """
    cv2 = _cv2()
    ele = qwen_video_element(video, **sampling)
    vp = _qwen_vl_utils()
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as tvF

    path = ele["video"]
    if not os.path.exists(path):
        raise VideoError(f"video file not found: {path}")
    if not os.path.isfile(path):
        raise VideoError(f"not a file: {path}")
    cap = cv2.VideoCapture(path)
    try:
        if not cap.isOpened():
            raise VideoError(f"OpenCV cannot open video {path} (not a video or unsupported codec)")
        video_fps = float(cap.get(cv2.CAP_PROP_FPS) or 0.0)
        reported = int(cap.get(cv2.CAP_PROP_FRAME_COUNT) or 0)
    finally:
        cap.release()
    if not (video_fps > 0 and math.isfinite(video_fps)):
        raise VideoError(f"video {path} reports no frame rate (OpenCV gives {video_fps}); fps sampling needs one")
    total = reported if reported > 0 else _count_frames(cv2, path)
    if total <= 0:
        raise VideoError(f"video {path} has no decodable frames")
    if "fps" in ele and float(ele["fps"]) > video_fps:
        raise VideoError(f"fps {ele['fps']} is above the video's own {video_fps:g} fps ({path}): sample at most "
                         f"{video_fps:g} fps, or pass nframes")

    def pick(total_frames: int) -> tuple[list[int], int, int]:
        try:
            start, end, n_range = vp.calculate_video_frame_range(ele, total_frames, video_fps)
            nframes = vp.smart_nframes(ele, total_frames=n_range, video_fps=video_fps)
        except (ValueError, AssertionError) as e:
            raise VideoError(f"video {path} ({total_frames} frames at {video_fps:g} fps): {e}") from None
        return torch.linspace(start, end, nframes).round().long().tolist(), n_range, nframes

    idx, n_range, nframes = pick(total)
    rgb = _decode_at(cv2, path, idx)  # a frame the container lists but cannot decode: VideoError (corrupt file)
    frames = torch.from_numpy(np.stack(rgb)).permute(0, 3, 1, 2)  # uint8 [T, 3, H, W], as decord's reader gives
    sample_fps = nframes / max(n_range, 1e-6) * video_fps
    # the resize block of qwen_vl_utils.fetch_video, with its own functions and defaults
    factor = int(image_patch_size) * vp.SPATIAL_MERGE_SIZE
    min_pixels = ele.get("min_pixels", vp.VIDEO_MIN_TOKEN_NUM * factor * factor)
    total_pixels = ele.get("total_pixels", vp.MODEL_SEQ_LEN * factor * factor * 0.9)
    max_pixels = max(min(vp.VIDEO_MAX_TOKEN_NUM * factor * factor, total_pixels / nframes * vp.FRAME_FACTOR),
                     int(min_pixels * 1.05))
    max_pixels = min(ele.get("max_pixels", max_pixels), max_pixels)
    _, _, height, width = frames.shape
    try:
        if "resized_height" in ele:
            rh, rw = vp.smart_resize(ele["resized_height"], ele["resized_width"], factor=factor)
        else:
            rh, rw = vp.smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    except (ValueError, AssertionError) as e:
        raise VideoError(f"video {path}: cannot resize {width}x{height}: {e}") from None
    out = tvF.resize(frames, [rh, rw], interpolation=InterpolationMode.BICUBIC, antialias=True).float()
    return QwenVideo(out, [int(i) for i in idx], video_fps, sample_fps, int(n_range), path)


__all__ = ["VideoError", "Frame", "synthetic_frame", "write_synthetic_video", "read_frames", "QwenVideo",
           "QWEN_VIDEO_KEYS", "qwen_video_element", "sample_qwen_video"]
