"""The KV operator against transformers' own forward (re-prefill is the ground truth).

Families: Llama (GQA), Qwen2 (GQA), DeepSeek-V3 and V2 (MLA latent + k_pe), Qwen2.5-VL (blocked M-RoPE),
Qwen3-VL (interleaved M-RoPE + deepstack). Text chunks here; image chunks in test_hf_qwen_vl.py.
"""
from __future__ import annotations

import pytest
import torch

import windowkit as wk
from windowkit.backends.tiny import build, synthetic_image_chunk
from windowkit.kv import (RopeSpec, concat, eta, form_orbit_patch, form_patch, kl_divergence, orderings, place,
                          reconstruction_error, relocate_keys)
from windowkit.kv.patch import deficit
from windowkit.kv.rope import bf16_ulp

FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-deepseek-v3", "tiny-deepseek-v2", "tiny-qwen2.5-vl", "tiny-qwen3-vl"]


@pytest.fixture(scope="module")
def backends():
    cache = {}

    def get(name: str, dtype=torch.float32) -> wk.HFBackend:
        if (name, dtype) not in cache:
            cache[(name, dtype)] = wk.HFBackend(build(name, dtype=dtype))
        return cache[(name, dtype)]

    return get


def _text(be, n, seed, id=""):
    g = torch.Generator().manual_seed(seed)
    return wk.Chunk.text(torch.randint(10, be.vocab_size, (n,), generator=g), id=id or f"t{seed}-{n}")


def _own_cache(model, ids: torch.Tensor, positions: torch.Tensor):
    """The model's own KV for ``ids`` at explicit ``positions`` (ground truth, no windowkit code)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    if positions.dim() == 1:
        pos = positions[None]
    else:  # Qwen-VL: [3, 1, S]
        pos = positions[:, None, :]
    with torch.no_grad():
        kw = dict(input_ids=ids[None], position_ids=pos, use_cache=True)
        kw["past_key_values"] = cache
        if getattr(model.config, "model_type", "") in ("qwen2_5_vl", "qwen3_vl"):
            kw["mm_token_type_ids"] = torch.zeros_like(ids)[None]
        out = model(**kw)
    c = out.past_key_values
    return [(l.keys[0], l.values[0]) for l in c.layers], out.logits[0, -1].float()


# ----------------------------------------------------------------------------- relocation
@pytest.mark.parametrize("name", FAMILIES)
def test_relocation_matches_models_own_encode_fp32(backends, name):
    be = backends(name)
    chunk = _text(be, 24, seed=1)
    canon = be.encode(chunk)
    r = be.layout.rope_slot
    for delta in (1, 37, 1000):
        pos = torch.arange(delta, delta + len(chunk))
        if be.n_axes == 3:
            pos = pos[None].expand(3, -1)
        own, _ = _own_cache(be.model, chunk.input_ids, pos)
        moved = canon.relocate(delta, be.rope)
        for l, (m, o) in enumerate(zip(moved.layers, own)):
            # layer 0 is pure rotation: elementwise max error. Deeper layers also carry the model's own
            # attention rounding across absolute positions: relative (Frobenius) error per layer.
            err = ((m[r] - o[r]).abs().max() / o[r].abs().max()).item() if l == 0 else \
                ((m[r] - o[r]).norm() / o[r].norm()).item()
            assert err <= 1e-5, f"{name} layer {l} delta {delta}: rel err {err:.2e}"
            other = 1 - r  # values / MLA latent: never touched, and equal to the model's own
            assert m[other] is canon.layers[l][other]
            # deeper layers see position only relatively: equal up to attention rounding
            assert ((m[other] - o[other]).abs().max() / o[other].abs().max()) <= 1e-4


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-deepseek-v3", "tiny-qwen2.5-vl"])
def test_relocation_bf16_within_one_ulp_of_exact_rotation(backends, name):
    """bf16: relocated keys are the correctly rounded rotation of the stored keys (<= 1 bf16 ULP of the
    fp64 rotation), and within a few ULP of the model's own bf16 encode (whose cos/sin are bf16 too)."""
    be = backends(name, torch.bfloat16)
    chunk = _text(be, 16, seed=2)
    canon = be.encode(chunk)
    r = be.layout.rope_slot
    delta = 53
    moved = canon.relocate(delta, be.rope)
    ang = (delta * be.rope.inv_freq.double())
    c, s = ang.cos(), ang.sin()
    for m, k in zip(moved.layers, canon.layers):
        x = k[r].double()
        n = be.rope.n_freq
        if be.rope.pairing == "half":
            x1, x2 = x[..., :n], x[..., n:]
            exact = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)
        else:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            exact = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], -1).flatten(-2)
        assert ((m[r].double() - exact).abs() <= bf16_ulp(exact).double() + 1e-30).all()
    # and at least as close to the exact rotation as the model's own bf16 encode at delta (layer 0: the
    # keys there depend on content and position alone)
    pos = torch.arange(delta, delta + len(chunk))
    if be.n_axes == 3:
        pos = pos[None].expand(3, -1)
    own, _ = _own_cache(be.model, chunk.input_ids, pos)
    k0 = canon.layers[0][r].double()
    x1, x2 = (k0[..., :n], k0[..., n:]) if be.rope.pairing == "half" else (k0[..., 0::2], k0[..., 1::2])
    ex = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1) if be.rope.pairing == "half" else \
        torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], -1).flatten(-2)
    ours = (moved.layers[0][r].double() - ex).abs().max()
    model_own = (own[0][r].double() - ex).abs().max()
    assert ours <= model_own, (float(ours), float(model_own))


