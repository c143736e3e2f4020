"""Qwen2.5-VL / Qwen3-VL adapter for ``HFBackend``: 3-D positions, vision embedding, decoder run.

    model = windowkit.backends.tiny.build("tiny-qwen3-vl")      # or a Qwen*VLForConditionalGeneration
    backend = wk.HFBackend(model)                               # picks QwenVLAdapter by model_type
    img = wk.Chunk.image(ids, pixel_values=pv, image_grid_thw=torch.tensor([[1, 4, 4]]))
    pos, span = backend.positions(img, start=10)                # [3, S] (t, h, w) ids, next chunk at 10 + span
    res = backend.forward([img], 10)                            # vision tower runs once per chunk id

The adapter owns windowkit's copy of the model's M-RoPE position rule (it never calls
``get_rope_index``) so that a chunk's positions are a pure function of (chunk, start):

    positions(chunk, start) == positions(chunk, 0) + start      on every axis

which is what makes relocating a stored chunk one uniform rotation. Placed back to back, chunks get the
same ids as transformers' ``get_rope_index`` on the concatenation, with one documented exception
(``_next_position``: text after a Qwen2.5-VL video whose time axis outruns its spatial extent).
"""
from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from windowkit.backends.base import BackendStats, Embeds
from windowkit.chunk import Chunk
from windowkit.errors import ChunkError, UnsupportedModelError

TEXT, IMAGE, VIDEO = 0, 1, 2  # mm_token_type_ids convention of the transformers processors


@dataclass(frozen=True)
class _Group:
    """One run of a chunk's tokens that shares a position rule: text, or one image / video (frame) grid."""

    kind: int  # TEXT | IMAGE | VIDEO
    lo: int  # token range [lo, hi) inside the chunk
    hi: int
    grid: tuple[int, int, int] = (0, 0, 0)  # merged (T, H, W) for vision groups
    interval: Union[float, torch.Tensor] = 1  # temporal position step per temporal patch (before flooring)


