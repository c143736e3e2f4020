"""Helpers the agents share (the long-video, web and browser agents).

    from agents.common import common_prefix, common_prefix_tokens

    common_prefix(prev_chunks, chunks)          # leading chunks unchanged since the previous step (by id)
    common_prefix_tokens(prev_chunks, chunks)   # tokens a prefix cache re-prefills this step

The KL between two next-token distributions is ``windowkit.kv.metrics.kl_divergence``.
"""
from __future__ import annotations

from typing import Sequence

from windowkit.chunk import Chunk


def common_prefix(prev: Sequence[Chunk], cur: Sequence[Chunk]) -> int:
    """Number of leading chunks ``cur`` shares with ``prev`` (by id)."""
    k = 0
    while k < min(len(prev), len(cur)) and prev[k].id == cur[k].id:
        k += 1
    return k


def common_prefix_tokens(prev: Sequence[Chunk], cur: Sequence[Chunk]) -> int:
    """Tokens of ``cur`` from its first chunk that differs from ``prev`` on (a prefix cache re-prefills them)."""
    return sum(len(c) for c in cur[common_prefix(prev, cur):])


__all__ = ["common_prefix", "common_prefix_tokens"]
