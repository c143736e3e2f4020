"""Rank-m conditioning patches: form once from a conditioned forward, apply with zero forwards.

    KV(B|A) at offset δ  ≈  R(δ)·( KV(B|∅) + U_m V_mᵀ )

The deficit is taken in the chunk's *canonical frame*: Δ = R(-δ)·KV(B|A) − KV(B|∅). Because R is
linear and the same for every token of a uniform shift, a patch formed at one offset applies exactly at
any other: the patch depends on the antecedent A alone, the rotation on δ alone.

Per layer and per slot, Δ is read as a matrix [S, H·D] (tokens x all heads' features, as the paper and
iS-KV stack heads) and cut to its top-m SVD. For MLA, slot 0 (the latent) gets rank m and slot 1 (the
shared k_pe band) a small rank of its own (``rope_rank``).

    canon = backend.encode(chunk).kv                      # KV(B|∅) at position 0
    cond  = ...                                           # KV(B|A) at offset delta, one forward
    p     = form_patch(cond, canon, delta, spec, rank=32)
    kv    = place(canon, delta, spec, p)                  # zero forwards
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from itertools import permutations
from typing import Iterable, Sequence, Union

import torch

from windowkit.errors import KVShapeError
from windowkit.kv.layout import ChunkKV, KVLayout, mean
from windowkit.kv.rope import Delta, RopeSpec, is_zero_delta, rotate_into, rotation, rotation_angles, shift_positions
from windowkit.kv.svd import Method, truncated_svd

Layers = Union[None, str, Sequence[int]]


@dataclass
class Patch:
    """Low-rank factors per (layer, slot), in the chunk's canonical frame."""

    factors: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]  # (l, s) -> (us [S, m], vt [m, H*D])
    layout: KVLayout
    num_tokens: int
    rank: int
    rope_rank: int
    energy: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)  # (kept, total)
    meta: dict[str, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(u.numel() * u.element_size() + v.numel() * v.element_size() for u, v in self.factors.values())

    @property
    def layers(self) -> list[int]:
        return sorted({l for l, _ in self.factors})

    def tail_energy(self, layer: int, slot: int) -> float:
        kept, total = self.energy[(layer, slot)]
        return max(total - kept, 0.0)

    def fraction_of(self, kv: ChunkKV) -> float:
        """Patch bytes as a fraction of the chunk's KV bytes."""
        return self.nbytes / max(kv.nbytes, 1)

    def to(self, dtype: torch.dtype | None = None, device=None) -> "Patch":
        f = {k: (u.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype)) for k, (u, v) in self.factors.items()}
        return Patch(f, self.layout, self.num_tokens, self.rank, self.rope_rank, dict(self.energy), dict(self.meta))

    # ---------------------------------------------------------------- (de)serialisation without pickle
    def to_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        tensors = {}
        for (l, s), (u, v) in self.factors.items():
            tensors[f"{l}.{s}.us"] = u.contiguous()
            tensors[f"{l}.{s}.vt"] = v.contiguous()
        meta = {"num_tokens": str(self.num_tokens), "rank": str(self.rank), "rope_rank": str(self.rope_rank),
                "energy": json.dumps({f"{l}.{s}": list(e) for (l, s), e in self.energy.items()}),
                "meta": json.dumps(self.meta)}
        return tensors, meta

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, str], layout: KVLayout) -> "Patch":
        factors = {}
        for name in tensors:
            if name.endswith(".us"):
                l, s, _ = name.split(".")
                factors[(int(l), int(s))] = (tensors[name], tensors[f"{l}.{s}.vt"])
        energy = {tuple(int(x) for x in k.split(".")): tuple(v) for k, v in json.loads(meta["energy"]).items()}
        return cls(factors, layout, int(meta["num_tokens"]), int(meta["rank"]), int(meta["rope_rank"]),
                   energy, json.loads(meta.get("meta", "{}")))


# -------------------------------------------------------------------- helpers
def as_matrix(t: torch.Tensor) -> torch.Tensor:
    """[H, S, D] -> [S, H*D] (fp32): one KV slot of one layer as the matrix the patch SVD factors."""
    h, s, d = t.shape
    return t.float().transpose(0, 1).reshape(s, h * d)


def _from_matrix(m: torch.Tensor, h: int, d: int) -> torch.Tensor:
    """[S, H*D] -> [H, S, D]."""
    s = m.shape[0]
    return m.reshape(s, h, d).transpose(0, 1)


