"""CostModelBackend: the Backend protocol without a model, so a real Window runs on traces at ~no cost.

KV is fake and tiny (1 layer, 1 KV head, head_dim 2, zeros): the Window's relocations, patch forms and
applies run their real code paths on negligible tensors, while the backend books *modeled* milliseconds
from a CostProfile into ``ledger``: prefill per forwarded token, vision encode the first time a visual
chunk id is seen. Relocation / patch costs happen inside the Window (no backend call), so the simulator
charges them from Window.stats deltas with ``charge_reuse``.

    backend = CostModelBackend(load_profile("h100-kamera"))
    win = Window(backend, mode="patch")
    win.assign([backend.chunk("frame-1", 64, "video"), backend.chunk("q", 20)])
    backend.ledger.total_ms
"""
from __future__ import annotations

import copy
import hashlib
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import torch

from windowkit.backends.base import BackendStats, ForwardResult
from windowkit.chunk import Chunk
from windowkit.errors import ChunkError, KVShapeError, UnsupportedModelError
from windowkit.kv.layout import ChunkKV, KVLayout
from windowkit.kv.rope import RopeSpec
from windowkit.trace.costs import CostProfile, load_profile

LAYOUT = KVLayout("gqa", 1, ((1, 2), (1, 2)), rope_slot=0)  # 16 fake bytes per token
VOCAB = 8


@dataclass
class CostLedger:
    """Modeled cost booked so far (cumulative)."""

    prefill_ms: float = 0.0
    vision_ms: float = 0.0
    replay_ms: float = 0.0
    patch_apply_ms: float = 0.0
    patch_form_ms: float = 0.0
    prefill_tokens: int = 0
    vision_encodes: int = 0  # vision-tower runs (one per distinct visual chunk)
    forwards: int = 0
    # part of prefill_ms: canonical encodes of chunks already prefilled in context (form="eager" encodes them
    # at admission; the default form="lazy" only when something needs the canonical)
    encode_extra_ms: float = 0.0

    @property
    def total_ms(self) -> float:
        return self.prefill_ms + self.vision_ms + self.replay_ms + self.patch_apply_ms + self.patch_form_ms

    def as_dict(self) -> dict:
        d = asdict(self)
        d["total_ms"] = self.total_ms
        return d

    def copy(self) -> "CostLedger":
        return copy.copy(self)  # flat numbers: a shallow copy is a copy (asdict's deep walk was a step's hot spot)


def chunk_ids_for(chunk_id: str, tokens: int) -> torch.Tensor:
    """Token ids derived from a trace id: a 63-bit digest first (so the content hash, and the store key,
    is distinct per id), zeros after. Deterministic across runs."""
    if tokens < 1:
        raise ChunkError(f"chunk {chunk_id!r}: tokens must be >= 1, got {tokens}")
    ids = torch.zeros(int(tokens), dtype=torch.long)
    ids[0] = int.from_bytes(hashlib.sha256(chunk_id.encode()).digest()[:8], "little") >> 1
    return ids