def test_relocation_by_zero_is_byte_identical_and_composes(backends):
    be = backends("tiny-qwen2")
    canon = be.encode(_text(be, 12, seed=3))
    k = canon.layers[0][0]
    assert relocate_keys(k, 0, be.rope) is k
    z = canon.relocate(0, be.rope)
    for a, b in zip(z.layers, canon.layers):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    ab = relocate_keys(relocate_keys(k, 17, be.rope), 25, be.rope)
    assert torch.allclose(ab, relocate_keys(k, 42, be.rope), atol=1e-5)
    back = relocate_keys(relocate_keys(k, 99, be.rope), -99, be.rope)
    assert torch.allclose(back, k, atol=1e-5)


def test_mrope_per_axis_delta_matches_model(backends):
    """Qwen2.5-VL blocked and Qwen3-VL interleaved M-RoPE: a per-axis (dt, dh, dw) shift equals the model's
    own keys at the shifted 3-D positions."""
    for name in ("tiny-qwen2.5-vl", "tiny-qwen3-vl"):
        be = backends(name)
        chunk = _text(be, 10, seed=4)
        base = torch.arange(5, 15)[None].expand(3, -1).clone()
        own0, _ = _own_cache(be.model, chunk.input_ids, base)
        d = torch.tensor([7, -2, 3])[:, None]
        own1, _ = _own_cache(be.model, chunk.input_ids, base + d)
        for (k0, _v0), (k1, _v1) in zip(own0, own1):
            moved = relocate_keys(k0, (7, -2, 3), be.rope)
            assert ((moved - k1).abs().max() / k1.abs().max()) <= 1e-5
            # a uniform shift is the same as a 1-D rotation
            assert torch.allclose(relocate_keys(k0, (4, 4, 4), be.rope), relocate_keys(k0, 4, be.rope), atol=1e-6)


# ----------------------------------------------------------------------------- patches
@pytest.mark.parametrize("name", FAMILIES)
def test_exact_window_equals_fresh_prefill(backends, name):
    be = backends(name)
    a, b, q = _text(be, 20, 5, "a"), _text(be, 16, 6, "b"), _text(be, 5, 7, "q")
    ids = torch.cat([a.input_ids, b.input_ids, q.input_ids])
    pos = torch.arange(len(ids))
    _, ref = _own_cache(be.model, ids, pos if be.n_axes == 1 else pos[None].expand(3, -1))
    win = wk.Window(be, mode="exact")
    win.admit(a)
    win.admit(b)
    assert kl_divergence(ref, win.forward(q.input_ids)) <= 1e-6


