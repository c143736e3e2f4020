"""Cold tier: a canonical ``ChunkKV`` stored as exact edge rows + a per-layer, per-slot low-rank middle.

    from windowkit.store import ChunkStore, ColdTierConfig

    store = ChunkStore(budget_bytes=64 << 20, cold=ColdTierConfig(rank=16))   # off unless ``cold`` is given
    store.compress(key)                  # now; or let budget pressure do it (see docs/store.md, "Cold tier")
    kv = store.get_canonical(key)        # reconstructed ChunkKV; store.meta(key)["approx"] = relative error

The method is the one described in Zhongzhu Zhou's review "iS-KV: When the Basis Moves, the History Must Move
with It" (of Zhao et al., "iS-KV: Online Low-Rank KV Cache Compression via Block-Incremental SVD", arXiv
2610.02815); sections, algorithms and equations below are the review's. Layout of one cold canonical (section
"Exact states, pending states, and compressed history", Algorithm 1, steps 6-8, for a finished chunk)::

    slot X [H, S, D] of layer l   ->  rows [0, p)      exact   "cold.l.s.head" [H, p, D]   (attention sinks)
                                      rows [p, S - r)  U diag(S) Bᵀ over the concatenated heads, d = H·D:
                                                       "cold.l.s.U" [n, k], "cold.l.s.S" [k], "cold.l.s.B" [d, k]
                                      rows [S - r, S)  exact   "cold.l.s.tail" [H, r, D]   (recent rows)
    a slot whose middle is below break-even stays dense under its usual name "l.s"; positions stay exact.

Factorization: ``IncrementalSVD`` from ``windowkit.kv.isvd`` with a single block update, i.e. the one-shot
truncated SVD of Algorithm 2 step 1 in fp32 (with eq. (5)'s numerical floor, so exactly-zero directions are
not stored). A stored canonical is complete and immutable, so there is nothing to fold incrementally: the
one-shot SVD of the whole middle block is the global optimum of eq. (2), where a block-by-block fold is
only locally optimal (section "Why the optimum is local"). Factors are stored in ``factor_dtype`` (bf16 by
default: fp16's range overflowed for derived factors such as singular values in the paper's long runs, section
"Precision is part of the method configuration"); the reconstruction is fp32 math, rounded once to the KV dtype.

``rope``: with a ``RopeSpec`` (1-D RoPE) the rope slot's middle block is rotated back to position 0
(pre-RoPE, as the paper factorizes keys: section "Prefill chooses what stays exact") before the SVD and rotated to its stored positions again on
reconstruction. The spec's frequencies travel in the entry, so a reader needs no configuration.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from windowkit.errors import KVShapeError, WindowkitError
from windowkit.kv.isvd import IncrementalSVD, break_even_rows, persistent_bytes
from windowkit.kv.layout import ChunkKV, KVLayout
from windowkit.kv.rope import RopeSpec, relocate_keys

Tensors = dict[str, torch.Tensor]
PREFIX = "cold."
_ROPE_FREQ, _ROPE_PAIRING = "cold.rope.inv_freq", "cold.rope.interleaved"

__all__ = ["ColdTierConfig", "compress_tensors", "decompress_tensors", "is_cold", "compress_kv", "decompress_kv"]


@dataclass(frozen=True)
class ColdTierConfig:
    """How a canonical is stored cold.

    rank: largest number of singular triplets kept per (layer, slot).
    protected_rows: first rows kept exact (attention sinks; the review's protected set, reduced to the start
        of a chunk).
    recent_rows: last rows kept exact (the rows nearest whatever follows the chunk in a window).
    min_rows: smallest middle block (rows between the exact ones) worth factorizing; None: the break-even
        length ``break_even_rows(d, rank)`` of eq. (13) for that slot's width ``d = heads·dim``. A slot below
        it, or with ``rank >= d``, or whose factors would not be smaller than its dense middle, stays exact; a
        canonical with no compressible slot is not made cold at all.
    factor_dtype: dtype of U, S, B as stored (bf16 default; float32 for exact-SVD tests).
    rope: optional ``RopeSpec`` (1-D RoPE only): factorize the rope slot pre-RoPE (see the module doc).
    """

    rank: int
    protected_rows: int = 4
    recent_rows: int = 16
    min_rows: Optional[int] = None
    factor_dtype: torch.dtype = torch.bfloat16
    rope: Optional[RopeSpec] = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise WindowkitError(f"ColdTierConfig.rank must be an int >= 1, got {self.rank!r}")
        for name in ("protected_rows", "recent_rows"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise WindowkitError(f"ColdTierConfig.{name} must be an int >= 0, got {v!r}")
        if self.min_rows is not None and (not isinstance(self.min_rows, int) or self.min_rows < 1):
            raise WindowkitError(f"ColdTierConfig.min_rows must be None or an int >= 1, got {self.min_rows!r}")
        if self.factor_dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
            raise WindowkitError(f"ColdTierConfig.factor_dtype must be a float dtype, got {self.factor_dtype}")
        if self.rope is not None and (not isinstance(self.rope, RopeSpec) or self.rope.n_axes != 1):
            raise WindowkitError("ColdTierConfig.rope must be a 1-D RopeSpec (M-RoPE is not supported here)")

    def min_rows_for(self, d: int) -> Optional[int]:
        """Smallest middle block factorized for width ``d``; None if rank-``rank`` factors never pay off."""
        if self.rank >= d:
            return None
        return self.min_rows if self.min_rows is not None else break_even_rows(d, self.rank)


def is_cold(tensors: Tensors) -> bool:
    """Whether a canonical's stored tensors are a cold (compressed) form."""
    return any(k.startswith(PREFIX) for k in tensors)


