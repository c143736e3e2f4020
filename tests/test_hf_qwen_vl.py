"""Tests for windowkit.backends.hf_qwen_vl (QwenVLAdapter behind HFBackend) on tiny Qwen2.5-VL / Qwen3-VL.

Ground truth is always transformers itself: ``model.model.get_rope_index`` for positions and the model's own
full forward ``model(input_ids=..., pixel_values=..., image_grid_thw=..., mm_token_type_ids=..., use_cache=True)``
over the concatenated inputs for logits and KV. fp32 throughout.
"""
from __future__ import annotations

import pytest
import torch

from windowkit.backends.hf import HFBackend
from windowkit.backends.tiny import build
from windowkit.chunk import Chunk
from windowkit.errors import ChunkError
from windowkit.kv.layout import ChunkKV, concat

try:  # pytest puts tests/ on sys.path (no __init__.py); `python -m pytest` from the root also finds tests.*
    from vl_inputs import image_chunk, model_inputs, rope_index_inputs, text_chunk, video_chunk
except ImportError:  # pragma: no cover
    from tests.vl_inputs import image_chunk, model_inputs, rope_index_inputs, text_chunk, video_chunk

QWEN25, QWEN3 = "tiny-qwen2.5-vl", "tiny-qwen3-vl"
MODELS = [QWEN25, QWEN3]
LOGIT_ATOL = 1e-4  # logits are O(3); observed diffs ~1e-6
KV_ATOL = 1e-5


@pytest.fixture(scope="module", params=MODELS)
def vl(request):
    model = build(request.param)
    return request.param, model, HFBackend(model)