@pytest.mark.parametrize("name", FAMILIES)
def test_full_rank_patch_reproduces_conditioned_kv(backends, name):
    be = backends(name)
    a, b = _text(be, 20, 8, "a"), _text(be, 24, 9, "b")
    ra = be.forward([a], 0)
    cond = be.forward([b], len(a), past=ra.kv).kv
    canon = be.encode(b)
    p = form_patch(cond, canon, len(a), be.rope, rank=None)
    assert reconstruction_error(place(canon, len(a), be.rope, p), cond) <= 1e-5
    # and the conditioned KV itself is the model's own prefill of [a, b] (ground truth)
    ids = torch.cat([a.input_ids, b.input_ids])
    pos = torch.arange(len(ids))
    own, _ = _own_cache(be.model, ids, pos if be.n_axes == 1 else pos[None].expand(3, -1))
    own_b = wk.kv.ChunkKV([(k[:, len(a):], v[:, len(a):]) for k, v in own], be.layout)
    assert reconstruction_error(cond, own_b) <= 1e-5


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-deepseek-v3"])
def test_rank_m_error_equals_svd_tail_energy(backends, name):
    be = backends(name)
    a, b = _text(be, 30, 10, "a"), _text(be, 40, 11, "b")
    ra = be.forward([a], 0)
    cond = be.forward([b], len(a), past=ra.kv).kv
    canon = be.encode(b)
    d = deficit(cond, canon, len(a), be.rope)
    for m in (1, 4, 8):
        p = form_patch(cond, canon, len(a), be.rope, rank=m, rope_rank=m)
        approx = place(canon, len(a), be.rope, p).relocate(-len(a), be.rope)
        back = cond.relocate(-len(a), be.rope)
        for l in range(be.layout.num_layers):
            for slot in (0, 1):
                err2 = float(((approx.layers[l][slot] - back.layers[l][slot]).double() ** 2).sum())
                tail = p.tail_energy(l, slot)
                sv = torch.linalg.svdvals(d.layers[l][slot].transpose(0, 1).reshape(d.num_tokens, -1).double())
                assert abs(tail - float((sv[m:] ** 2).sum())) <= 1e-4 * float((sv ** 2).sum()) + 1e-9
                assert abs(err2 - tail) <= 1e-3 * float((sv ** 2).sum()) + 1e-8, (l, slot, err2, tail)


@pytest.mark.parametrize("name", FAMILIES)
def test_kl_falls_with_rank_and_blind_is_worse_than_rank32(backends, name):
    be = backends(name)
    a, b, q = _text(be, 48, 12, "a"), _text(be, 64, 13, "b"), _text(be, 6, 14, "q")
    ref = be.forward([a, b, q], 0).logits
    ra = be.forward([a], 0)
    cond = be.forward([b], len(a), past=ra.kv).kv
    canon = be.encode(b)

    def kl(kv_b):
        return kl_divergence(ref, be.forward([q], len(a) + len(b), past=concat([ra.kv, kv_b])).logits)

    kl_blind = kl(place(canon, len(a), be.rope))
    kls = [kl(place(canon, len(a), be.rope, form_patch(cond, canon, len(a), be.rope, rank=m))) for m in (1, 4, 16, 32, 64)]
    assert kl_blind > 1e-3, "the tiny model must condition measurably for this test to mean anything"
    for lo, hi in zip(kls[1:], kls[:-1]):
        assert lo <= hi * 1.05 + 1e-9, kls
    assert kls[3] < kl_blind / 10, (kl_blind, kls)
    assert kls[-1] < 1e-6 or be.layout.family == "mla"  # rank 64 = full width for the tiny GQA models


def test_orbit_patch_k3(backends):
    """Reorder: one patch averaged over the permutation orbit (test ordering held out) vs the ordering's
    own patch. Reports eta_orbit next to eta_exact."""
    results = {}
    for name in ("tiny-llama", "tiny-deepseek-v3", "tiny-qwen2.5-vl"):
        be = backends(name)
        xs = [_text(be, 12, 20 + i, f"x{i}") for i in range(3)]
        b, q = _text(be, 24, 30, "b"), _text(be, 5, 31, "q")
        delta = sum(len(x) for x in xs)
        canon = be.encode(b)
        cond = {}
        for perm in orderings(range(3)):
            res = be.forward([xs[i] for i in perm] + [b], 0)
            cond[perm] = res.kv.slice(delta, delta + len(b))
        etas_o, etas_e = [], []
        for test in orderings(range(3)):
            ctx = [xs[i] for i in test]
            ref = be.forward(ctx + [b, q], 0).logits
            rctx = be.forward(ctx, 0)

            def kl(kv_b):
                return kl_divergence(ref, be.forward([q], delta + len(b), past=concat([rctx.kv, kv_b])).logits)

            kb = kl(place(canon, delta, be.rope))
            orbit = form_orbit_patch([cond[p] for p in cond if p != test], canon, delta, be.rope, rank=16)
            exact = form_patch(cond[test], canon, delta, be.rope, rank=16)
            etas_o.append(eta(kb, kl(place(canon, delta, be.rope, orbit))))
            etas_e.append(eta(kb, kl(place(canon, delta, be.rope, exact))))
        results[name] = (sum(etas_o) / 6, sum(etas_e) / 6)
    print("\neta_orbit vs eta_exact at K=3, rank 16:", {k: (round(o, 3), round(e, 3)) for k, (o, e) in results.items()})
    for name, (o, e) in results.items():
        assert e > 0.8, (name, e)
        assert o > 0.5, (name, o)  # the held-out orbit mean closes most of the blind gap