def _nbytes(tensors: Tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _pos1d(positions: Optional[torch.Tensor], S: int) -> torch.Tensor:
    if positions is None:
        return torch.arange(S)
    if positions.shape[0] != 1:
        raise KVShapeError("pre-RoPE cold storage needs 1-D positions")
    return positions[0]


@torch.no_grad()
def compress_kv(kv: ChunkKV, cfg: ColdTierConfig) -> Optional[tuple[Tensors, dict]]:
    """Cold tensors of ``kv`` and facts about them, or None when no slot is worth compressing.

    Facts: ``approx`` (relative Frobenius error of the reconstruction over all layers and slots, fp32),
    ``rank``, ``exact_bytes`` (bytes of the dense form, positions included), ``bytes``, ``slots_cold``.
    """
    lay, S = kv.layout, kv.num_tokens
    p = min(cfg.protected_rows, S)
    r = min(cfg.recent_rows, S - p)
    n = S - p - r
    out: Tensors = {}
    cold_slots = 0
    rope = cfg.rope if cfg.rope is not None else None
    pos = None
    for l, pair in enumerate(kv.layers):
        for s, x in enumerate(pair):
            h, dim = lay.slot_shapes[s]
            d = h * dim
            need = cfg.min_rows_for(d)
            fb = torch.empty(0, dtype=cfg.factor_dtype).element_size()
            ok = (need is not None and n >= need and n > 0
                  and persistent_bytes(n, d, cfg.rank, factor_bytes=fb) < n * d * x.element_size())
            if not ok:
                out[f"{l}.{s}"] = x.detach().contiguous()
                continue
            mid = x[:, p:S - r].float()
            if rope is not None and s == lay.rope_slot:
                if pos is None:
                    pos = _pos1d(kv.positions, S)[p:S - r].to(x.device)
                mid = relocate_keys(mid, -pos, rope, positions=pos)  # to position 0: pre-RoPE
            M = mid.permute(1, 0, 2).reshape(n, d)  # rows = tokens, features = concatenated heads
            isvd = IncrementalSVD(cfg.rank, store_dtype=cfg.factor_dtype, device=x.device)
            isvd.update(M)  # empty history: one-shot truncated SVD (Algorithm 2, step 1), fp32
            key = f"{PREFIX}{l}.{s}."
            out[key + "head"] = x[:, :p].detach().contiguous()
            out[key + "tail"] = x[:, S - r:].detach().contiguous()
            out[key + "U"], out[key + "S"], out[key + "B"] = isvd.U, isvd.S, isvd.B
            cold_slots += 1
    if cold_slots == 0:
        return None
    if kv.positions is not None:
        out["positions"] = kv.positions.contiguous()
    if rope is not None and pos is not None:
        out[_ROPE_FREQ] = rope.inv_freq.detach().float().cpu().contiguous()
        out[_ROPE_PAIRING] = torch.tensor([1 if rope.pairing == "interleaved" else 0], dtype=torch.int8)
    rec = decompress_tensors(out, lay)
    num = den = 0.0
    for (a, b), (ra, rb) in zip(kv.layers, rec.layers):
        for x, y in ((a, ra), (b, rb)):
            num += float((y.float() - x.float()).pow(2).sum())
            den += float(x.float().pow(2).sum())
    exact = kv.nbytes + (0 if kv.positions is None else kv.positions.numel() * kv.positions.element_size())
    facts = {"approx": math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf), "rank": cfg.rank,
             "exact_bytes": exact, "bytes": _nbytes(out), "slots_cold": cold_slots,
             "slots": 2 * lay.num_layers, "exact_rows": [p, r], "pre_rope": pos is not None}
    return out, facts