# ---------------------------------------------------------------------- ground-truth helpers (transformers only)
def full_forward(model, chunks: list[Chunk], position_ids: torch.Tensor | None = None):
    """The model's own forward over the concatenated chunks: (last logits [vocab] fp32, DynamicCache)."""
    kw = model_inputs(chunks)
    if position_ids is not None:
        kw["position_ids"] = position_ids[:, None]  # [3, 1, L]
    model.model.rope_deltas = None  # never let a previous call's cached deltas leak in
    with torch.no_grad():
        out = model(**kw, use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    return out.logits[0, -1].float(), cache


def rope_index(model, chunks: list[Chunk]) -> torch.Tensor:
    """transformers' 3-D positions [3, L] of the concatenated chunks."""
    pos, _ = model.model.get_rope_index(**rope_index_inputs(model_inputs(chunks)))
    return pos[:, 0]


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    lp, lq = p_logits.double().log_softmax(-1), q_logits.double().log_softmax(-1)
    return float((lp.exp() * (lp - lq)).sum())


def assert_kv_equals_cache(kv: ChunkKV, cache, lo: int = 0, atol: float = KV_ATOL) -> None:
    """kv == the model cache's tokens [lo, lo + kv.num_tokens) on every layer, keys and values."""
    assert len(cache.layers) == len(kv.layers)
    hi = lo + kv.num_tokens
    for i, ((k, v), layer) in enumerate(zip(kv.layers, cache.layers)):
        torch.testing.assert_close(k, layer.keys[0, :, lo:hi], atol=atol, rtol=1e-5, msg=f"layer {i} keys")
        torch.testing.assert_close(v, layer.values[0, :, lo:hi], atol=atol, rtol=1e-5, msg=f"layer {i} values")


def place(backend: HFBackend, chunks: list[Chunk], start: int = 0) -> torch.Tensor:
    """windowkit's positions [3, L] of chunks placed back to back from ``start``."""
    cols, p = [], start
    for c in chunks:
        pos, span = backend.positions(c, p)
        cols.append(pos)
        p += span
    return torch.cat(cols, 1)


def video_for(name: str, seed: int = 5, **kw) -> Chunk:
    # Qwen2.5-VL: 2 temporal patches 1 time step apart (0.5 s * 2 tokens/s): every transformers version agrees
    secs = 0.5 if name == QWEN25 else None
    return video_chunk(name, (2, 4, 4), seed=seed, second_per_grid_ts=secs, **kw)


def mixed_chunks(name: str) -> list[Chunk]:
    """[text, image, text, image, video, text]: every kind of group, non-square grid included."""
    return [text_chunk(5, seed=1), image_chunk(name, (1, 4, 4), seed=2, text_before=2), text_chunk(3, seed=3),
            image_chunk(name, (1, 4, 6), seed=4, text_before=1, text_after=2), video_for(name, text_before=2),
            text_chunk(4, seed=6)]


# ---------------------------------------------------------------------- 1. positions
def test_positions_match_get_rope_index(vl):
    name, model, backend = vl
    chunks = mixed_chunks(name)
    ours = place(backend, chunks)
    assert ours.shape == (3, sum(len(c) for c in chunks))
    assert torch.equal(ours, rope_index(model, chunks))
    # span: the next chunk starts one past the chunk's largest id, on every axis
    for c in chunks:
        pos, span = backend.positions(c, 0)
        assert span == int(pos.max()) + 1


def test_positions_shift_uniformly(vl):
    name, _, backend = vl
    for c in mixed_chunks(name):
        p0, s0 = backend.positions(c, 0)
        p1, s1 = backend.positions(c, 37)
        assert s0 == s1 and torch.equal(p1, p0 + 37)


def test_image_chunk_positions_by_hand(vl):
    name, _, backend = vl
    c = image_chunk(name, (1, 4, 6), seed=0, text_before=2, text_after=1)  # merged grid 2 x 3
    pos, span = backend.positions(c, 10)
    # text 10,11 · <vs> 12 · image at 13: t=13, h=13..14, w=13..15 · <ve> 16 · text 17
    exp = torch.tensor([[10, 11, 12, 13, 13, 13, 13, 13, 13, 16, 17],
                        [10, 11, 12, 13, 13, 13, 14, 14, 14, 16, 17],
                        [10, 11, 12, 13, 14, 15, 13, 14, 15, 16, 17]])
    assert torch.equal(pos, exp) and span == 8


def test_qwen25_text_after_multi_patch_video_follows_max_plus_one():
    """The documented exception (QwenVLAdapter._next_position): video grid (2,4,4), 2 tokens/s, 1 s per patch.

    Its t offsets are {0, 2}; its spatial extent is 2. windowkit starts the next token at max + 1
    (released Qwen code, transformers <= 5.2); transformers >= 5.3 advances by the spatial extent only, so
    its next text id repeats the video's last t. Everything up to the end of the video agrees.
    """
    model = build(QWEN25)
    backend = HFBackend(model)
    a, b = text_chunk(3, seed=1), text_chunk(4, seed=2)
    v = video_chunk(QWEN25, (2, 4, 4), seed=3, text_before=0, second_per_grid_ts=1.0)  # <vs> pads*8 <ve>
    chunks = [a, v, b]
    ours, hf = place(backend, chunks), rope_index(model, chunks)
    n_vid = 3 + 1 + 8  # a, <vs>, pads
    assert torch.equal(ours[:, :n_vid], hf[:, :n_vid])
    vid_t = ours[0, 4:n_vid]
    assert vid_t.tolist() == [4] * 4 + [6] * 4  # t = start + floor(k * 2)
    # windowkit: <ve> and the text after it start at max(video ids) + 1 = 7, identical on all rows
    tail = torch.arange(7, 7 + 1 + len(b))
    assert torch.equal(ours[:, n_vid:], tail.expand(3, -1))
    # transformers: either the same rule, or the known >= 5.3 rule one lower (colliding with t = 6)
    assert int(hf[0, n_vid]) in (7, 6)
    assert torch.equal(hf[:, n_vid:], hf[:, n_vid:n_vid + 1] + torch.arange(1 + len(b)))
    # chunk boundaries never change positions: the same tokens as one chunk get the same ids
    one = Chunk.video(torch.cat([c.input_ids for c in chunks]), pixel_values_videos=v.pixel_values_videos,
                      video_grid_thw=v.video_grid_thw, second_per_grid_ts=v.second_per_grid_ts)
    assert torch.equal(backend.positions(one, 0)[0], ours)
    # and the decoder at windowkit's positions is the model's own forward given those positions
    ref_logits, ref_cache = full_forward(model, chunks, position_ids=ours)
    res = backend.forward(chunks, 0)
    assert (res.logits - ref_logits).abs().max() < LOGIT_ATOL
    assert_kv_equals_cache(res.kv, ref_cache)


# ---------------------------------------------------------------------- 2./3. forward and splicing
def three_chunks(name: str) -> list[Chunk]:
    return [image_chunk(name, (1, 4, 4), seed=11, text_before=3), image_chunk(name, (1, 4, 6), seed=12, text_before=2),
            video_for(name, seed=13, text_before=1, text_after=3)]


def test_forward_equals_full_forward(vl):
    name, model, backend = vl
    chunks = three_chunks(name)
    ref_logits, ref_cache = full_forward(model, chunks)
    res = backend.forward(chunks, 0)
    assert res.kv.num_tokens == sum(len(c) for c in chunks)
    assert res.token_counts == [len(c) for c in chunks]
    assert kl(ref_logits, res.logits) <= 1e-6
    assert (res.logits - ref_logits).abs().max() < LOGIT_ATOL
    assert_kv_equals_cache(res.kv, ref_cache)


def test_spliced_forward_equals_full_forward(vl):
    name, model, backend = vl
    c1, c2, c3 = three_chunks(name)
    ref_logits, ref_cache = full_forward(model, [c1, c2, c3])
    head = backend.forward([c1, c2], 0)
    tail = backend.forward([c3], sum(head.spans), past=head.kv)
    assert kl(ref_logits, tail.logits) <= 1e-6
    assert (tail.logits - ref_logits).abs().max() < LOGIT_ATOL
    assert_kv_equals_cache(concat([head.kv, tail.kv]), ref_cache)
    # the spliced cache was not mutated by the forward over it
    assert head.kv.num_tokens == len(c1) + len(c2)


def _slots_and_starts(chunks: list[Chunk], backend: HFBackend) -> tuple[list[int], list[int]]:
    slots, starts, i, p = [], [], 0, 0
    for c in chunks:
        slots.append(i)
        starts.append(p)
        i += len(c)
        p += backend.span(c)
    return slots, starts


def test_selective_recompute_reproduces_the_models_own_kv(vl):
    """M-RoPE selective recompute: over the model's own exact KV, ANY chosen tokens (mid-window, vision pads and
    text, several chunks, not a suffix: a 4-D mask, 3-D positions, deepstack rows on Qwen3-VL) come back equal to
    the model's own full forward; a chosen suffix that ends the window gives its logits too."""
    name, model, backend = vl
    chunks = mixed_chunks(name)
    ref_logits, ref_cache = full_forward(model, chunks)
    slots, starts = _slots_and_starts(chunks, backend)
    n = sum(len(c) for c in chunks)
    exact = ChunkKV([(l.keys[0], l.values[0]) for l in ref_cache.layers], backend.layout)
    g = torch.Generator().manual_seed(3)
    picks = [torch.randperm(len(c), generator=g)[: max(1, len(c) // 3)].sort().values for c in chunks[1:5]]
    picks[0] = torch.arange(2, len(chunks[1]))  # every vision pad of the first image (and nothing before them)
    kvs = backend.recompute(exact, chunks[1:5], starts[1:5], picks, slots=slots[1:5])
    for c, kv, off, lo in zip(chunks[1:5], kvs, picks, slots[1:5]):
        assert kv.num_tokens == off.numel()
        for i, ((k, v), layer) in enumerate(zip(kv.layers, ref_cache.layers)):
            torch.testing.assert_close(k, layer.keys[0, :, lo + off], atol=KV_ATOL, rtol=1e-5, msg=f"{c.id} L{i} K")
            torch.testing.assert_close(v, layer.values[0, :, lo + off], atol=KV_ATOL, rtol=1e-5, msg=f"{c.id} L{i} V")
    # the last chunk's tail: logits of the window's last token
    last = chunks[-1]
    kvs, logits = backend.recompute(exact, [chunks[3], last], [starts[3], starts[-1]],
                                    [torch.tensor([1, 5]), torch.arange(len(last))], slots=[slots[3], slots[-1]],
                                    return_logits=True)
    assert kl(ref_logits, logits) <= 1e-6
    assert_kv_equals_cache(kvs[1], ref_cache, lo=n - len(last))


def test_selective_recompute_on_m_rope_needs_slots(vl):
    """Slots are not positions on M-RoPE (an image holds more tokens than it spans): without them, refuse."""
    name, model, backend = vl
    chunks = three_chunks(name)
    past = backend.forward(chunks[:2], 0).kv
    with pytest.raises(ChunkError, match="slots"):
        backend.recompute(past, [chunks[1]], [backend.span(chunks[0])], [torch.tensor([0, 1])])
    with pytest.raises(ChunkError, match="slots"):
        backend.recompute(past, [chunks[1]], [backend.span(chunks[0])], [torch.tensor([0, 1])], slots=[0, 1])
    assert backend.supports_recompute and not backend.reads_attention


def test_text_only_chunk(vl):
    name, model, backend = vl
    c = text_chunk(7, seed=21)
    before = backend.stats.vision_calls
    res = backend.forward([c], 0)
    assert backend.stats.vision_calls == before
    assert backend.embeds(c).visual_mask is None and backend.embeds(c).deepstack is None
    ref_logits, ref_cache = full_forward(model, [c])
    assert (res.logits - ref_logits).abs().max() < LOGIT_ATOL
    assert_kv_equals_cache(res.kv, ref_cache)


# ---------------------------------------------------------------------- 4. relocation
def test_relocated_canonical_equals_model_kv_at_delta(vl):
    name, model, backend = vl
    c = image_chunk(name, (1, 4, 6), seed=31, text_before=2, text_after=2)
    delta = 13
    # transformers' own ids for the chunk after a delta-token text prefix == windowkit's ids at delta
    prefix = text_chunk(delta, seed=32)
    gt_pos = rope_index(model, [prefix, c])[:, delta:]
    assert torch.equal(backend.positions(c, delta)[0], gt_pos)
    assert torch.equal(gt_pos, backend.positions(c, 0)[0] + delta)
    # the model's own KV of the chunk computed alone at those ids
    _, ref_cache = full_forward(model, [c], position_ids=gt_pos)
    moved = backend.encode(c).relocate(delta, backend.rope)
    for i, ((k, v), layer) in enumerate(zip(moved.layers, ref_cache.layers)):
        rk, rv = layer.keys[0], layer.values[0]
        assert float((k - rk).abs().max() / rk.abs().max()) <= 1e-5, f"layer {i} keys"
        assert float((v - rv).abs().max() / rv.abs().max()) <= 1e-5, f"layer {i} values"


# ---------------------------------------------------------------------- 5. Qwen3-VL deepstack
def test_qwen3_deepstack_matters_and_canonical_is_models_own():
    model = build(QWEN3)
    backend = HFBackend(model)
    c = image_chunk(QWEN3, (1, 4, 4), seed=41, text_before=2, text_after=1)
    emb = backend.embeds(c)
    n_vis = int((c.input_ids == 5).sum())
    assert emb.deepstack is not None and len(emb.deepstack) == len(model.config.vision_config.deepstack_visual_indexes)
    assert all(d.shape == (n_vis, model.config.text_config.hidden_size) for d in emb.deepstack)
    canon = backend.encode(c)
    _, ref_cache = full_forward(model, [c])  # the model's own encode of the chunk alone, with pixels
    assert_kv_equals_cache(canon, ref_cache)
    # the same embeddings and positions without deepstack: layer 0 is untouched (features are added after
    # it), later layers change at the visual tokens and everything after them
    pos = backend.positions(c, 0)[0]
    with torch.no_grad():
        out = model.model.language_model(inputs_embeds=emb.embeds[None], position_ids=pos[:, None], use_cache=True)
    plain = out.past_key_values
    torch.testing.assert_close(canon.layers[0][0], plain.layers[0].keys[0], atol=KV_ATOL, rtol=1e-5)
    for i in range(1, len(canon.layers)):
        k, rk = canon.layers[i][0], plain.layers[i].keys[0]
        assert float((k - rk).abs().max() / rk.abs().max()) > 1e-2, f"layer {i}: deepstack made no difference"
        first_vis = int((c.input_ids == 5).nonzero()[0])
        torch.testing.assert_close(k[:, :first_vis], rk[:, :first_vis], atol=KV_ATOL, rtol=1e-5)


# ---------------------------------------------------------------------- 6. vision runs once
@pytest.mark.parametrize("name", MODELS)
def test_vision_runs_once_per_chunk(name):
    backend = HFBackend(build(name))
    c = image_chunk(name, (1, 4, 4), seed=51)
    first = backend.forward([c], 0)
    second = backend.forward([c], 0)
    assert backend.stats.vision_calls == 1
    assert torch.equal(first.logits, second.logits)
    backend.forward([text_chunk(3, seed=52), c], 0)  # same chunk elsewhere: still no vision run
    assert backend.stats.vision_calls == 1


# ---------------------------------------------------------------------- 7. bad input
@pytest.mark.parametrize("n_pad", [3, 5])
def test_pad_count_mismatch_raises(vl, n_pad):
    name, _, backend = vl
    bad = image_chunk(name, (1, 4, 4), seed=61, n_pad=n_pad)  # grid needs 4 pads
    with pytest.raises(ChunkError):
        backend.positions(bad, 0)
    with pytest.raises(ChunkError):
        backend.forward([bad], 0)


def test_bad_vision_inputs_raise(vl):
    name, _, backend = vl
    good = image_chunk(name, (1, 4, 4), seed=62)
    rows = Chunk.image(good.input_ids, pixel_values=good.pixel_values[:-1], image_grid_thw=good.image_grid_thw)
    odd = Chunk.image(good.input_ids, pixel_values=torch.zeros(15, good.pixel_values.shape[1]),
                      image_grid_thw=torch.tensor([[1, 3, 5]]))
    pads_no_pixels = Chunk.text(good.input_ids)
    for bad in (rows, odd, pads_no_pixels):
        with pytest.raises(ChunkError):
            backend.forward([bad], 0)
    vid = video_for(name)
    short = Chunk.video(vid.input_ids[:-3], pixel_values_videos=vid.pixel_values_videos,
                        video_grid_thw=vid.video_grid_thw, second_per_grid_ts=vid.second_per_grid_ts)
    with pytest.raises(ChunkError):
        backend.positions(short, 0)


def test_default_window_slide_is_one_exact_forward(vl):
    """The default Window on M-RoPE: a slide (evict head, admit at the tail) is deferred to the next read and runs
    as ONE selective-recompute forward (slots and 3-D positions; no full-recondition fallback) of the stale
    survivors (the balanced rule's head:128 and, with no query attention to read, its query:96 by position: all
    of these small chunks) + the new chunk + the query; the answer equals the model's own full forward over the
    same contents (the survivors lost their head)."""
    import windowkit as wk

    name, model, backend = vl
    chunks = mixed_chunks(name)
    win = wk.Window(backend)
    for c in chunks[:4]:
        win.admit(c)
    win.flush()
    f0 = win.stats.forwards
    win.evict("head")
    win.admit(chunks[4])
    query = text_chunk(3, seed=9)
    logits = win.forward(query)
    assert win.stats.forwards - f0 == 1  # repair + admission + query fused
    assert sum(len(c) for c in chunks[1:4]) <= 128 + 96
    assert win.stats.fallbacks == 0 and win.stats.repaired_tokens == sum(len(c) for c in chunks[1:4])
    ref, _ = full_forward(model, chunks[1:5] + [query])
    assert kl(ref, logits) <= 1e-6