def test_deep_half_patch_touches_only_deep_layers(backends):
    be = backends("tiny-llama")
    a, b = _text(be, 20, 40, "a"), _text(be, 20, 41, "b")
    ra = be.forward([a], 0)
    cond = be.forward([b], len(a), past=ra.kv).kv
    canon = be.encode(b)
    p = form_patch(cond, canon, len(a), be.rope, rank=8, layers="deep")
    assert p.layers == [2, 3]
    full = form_patch(cond, canon, len(a), be.rope, rank=8)
    assert p.nbytes * 2 == full.nbytes
    pr = form_patch(cond, canon, len(a), be.rope, rank=8, method="randomized")
    e_exact = reconstruction_error(place(canon, len(a), be.rope, full), cond)
    e_rand = reconstruction_error(place(canon, len(a), be.rope, pr), cond)
    assert e_rand <= e_exact * 1.1 + 1e-6


def test_patch_transfers_across_offsets(backends):
    """A patch lives in the canonical frame: formed at one offset, it applies exactly at another
    (same antecedent, moved behind a fixed prefix)."""
    be = backends("tiny-qwen2")
    pre, a, b = _text(be, 9, 50, "p"), _text(be, 16, 51, "a"), _text(be, 16, 52, "b")
    r1 = be.forward([a, b], 0)
    cond1 = r1.kv.slice(len(a), len(a) + len(b))
    canon = be.encode(b)
    p = form_patch(cond1, canon, len(a), be.rope, rank=None)
    # the same [a, b] shifted by 9 positions: ground truth = the model's own KV at the shifted positions
    pos = torch.arange(9, 9 + len(a) + len(b))
    own, _ = _own_cache(be.model, torch.cat([a.input_ids, b.input_ids]), pos)
    own_b = wk.kv.ChunkKV([(k[:, len(a):], v[:, len(a):]) for k, v in own], be.layout)
    assert reconstruction_error(place(canon, 9 + len(a), be.rope, p), own_b) <= 1e-5
    assert pre.id  # prefix chunk unused: positions alone move


def test_image_chunk_patch_qwen_vl(backends):
    """Image chunks (vision inputs): blind reuse loses binding, rank-32 patch restores it."""
    for name in ("tiny-qwen2.5-vl", "tiny-qwen3-vl"):
        be = backends(name)
        a = synthetic_image_chunk(be.model, (1, 8, 8), seed=1, id="imgA", text_before=4)
        b = synthetic_image_chunk(be.model, (1, 8, 8), seed=2, id="imgB", text_before=4)
        q = _text(be, 5, 60, "q")
        ref = be.forward([a, b, q], 0).logits
        ra = be.forward([a], 0)
        d = ra.spans[0]
        cond = be.forward([b], d, past=ra.kv).kv
        canon = be.encode(b)
        qs = d + be.span(b)

        def kl(kv_b):
            return kl_divergence(ref, be.forward([q], qs, past=concat([ra.kv, kv_b])).logits)

        kb = kl(place(canon, d, be.rope))
        kp = kl(place(canon, d, be.rope, form_patch(cond, canon, d, be.rope, rank=32)))
        kf = kl(place(canon, d, be.rope, form_patch(cond, canon, d, be.rope, rank=None)))
        assert kf <= 1e-8 and kp < kb / 10, (name, kb, kp, kf)


