"""KV layouts and the batch-free KV of one chunk.

Every supported family stores, per layer, two tensors (transformers' ``layer.keys`` / ``layer.values``):

  family  slot 0                         slot 1                         rope on
  gqa     K   [H_kv, S, head_dim]        V   [H_kv, S, v_head_dim]      slot 0 (whole head)
  mla     c_KV latent [1, S, kv_lora]    k_pe [1, S, qk_rope_head_dim]  slot 1 (content latent never rotates)

MHA is GQA with H_kv = H_q. A ``ChunkKV`` is one chunk's slice of that cache, without the batch axis.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Literal, Optional, Sequence

import torch

from windowkit.errors import KVShapeError
from windowkit.kv.rope import Delta, RopeSpec, relocate_keys_many, shift_positions

Family = Literal["gqa", "mla"]


@dataclass(frozen=True)
class KVLayout:
    """Shape contract of a model's cache: per slot (heads, dim), which slot carries RoPE."""

    family: Family
    num_layers: int
    slot_shapes: tuple[tuple[int, int], tuple[int, int]]  # ((heads0, dim0), (heads1, dim1))
    rope_slot: int  # 0 for GQA/MHA keys, 1 for MLA k_pe

    @property
    def slot_names(self) -> tuple[str, str]:
        return ("k", "v") if self.family == "gqa" else ("latent", "k_pe")

    def describe(self) -> str:
        (h0, d0), (h1, d1) = self.slot_shapes
        n0, n1 = self.slot_names
        return f"{self.family}: {self.num_layers} layers, {n0}[{h0}x{d0}] {n1}[{h1}x{d1}], rope on {self.slot_names[self.rope_slot]}"