class QwenVLAdapter:
    """Family adapter for Qwen2.5-VL and Qwen3-VL (``HFBackend`` builds it; same interface as TextAdapter).

    Qwen3-VL specifics: videos are split into per-frame ``t=1`` grids (the processor writes a timestamp
    and its own vision_start/end around every frame), and the vision tower's deepstack features are
    returned with the embeddings so the decoder can add them after its first layers.
    """

    n_axes = 3

    def __init__(self, model: Any, stats: BackendStats):
        inner = getattr(model, "model", None)
        lm = getattr(inner, "language_model", None)
        if inner is None or lm is None or getattr(inner, "visual", None) is None or not hasattr(model, "lm_head"):
            raise UnsupportedModelError(
                f"{type(model).__name__}: QwenVLAdapter needs a Qwen*VLForConditionalGeneration "
                "(model.model.visual, model.model.language_model, model.lm_head)"
            )
        cfg = model.config
        self.model = model
        self.stats = stats
        self.family = str(cfg.model_type)  # "qwen2_5_vl" | "qwen3_vl"
        if self.family not in ("qwen2_5_vl", "qwen3_vl"):
            raise UnsupportedModelError(f"QwenVLAdapter: unsupported model_type {self.family!r}")
        vcfg = cfg.vision_config
        self.merge = int(vcfg.spatial_merge_size)
        # Qwen2.5-VL spaces video temporal patches by tokens_per_second * seconds; Qwen3-VL uses timestamps
        self.tokens_per_second = getattr(vcfg, "tokens_per_second", None) if self.family == "qwen2_5_vl" else None
        self.image_token_id = int(cfg.image_token_id)
        self.video_token_id = int(cfg.video_token_id)
        self.split_video_frames = self.family == "qwen3_vl"
        params = inspect.signature(lm.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.has_deepstack = "deepstack_visual_embeds" in params and "visual_pos_masks" in params

    # ------------------------------------------------------------------ token layout
    def _groups(self, chunk: Chunk) -> list[_Group]:
        """Split a chunk into text runs and vision grids; validate pads against grids (ChunkError)."""
        ids = chunk.input_ids
        types = torch.zeros_like(ids)
        types[ids == self.image_token_id] = IMAGE
        types[ids == self.video_token_id] = VIDEO
        grids = {IMAGE: self._grids(chunk, IMAGE), VIDEO: self._grids(chunk, VIDEO)}
        used = {IMAGE: 0, VIDEO: 0}
        out: list[_Group] = []
        pos = 0
        for kind, run in itertools.groupby(types.tolist()):
            n = len(list(run))
            lo, hi = pos, pos + n
            pos = hi
            if kind == TEXT:
                out.append(_Group(TEXT, lo, hi))
                continue
            # a pad run is one grid in processor output; adjacent grids with no separator are consumed in order
            name = "image" if kind == IMAGE else "video"
            while lo < hi:
                if used[kind] >= len(grids[kind]):
                    raise ChunkError(
                        f"chunk {chunk.id!r}: {int((types == kind).sum())} {name} pad tokens but the {name} grids "
                        f"account for {sum(g[0] * g[1] * g[2] for g, _ in grids[kind])}"
                    )
                grid, interval = grids[kind][used[kind]]
                used[kind] += 1
                m = grid[0] * grid[1] * grid[2]
                if lo + m > hi:
                    raise ChunkError(
                        f"chunk {chunk.id!r}: a run of {hi - lo} {name} pad tokens at {lo} is shorter than its "
                        f"grid's {m} merged tokens (pad-token count must match {name}_grid_thw)"
                    )
                out.append(_Group(kind, lo, lo + m, grid, interval))
                lo += m
        for kind, name in ((IMAGE, "image"), (VIDEO, "video")):
            if used[kind] != len(grids[kind]):
                n_pad = int((types == kind).sum())
                need = sum(g[0] * g[1] * g[2] for g, _ in grids[kind])
                raise ChunkError(
                    f"chunk {chunk.id!r}: {n_pad} {name} pad tokens (id {self._pad_id(kind)}) but {name}_grid_thw "
                    f"needs {need} merged tokens"
                )
        return out

    def _pad_id(self, kind: int) -> int:
        return self.image_token_id if kind == IMAGE else self.video_token_id

    def _grids(self, chunk: Chunk, kind: int) -> list[tuple[tuple[int, int, int], Union[float, torch.Tensor]]]:
        """Merged (T, H, W) grids of a chunk's images or videos (Qwen3-VL: one t=1 grid per video frame)."""
        grid_thw = chunk.image_grid_thw if kind == IMAGE else chunk.video_grid_thw
        pixels = chunk.pixel_values if kind == IMAGE else chunk.pixel_values_videos
        name = "image" if kind == IMAGE else "video"
        if grid_thw is None:
            if pixels is not None:
                raise ChunkError(f"chunk {chunk.id!r}: {name} pixels without {name}_grid_thw")
            return []
        if pixels is None:
            raise ChunkError(f"chunk {chunk.id!r}: {name}_grid_thw without {name} pixels")
        if bool((grid_thw <= 0).any()):
            raise ChunkError(f"chunk {chunk.id!r}: {name}_grid_thw must be positive, got {grid_thw.tolist()}")
        n_patches = int(grid_thw.prod(-1).sum())
        if pixels.dim() != 2 or pixels.shape[0] != n_patches:
            raise ChunkError(
                f"chunk {chunk.id!r}: {name} pixels have shape {tuple(pixels.shape)}, {name}_grid_thw "
                f"{grid_thw.tolist()} needs [{n_patches}, C*T*P*P]"
            )
        secs = chunk.second_per_grid_ts
        if kind == VIDEO and secs is not None:
            secs = torch.as_tensor(secs).reshape(-1)
            if secs.numel() != grid_thw.shape[0]:
                raise ChunkError(f"chunk {chunk.id!r}: {secs.numel()} second_per_grid_ts for {grid_thw.shape[0]} videos")
        out = []
        for i, (t, h, w) in enumerate(grid_thw.tolist()):
            if h % self.merge or w % self.merge:
                raise ChunkError(f"chunk {chunk.id!r}: {name} grid {(t, h, w)} not divisible by merge {self.merge}")
            merged = (t, h // self.merge, w // self.merge)
            interval: Union[float, torch.Tensor] = 1
            if kind == VIDEO and self.tokens_per_second is not None:
                # same arithmetic (and dtype) as transformers: tokens_per_second * second_per_grid_ts[i]
                interval = self.tokens_per_second * (secs[i] if secs is not None else 1)
            if kind == VIDEO and self.split_video_frames:
                out.extend([((1, merged[1], merged[2]), 1)] * t)
            else:
                out.append((merged, interval))
        return out

    # ------------------------------------------------------------------ positions
    def positions(self, chunk: Chunk, start: int) -> tuple[torch.Tensor, int]:
        """Position ids [3, S] (t, h, w) of ``chunk`` placed at ``start``, and its span (next chunk's offset).

        text:   t = h = w = cur .. cur+n-1, then cur += n
        vision: t = cur + floor(k * interval) (k: temporal patch), h = cur + row, w = cur + col (merged grid),
                then cur = max(position so far) + 1            (see ``_next_position``)
        """
        start = int(start)
        cols = []
        cur = start
        for g in self._groups(chunk):
            if g.kind == TEXT:
                cols.append(torch.arange(cur, cur + g.hi - g.lo, dtype=torch.long).expand(3, -1))
                cur += g.hi - g.lo
                continue
            gt, gh, gw = g.grid
            # floor happens before adding the start (as transformers does), so positions(start) = positions(0) + start
            t = (torch.arange(gt) * g.interval).long()  # [gt]
            tt, hh, ww = torch.meshgrid(t, torch.arange(gh), torch.arange(gw), indexing="ij")
            cols.append(torch.stack([tt, hh, ww]).reshape(3, -1) + cur)  # [3, gt*gh*gw]
            cur = self._next_position(cur, int(t[-1]), gh, gw)
        pos = torch.cat(cols, 1)  # [3, S]
        return pos, cur - start

    @staticmethod
    def _next_position(cur: int, t_last: int, gh: int, gw: int) -> int:
        """Where the token after a vision group starts: one past the group's largest position id.

        This is the rule of the released Qwen2-VL/Qwen2.5-VL code and of transformers <= 5.2
        (``st_idx = llm_pos_ids_list[-1].max() + 1``). transformers >= 5.3 advances by ``max(H, W)``
        only, ignoring the time axis: for a Qwen2.5-VL video whose last temporal offset
        floor((T-1) * interval) reaches max(H, W) (e.g. grid (2,4,4), 2 tokens/s, 1 s per patch:
        t offsets {0, 2}, spatial extent 2), the following text would then reuse the video's last t
        id. windowkit keeps max + 1 because (a) it is what the checkpoints were trained with, and
        (b) it makes span = max + 1 - start, so splitting a sequence into chunks never changes its
        positions. Images, single-patch videos, Qwen3-VL frames and short intervals agree with every
        version. tests/test_hf_qwen_vl.py pins this case.
        """
        return cur + max(t_last, gh - 1, gw - 1) + 1

    # ------------------------------------------------------------------ embeddings
    def embed(self, chunk: Chunk) -> Embeds:
        """Token embeddings with the vision tower's features scattered into the image / video pads."""
        groups = self._groups(chunk)  # validates pads vs grids before any compute
        inner = self.model.model
        emb_layer = inner.get_input_embeddings()
        dev = emb_layer.weight.device
        ids = chunk.input_ids.to(dev)
        embeds = emb_layer(ids)  # [S, hidden]
        if not any(g.kind != TEXT for g in groups):
            return Embeds(embeds)
        visual = (ids == self.image_token_id) | (ids == self.video_token_id)  # [S]
        deep_parts: list[tuple[torch.Tensor, list[torch.Tensor]]] = []  # (pad mask, per-layer features)
        for kind, pv, grid in ((IMAGE, chunk.pixel_values, chunk.image_grid_thw),
                               (VIDEO, chunk.pixel_values_videos, chunk.video_grid_thw)):
            if pv is None:
                continue
            fn = inner.get_image_features if kind == IMAGE else inner.get_video_features
            out = fn(pv.to(dev), grid.to(dev), return_dict=True)
            self.stats.vision_calls += 1
            feats = torch.cat(out.pooler_output, 0).to(embeds.dtype)  # [n_pads, hidden]
            mask = ids == self._pad_id(kind)  # [S]
            if feats.shape != (int(mask.sum()), embeds.shape[-1]):
                raise ChunkError(f"chunk {chunk.id!r}: vision tower gave {tuple(feats.shape)} features for "
                                 f"{int(mask.sum())} pad tokens")
            embeds = embeds.masked_scatter(mask[:, None], feats)
            ds = getattr(out, "deepstack_features", None)
            if ds is not None:
                deep_parts.append((mask, [torch.cat(f, 0).to(embeds.dtype) for f in ds]))
        deepstack = None
        if deep_parts and self.has_deepstack:
            # rows in token order over all visual tokens, as Qwen3VLModel.forward joins images and videos
            n_layers = len(deep_parts[0][1])
            deepstack = []
            for layer in range(n_layers):
                joint = embeds.new_zeros(int(visual.sum()), embeds.shape[-1])  # [n_visual, hidden]
                for mask, feats in deep_parts:
                    joint[mask[visual]] = feats[layer]
                deepstack.append(joint)
        return Embeds(embeds, visual, deepstack)

    # ------------------------------------------------------------------ decoder
    def run(self, embeds: torch.Tensor, position_ids: torch.Tensor, cache: Any,
            visual_mask: Optional[torch.Tensor] = None, deepstack: Optional[list[torch.Tensor]] = None,
            attention_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Any]:
        """Decoder over ``embeds`` [1, L, hidden] at ``position_ids`` [3, L] after ``cache``; last logits [vocab].
        A 4-D ``attention_mask`` [1, 1, L, cache + L] (a selective recompute: the rows need not continue the cache)
        goes to the decoder as is; without one, every new token sees the whole cache, causally among themselves.

        Position ids go in as [3, 1, L], never [4, 1, L]: with no text-position row transformers builds the
        causal mask from the cache's storage length (new tokens see every cached entry) and never runs its
        packed-sequence detection, whatever jumps the 3-D ids have across chunks.
        """
        if position_ids.dim() != 2 or position_ids.shape[0] != 3 or position_ids.shape[1] != embeds.shape[1]:
            raise ChunkError(f"position_ids must be [3, {embeds.shape[1]}], got {tuple(position_ids.shape)}")
        lm = self.model.model.language_model
        kw: dict[str, Any] = {self.cache_kw: cache, "use_cache": True}
        if deepstack is not None:
            if not self.has_deepstack:
                raise UnsupportedModelError(f"{type(lm).__name__} takes no deepstack inputs")
            if visual_mask is None or int(visual_mask.sum()) != deepstack[0].shape[0]:
                raise ChunkError("deepstack features need a visual mask with one True per feature row")
            kw["visual_pos_masks"] = visual_mask  # [1, L]
            kw["deepstack_visual_embeds"] = deepstack  # per layer [n_visual, hidden]
        if attention_mask is not None:
            kw["attention_mask"] = attention_mask
        out = lm(inputs_embeds=embeds, position_ids=position_ids[:, None].to(embeds.device), **kw)
        new_cache = getattr(out, "cache", None)
        if new_cache is None:
            new_cache = out.past_key_values
        logits = self.model.lm_head(out.last_hidden_state[:, -1])  # [1, vocab]
        return logits[0].float(), new_cache


__all__ = ["QwenVLAdapter"]