# ----------------------------------------------------------------------------- bad input
def test_bad_inputs_raise_windowkit_errors(backends):
    be = backends("tiny-llama")
    with pytest.raises(wk.ChunkError):
        wk.Chunk.text(torch.tensor([], dtype=torch.long))
    with pytest.raises(wk.ChunkError):
        wk.Chunk.text(torch.tensor([1.5, 2.0]))
    with pytest.raises(wk.ChunkError):  # token ids from another tokenizer
        be.forward([wk.Chunk.text(torch.tensor([5, 100000]))], 0)
    vl = backends("tiny-qwen2.5-vl")
    img = synthetic_image_chunk(vl.model, (1, 4, 4), seed=0)
    with pytest.raises(wk.ChunkError):  # pixels into a text model
        be.forward([wk.Chunk.image(torch.tensor([3, 5, 5, 5, 5, 4]), pixel_values=img.pixel_values,
                                   image_grid_thw=img.image_grid_thw)], 0)
    canon = be.encode(_text(be, 8, 70))
    with pytest.raises(wk.KVShapeError):  # wrong dtype into the model
        be.forward([_text(be, 4, 71)], 8, past=canon.to(torch.bfloat16))
    with pytest.raises(wk.KVShapeError):  # wrong device
        be.forward([_text(be, 4, 71)], 8, past=canon.to(device="meta"))
    other = backends("tiny-deepseek-v3")
    with pytest.raises(wk.KVShapeError):  # KV of another model's layout
        be.forward([_text(be, 4, 71)], 8, past=other.encode(_text(other, 8, 72)))
    with pytest.raises(wk.KVShapeError):  # patch for a chunk of another length
        b1, b2 = be.encode(_text(be, 8, 73)), be.encode(_text(be, 9, 74))
        p = form_patch(b1, b1, 0, be.rope, rank=2)
        place(b2, 3, be.rope, p)
    with pytest.raises(wk.KVShapeError):
        relocate_keys(canon.layers[0][0][..., :8], 3, be.rope)  # not the rotary width


def test_unsupported_rope_and_models_are_refused():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(wk.UnsupportedModelError, match="dynamic"):
        RopeSpec.from_config(cfg)
    with pytest.raises(wk.UnsupportedModelError, match="dynamic"):
        wk.HFBackend(LlamaForCausalLM(cfg))
    with pytest.raises(wk.UnsupportedModelError, match="gpt2"):
        wk.HFBackend(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)))


def test_scaled_rope_uses_inv_freq_without_cos_sin_scaling():
    """llama3 and YaRN: relocation uses the model's own (interpolated) inv_freq, not its scaled cos/sin."""
    from transformers import LlamaConfig, LlamaForCausalLM

    for params in ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64, "rope_theta": 5e5},
                   {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1e4}):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=2, max_position_embeddings=512,
                                             rope_parameters=params)).eval()
        be = wk.HFBackend(model)  # its constructor probe already checks relocation on this model
        spec_cfg = RopeSpec.from_config(model.config)
        assert torch.allclose(spec_cfg.inv_freq, be.rope.inv_freq)
        c = wk.Chunk.text(torch.arange(10, 22))
        canon = be.encode(c)
        own, _ = _own_cache(model, c.input_ids, torch.arange(300, 312))
        for m, o in zip(canon.relocate(300, be.rope).layers, own):
            assert ((m[0] - o[0]).abs().max() / o[0].abs().max()) <= 1e-5


def test_engine_layouts_agree_for_deepseek_v3(backends):
    """SGLang keeps DeepSeek-V3's k_pe in GPT-J pairs, transformers de-interleaves it: the same rotation
    must come out of both specs once the layouts are converted."""
    be = backends("tiny-deepseek-v3")
    hf_spec = RopeSpec.from_config(be.model.config, engine="transformers")
    sg_spec = RopeSpec.from_config(be.model.config, engine="sglang")
    assert hf_spec.pairing == "half" and sg_spec.pairing == "interleaved"
    k = be.encode(_text(be, 6, 80)).layers[1][1]  # k_pe [1, S, 16], half-split
    n = hf_spec.n_freq
    to_pairs = torch.stack([k[..., :n], k[..., n:]], -1).flatten(-2)  # (x_i, x_{i+n}) -> (x_2i, x_2i+1)
    moved_pairs = relocate_keys(to_pairs, 41, sg_spec)
    back = torch.cat([moved_pairs[..., 0::2], moved_pairs[..., 1::2]], -1)
    assert torch.allclose(back, relocate_keys(k, 41, hf_spec), atol=1e-6)
    with pytest.raises(wk.UnsupportedModelError):
        RopeSpec.from_config(be.model.config, engine="vllm")