@dataclass
class ChunkKV:
    """One chunk's KV over all layers: ``layers[l] = (slot0 [H0, S, D0], slot1 [H1, S, D1])``."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    layout: KVLayout
    # [n_axes, S] positions the rope slot is rotated to now (None: unknown; relocation then uses δ·inv_freq)
    positions: Optional[torch.Tensor] = field(default=None)

    def __post_init__(self) -> None:
        if len(self.layers) != self.layout.num_layers:
            raise KVShapeError(f"{len(self.layers)} layers given, layout has {self.layout.num_layers}")
        s = None
        for l, pair in enumerate(self.layers):
            for slot, t in enumerate(pair):
                h, d = self.layout.slot_shapes[slot]
                if t.dim() != 3 or t.shape[0] != h or t.shape[2] != d:
                    raise KVShapeError(f"layer {l} slot {slot}: shape {tuple(t.shape)}, expected [{h}, S, {d}]")
                if s is None:
                    s = t.shape[1]
                elif t.shape[1] != s:
                    raise KVShapeError(f"layer {l} slot {slot}: {t.shape[1]} tokens, expected {s}")
        if self.positions is not None:
            p = self.positions.long().cpu()
            self.positions = p[None] if p.dim() == 1 else p
            if self.positions.shape[-1] != s:
                raise KVShapeError(f"positions cover {self.positions.shape[-1]} tokens, KV has {s}")

    @classmethod
    def _of_valid(cls, layers: list[tuple[torch.Tensor, torch.Tensor]], layout: KVLayout,
                  positions: Optional[torch.Tensor]) -> "ChunkKV":
        """A ChunkKV made from a checked one's parts (a slice, a rotation): valid by construction, not re-checked
        (the checks cost more than the edit on a chunk of a few tokens)."""
        kv = cls.__new__(cls)
        kv.layers, kv.layout, kv.positions = layers, layout, positions
        return kv

    # ---------------------------------------------------------------- facts
    @property
    def num_tokens(self) -> int:
        return int(self.layers[0][0].shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0][0].dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0][0].device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.layers for t in pair)

    # ---------------------------------------------------------------- edits (all return new objects)
    def relocate(self, delta: Delta, spec: RopeSpec) -> "ChunkKV":
        """R(delta) on the rope slot; the other slot is shared, not copied (it never changes)."""
        r = self.layout.rope_slot
        moved = relocate_keys_many([pair[r] for pair in self.layers], delta, spec, self.positions)  # one rotation
        out = []
        for pair, k in zip(self.layers, moved):
            p = list(pair)
            p[r] = k
            out.append((p[0], p[1]))
        pos = None if self.positions is None else shift_positions(self.positions, delta)
        return ChunkKV._of_valid(out, self.layout, pos)

    def slice(self, start: int, stop: int) -> "ChunkKV":
        pos = None if self.positions is None else self.positions[:, start:stop]
        return ChunkKV._of_valid([(a[:, start:stop], b[:, start:stop]) for a, b in self.layers], self.layout, pos)

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> "ChunkKV":
        return ChunkKV([(a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)) for a, b in self.layers],
                       self.layout, self.positions)

    def clone(self) -> "ChunkKV":
        pos = None if self.positions is None else self.positions.clone()
        return ChunkKV([(a.clone(), b.clone()) for a, b in self.layers], self.layout, pos)

    def map(self, fn) -> "ChunkKV":
        """Apply ``fn(layer, slot, tensor) -> tensor`` to every tensor (positions kept)."""
        return ChunkKV([(fn(l, 0, a), fn(l, 1, b)) for l, (a, b) in enumerate(self.layers)], self.layout,
                       self.positions)

    def check_compatible(self, other: "ChunkKV", what: str = "KV") -> None:
        if other.layout != self.layout:
            raise KVShapeError(f"{what}: layout {other.layout.describe()} != {self.layout.describe()}")
        if other.num_tokens != self.num_tokens:
            raise KVShapeError(f"{what}: {other.num_tokens} tokens != {self.num_tokens}")
        if other.dtype != self.dtype:
            raise KVShapeError(f"{what}: dtype {other.dtype} != {self.dtype}")
        if other.device != self.device:
            raise KVShapeError(f"{what}: device {other.device} != {self.device}")

    # ---------------------------------------------------------------- (de)serialisation without pickle
    def to_tensors(self, prefix: str = "", contiguous: bool = True) -> dict[str, torch.Tensor]:
        """Named tensors (``{prefix}{layer}.{slot}``, ``{prefix}positions``); ``contiguous=False`` leaves views as
        they are, for a caller that copies them anyway (the store's put: one copy, not two)."""
        fix = (lambda t: t.contiguous()) if contiguous else (lambda t: t)  # noqa: E731
        out = {f"{prefix}{l}.{s}": fix(t) for l, pair in enumerate(self.layers) for s, t in enumerate(pair)}
        if self.positions is not None:
            out[f"{prefix}positions"] = fix(self.positions)
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], layout: KVLayout, prefix: str = "") -> "ChunkKV":
        try:
            layers = [(tensors[f"{prefix}{l}.0"], tensors[f"{prefix}{l}.1"]) for l in range(layout.num_layers)]
        except KeyError as e:
            raise KVShapeError(f"missing tensor {e} for {layout.describe()}") from None
        return cls(layers, layout, tensors.get(f"{prefix}positions"))


def concat(chunks: Sequence[ChunkKV]) -> ChunkKV:
    """Concatenate chunks along tokens (window order)."""
    if not chunks:
        raise KVShapeError("nothing to concatenate")
    layout = chunks[0].layout
    for c in chunks[1:]:
        if c.layout != layout:
            raise KVShapeError("cannot concatenate KV of different layouts")
    pos = None
    if all(c.positions is not None for c in chunks) and len({c.positions.shape[0] for c in chunks}) == 1:
        pos = torch.cat([c.positions for c in chunks], 1)
    if len(chunks) == 1:
        return chunks[0]
    return ChunkKV([(torch.cat([c.layers[l][0] for c in chunks], 1), torch.cat([c.layers[l][1] for c in chunks], 1))
                    for l in range(layout.num_layers)], layout, pos)


def mean(chunks: Iterable[ChunkKV]) -> ChunkKV:
    """Elementwise mean in fp32 (the orbit patch averages deficits over orderings)."""
    chunks = list(chunks)
    if not chunks:
        raise KVShapeError("mean of no KV")
    n = len(chunks)
    return ChunkKV([(sum(c.layers[l][0].float() for c in chunks) / n, sum(c.layers[l][1].float() for c in chunks) / n)
                    for l in range(chunks[0].layout.num_layers)], chunks[0].layout, chunks[0].positions)


__all__ = ["Family", "KVLayout", "ChunkKV", "concat", "mean"]