def select_layers(layers: Layers, num_layers: int) -> list[int]:
    """None/'all' -> every layer; 'deep' -> the deep half (the paper's cheaper variant); or explicit ids."""
    if layers is None or layers == "all":
        return list(range(num_layers))
    if layers == "deep":
        return list(range(num_layers // 2, num_layers))
    if isinstance(layers, str):
        raise KVShapeError(f"layers must be None, 'all', 'deep' or a list of ints, got {layers!r}")
    out = sorted(set(int(l) for l in layers))
    if not out or out[0] < 0 or out[-1] >= num_layers:
        raise KVShapeError(f"layer ids {out} outside 0..{num_layers - 1}")
    return out


def deficit(conditioned: ChunkKV, base: ChunkKV, delta: Delta, spec: RopeSpec) -> ChunkKV:
    """Δ = R(-δ)·conditioned − base, in fp32 and in the canonical frame of ``base``."""
    base.check_compatible(conditioned, "conditioned KV")
    back = conditioned.relocate(_negate(delta), spec)
    return ChunkKV([(a.float() - ba.float(), b.float() - bb.float())
                    for (a, b), (ba, bb) in zip(back.layers, base.layers)], base.layout, base.positions)


def _negate(delta: Delta) -> Delta:
    if isinstance(delta, torch.Tensor):
        return -delta
    if isinstance(delta, (list, tuple)):
        return tuple(-int(x) for x in delta)
    return -int(delta)


def patch_from_deficit(d: ChunkKV, rank: int | None = 32, *, layers: Layers = None, rope_rank: int | None = None,
                       method: Method = "exact", dtype: torch.dtype | None = None,
                       meta: dict[str, str] | None = None) -> Patch:
    """Top-m SVD of a deficit, per selected layer and slot. ``rank=None`` keeps full rank."""
    layout = d.layout
    s = d.num_tokens
    full = max(s, max(h * dd for h, dd in layout.slot_shapes))
    m = full if rank is None else int(rank)
    if m < 1:
        raise KVShapeError(f"patch rank must be >= 1, got {rank}")
    if rope_rank is None:  # MLA: the k_pe band is small and needs only a few directions
        rope_rank = max(1, m // 4) if (layout.family == "mla" and rank is not None) else m
    out_dtype = dtype or torch.float32
    factors, energy = {}, {}
    for l in select_layers(layers, layout.num_layers):
        for slot in (0, 1):
            r = rope_rank if (layout.family == "mla" and slot == layout.rope_slot) else m
            tr = truncated_svd(as_matrix(d.layers[l][slot]), r, method)
            factors[(l, slot)] = (tr.us.to(out_dtype), tr.vt.to(out_dtype))
            energy[(l, slot)] = (tr.kept_energy, tr.total_energy)
    return Patch(factors, layout, s, m, rope_rank, energy, dict(meta or {}))


def form_patch(conditioned: ChunkKV, canonical: ChunkKV, delta: Delta, spec: RopeSpec, rank: int | None = 32, *,
               layers: Layers = None, rope_rank: int | None = None, method: Method = "exact",
               dtype: torch.dtype | None = None, meta: dict[str, str] | None = None) -> Patch:
    """Patch that turns R(δ)·canonical into ``conditioned`` (KV(B|A) at offset δ), kept to rank m.

        p = form_patch(kv_b_given_a, kv_b_alone, delta=len(a), spec=spec, rank=32)
    """
    return patch_from_deficit(deficit(conditioned, canonical, delta, spec), rank, layers=layers, rope_rank=rope_rank,
                              method=method, dtype=dtype or canonical.dtype, meta=meta)


def form_orbit_patch(conditioned: Sequence[ChunkKV], canonical: ChunkKV, delta: Delta, spec: RopeSpec,
                     rank: int | None = 32, **kw) -> Patch:
    """One patch for every ordering of the antecedent set: the SVD of the mean deficit over orderings.

    ``conditioned[i]`` is KV(B | π_i(A)) at offset δ (the same δ for every ordering of the same set).
    """
    if not conditioned:
        raise KVShapeError("an orbit patch needs at least one ordering")
    d = mean(deficit(c, canonical, delta, spec) for c in conditioned)
    meta = dict(kw.pop("meta", None) or {})
    meta.setdefault("kind", "orbit")
    meta.setdefault("orderings", str(len(conditioned)))
    kw.setdefault("dtype", canonical.dtype)
    return patch_from_deficit(d, rank, meta=meta, **kw)


def form_removal_patch(conditioned_after: ChunkKV, kept: ChunkKV, delta: Delta, spec: RopeSpec,
                       rank: int | None = 64, **kw) -> Patch:
    """Removal patch for a survivor: from its kept-as-is KV (canonical frame) to KV(S | context minus evicted).

    ``kept`` is what the survivor holds now, in its canonical frame (canonical + its old patch).
    """
    meta = dict(kw.pop("meta", None) or {})
    meta.setdefault("kind", "removal")
    kw.setdefault("dtype", kept.dtype)
    return patch_from_deficit(deficit(conditioned_after, kept, delta, spec), rank, meta=meta, **kw)


def _check_patch(kv: ChunkKV, patch: Patch) -> None:
    if patch.layout != kv.layout:
        raise KVShapeError(f"patch layout {patch.layout.describe()} != KV layout {kv.layout.describe()}")
    if patch.num_tokens != kv.num_tokens:
        raise KVShapeError(f"patch is for {patch.num_tokens} tokens, KV has {kv.num_tokens}")


def _factors(f: tuple[torch.Tensor, torch.Tensor], h: int, d: int, s: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(us [S, m], vt [m, H*D]) -> batched GEMM operands ([H, S, m] view, [H, m, D])."""
    us, vt = f
    m = us.shape[1]
    us = us.to(device, torch.float32)
    vt = vt.to(device, torch.float32).view(m, h, d).permute(1, 0, 2)
    return us.expand(h, s, m), vt


def apply_patch(kv: ChunkKV, patch: Patch | None) -> ChunkKV:
    """kv + U_m V_mᵀ per patched layer and slot (fp32 accumulate, result in kv's dtype). Zero forwards."""
    if patch is None:
        return kv
    _check_patch(kv, patch)
    out = []
    for l, pair in enumerate(kv.layers):
        new = list(pair)
        for slot in (0, 1):
            f = patch.factors.get((l, slot))
            if f is None:
                continue
            x = pair[slot]
            h, s, d = x.shape
            u, v = _factors(f, h, d, s, x.device)
            y = torch.baddbmm(x.float(), u, v)  # one batched GEMM: [H, S, m] @ [H, m, D]
            new[slot] = y if x.dtype == torch.float32 else y.to(x.dtype)
        out.append((new[0], new[1]))
    return ChunkKV(out, kv.layout, kv.positions)


def place(canonical: ChunkKV, delta: Delta, spec: RopeSpec, patch: Patch | None = None) -> ChunkKV:
    """The reuse operator: R(δ)·(KV(B|∅) + U_m V_mᵀ). With ``patch=None`` this is blind reuse.

    Fused: R(δ)(K + U Vᵀ) = R(δ)K + U·(R(δ)Vᵀ), so the rotation touches the m x H·D factor instead of
    the S x H·D update, the canonical's keys are rotated straight into the output buffer and the rank-m
    update is one batched GEMM accumulated in place. fp32 math, one rounding to the KV dtype.
    The canonical's keys use exact per-token angles (see ``relocate_keys``); the factor uses the uniform
    angle δ·inv_freq (they differ by fp32 rounding of the angle only, on the small patch term).
    """
    if patch is not None:
        _check_patch(canonical, patch)
    if isinstance(delta, torch.Tensor) and delta.dim() > 0:  # per-token deltas: no shared factor rotation
        return apply_patch(canonical, patch).relocate(delta, spec)
    if is_zero_delta(delta):
        return apply_patch(canonical, patch)
    lay = canonical.layout
    r = lay.rope_slot
    k0 = canonical.layers[0][r]
    cos, sin = rotation(delta, spec, k0, canonical.positions)  # [S, n] or [n]
    ang = rotation_angles(delta, spec, k0)  # uniform angle for the factor rows
    fc, fs = ang.cos(), ang.sin()
    out = []
    for l, pair in enumerate(canonical.layers):
        new = list(pair)
        for slot in (0, 1):
            x = pair[slot]
            f = patch.factors.get((l, slot)) if patch is not None else None
            if slot == r:
                t = torch.empty(x.shape, dtype=torch.float32, device=x.device)
                rotate_into(x, cos, sin, spec, t)
                if f is not None:
                    h, s, d = x.shape
                    u, v = _factors(f, h, d, s, x.device)  # v: [H, m, D]
                    vr = torch.empty_like(v)
                    rotate_into(v, fc, fs, spec, vr)
                    t.baddbmm_(u, vr)
            elif f is not None:
                h, s, d = x.shape
                u, v = _factors(f, h, d, s, x.device)
                t = torch.baddbmm(x.float(), u, v)
            else:
                continue  # values / MLA latent without a patch: shared, never copied
            new[slot] = t if x.dtype == torch.float32 else t.to(x.dtype)
        out.append((new[0], new[1]))
    pos = None if canonical.positions is None else shift_positions(canonical.positions, delta)
    return ChunkKV(out, lay, pos)


def orderings(items: Sequence, limit: int = 24, seed: int = 0) -> list[tuple]:
    """All orderings for K <= 4 (at most 24), else ``limit`` distinct random ones (sampled orbit)."""
    items = tuple(items)
    if len(items) <= 4:
        return list(permutations(items))
    g = torch.Generator().manual_seed(seed)
    seen: list[tuple] = [items]
    tries = 0
    while len(seen) < limit and tries < 50 * limit:
        perm = tuple(items[i] for i in torch.randperm(len(items), generator=g).tolist())
        tries += 1
        if perm not in seen:
            seen.append(perm)
    return seen


def reconstruction_error(approx: ChunkKV, target: ChunkKV, layers: Iterable[int] | None = None) -> float:
    """||approx - target||_F / ||target||_F over the given layers (all by default)."""
    ls = range(target.layout.num_layers) if layers is None else layers
    num = den = 0.0
    for l in ls:
        for slot in (0, 1):
            a, t = approx.layers[l][slot].float(), target.layers[l][slot].float()
            num += float(((a - t) ** 2).sum())
            den += float((t ** 2).sum())
    return (num / max(den, 1e-30)) ** 0.5


__all__ = ["Patch", "deficit", "patch_from_deficit", "form_patch", "form_orbit_patch", "form_removal_patch",
           "apply_patch", "place", "orderings", "select_layers", "reconstruction_error", "as_matrix"]
