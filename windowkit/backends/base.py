"""The Backend protocol: what the Window needs from a model runtime.

A backend turns chunks into KV (``forward``), knows where each chunk's tokens sit in position space
(``positions``), and can run a query over a spliced cache. Positions are in *position space*: a
chunk starting at ``start`` occupies ``span`` position steps (its token count for text; for Qwen-VL
images, the model's own 3-D rule decides), and the next chunk starts at ``start + span``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import torch

from windowkit.chunk import Chunk
from windowkit.kv.layout import ChunkKV, KVLayout
from windowkit.kv.rope import RopeSpec


@dataclass
class Embeds:
    """A chunk's decoder inputs, computed once (the vision tower never re-runs for a cached chunk)."""

    embeds: torch.Tensor  # [S, hidden] in the model dtype
    visual_mask: Optional[torch.Tensor] = None  # [S] bool: which tokens are visual (deepstack)
    deepstack: Optional[list[torch.Tensor]] = None  # per deepstack layer [n_visual, hidden]


@dataclass
class ForwardResult:
    kv: ChunkKV  # KV of the tokens just run (all given chunks, in order)
    logits: torch.Tensor  # [vocab] next-token logits after the last token (fp32)
    spans: list[int]  # position-space span of each chunk run
    token_counts: list[int]  # tokens of each chunk run


@dataclass
class BackendStats:
    forwards: int = 0
    forward_tokens: int = 0
    vision_calls: int = 0
    extra: dict = field(default_factory=dict)


class Backend(Protocol):
    layout: KVLayout
    rope: RopeSpec
    stats: BackendStats

    def positions(self, chunk: Chunk, start: int) -> tuple[torch.Tensor, int]:
        """Position ids [n_axes, S] of ``chunk`` starting at ``start``, and its span."""

    def forward(self, chunks: Sequence[Chunk], start: int, past: Optional[ChunkKV] = None) -> ForwardResult:
        """Run ``chunks`` (concatenated) at ``start`` over the cached ``past``; return their KV + last logits."""

    def fingerprint(self) -> str:
        """Stable id of the model (config + weights sample), for the store's ModelMismatchError."""


__all__ = ["Backend", "BackendStats", "Embeds", "ForwardResult"]
