"""HFBackend: the transformers reference backend.

    model = transformers.AutoModelForCausalLM.from_pretrained(path)   # or a tiny random one
    backend = wk.HFBackend(model)
    res = backend.forward([chunk], start=0)          # canonical KV(B|∅) + next-token logits

It reads the cache layout and the RoPE scheme from the model, checks on a 4-token probe that re-rotating
a key reproduces the model's own key at another position (refusing the model otherwise), and runs
forwards over spliced caches with explicit positions. Family-specific parts (embedding, position rule,
running the decoder) live in small adapters: text decoders here, Qwen-VL in ``hf_qwen_vl``.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import time
from contextlib import nullcontext
from typing import Any, Optional, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from windowkit.backends.base import BackendStats, Embeds, ForwardResult  # Embeds: shared with hf_qwen_vl
from windowkit.backends.attention import attention, block_plan, capture_rows
from windowkit.backends.hf_qwen_vl import QwenVLAdapter
from windowkit.chunk import Chunk
from windowkit.errors import ChunkError, KVShapeError, UnsupportedModelError
from windowkit.kv.layout import ChunkKV, KVLayout
from windowkit.kv.rope import RopeSpec, relocate_keys

TEXT_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "deepseek_v2", "deepseek_v3")
VL_FAMILIES = ("qwen2_5_vl", "qwen3_vl")
# families where HFBackend.recompute (selective token recompute under a 4-D mask) is exact
RECOMPUTE_FAMILIES = ("llama", "qwen2", "qwen3")


def _busy(fn):
    """Add a model call's wall time to ``stats.busy_ms``: an agent can split its step into the model's time and
    everything around it (bookkeeping) without timing the backend from outside."""
    @functools.wraps(fn)
    def run(self, *args, **kw):
        t0 = time.perf_counter()
        try:
            return fn(self, *args, **kw)
        finally:
            self.stats.busy_ms += (time.perf_counter() - t0) * 1e3
    return run


class TextAdapter:
    """Plain decoders (Llama, Qwen2/3, Mistral, DeepSeek-V2/V3): 1-D positions, token embeddings."""

    n_axes = 1

    def __init__(self, model: Any, stats: BackendStats):
        self.model = model
        self.stats = stats
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.has_logits_to_keep = "logits_to_keep" in params

    def positions(self, chunk: Chunk, start: int) -> tuple[torch.Tensor, int]:
        n = len(chunk)
        return torch.arange(start, start + n, dtype=torch.long)[None], n

    def embed(self, chunk: Chunk) -> Embeds:
        if chunk.has_vision:
            raise ChunkError(f"{type(self.model).__name__} is a text model; chunk {chunk.id!r} carries pixels")
        emb = self.model.get_input_embeddings()
        return Embeds(emb(chunk.input_ids.to(emb.weight.device)))

    def run(self, embeds: torch.Tensor, position_ids: torch.Tensor, cache: Any, visual_mask=None, deepstack=None,
            attention_mask: Optional[torch.Tensor] = None):
        """Decoder over ``embeds`` [1, L, hidden] at ``position_ids`` [1, L] after ``cache`` (under a 4-D
        ``attention_mask`` where given: a selective recompute); last logits [vocab] and the cache."""
        kw = {self.cache_kw: cache, "use_cache": True}
        if self.has_logits_to_keep:
            kw["logits_to_keep"] = 1
        out = self.model(inputs_embeds=embeds, position_ids=position_ids, attention_mask=attention_mask, **kw)
        new_cache = getattr(out, "cache", None) or out.past_key_values
        return out.logits[0, -1].float(), new_cache


def _model_type(model: Any) -> str:
    cfg = model.config
    return str(getattr(cfg, "model_type", ""))


def _text_config(model: Any) -> Any:
    cfg = model.config
    return getattr(cfg, "text_config", None) or cfg


def _find_rotary(model: Any) -> Any:
    for name, mod in model.named_modules():
        cls = type(mod).__name__
        if cls.endswith("RotaryEmbedding") and "Vision" not in cls and hasattr(mod, "inv_freq"):
            return mod
    return None


class HFBackend:
    """transformers reference backend for Llama/Qwen2/Qwen3, DeepSeek-V2/V3 (MLA), Qwen2.5-VL, Qwen3-VL.

        backend = HFBackend(model)
        canon = backend.forward([chunk], start=0).kv              # KV(B|∅)
        cond = backend.forward([b], start=len(a), past=kv_a).kv  # KV(B|A), one conditioned forward
    """

    needs_past = True  # forwards read the past KV (the Backend protocol's flag)

    def __init__(self, model: Any, *, verify: bool = True):
        if not hasattr(model, "config") or not hasattr(model, "forward"):
            raise UnsupportedModelError(f"HFBackend needs a transformers model, got {type(model).__name__}")
        self.model = model.eval()
        self.model_type = _model_type(model)
        self.stats = BackendStats()
        if self.model_type in VL_FAMILIES:
            self.adapter: Any = QwenVLAdapter(model, self.stats)
        elif self.model_type in TEXT_FAMILIES:
            self.adapter = TextAdapter(model, self.stats)
        else:
            raise UnsupportedModelError(
                f"model_type {self.model_type!r} is not supported; supported: {', '.join(TEXT_FAMILIES + VL_FAMILIES)}"
            )
        self.layout = self._detect_layout()
        rot = _find_rotary(model)
        if rot is None:
            raise UnsupportedModelError(f"{type(model).__name__}: no rotary embedding module with inv_freq found")
        self.rope = RopeSpec.from_config(model.config, engine="transformers", inv_freq=rot.inv_freq)
        rope_dim = self.layout.slot_shapes[self.layout.rope_slot][1]
        if self.rope.rot_dim != rope_dim:
            raise UnsupportedModelError(
                f"rotary width {self.rope.rot_dim} != cached rope dims {rope_dim} (partial rotary is not supported)"
            )
        self._embed_cache: dict[str, Embeds] = {}
        self._pos_cache: dict[str, tuple[torch.Tensor, int]] = {}  # M-RoPE positions at 0, by content hash
        self._fingerprint: Optional[str] = None
        if verify:
            self._verify_relocation()

    # ------------------------------------------------------------------ facts
    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def n_axes(self) -> int:
        return self.adapter.n_axes

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    def fingerprint(self) -> str:
        """sha256 of the config and a sample of every weight: a store written for another model is refused."""
        if self._fingerprint is None:
            h = hashlib.sha256(self.model.config.to_json_string(use_diff=False).encode())
            with torch.no_grad():
                for name, p in sorted(self.model.named_parameters(), key=lambda kv: kv[0]):
                    flat = p.detach().reshape(-1)
                    h.update(name.encode())
                    h.update(flat[:16].float().cpu().numpy().tobytes())
                    h.update(repr(float(flat.float().sum())).encode())
            self._fingerprint = h.hexdigest()[:32]
        return self._fingerprint

    def _detect_layout(self) -> KVLayout:
        cfg = _text_config(self.model)
        n_layers = int(cfg.num_hidden_layers)
        if self.model_type.startswith("deepseek"):
            attn = None
            for mod in self.model.modules():
                if type(mod).__name__.endswith("Attention"):
                    attn = mod
                    break
            if attn is None or not hasattr(attn, "expand_kv"):
                raise UnsupportedModelError(
                    "this transformers version caches DeepSeek MLA decompressed per head; windowkit needs the "
                    "latent cache layout (transformers >= 5.16)"
                )
            return KVLayout("mla", n_layers, ((1, int(cfg.kv_lora_rank)), (1, int(cfg.qk_rope_head_dim))), rope_slot=1)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        n_kv = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        return KVLayout("gqa", n_layers, ((n_kv, int(head_dim)), (n_kv, int(head_dim))), rope_slot=0)

    # ------------------------------------------------------------------ positions and embeddings
    def positions(self, chunk: Chunk, start: int) -> tuple[torch.Tensor, int]:
        """[n_axes, S] position ids of ``chunk`` placed at ``start``, and its span in position space."""
        if self.adapter.n_axes == 1:
            return self.adapter.positions(chunk, int(start))
        # M-RoPE: parsing a chunk's vision groups costs more than a step's bookkeeping; positions(start) is
        # positions(0) + start on every axis (hf_qwen_vl), so the layout at 0 is kept per content (as embeds)
        got = self._positions_at_0(chunk)
        return got[0] + int(start), got[1]

    def _positions_at_0(self, chunk: Chunk) -> tuple[torch.Tensor, int]:
        key = chunk.content_hash()
        got = self._pos_cache.get(key)
        if got is None:
            got = self._pos_cache[key] = self.adapter.positions(chunk, 0)
        return got

    @_busy
    def span(self, chunk: Chunk) -> int:
        if self.adapter.n_axes == 1:
            return len(chunk)  # 1-D RoPE: one position per token
        return self._positions_at_0(chunk)[1]  # no tensor work: the span is kept with the layout at 0

    def embeds(self, chunk: Chunk) -> Embeds:
        """Decoder inputs of a chunk, cached by content hash (vision runs once per distinct chunk)."""
        key = chunk.content_hash()
        e = self._embed_cache.get(key)
        if e is None:
            with torch.no_grad():
                e = self.adapter.embed(chunk)
            self._embed_cache[key] = e
        return e

    def forget(self, chunk: Chunk) -> None:
        """Drop a chunk's cached decoder inputs (the store keeps its KV)."""
        self._embed_cache.pop(chunk.content_hash(), None)
        self._pos_cache.pop(chunk.content_hash(), None)

    # ------------------------------------------------------------------ the forward primitive
    def make_cache(self, past: Optional[ChunkKV]) -> Any:
        """A transformers ``DynamicCache`` holding ``past``. Its layers hold views of ``past``'s tensors (no
        copy: ``DynamicCache(data)`` would copy the whole window once more before the forward copies it again);
        transformers' cache never writes into them in place (``update`` concatenates into new tensors)."""
        cache = DynamicCache()
        if past is None or past.num_tokens == 0:
            return cache
        self.check_kv(past)
        for a, b in past.layers:
            layer = DynamicLayer()
            k, v = a[None], b[None]
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
            cache.layers.append(layer)
        return cache

    def check_kv(self, kv: ChunkKV) -> None:
        if kv.layout != self.layout:
            raise KVShapeError(f"KV layout {kv.layout.describe()} does not match the model's {self.layout.describe()}")
        if kv.dtype != self.dtype:
            raise KVShapeError(f"KV dtype {kv.dtype} != model dtype {self.dtype}")
        if kv.device != self.device:
            raise KVShapeError(f"KV on {kv.device}, model on {self.device}")

    @_busy
    def forward(self, chunks: Sequence[Chunk], start: int, past: Optional[ChunkKV] = None) -> ForwardResult:
        """Run ``chunks`` back to back from position ``start`` over ``past``; KV of the new tokens + logits."""
        if not chunks:
            raise ChunkError("forward needs at least one chunk")
        vocab = self.vocab_size
        for c in chunks:
            if not isinstance(c, Chunk):
                raise ChunkError(f"expected a windowkit.Chunk, got {type(c).__name__}")
            lo, hi = int(c.input_ids.min()), int(c.input_ids.max())
            if lo < 0 or hi >= vocab:
                raise ChunkError(f"chunk {c.id!r} has token ids in [{lo}, {hi}] but the model's vocabulary is {vocab}: "
                                 "was it tokenized for another model?")
        if int(start) < 0:
            raise ChunkError(f"start position must be >= 0, got {start}")
        pos, embs, masks, deep, spans, counts = [], [], [], [], [], []
        p = int(start)
        any_visual = False
        for c in chunks:
            ids, span = self.positions(c, p)
            e = self.embeds(c)
            pos.append(ids)
            embs.append(e.embeds)
            spans.append(span)
            counts.append(len(c))
            p += span
            if e.visual_mask is not None:
                any_visual = True
            masks.append(e.visual_mask if e.visual_mask is not None
                         else torch.zeros(len(c), dtype=torch.bool, device=e.embeds.device))
            deep.append(e.deepstack)
        embeds = torch.cat(embs, 0)[None]  # [1, L, hidden]
        position_ids = torch.cat(pos, 1).to(self.device)  # [n_axes, L]
        visual_mask = deepstack = None
        if any_visual and any(d is not None for d in deep):
            visual_mask = torch.cat(masks, 0)[None].to(self.device)
            n_layers = max(len(d) for d in deep if d is not None)
            deepstack = [torch.cat([d[i] for d in deep if d is not None], 0) for i in range(n_layers)]
        cache = self.make_cache(past)
        past_len = 0 if past is None else past.num_tokens
        with torch.no_grad():
            logits, cache = self.adapter.run(embeds, position_ids, cache, visual_mask, deepstack)
        self.stats.forwards += 1
        self.stats.forward_tokens += embeds.shape[1]
        layers = [(layer.keys[0, :, past_len:], layer.values[0, :, past_len:]) for layer in cache.layers]
        return ForwardResult(ChunkKV(layers, self.layout, position_ids.cpu()), logits, spans, counts)

    def encode(self, chunk: Chunk) -> ChunkKV:
        """Canonical KV(B|∅): the chunk alone at position 0."""
        return self.forward([chunk], 0).kv

    # ------------------------------------------------------------------ selective recompute (survivor repair)
    @property
    def supports_recompute(self) -> bool:
        """True where ``recompute`` is exact: decoders with per-head K/V, text (Llama, Qwen2, Qwen3; 1-D
        positions) and M-RoPE (Qwen2.5-VL, Qwen3-VL; 3-D positions, ``slots=`` given). MLA families fall back to
        a full recondition in the Window."""
        return self.model_type in RECOMPUTE_FAMILIES + VL_FAMILIES

    @property
    def reads_attention(self) -> bool:
        """True where ``query_attention`` and ``recompute(probe=True)`` read attention weights: the text families
        of ``supports_recompute`` (the query-driven focus maps weights to window positions, which are slots only
        with 1-D positions)."""
        return self.model_type in RECOMPUTE_FAMILIES

    @_busy
    def recompute(self, past: Optional[ChunkKV], chunks: Sequence[Chunk], starts: Sequence[int],
                  offsets: Sequence[torch.Tensor], *, slots: Optional[Sequence[int]] = None,
                  return_logits: bool = False, probe: bool = False):
        """CacheBlend-style selective recompute: ONE forward over the chosen tokens at their own positions.

        past:    the window KV from its first token (prefix + chunks) covering at least every chosen token's
                 slot; the chosen tokens' own entries in it are stale and never read
        chunks:  the chunks holding chosen tokens, each at position ``starts[i]``
        offsets: per chunk, sorted token offsets to recompute (a LongTensor, may be empty)
        slots:   per chunk, the index in ``past`` (storage order) of its first token. Text decoders: omit it
                 (storage index == position, ``slots = starts``). M-RoPE (Qwen2.5-VL / Qwen3-VL): required, since
                 an image's tokens span fewer positions than they hold slots; positions are then the chunk's own
                 3-D ids (``positions(chunk, starts[i])``) at the chosen offsets

        Each chosen token attends to the stale KV of every unchosen token before it (and the prefix) and,
        causally, to the fresh KV of the chosen tokens before it (a 4-D mask; position ids explicit). With
        every token after some position chosen this is exactly a prefill of them over the KV in front.
        Past entries no chosen token reads (after the last unchosen entry before the last chosen token) are cut
        off; when the chosen tokens are then every token from the cut on, the forward is a plain prefill (no 4-D
        mask: transformers' own causal path, e.g. repair "all"). Chosen tokens may also continue ``past`` at its
        end (positions ``past.num_tokens``, +1, ... without a gap: a new chunk admitted at the tail, a query), so
        a repair, the next admission and a query can run as ONE forward. Returns, per chunk, the fresh KV of its
        chosen tokens (``ChunkKV`` with their positions); with ``return_logits=True`` ``(kvs, logits)``, the
        next-token logits [vocab] of the last chosen token. ``probe=True`` (with ``return_logits``) also reads where
        that last token attends, as ``query_attention`` does: ``(kvs, logits, weights)``, weights [positions up to
        the last chosen one] summed over heads, averaged over layers (stale entries it reads at their positions,
        fresh chosen tokens at theirs, masked ones 0; in slots, not positions, on M-RoPE models).
        """
        if not self.supports_recompute:
            raise UnsupportedModelError(f"selective recompute is not exact for {self.model_type!r} "
                                        f"(supported: {', '.join(RECOMPUTE_FAMILIES + VL_FAMILIES)})")
        if len(chunks) != len(starts) or len(chunks) != len(offsets):
            raise ChunkError("recompute: chunks, starts and offsets must have the same length")
        multi = self.adapter.n_axes > 1
        if slots is None:
            if multi:
                raise ChunkError("recompute on an M-RoPE model needs slots= (each chunk's first index in past): "
                                 "an image spans fewer positions than it holds tokens")
            slots = starts
        elif len(slots) != len(chunks):
            raise ChunkError("recompute: slots must have one entry per chunk")
        embs, idx, pos, counts, vis, deep = [], [], [], [], [], []
        for c, s, ix, off in zip(chunks, starts, slots, offsets):
            off = torch.as_tensor(off, dtype=torch.long).reshape(-1)
            if off.numel() and (int(off.min()) < 0 or int(off.max()) >= len(c)):
                raise ChunkError(f"recompute: offsets of chunk {c.id!r} outside 0..{len(c) - 1}")
            counts.append(int(off.numel()))
            if not off.numel():
                continue
            e = self.embeds(c)
            embs.append(e.embeds[off.to(self.device)])
            idx.append(off + int(ix))
            pos.append(self.positions(c, int(s))[0][:, off] if multi else (off + int(s))[None])
            vm = e.visual_mask[off.to(e.visual_mask.device)] if e.visual_mask is not None else None
            vis.append(vm if vm is not None else torch.zeros(int(off.numel()), dtype=torch.bool))
            if e.deepstack is not None and vm is not None and bool(vm.any()):
                rank = torch.cumsum(e.visual_mask.long(), 0) - 1  # [S] row of each visual token in the features
                rows = rank[off.to(rank.device)][vm]
                deep.append([d[rows] for d in e.deepstack])
        outs: list[ChunkKV] = []
        if not embs:
            raise ChunkError("recompute: no token chosen")
        sel = torch.cat(idx)  # [q] slots of the chosen tokens in past, increasing in window order
        if bool((sel[1:] <= sel[:-1]).any()):
            raise ChunkError("recompute: chosen positions must increase in window order")
        position_ids = torch.cat(pos, 1)  # [n_axes, q]
        visual_mask = deepstack = None
        if deep:  # Qwen3-VL: the chosen visual tokens' deepstack rows, in token order
            visual_mask = torch.cat([v.cpu() for v in vis])[None].to(self.device)
            deepstack = [torch.cat([d[i] for d in deep], 0) for i in range(len(deep[0]))]
        if probe and not self.reads_attention:
            raise UnsupportedModelError(f"recompute(probe=True) reads attention for text LLM families, not "
                                        f"{self.model_type!r}")
        if probe and not return_logits:
            raise ChunkError("recompute: probe=True reads the last chosen token's row: pass return_logits=True")
        s_len = 0 if past is None else past.num_tokens
        span = max(s_len, int(sel.max()) + 1)  # positions the probe's weights cover
        beyond = sel[sel >= s_len]  # an append at the end of past: s_len, s_len + 1, ... with no gap
        if beyond.numel() and not torch.equal(beyond, torch.arange(s_len, s_len + beyond.numel())):
            raise ChunkError(f"recompute: past covers {s_len} positions; chosen tokens beyond it must continue it "
                             f"without a gap, got positions {beyond[:4].tolist()}...")
        q = int(sel.numel())
        kv_pos = torch.arange(s_len)
        chosen = torch.zeros(s_len, dtype=torch.bool)
        chosen[sel[sel < s_len]] = True
        # Only unchosen entries before the last chosen position are ever read. The past after the last of them is
        # either chosen (stale, masked) or behind every chosen token: cut it off, the forward attends over less.
        readable = (~chosen & (kv_pos < int(sel.max()))).nonzero()
        cut = int(readable[-1]) + 1 if readable.numel() else 0
        if cut < s_len:
            past = past.slice(0, cut) if cut > 0 else None
            kv_pos, chosen = kv_pos[:cut], chosen[:cut]
        mask, blocks = None, None
        if not torch.equal(sel, torch.arange(cut, cut + q)):  # else every token from `cut` on: a plain prefill
            allowed = torch.zeros(q, cut + q, dtype=torch.bool)
            allowed[:, :cut] = (kv_pos[None] < sel[:, None]) & ~chosen[None]  # stale KV of unchosen tokens before
            allowed[:, cut:] = sel[None] <= sel[:, None]  # fresh KV of chosen tokens, causally
            mask = torch.zeros(1, 1, q, cut + q, dtype=self.dtype)
            mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
            mask = mask.to(self.device)
            # rows early in the window read few past keys: run them in blocks over only those (attention.py)
            blocks = block_plan(sel, (~chosen).nonzero().reshape(-1), cut)
        s_len = cut
        cache = self.make_cache(past)
        own = probe or blocks is not None  # windowkit's attention: the probe's row, the blocks
        with attention(self.model, rows=int(probe), blocks=blocks) if own else nullcontext() as rows, torch.no_grad():
            logits, cache = self.adapter.run(torch.cat(embs, 0)[None], position_ids.to(self.device), cache,
                                             visual_mask, deepstack, attention_mask=mask)
        self.stats.forwards += 1
        self.stats.forward_tokens += q
        layers = [(layer.keys[0, :, s_len:], layer.values[0, :, s_len:]) for layer in cache.layers]
        o = 0
        for n in counts:
            outs.append(ChunkKV([(a[:, o:o + n], b[:, o:o + n]) for a, b in layers], self.layout,
                                position_ids[:, o:o + n].cpu()))
            o += n
        if probe:  # the last chosen token's row over [past[:cut] | chosen tokens] -> window positions
            row = torch.stack([a[-1] for a in rows]).mean(0).cpu()  # [cut + q]
            weights = torch.zeros(span)
            weights[:cut] = row[:cut]
            weights[sel] = row[cut:]
            return outs, logits, weights
        if return_logits:
            return outs, logits
        return outs

    @_busy
    def query_attention(self, past: ChunkKV, query: Chunk, start: int, rows: int = 1,
                        lookahead: int = 0, return_kv: bool = False):
        """How much the query reads each past token: [past.num_tokens] attention weights, summed over heads and
        averaged over layers, of the query's last ``rows`` tokens and of ``lookahead`` greedy tokens decoded after
        it (a row sums to the head count over past + query + decoded tokens).

            att = backend.query_attention(win.window_kv(), Chunk.text(question_ids), win.next_position)

        ``lookahead=1`` reads where the first answer token looks: a chat model's first token after the question is
        often a space or a template token, and it is the token after it that copies the fact. Forwards of the
        query (and each decoded token) over ``past`` with SDPA, the rows' weights recomputed from the same query and
        keys (``attention.capture_rows``; equal to transformers' eager ``output_attentions``). Text LLM families
        only (those with ``recompute``). With ``return_kv=True`` returns ``(weights, kv)``: ``past`` followed by the query's KV from that forward, in the
        tensors transformers built for it (no copy: the caller may write into them).
        """
        if not self.reads_attention:
            raise UnsupportedModelError(f"query attention is read for text LLM families, not {self.model_type!r}")
        if past is None or past.num_tokens == 0:
            raise ChunkError("query_attention: no past KV to attend to")
        if int(lookahead) < 0:
            raise ChunkError(f"query_attention: lookahead must be >= 0, got {lookahead}")
        s_len, q = past.num_tokens, len(query)
        rows = max(1, min(int(rows), q))
        cache = self.make_cache(past)
        kw = {self.adapter.cache_kw: cache, "use_cache": True}
        if self.adapter.has_logits_to_keep:
            kw["logits_to_keep"] = 1
        embeds, pos = self.embeds(query).embeds[None], torch.arange(int(start), int(start) + q, device=self.device)
        picked: list[torch.Tensor] = []  # per forward: [L, s_len] of its rows
        query_kv = None
        with capture_rows(self.model, rows) as got:  # SDPA, plus the softmax of the last rows (attention.py)
            for step in range(1 + int(lookahead)):
                got.clear()
                with torch.no_grad():
                    out = self.model(inputs_embeds=embeds, position_ids=pos[None], **kw)
                self.stats.forwards += 1
                self.stats.forward_tokens += int(pos.numel())
                r = rows if step == 0 else 1
                # per layer [rows, s_len + ...] -> the last r rows over the past, summed over rows
                picked.append(torch.stack([a[-r:, :s_len].sum(0) for a in got]))
                if step == 0 and return_kv:  # past + query: the cache's own tensors (a later update makes new ones)
                    c = getattr(out, "cache", None) or out.past_key_values
                    full_pos = torch.arange(s_len + q)[None] if past.positions is None else torch.cat(
                        [past.positions[:1], pos[None].cpu()], 1)
                    query_kv = ChunkKV([(layer.keys[0], layer.values[0]) for layer in c.layers], self.layout,
                                       full_pos)
                if step < int(lookahead):
                    tok = out.logits[0, -1].argmax().reshape(1, 1)
                    embeds = self.model.get_input_embeddings()(tok.to(self.device))
                    pos = pos[-1:] + 1
        weights = (torch.stack(picked).sum(0).mean(0) / (rows + int(lookahead))).cpu()
        return (weights, query_kv) if return_kv else weights

    # ------------------------------------------------------------------ self-check
    def _verify_relocation(self) -> None:
        """Refuse a model whose cached keys do not re-rotate exactly (wrong layout, scaled or dynamic RoPE)."""
        vocab = self.vocab_size
        ids = torch.arange(4) % max(vocab, 1) + min(10, max(vocab - 4, 0))
        probe = Chunk.text(ids, id="__windowkit_probe__")
        shift = 7
        try:
            a = self.forward([probe], 0).kv
            b = self.forward([probe], shift).kv
        finally:
            self.forget(probe)
            self.stats.forwards -= 2
            self.stats.forward_tokens -= 8
        # layer 0 only: its keys depend on content and position alone. Deeper layers also carry the
        # model's own rounding noise across positions (in bf16 an MoE router can even flip experts).
        r = self.layout.rope_slot
        moved = relocate_keys(a.layers[0][r], shift, self.rope, a.positions).float()
        own = b.layers[0][r].float()
        rel = float((moved - own).norm() / own.norm().clamp_min(1e-30))
        tol = 1e-4 if self.dtype == torch.float32 else 3e-2
        if not rel <= tol:
            raise UnsupportedModelError(
                f"re-rotating cached keys does not reproduce the model's keys (relative error {rel:.2e} > {tol:g}); "
                "the RoPE scheme or cache layout of this model is not one windowkit can relocate exactly"
            )


__all__ = ["HFBackend", "TextAdapter", "Embeds", "TEXT_FAMILIES", "VL_FAMILIES", "RECOMPUTE_FAMILIES"]