class CostModelBackend:
    """A Backend whose forwards cost modeled time instead of compute (see the module docstring).

    profile:  a CostProfile or the name / path of one
    vision_cache: True (default) runs the vision tower once per distinct chunk id, like HFBackend's
              embedding cache; False charges it on every forward of a visual chunk.
    """

    n_axes = 1
    reads_attention = False  # no attention to read: query_attention raises, the Window's focus is off
    needs_past = False  # forward never reads the cache: the Window skips assembling it
    vocab_size = VOCAB
    dtype = torch.float32
    device = torch.device("cpu")

    def __init__(self, profile="h100-kamera", *, vision_cache: bool = True):
        self.profile: CostProfile = load_profile(profile)
        self.layout = LAYOUT
        self.rope = RopeSpec(inv_freq=torch.tensor([1e-4]))
        self.stats = BackendStats()
        self.ledger = CostLedger()
        self.vision_cache = vision_cache
        self._seen_visual: set[str] = set()
        self._forwarded: set[str] = set()
        self._zero_kv: dict[int, ChunkKV] = {}

    # ------------------------------------------------------------------ chunks from trace ids
    @staticmethod
    def chunk(chunk_id: str, tokens: int, kind: str = "text") -> Chunk:
        """A text Chunk standing for a trace chunk; its modality rides in ``meta["modality"]``."""
        return Chunk.text(chunk_ids_for(chunk_id, tokens), id=chunk_id, modality=kind)

    # ------------------------------------------------------------------ Backend protocol
    def fingerprint(self) -> str:
        return f"costmodel-{self.profile.name}"

    def positions(self, chunk: Chunk, start: int) -> tuple[torch.Tensor, int]:
        n = len(chunk)
        return torch.arange(int(start), int(start) + n, dtype=torch.long)[None], n

    def span(self, chunk: Chunk) -> int:
        return len(chunk)

    def forward(self, chunks: Sequence[Chunk], start: int, past: Optional[ChunkKV] = None) -> ForwardResult:
        """Book prefill (and first-sight vision) cost for ``chunks``; return zero KV at their positions."""
        if not chunks:
            raise ChunkError("forward needs at least one chunk")
        counts = [len(c) for c in chunks]
        n = sum(counts)
        for c in chunks:
            if c.meta.get("modality", "text") != "text":
                if not self.vision_cache or c.id not in self._seen_visual:
                    self._seen_visual.add(c.id)
                    self.ledger.vision_ms += self.profile.vision_ms(len(c))
                    self.ledger.vision_encodes += 1
                    self.stats.vision_calls += 1
        self.ledger.prefill_ms += self.profile.prefill_ms(n)
        if len(chunks) == 1 and int(start) == 0 and past is None and chunks[0].id in self._forwarded \
                and not chunks[0].id.startswith("__"):
            self.ledger.encode_extra_ms += self.profile.prefill_ms(n)
        self._forwarded.update(c.id for c in chunks)
        self.ledger.prefill_tokens += n
        self.ledger.forwards += 1
        self.stats.forwards += 1
        self.stats.forward_tokens += n
        # positions=None: relocation then uses the plain δ·inv_freq angle (fewer torch ops; the fake KV is zeros)
        return ForwardResult(self._zeros(n), torch.zeros(VOCAB), counts, counts)

    def encode(self, chunk: Chunk) -> ChunkKV:
        return self.forward([chunk], 0).kv

    supports_recompute = True

    def recompute(self, past: Optional[ChunkKV], chunks: Sequence[Chunk], starts: Sequence[int],
                  offsets: Sequence[torch.Tensor], **kw) -> list[ChunkKV]:
        """HFBackend.recompute's cost: one forward of the chosen tokens, booked as prefill tokens (no vision:
        their embeddings are cached). Returns zero KV for them."""
        counts = [len(o) for o in offsets]
        n = sum(counts)
        if n < 1:
            raise ChunkError("recompute: no token chosen")
        self.ledger.prefill_ms += self.profile.prefill_ms(n)
        self.ledger.prefill_tokens += n
        self.ledger.forwards += 1
        self.stats.forwards += 1
        self.stats.forward_tokens += n
        zk = self._zero_kv
        out = [zk[k] if k in zk else self._zeros(k) for k in counts]
        if kw.get("return_logits"):
            return out, torch.zeros(VOCAB)
        return out

    def query_attention(self, past: ChunkKV, query: Chunk, start: int, rows: int = 1, lookahead: int = 0,
                        return_kv: bool = False):
        """A cost model reads no attention (``reads_attention`` is False): raises UnsupportedModelError."""
        raise UnsupportedModelError("CostModelBackend reads no attention (reads_attention is False)")

    def _zeros(self, n: int) -> ChunkKV:
        """A shared zero KV of ``n`` tokens: the Window never writes into a backend's KV (edits make new tensors)."""
        kv = self._zero_kv.get(n)
        if kv is None:
            z = torch.zeros(1, n, 2)
            kv = self._zero_kv[n] = ChunkKV([(z, z)], LAYOUT, None)
        return kv

    def make_cache(self, past: Optional[ChunkKV]) -> Optional[ChunkKV]:
        """No model runtime here: the 'cache' is the spliced ChunkKV itself."""
        if past is not None:
            self.check_kv(past)
        return past

    def forget(self, chunk: Chunk) -> None:
        """Nothing cached per chunk except 'vision already ran', which the store-side view keeps."""

    def check_kv(self, kv: ChunkKV) -> None:
        if kv.layout != self.layout:
            raise KVShapeError(f"KV layout {kv.layout.describe()} does not match {self.layout.describe()}")

    # ------------------------------------------------------------------ costs booked from Window deltas
    def charge_reuse(self, replay_tokens: int = 0, patch_apply_tokens: int = 0, patch_form_tokens: int = 0) -> float:
        """Book KV replay (relocate/place), rank-m adds and SVDs done inside the Window. Returns the ms."""
        p = self.profile
        a, b, c = p.replay_ms(replay_tokens), p.patch_apply_ms(patch_apply_tokens), p.patch_form_ms(patch_form_tokens)
        self.ledger.replay_ms += a
        self.ledger.patch_apply_ms += b
        self.ledger.patch_form_ms += c
        return a + b + c


__all__ = ["CostModelBackend", "CostLedger", "chunk_ids_for", "LAYOUT"]