def compress_tensors(tensors: Tensors, layout: KVLayout, cfg: ColdTierConfig) -> Optional[tuple[Tensors, dict]]:
    """``compress_kv`` on a canonical's stored tensors (``ChunkKV.to_tensors()``); None if already cold."""
    if is_cold(tensors):
        return None
    return compress_kv(ChunkKV.from_tensors(tensors, layout), cfg)


@torch.no_grad()
def decompress_tensors(tensors: Tensors, layout: KVLayout) -> ChunkKV:
    """The reconstructed ``ChunkKV`` of cold tensors (exact rows and positions as stored, fp32 math)."""
    positions = tensors.get("positions")
    rope = None
    if _ROPE_FREQ in tensors:
        inter = bool(int(tensors[_ROPE_PAIRING][0]))
        rope = RopeSpec(tensors[_ROPE_FREQ].float(), "interleaved" if inter else "half")
    layers = []
    for l in range(layout.num_layers):
        pair = []
        for s in (0, 1):
            dense = tensors.get(f"{l}.{s}")
            if dense is not None:
                pair.append(dense)
                continue
            key = f"{PREFIX}{l}.{s}."
            try:
                head, tail = tensors[key + "head"], tensors[key + "tail"]
                U, Sv, B = tensors[key + "U"].float(), tensors[key + "S"].float(), tensors[key + "B"].float()
            except KeyError as e:
                raise KVShapeError(f"cold canonical lacks tensor {e}") from None
            h, dim = layout.slot_shapes[s]
            if head.dim() != 3 or head.shape[0] != h or head.shape[2] != dim or B.shape[0] != h * dim:
                raise KVShapeError(f"cold slot {l}.{s} does not match {layout.describe()}")
            n = U.shape[0]
            mid = ((U * Sv) @ B.T).reshape(n, h, dim).permute(1, 0, 2)  # [H, n, D] fp32
            if rope is not None and s == layout.rope_slot:
                S = head.shape[1] + n + tail.shape[1]
                pos = _pos1d(positions, S)[head.shape[1]:head.shape[1] + n].to(mid.device)
                mid = relocate_keys(mid.contiguous(), pos, rope, positions=torch.zeros_like(pos))
            pair.append(torch.cat([head, mid.to(device=head.device, dtype=head.dtype), tail], 1))
        layers.append((pair[0], pair[1]))
    return ChunkKV(layers, layout, positions)


def decompress_kv(tensors: Tensors, layout: KVLayout) -> ChunkKV:
    """Alias of ``decompress_tensors``."""
    return decompress_tensors(tensors, layout)
