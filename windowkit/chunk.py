"""A chunk: the unit the window admits, evicts, recalls and reorders (a frame, a screenshot, a text span).

    a = Chunk.text(torch.tensor([1, 2, 3]))
    b = Chunk.image(ids, pixel_values=pv, image_grid_thw=torch.tensor([[1, 4, 4]]))

A chunk's default id is a hash of its inputs, so the same content always maps to the same store entry.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch

from windowkit.errors import ChunkError

Kind = Literal["text", "image", "video"]


def _hash_tensor(h: "hashlib._Hash", name: str, t: Optional[torch.Tensor]) -> None:
    if t is None:
        return
    t = t.detach().cpu().contiguous()
    h.update(f"{name}:{t.dtype}:{tuple(t.shape)}:".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


@dataclass(eq=False)
class Chunk:
    """Processed model inputs of one chunk (as a transformers processor returns them), plus an id."""

    input_ids: torch.Tensor  # [S] int64
    kind: Kind = "text"
    pixel_values: Optional[torch.Tensor] = None  # image patches [n_patches, C*T*P*P]
    image_grid_thw: Optional[torch.Tensor] = None  # [n_images, 3]
    pixel_values_videos: Optional[torch.Tensor] = None
    video_grid_thw: Optional[torch.Tensor] = None  # [n_videos, 3]
    second_per_grid_ts: Optional[torch.Tensor] = None  # Qwen2.5-VL video: seconds per temporal patch
    id: str = ""
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        ids = self.input_ids
        if not isinstance(ids, torch.Tensor):
            try:
                ids = torch.as_tensor(ids, dtype=torch.long)
            except (TypeError, ValueError) as e:
                raise ChunkError(f"input_ids must be a 1-D integer tensor: {e}") from None
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1:
            raise ChunkError(f"input_ids must be 1-D (one chunk, no batch), got shape {tuple(ids.shape)}")
        if ids.numel() == 0:
            raise ChunkError("empty chunk: input_ids has no tokens")
        if ids.is_floating_point() or ids.dtype == torch.bool:
            raise ChunkError(f"input_ids must be integers, got {ids.dtype}")
        self.input_ids = ids.long().cpu()
        if self.kind == "image" and (self.pixel_values is None or self.image_grid_thw is None):
            raise ChunkError("an image chunk needs pixel_values and image_grid_thw")
        if self.kind == "video" and (self.pixel_values_videos is None or self.video_grid_thw is None):
            raise ChunkError("a video chunk needs pixel_values_videos and video_grid_thw")
        for name in ("image_grid_thw", "video_grid_thw"):
            g = getattr(self, name)
            if g is not None:
                g = torch.as_tensor(g, dtype=torch.long)
                if g.dim() == 1:
                    g = g[None]
                if g.dim() != 2 or g.shape[1] != 3:
                    raise ChunkError(f"{name} must be [n, 3] (t, h, w), got {tuple(g.shape)}")
                setattr(self, name, g)
        if not self.id:
            self.id = self.content_hash()[:16]

    # ---------------------------------------------------------------- constructors
    @classmethod
    def text(cls, input_ids, id: str = "", **meta) -> "Chunk":
        return cls(input_ids, "text", id=id, meta=meta)

    @classmethod
    def image(cls, input_ids, *, pixel_values, image_grid_thw, id: str = "", **meta) -> "Chunk":
        return cls(input_ids, "image", pixel_values=pixel_values, image_grid_thw=image_grid_thw, id=id, meta=meta)

    @classmethod
    def video(cls, input_ids, *, pixel_values_videos, video_grid_thw, second_per_grid_ts=None, id: str = "",
              **meta) -> "Chunk":
        return cls(input_ids, "video", pixel_values_videos=pixel_values_videos, video_grid_thw=video_grid_thw,
                   second_per_grid_ts=second_per_grid_ts, id=id, meta=meta)

    # ---------------------------------------------------------------- facts
    def __len__(self) -> int:
        return int(self.input_ids.numel())

    @property
    def has_vision(self) -> bool:
        return self.pixel_values is not None or self.pixel_values_videos is not None

    def content_hash(self) -> str:
        """sha256 over ids, pixels and grids (the model fingerprint is added by the store). Cached."""
        cached = self.__dict__.get("_content_hash")
        if cached is not None:
            return cached
        h = hashlib.sha256()
        h.update(self.kind.encode())
        for name in ("input_ids", "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
                     "second_per_grid_ts"):
            _hash_tensor(h, name, getattr(self, name))
        self.__dict__["_content_hash"] = h.hexdigest()
        return self.__dict__["_content_hash"]

    def __repr__(self) -> str:
        return f"Chunk(id={self.id!r}, kind={self.kind!r}, tokens={len(self)})"


__all__ = ["Chunk", "Kind"]
