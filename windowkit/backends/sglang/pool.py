"""Write a chunk's reconstructed KV into SGLang's token-to-KV pools, and read it back.

SGLang (0.5.23) keeps one KV pool per scheduler (per TP rank); a request's tokens map to *slots*
(rows) of that pool through ``req_to_token``. The pools this module talks to:

  pool                 per layer l                                       row of one token (slot)
  MHATokenToKVPool     k_buffer[l], v_buffer[l]: [size+page, H_local, D]  K and V of this rank's KV heads
  MLATokenToKVPool     kv_buffer[l]: [size+page, 1, kv_lora_rank+rope]    [latent | k_pe], replicated on all ranks

Keys are stored *after* RoPE in both (SGLang rotates, then ``set_kv_buffer``), which is exactly what a
windowkit ``place()`` returns: R(δ)·(canonical + patch). The first page (slots ``0..page_size-1``) is
SGLang's dummy sink and is never written here.

    io = SGLangKVPool.from_config(pool, backend.layout, model.config, tp_rank=0, tp_size=2)
    io.write(place(canon, delta, backend.rope, patch), loc)   # loc: [S] slot ids from SGLang's allocator
    kv = io.read(loc)                                          # this rank's heads, windowkit layout

Input convention: by default a ``ChunkKV`` in *transformers* layout (what ``HFBackend`` produces); for
DeepSeek-V3/Kimi with ``rope_interleave`` the rope slot (``k_pe``) is re-paired half-split -> GPT-J pairs
on the way in and back on the way out (see ``convert.py``). Pass ``source="sglang"`` for KV already in
SGLang's pair layout (e.g. relocated with ``RopeSpec.from_config(cfg, engine="sglang")``).

Writes go through the pool's own ``set_kv_buffer`` / ``set_mla_kv_buffer`` (``layer_id_override``), so
dtype casts, FP8 ``store_dtype`` views and the HND layout are SGLang's business. Nothing here imports
sglang at module load; the pool object is duck-typed.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Iterator, Literal, Optional, Sequence

import torch

from windowkit.backends.sglang.convert import kv_heads_for_rank, repair
from windowkit.errors import KVShapeError, UnsupportedModelError
from windowkit.kv.layout import ChunkKV, KVLayout
from windowkit.kv.rope import Pairing, RopeSpec

Source = Literal["transformers", "sglang"]


@contextlib.contextmanager
def standalone_parallel() -> Iterator[None]:
    """Give SGLang's MLA writes the parallel context they read when no scheduler published one.

    ``MLATokenToKVPool.set_mla_kv_buffer`` asks ``get_parallel()`` for its decode-context-parallel width;
    outside a running engine (unit tests, offline tools) nothing is published and it raises. Inside an
    engine this is a no-op.
    """
    from sglang.srt.runtime_context import get_parallel

    par = get_parallel()
    try:
        _ = par.attn_dcp_size  # published by a running scheduler
        published = True
    except RuntimeError:
        published = False
    if published:
        yield
        return
    with par.override(dcp_enabled=False, attn_dcp_size=1, attn_dcp_rank=0):
        yield


def slots_for_pages(pages: torch.Tensor, page_size: int, num_tokens: Optional[int] = None) -> torch.Tensor:
    """Token slot ids of whole pages (page ``p`` covers slots ``p*page_size .. p*page_size+page_size-1``),
    cut to ``num_tokens`` (a partial last page)."""
    pages = torch.as_tensor(pages, dtype=torch.int64)
    loc = (pages[:, None] * page_size + torch.arange(page_size, device=pages.device)[None]).flatten()
    if num_tokens is not None:
        if num_tokens > loc.numel():
            raise KVShapeError(f"{num_tokens} tokens do not fit in {pages.numel()} pages of {page_size}")
        loc = loc[:num_tokens]
    return loc


class SGLangKVPool:
    """windowkit ``ChunkKV`` <-> one SGLang KV pool (one TP rank's), at given slot indices."""

    def __init__(self, pool: Any, layout: KVLayout, *, tp_rank: int = 0, tp_size: int = 1,
                 src_pairing: Pairing = "half", pool_pairing: Pairing = "half"):
        self.pool = pool
        self.layout = layout
        self.tp_rank, self.tp_size = int(tp_rank), int(tp_size)
        self.src_pairing, self.pool_pairing = src_pairing, pool_pairing
        self.start_layer = int(getattr(pool, "start_layer", 0) or 0)
        self.layer_num = int(pool.layer_num)
        if self.start_layer < 0 or self.start_layer + self.layer_num > layout.num_layers:
            raise KVShapeError(f"pool layers [{self.start_layer}, {self.start_layer + self.layer_num}) outside "
                               f"the model's {layout.num_layers}")
        (h0, d0), (h1, d1) = layout.slot_shapes
        if layout.family == "gqa":
            if not hasattr(pool, "k_buffer"):
                raise UnsupportedModelError(f"{type(pool).__name__} is not an MHA/GQA pool (no k_buffer)")
            self.heads = kv_heads_for_rank(h0, self.tp_rank, self.tp_size)
            n = self.heads[1] - self.heads[0]
            if (int(pool.head_num), int(pool.head_dim), int(pool.v_head_dim)) != (n, d0, d1):
                raise KVShapeError(f"pool rows hold {pool.head_num} heads x (K {pool.head_dim}, V {pool.v_head_dim}); "
                                   f"rank {tp_rank}/{tp_size} of {layout.describe()} needs {n} x (K {d0}, V {d1})")
            kind = getattr(pool, "kv_cache_layout", "nhd")
            if kind not in ("nhd", "hnd"):
                raise UnsupportedModelError(f"KV cache layout {kind!r} is not supported (nhd, hnd)")
            self.kind = kind
        elif layout.family == "mla":
            if not hasattr(pool, "kv_lora_rank"):
                raise UnsupportedModelError(f"{type(pool).__name__} is not an MLA pool (no kv_lora_rank)")
            if getattr(pool, "use_dsa", False):
                raise UnsupportedModelError("DSA (DeepSeek-V3.2 sparse attention) MLA pools are not supported")
            if (int(pool.kv_lora_rank), int(pool.qk_rope_head_dim)) != (d0, d1) or (h0, h1) != (1, 1):
                raise KVShapeError(f"pool row is [latent {pool.kv_lora_rank} | k_pe {pool.qk_rope_head_dim}]; "
                                   f"{layout.describe()} needs [{d0} | {d1}]")
            kv_heads_for_rank(1, self.tp_rank, self.tp_size)  # validates the rank only: MLA is replicated
            self.heads = (0, 1)
            self.kind = "mla"
        else:
            raise UnsupportedModelError(f"unknown KV family {layout.family!r}")

    @classmethod
    def from_config(cls, pool: Any, layout: KVLayout, config: Any, *, source: Source = "transformers",
                    tp_rank: int = 0, tp_size: int = 1) -> "SGLangKVPool":
        """Pair layouts read from a transformers config: ``source`` names the layout of the KV you will
        write (``"transformers"`` for ``HFBackend`` output), the pool side is always SGLang's."""
        src = RopeSpec.from_config(config, engine=source).pairing
        dst = RopeSpec.from_config(config, engine="sglang").pairing
        return cls(pool, layout, tp_rank=tp_rank, tp_size=tp_size, src_pairing=src, pool_pairing=dst)

    # ------------------------------------------------------------------ facts
    @property
    def local_layout(self) -> KVLayout:
        """This rank's layout: GQA slots keep only the rank's KV heads."""
        if self.layout.family != "gqa":
            return self.layout
        n = self.heads[1] - self.heads[0]
        (_, d0), (_, d1) = self.layout.slot_shapes
        return replace(self.layout, slot_shapes=((n, d0), (n, d1)))

    @property
    def layers(self) -> range:
        return range(self.start_layer, self.start_layer + self.layer_num)

    def shard(self, kv: ChunkKV) -> ChunkKV:
        """This rank's part of a full-model chunk (GQA: its KV heads; MLA: all of it), same pairing."""
        if self.layout.family != "gqa" or self.heads == (0, self.layout.slot_shapes[0][0]):
            return kv
        a, b = self.heads
        return ChunkKV([(k[a:b], v[a:b]) for k, v in kv.layers], self.local_layout, kv.positions)

    # ------------------------------------------------------------------ write / read
    def _loc(self, loc: Any, n: int) -> torch.Tensor:
        # the pool's device attribute, not get_key_buffer(): inside an engine that call waits on the
        # layer-wise load counter, which a linker's own write must not do
        dev = getattr(self.pool, "device", None)
        dev = torch.device(dev) if dev is not None else self._buffer(self.start_layer).device
        loc = torch.as_tensor(loc).to(device=dev, dtype=torch.int64).flatten()
        if loc.numel() != n:
            raise KVShapeError(f"{loc.numel()} slots given for {n} tokens")
        rows = int(self.pool.size) + int(self.pool.page_size)
        if n and (int(loc.min()) < int(self.pool.page_size) or int(loc.max()) >= rows):
            raise KVShapeError(f"slot ids must lie in [{self.pool.page_size}, {rows}) (the first page is SGLang's "
                               f"dummy sink); got [{int(loc.min())}, {int(loc.max())}]")
        if n and torch.unique(loc).numel() != n:
            raise KVShapeError("slot ids repeat")
        return loc

    def _buffer(self, layer: int) -> torch.Tensor:
        return self.pool.get_key_buffer(layer)

    def write(self, kv: ChunkKV, loc: Any, layers: Optional[Sequence[int]] = None) -> None:
        """Write every layer of ``kv`` this pool holds (its ``start_layer`` range) at slots ``loc`` ([S]).

        ``layers``: only these (model) layer ids, e.g. one at a time for a layer-wise load."""
        if kv.layout != self.layout and kv.layout != self.local_layout:
            raise KVShapeError(f"chunk layout {kv.layout.describe()} != pool's {self.layout.describe()}")
        loc = self._loc(loc, kv.num_tokens)
        todo = list(self.layers) if layers is None else [int(l) for l in layers]
        if any(l not in self.layers for l in todo):
            raise KVShapeError(f"layers {todo} outside the pool's {self.layers.start}..{self.layers.stop - 1}")
        local = kv.layout == self.local_layout and self.local_layout != self.layout
        a, b = (0, None) if local else self.heads
        r = self.layout.rope_slot
        dev = loc.device
        if self.kind == "mla":
            with standalone_parallel():
                for l in todo:
                    lat, kpe = kv.layers[l]
                    kpe = repair(kpe, self.src_pairing, self.pool_pairing)
                    self.pool.set_mla_kv_buffer(None, loc, lat.to(dev).transpose(0, 1).contiguous(),
                                                kpe.to(dev).transpose(0, 1).contiguous(), layer_id_override=l)
            return
        for l in todo:
            k, v = kv.layers[l]
            if r == 0:
                k = repair(k, self.src_pairing, self.pool_pairing)
            k = k[a:b].to(dev).transpose(0, 1).contiguous()  # [H, S, D] -> [S, H, D]
            v = v[a:b].to(dev).transpose(0, 1).contiguous()
            self.pool.set_kv_buffer(None, loc, k, v, layer_id_override=l)

    def read(self, loc: Any, positions: Optional[torch.Tensor] = None) -> ChunkKV:
        """The KV at slots ``loc`` as this rank's ``ChunkKV`` (``local_layout``, the source pairing,
        the pool's dtype). Needs a pool that holds every layer (no pipeline split)."""
        if self.layer_num != self.layout.num_layers:
            raise KVShapeError(f"pool holds layers {self.layers.start}..{self.layers.stop - 1} of "
                               f"{self.layout.num_layers}; read needs all of them")
        loc = torch.as_tensor(loc, dtype=torch.int64).flatten()
        loc = self._loc(loc, loc.numel())
        out = []
        for l in self.layers:
            if self.kind == "mla":
                row = self.pool.get_key_buffer(l)[loc]  # [S, 1, R + r]
                rank = int(self.pool.kv_lora_rank)
                lat = row[..., :rank].transpose(0, 1).contiguous()
                kpe = repair(row[..., rank:].transpose(0, 1).contiguous(), self.pool_pairing, self.src_pairing)
                out.append((lat, kpe))
                continue
            kb, vb = self.pool.get_key_buffer(l), self.pool.get_value_buffer(l)
            if self.kind == "hnd":  # [pages, H, page, D]
                p = int(self.pool.page_size)
                k, v = kb[loc // p, :, loc % p, :], vb[loc // p, :, loc % p, :]
            else:  # [rows, H, D]
                k, v = kb[loc], vb[loc]
            k = k.transpose(0, 1).contiguous()
            if self.layout.rope_slot == 0:
                k = repair(k, self.pool_pairing, self.src_pairing)
            out.append((k, v.transpose(0, 1).contiguous()))
        return ChunkKV(out, self.local_layout, positions)


__all__ = ["SGLangKVPool", "slots_for_pages", "standalone_parallel"]
