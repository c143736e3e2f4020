"""Layout conventions between windowkit (transformers layout) and SGLang's KV pools. No sglang import.

Two things differ between a windowkit ``ChunkKV`` and what SGLang keeps in its pools:

1. Token/head order. windowkit stores a slot as ``[H, S, D]`` (heads first, as transformers' cache does);
   SGLang's pools are token-major, one row per KV slot: ``[S, H, D]`` (NHD).
2. DeepSeek-V3 / Kimi ``k_pe`` pair order. transformers de-interleaves the rotary dims before a
   rotate-half RoPE, so its cached ``k_pe`` is *half-split*: ``[x0', x2', x4', ... | x1', x3', ...]``
   (the rotated even lanes, then the rotated odd lanes). SGLang applies GPT-J RoPE in place when
   ``config.rope_interleave`` is true (the default), so its cached ``k_pe`` keeps *interleaved pairs*:
   ``[x0', x1', x2', x3', ...]``. The two hold the same numbers; one is a fixed permutation of the other,
   and the queries each engine computes are permuted the same way, so attention scores agree.
   DeepSeek-V2 is interleaved in both engines; GQA/MHA models are half-split in both.

``RopeSpec.from_config(config, engine=...)`` already names the pair layout per engine; the helpers here
convert a whole ``ChunkKV`` between them (a permutation: bit-exact, no arithmetic).

    src = RopeSpec.from_config(cfg, engine="transformers")
    dst = RopeSpec.from_config(cfg, engine="sglang")
    kv_sg = convert_pairing(kv, src, dst)          # no-op unless DeepSeek-V3 with rope_interleave
"""
from __future__ import annotations

import torch

from windowkit.errors import KVShapeError, UnsupportedModelError
from windowkit.kv.layout import ChunkKV
from windowkit.kv.rope import Pairing, RopeSpec


def half_to_interleaved(x: torch.Tensor) -> torch.Tensor:
    """``[..., a_0..a_{n-1}, b_0..b_{n-1}] -> [..., a_0, b_0, a_1, b_1, ...]`` (transformers -> SGLang k_pe)."""
    if x.shape[-1] % 2:
        raise KVShapeError(f"rotary width {x.shape[-1]} is odd")
    n = x.shape[-1] // 2
    return torch.stack((x[..., :n], x[..., n:]), dim=-1).flatten(-2)


def interleaved_to_half(x: torch.Tensor) -> torch.Tensor:
    """``[..., a_0, b_0, a_1, b_1, ...] -> [..., a_0..a_{n-1}, b_0..b_{n-1}]`` (SGLang -> transformers k_pe)."""
    if x.shape[-1] % 2:
        raise KVShapeError(f"rotary width {x.shape[-1]} is odd")
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def repair(x: torch.Tensor, src: Pairing, dst: Pairing) -> torch.Tensor:
    """Re-pair the rotary dims (last axis) of ``x`` from layout ``src`` to ``dst``; identity when equal."""
    if src == dst:
        return x
    return half_to_interleaved(x) if src == "half" else interleaved_to_half(x)


def convert_pairing(kv: ChunkKV, src: RopeSpec | Pairing, dst: RopeSpec | Pairing) -> ChunkKV:
    """The same chunk with its rope slot re-paired from ``src`` to ``dst`` layout (specs or pairing names).

    Only the rotary dims move; the non-rope slot is shared. Returns ``kv`` itself when nothing changes.
    """
    s = src.pairing if isinstance(src, RopeSpec) else src
    d = dst.pairing if isinstance(dst, RopeSpec) else dst
    if s == d:
        return kv
    r = kv.layout.rope_slot
    rot = kv.layout.slot_shapes[r][1]
    if isinstance(src, RopeSpec) and src.rot_dim != rot:
        raise UnsupportedModelError(
            f"rope slot has {rot} dims but the spec rotates {src.rot_dim}: partial rotary cannot be re-paired")
    return kv.map(lambda l, slot, t: repair(t, s, d) if slot == r else t)


def kv_heads_for_rank(num_kv_heads: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """``[start, stop)`` of the KV heads SGLang keeps on attention-TP rank ``tp_rank``.

    Mirrors ``QKVParallelLinear``: with at least as many KV heads as ranks each rank holds a contiguous
    block of ``num_kv_heads // tp_size`` heads; with fewer, each head is replicated on
    ``tp_size // num_kv_heads`` consecutive ranks and a rank holds one head.
    """
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise KVShapeError(f"bad tensor-parallel rank {tp_rank} of {tp_size}")
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise KVShapeError(f"{num_kv_heads} KV heads do not split over {tp_size} ranks")
        per = num_kv_heads // tp_size
        return tp_rank * per, (tp_rank + 1) * per
    if tp_size % num_kv_heads:
        raise KVShapeError(f"{tp_size} ranks do not replicate {num_kv_heads} KV heads evenly")
    head = tp_rank // (tp_size // num_kv_heads)
    return head, head + 1


__all__ = ["half_to_interleaved", "interleaved_to_half", "repair", "convert_pairing", "kv_heads_for_rank"]
