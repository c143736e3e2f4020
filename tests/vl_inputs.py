"""Synthetic Qwen-VL chunks for tests: token ids, pixels and grids laid out as the processors do.

    from tests.vl_inputs import image_chunk, text_chunk, video_chunk, model_inputs
    a = text_chunk(5, seed=1)
    b = image_chunk("tiny-qwen3-vl", n_grid=(1, 4, 4), seed=2, text_before=2)   # 4 merged image tokens
    v = video_chunk("tiny-qwen2.5-vl", n_grid=(2, 4, 4), seed=3, second_per_grid_ts=0.5)
    kw = model_inputs([a, b, v])          # kwargs for the model's own full forward / get_rope_index

Layouts (ids 3/4/5/6 = vision_start / vision_end / image_pad / video_pad, as in windowkit.backends.tiny):
    image:              text_before · <vs> · <image_pad>*N · <ve> · text_after
    video, Qwen2.5-VL:  text_before · <vs> · <video_pad>*(T*N) · <ve> · text_after
    video, Qwen3-VL:    text_before · (<t_k> · <vs> · <video_pad>*N · <ve>) per temporal patch k · text_after
with N = (H/2)*(W/2) merged tokens per temporal patch. Pixel rows are random normal, one per patch:
C * temporal_patch(2) * P * P with P = 14 (Qwen2.5-VL) or 16 (Qwen3-VL).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from windowkit.chunk import Chunk

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 3, 4, 5, 6
MERGE = 2
TEMPORAL_PATCH = 2
PATCH = {"tiny-qwen2.5-vl": 14, "tiny-qwen3-vl": 16}
TEXT_LOW, VOCAB = 10, 200  # random text ids avoid the special ids < 10


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


def _text_ids(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(TEXT_LOW, VOCAB, (n,), generator=g)


def _pixel_row(model_name: str) -> int:
    if model_name not in PATCH:
        raise ValueError(f"unknown VL model {model_name!r}; choose from {', '.join(PATCH)}")
    p = PATCH[model_name]
    return 3 * TEMPORAL_PATCH * p * p


def text_chunk(n: int = 6, seed: int = 0, id: str = "") -> Chunk:
    """A text chunk of ``n`` random ids."""
    return Chunk.text(_text_ids(n, _gen(seed)), id=id)


def image_chunk(model_name: str, n_grid: Sequence[int] = (1, 4, 4), seed: int = 0, text_before: int = 2,
                text_after: int = 0, id: str = "", n_pad: Optional[int] = None) -> Chunk:
    """An image chunk; ``n_pad`` overrides the number of image pad tokens (to build a bad chunk)."""
    t, h, w = (int(x) for x in n_grid)
    g = _gen(seed)
    n_tok = t * h * w // (MERGE * MERGE)
    n_pad = n_tok if n_pad is None else n_pad
    ids = torch.cat([_text_ids(text_before, g), torch.tensor([VISION_START]), torch.full((n_pad,), IMAGE_PAD),
                     torch.tensor([VISION_END]), _text_ids(text_after, g)])
    pv = torch.randn(t * h * w, _pixel_row(model_name), generator=g)
    return Chunk.image(ids, pixel_values=pv, image_grid_thw=torch.tensor([[t, h, w]]), id=id)


def video_chunk(model_name: str, n_grid: Sequence[int] = (2, 4, 4), seed: int = 0, text_before: int = 2,
                text_after: int = 0, second_per_grid_ts: Optional[float] = None, id: str = "") -> Chunk:
    """A video chunk of T temporal patches (Qwen3-VL: one timestamped <vs>...<ve> block per patch)."""
    t, h, w = (int(x) for x in n_grid)
    g = _gen(seed)
    per_frame = h * w // (MERGE * MERGE)
    parts = [_text_ids(text_before, g)]
    if model_name == "tiny-qwen3-vl":
        for k in range(t):  # a one-token "timestamp" then the frame
            parts += [torch.tensor([TEXT_LOW + k]), torch.tensor([VISION_START]), torch.full((per_frame,), VIDEO_PAD),
                      torch.tensor([VISION_END])]
    else:
        parts += [torch.tensor([VISION_START]), torch.full((t * per_frame,), VIDEO_PAD), torch.tensor([VISION_END])]
    parts.append(_text_ids(text_after, g))
    pv = torch.randn(t * h * w, _pixel_row(model_name), generator=g)
    secs = None if second_per_grid_ts is None else torch.tensor([float(second_per_grid_ts)])
    return Chunk.video(torch.cat(parts), pixel_values_videos=pv, video_grid_thw=torch.tensor([[t, h, w]]),
                       second_per_grid_ts=secs, id=id)


def mm_token_type_ids(input_ids: torch.Tensor) -> torch.Tensor:
    """0 text, 1 image pad, 2 video pad: what the processors return (``create_mm_token_type_ids``)."""
    out = torch.zeros_like(input_ids, dtype=torch.int)
    out[input_ids == IMAGE_PAD] = 1
    out[input_ids == VIDEO_PAD] = 2
    return out


def model_inputs(chunks: Sequence[Chunk]) -> dict:
    """Batch-of-one kwargs of the concatenated chunks for ``model(...)`` / ``model.model.get_rope_index``."""
    ids = torch.cat([c.input_ids for c in chunks])[None]  # [1, L]
    kw: dict = {"input_ids": ids, "mm_token_type_ids": mm_token_type_ids(ids)}
    imgs = [c for c in chunks if c.pixel_values is not None]
    vids = [c for c in chunks if c.pixel_values_videos is not None]
    if imgs:
        kw["pixel_values"] = torch.cat([c.pixel_values for c in imgs])
        kw["image_grid_thw"] = torch.cat([c.image_grid_thw for c in imgs])
    if vids:
        kw["pixel_values_videos"] = torch.cat([c.pixel_values_videos for c in vids])
        kw["video_grid_thw"] = torch.cat([c.video_grid_thw for c in vids])
        if any(c.second_per_grid_ts is not None for c in vids):
            kw["second_per_grid_ts"] = torch.cat([
                c.second_per_grid_ts.float().reshape(-1) if c.second_per_grid_ts is not None
                else torch.ones(c.video_grid_thw.shape[0]) for c in vids])
    return kw


def rope_index_inputs(kw: dict) -> dict:
    """The subset of ``model_inputs`` that ``get_rope_index`` takes."""
    keys = ("input_ids", "mm_token_type_ids", "image_grid_thw", "video_grid_thw", "second_per_grid_ts")
    return {k: v for k, v in kw.items() if k in keys}


__all__ = ["text_chunk", "image_chunk", "video_chunk", "model_inputs", "mm_token_type_ids", "rope_index_inputs",
           "PATCH", "VISION_START", "VISION_END", "IMAGE_PAD", "VIDEO_PAD"]
