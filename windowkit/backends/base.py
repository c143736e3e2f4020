"""The Backend protocol: what the Window needs from a model runtime.

A backend turns chunks into KV (``forward``), knows where each chunk's tokens sit in position space
(``positions``), and can run a query over a spliced cache. Positions are in *position space*: a
chunk starting at ``start`` occupies ``span`` position steps (its token count for text; for Qwen-VL
images, the model's own 3-D rule decides), and the next chunk starts at ``start + span``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence, runtime_checkable

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
    busy_ms: float = 0.0  # wall time inside model calls (HFBackend: forward, recompute, query_attention, span)
    extra: dict = field(default_factory=dict)


@runtime_checkable
class Backend(Protocol):
    """The contract between the Window and a model runtime: every member the Window (and the simulator driving
    it) reads. ``HFBackend`` (text and Qwen-VL), ``SGLangBackend`` and ``trace.CostModelBackend`` satisfy it;
    ``isinstance(b, Backend)`` checks that every member is present (tests/test_backend_protocol.py checks their
    kinds too).

    Optional capabilities are flags with a safe meaning rather than members a caller probes for:
    ``needs_past`` (False: forwards never read the past, the Window only accounts), ``supports_recompute``
    (False: ``recompute`` raises and the Window repairs by full re-conditioning), ``reads_attention`` (False:
    ``query_attention`` raises and the Window's query focus is off).

    Shapes: S tokens of a chunk, L layers, per layer a (K, V) pair ``[heads, S, dim]`` (``KVLayout``),
    position ids ``[n_axes, S]`` (n_axes 1 for text models, 3 for Qwen-VL's M-RoPE).
    """

    # ------------------------------------------------------------------ facts (attributes or properties)
    layout: KVLayout
    """The KV layout every ChunkKV this backend returns or accepts has (layers, slots, heads, dims)."""

    rope: RopeSpec
    """The rotary embedding of the model: the Window relocates KV with it (exact re-rotation)."""

    stats: BackendStats
    """Cumulative counters (forwards, forward tokens, vision-tower runs); the Window reads ``vision_calls``."""

    n_axes: int
    """Rows of a position-id tensor: 1 (1-D RoPE) or 3 (M-RoPE)."""

    dtype: torch.dtype
    """The KV dtype (the model's dtype): the Window sizes its byte estimates with it."""

    needs_past: bool
    """True: ``forward`` / ``recompute`` read the past KV, so the Window assembles it. False (a cost model): they
    never read it, and the Window skips tensor work (relocations are only counted)."""

    supports_recompute: bool
    """True: ``recompute`` is exact for this model (selective repair). False: the Window never calls it and
    repairs stale survivors by re-conditioning them from the first stale one (one forward)."""

    reads_attention: bool
    """True: ``query_attention`` returns attention weights and ``recompute(..., probe=True)`` returns the last
    token's row (the Window's query focus uses them). False: both raise; the Window never asks."""

    # ------------------------------------------------------------------ identity and positions
    def fingerprint(self) -> str:
        """Stable id of the model (config + weights sample), for the store's keys and ModelMismatchError."""
        ...

    def positions(self, chunk: Chunk, start: int) -> tuple[torch.Tensor, int]:
        """Position ids [n_axes, S] of ``chunk`` starting at ``start``, and its span in position space."""
        ...

    def span(self, chunk: Chunk) -> int:
        """Position-space span of ``chunk`` (``positions(chunk, 0)[1]``): the next chunk starts this far on."""
        ...

    # ------------------------------------------------------------------ running the model
    def forward(self, chunks: Sequence[Chunk], start: int, past: Optional[ChunkKV] = None) -> ForwardResult:
        """Run ``chunks`` (concatenated) from position ``start`` over the cached ``past`` (the window KV from
        position 0, or None); return the KV of the new tokens only, the next-token logits [vocab] after the
        last one, and each chunk's span and token count."""
        ...

    def encode(self, chunk: Chunk) -> ChunkKV:
        """Canonical KV(B|∅): ``chunk`` alone at position 0 (``forward([chunk], 0).kv``)."""
        ...

    def recompute(self, past: Optional[ChunkKV], chunks: Sequence[Chunk], starts: Sequence[int],
                  offsets: Sequence[torch.Tensor], *, slots: Optional[Sequence[int]] = None,
                  return_logits: bool = False, probe: bool = False) -> Any:
        """Selective recompute (CacheBlend semantics): ONE forward of the tokens at ``offsets`` ([k_i] LongTensor
        per chunk) of each ``chunks[i]`` placed at ``starts[i]``, attending to ``past``'s stale KV of the other
        tokens. ``slots[i]``: the index in ``past`` of ``chunks[i]``'s first token (default ``starts``: 1-D
        positions; required where a chunk spans fewer positions than it has tokens, M-RoPE vision). Returns a list of ChunkKV (one per chunk, its chosen tokens); with ``return_logits``
        ``(kvs, logits [vocab])``; with ``probe`` too ``(kvs, logits, weights [positions])`` (needs
        ``reads_attention``). Raises UnsupportedModelError where ``supports_recompute`` is False."""
        ...

    def query_attention(self, past: ChunkKV, query: Chunk, start: int, rows: int = 1, lookahead: int = 0,
                        return_kv: bool = False) -> Any:
        """Attention weights [past.num_tokens] the query's last ``rows`` tokens (and ``lookahead`` greedy tokens)
        put on each past token, summed over heads and averaged over layers; with ``return_kv`` ``(weights, kv)``,
        kv being ``past`` followed by the query's KV. Raises UnsupportedModelError where ``reads_attention`` is
        False."""
        ...

    def forget(self, chunk: Chunk) -> None:
        """Drop anything cached for ``chunk`` (its decoder inputs); a later forward recomputes it. Never fails."""
        ...

    # ------------------------------------------------------------------ KV hand-off
    def make_cache(self, past: Optional[ChunkKV]) -> Any:
        """The runtime's cache object holding ``past`` (a transformers DynamicCache for HF; the ChunkKV itself for
        a cost model), what ``Window.materialize`` returns. Raises KVShapeError on a foreign layout."""
        ...

    def check_kv(self, kv: ChunkKV) -> None:
        """Raise KVShapeError unless ``kv`` fits this backend (layout; dtype and device where it runs a model)."""
        ...


__all__ = ["Backend", "BackendStats", "Embeds", "ForwardResult"]
