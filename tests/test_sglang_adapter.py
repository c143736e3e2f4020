"""The SGLang adapter against SGLang's own classes (sglang 0.5.23, CPU, no engine).

1. Rotation equivalence: keys rotated by SGLang's rotary modules (forward_native) at position p, then
   relocated by windowkit by δ with ``RopeSpec.from_config(cfg, engine="sglang")``, equal SGLang's keys at
   p+δ. Llama (neox), Qwen2.5-VL (blocked M-RoPE) and Qwen3-VL (interleaved M-RoPE) with 3-D positions and
   deltas in position-id space, DeepSeek-V3 (GPT-J pairs; default RoPE and YaRN with mscale != 1).
2. Pools: ``SGLangKVPool`` writes land in the right slots of ``MHATokenToKVPool`` / ``MLATokenToKVPool``
   (NHD rows, TP head shards, MLA row [latent | k_pe] with k_pe in GPT-J pairs) and read back bit-identical.

Fails (never skips) when sglang is not importable: `make .venv/.windowkit-sglang-installed` (see docs/backends.md).
"""
from __future__ import annotations

import pytest
import torch

from _need import need  # noqa: E402

need("sglang", "make .venv/.windowkit-sglang-installed (pip install --no-deps -r requirements-sglang.txt)")

from sglang.srt.layers.rotary_embedding import base as sg_rope_base  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402

from windowkit.backends.sglang import (SGLangKVPool, convert_pairing, half_to_interleaved,  # noqa: E402
                                       interleaved_to_half, kv_heads_for_rank, slots_for_pages)
from windowkit.backends.tiny import build  # noqa: E402
from windowkit.errors import KVShapeError  # noqa: E402
from windowkit.kv import RopeSpec, relocate_keys  # noqa: E402
from windowkit.kv.layout import ChunkKV, KVLayout  # noqa: E402


# ---------------------------------------------------------------------- SGLang rotary modules on CPU
@pytest.fixture
def sg_rope(monkeypatch):
    """SGLang rope constructors, usable on a CPU-only machine.

    ``RotaryEmbedding.__init__`` picks a fused fallback kernel from ``vllm._custom_ops`` on any platform
    that is neither CUDA nor SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE``, which needs the sgl_kernel CPU
    build); that kernel is only used by ``forward_cuda``. Telling the module it runs on the CPU platform
    skips the import; ``forward_native`` (what these tests call) is unchanged.
    """
    if not torch.cuda.is_available():
        monkeypatch.setattr(sg_rope_base, "_is_cpu", True)
    from sglang.srt.layers.rotary_embedding import get_rope

    return get_rope


def _cfg(name):
    cfg = build(name).config
    return getattr(cfg, "text_config", None) or cfg, cfg


def _sg_keys(rope, positions, keys):
    """SGLang's rotation of ``keys`` [T, H, D] at ``positions`` ([T] or [3, T]): returns [T, H, D]."""
    T, H, D = keys.shape
    q = torch.zeros(T, D)
    if rope.__class__.__name__ == "DeepseekScalingRotaryEmbedding":  # takes [T, H, D] directly
        return rope.forward_native(positions, q[:, None], keys.clone())[1]
    return rope.forward_native(positions, q, keys.reshape(T, H * D).clone())[1].view(T, H, D)


def _assert_relocation(rope, spec, raw, pos, delta_pos, delta_arg, atol=2e-5):
    """SGLang(p) relocated by windowkit == SGLang(p + δ); raw: [T, H, D] pre-RoPE keys."""
    at_p = _sg_keys(rope, pos, raw)
    at_pd = _sg_keys(rope, pos + delta_pos, raw)
    moved = relocate_keys(at_p.transpose(0, 1), delta_arg, spec, positions=pos).transpose(0, 1)
    torch.testing.assert_close(moved, at_pd, atol=atol, rtol=0)
    assert (at_pd - at_p).abs().max() > 0.1  # the test moves keys measurably


def test_llama_neox_relocation_matches_sglang(sg_rope):
    text, cfg = _cfg("tiny-llama")
    d = text.hidden_size // text.num_attention_heads
    theta = text.rope_parameters["rope_theta"]
    rope = sg_rope(d, d, text.max_position_embeddings, theta, is_neox_style=True, rope_scaling=None,
                   dtype=torch.float32)
    assert type(rope).__name__ == "RotaryEmbedding"
    spec = RopeSpec.from_config(cfg, engine="sglang")
    assert spec.pairing == "half"
    torch.testing.assert_close(spec.inv_freq, rope._compute_inv_freq(theta), atol=0, rtol=1e-6)
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(24, text.num_key_value_heads, d, generator=g)
    for p0, delta in [(0, 64), (100, 37), (1000, -900), (2000, 2000)]:
        pos = torch.arange(p0, p0 + 24)
        _assert_relocation(rope, spec, raw, pos, delta, delta)
    # without positions: the plain δ·inv_freq rotation, exact up to fp32 angle rounding at small offsets
    pos = torch.arange(24)
    at_p, at_pd = _sg_keys(rope, pos, raw), _sg_keys(rope, pos + 40, raw)
    torch.testing.assert_close(relocate_keys(at_p.transpose(0, 1), 40, spec).transpose(0, 1), at_pd,
                               atol=1e-4, rtol=0)


def _vl_positions(n_text: int, grid: tuple[int, int, int], start: int = 0) -> torch.Tensor:
    """3-D M-RoPE position ids of [text x n_text, image (t, h, w) grid]: text shares one id on all axes,
    vision tokens get (t, h, w) + offset, as get_rope_index lays them out. Returns [3, T]."""
    t, h, w = grid
    text = torch.arange(start, start + n_text).expand(3, -1)
    tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    img = torch.stack([tt.flatten(), hh.flatten(), ww.flatten()]) + start + n_text
    return torch.cat([text, img], 1)


@pytest.mark.parametrize("name", ["tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_qwen_vl_mrope_relocation_matches_sglang(sg_rope, name):
    text, cfg = _cfg(name)
    d = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    params = dict(text.rope_parameters)
    scaling = {"rope_type": "default", "mrope_section": list(params["mrope_section"])}
    if name == "tiny-qwen3-vl":
        scaling["mrope_interleaved"] = True  # Qwen3-VL checkpoints set it in rope_scaling; transformers always interleaves
    rope = sg_rope(d, d, text.max_position_embeddings, params["rope_theta"], is_neox_style=True,
                   rope_scaling=scaling, dtype=torch.float32)
    assert type(rope).__name__ == "MRotaryEmbedding"
    spec = RopeSpec.from_config(cfg, engine="sglang")
    assert spec.mrope == ("interleaved" if name == "tiny-qwen3-vl" else "blocked")
    assert torch.equal(spec.axis, rope.axis_map.cpu())  # same frequency -> (t, h, w) assignment
    g = torch.Generator().manual_seed(1)
    pos = _vl_positions(5, (2, 4, 4), start=3)  # [3, 21]
    raw = torch.randn(pos.shape[1], text.num_key_value_heads, d, generator=g)
    # a uniform shift in position-id space (all three axes): a plain 1-D rotation
    for delta in (7, 300, -3):
        _assert_relocation(rope, spec, raw, pos, delta, delta)
    # per-axis shift (dt, dh, dw): e.g. moving a frame in time only
    for dt, dh, dw in [(4, 0, 0), (2, 5, 1)]:
        dpos = torch.tensor([dt, dh, dw])[:, None]
        _assert_relocation(rope, spec, raw, pos, dpos, (dt, dh, dw))


def _deepseek_v3_config(rope_parameters):
    from transformers import DeepseekV3Config

    base = build("tiny-deepseek-v3").config.to_dict()
    base["rope_parameters"] = rope_parameters
    base.pop("rope_scaling", None)
    return DeepseekV3Config(**{k: v for k, v in base.items() if k not in ("model_type", "transformers_version")})


def _sg_deepseek_rope(sg_rope, cfg):
    """The module SGLang's DeepseekV2AttentionMLA builds: GPT-J pairs (rope_interleave), and for YaRN
    rope_type forced to 'deepseek_yarn' -> DeepseekScalingRotaryEmbedding. get_rope cannot build that class
    on CPU (it calls get_device(), which raises 'No accelerator'); the model passes device= through
    get_rope_wrapper, so construct it the same way with device='cpu' and get_rope's own kwargs."""
    params = dict(cfg.rope_parameters)
    d = cfg.qk_rope_head_dim
    neox = not getattr(cfg, "rope_interleave", True)
    if params.get("rope_type", "default") == "default":
        return sg_rope(d, d, cfg.max_position_embeddings, params["rope_theta"], is_neox_style=neox,
                       rope_scaling=None, dtype=torch.float32)
    from sglang.srt.layers.rotary_embedding.rope_variant import DeepseekScalingRotaryEmbedding

    extra = {k: v for k, v in params.items()
             if k in ("extrapolation_factor", "attn_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")}
    return DeepseekScalingRotaryEmbedding(d, d, params.get("original_max_position_embeddings", cfg.max_position_embeddings),
                                          params["rope_theta"], neox, params["factor"], torch.float32,
                                          device="cpu", **extra)


@pytest.mark.parametrize("rope_parameters", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 128,
     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5},
], ids=["default", "yarn"])
def test_deepseek_v3_gptj_relocation_matches_sglang(sg_rope, rope_parameters):
    cfg = _deepseek_v3_config(rope_parameters)
    rope = _sg_deepseek_rope(sg_rope, cfg)
    spec_sg = RopeSpec.from_config(cfg, engine="sglang")
    spec_tf = RopeSpec.from_config(cfg, engine="transformers")
    assert spec_sg.pairing == "interleaved" and spec_tf.pairing == "half" and not rope.is_neox_style
    # frequencies agree with SGLang's module (YaRN: interpolated frequencies, no mscale in them)
    sg_inv = (rope._compute_inv_freq(rope.scaling_factor) if hasattr(rope, "scaling_factor")
              else rope._compute_inv_freq(rope.base))
    torch.testing.assert_close(spec_sg.inv_freq, sg_inv, atol=0, rtol=1e-6)
    if rope_parameters["rope_type"] == "yarn":
        assert abs(rope.mscale - 1.0) > 0.1  # SGLang's cos/sin cache is scaled by mscale
    g = torch.Generator().manual_seed(2)
    raw = torch.randn(16, 1, cfg.qk_rope_head_dim, generator=g)  # k_pe is one shared head
    for p0, delta in [(0, 64), (50, 1000), (3000, -2999)]:
        pos = torch.arange(p0, p0 + 16)
        at_p, at_pd = _sg_keys(rope, pos, raw), _sg_keys(rope, pos + delta, raw)
        # SGLang's own layout: GPT-J pairs, spec(engine="sglang")
        moved = relocate_keys(at_p.transpose(0, 1), delta, spec_sg, positions=pos).transpose(0, 1)
        torch.testing.assert_close(moved, at_pd, atol=3e-5, rtol=0)
        # transformers layout: de-interleave, relocate with spec(engine="transformers"), re-interleave
        tf = interleaved_to_half(at_p)
        moved_tf = relocate_keys(tf.transpose(0, 1), delta, spec_tf, positions=pos).transpose(0, 1)
        torch.testing.assert_close(half_to_interleaved(moved_tf), at_pd, atol=3e-5, rtol=0)


def test_deepseek_v3_transformers_k_pe_is_sglang_k_pe_reordered():
    """transformers' interleaved RoPE on raw k_pe == SGLang's GPT-J result, de-interleaved."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 1, 9, 16, generator=g)
    spec = RopeSpec.from_config(build("tiny-deepseek-v3").config, engine="sglang")
    ang = torch.arange(9).float()[:, None] * spec.inv_freq[None]
    emb = torch.cat([ang, ang], -1)
    _, k_tf = apply_rotary_pos_emb_interleave(x, x, emb.cos()[None], emb.sin()[None])
    c, s = ang.cos(), ang.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    k_sg = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], -1).flatten(-2)  # GPT-J pairs
    torch.testing.assert_close(k_tf, interleaved_to_half(k_sg), atol=1e-6, rtol=0)
    assert torch.equal(half_to_interleaved(interleaved_to_half(k_sg)), k_sg)


# ---------------------------------------------------------------------- pools
def _chunk(layout: KVLayout, S: int, dtype=torch.bfloat16, seed=0) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    return ChunkKV([tuple(torch.randn(h, S, d, generator=g).to(dtype) for h, d in layout.slot_shapes)
                    for _ in range(layout.num_layers)], layout)


def _mha(layout: KVLayout, heads: int, page_size: int, dtype=torch.bfloat16, size=128, **kw):
    (_, d0), (_, d1) = layout.slot_shapes
    return MHATokenToKVPool(size=size, page_size=page_size, dtype=dtype, head_num=heads, head_dim=d0,
                            v_head_dim=d1, layer_num=kw.pop("layer_num", layout.num_layers), device="cpu",
                            enable_memory_saver=False, enable_alt_stream=False, **kw)


def _loc(page_size: int, S: int) -> torch.Tensor:
    if page_size == 1:
        return torch.randperm(120, generator=torch.Generator().manual_seed(5))[:S] + 1  # scattered slots
    return slots_for_pages(torch.tensor([5, 2]), page_size, S)  # two pages, out of order, partial last page


GQA = KVLayout("gqa", 3, ((2, 32), (2, 32)), 0)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mha_pool_write_lands_in_slots_and_reads_back(page_size, dtype):
    kv = _chunk(GQA, 21, dtype)
    pool = _mha(GQA, 2, page_size, dtype)
    before = [(pool.k_buffer[l].clone(), pool.v_buffer[l].clone()) for l in range(3)]
    assert pool.k_buffer[0].shape == (128 + page_size, 2, 32)
    io = SGLangKVPool(pool, GQA)
    loc = _loc(page_size, 21)
    io.write(kv, loc)
    other = torch.ones(128 + page_size, dtype=torch.bool)
    other[loc] = False
    for l, (k, v) in enumerate(kv.layers):
        assert torch.equal(pool.k_buffer[l][loc], k.transpose(0, 1))  # NHD rows: [S, H, D]
        assert torch.equal(pool.v_buffer[l][loc], v.transpose(0, 1))
        assert torch.equal(pool.k_buffer[l][other], before[l][0][other])  # nothing else touched
        assert torch.equal(pool.v_buffer[l][other], before[l][1][other])
    back = io.read(loc)
    assert back.layout == GQA
    for (k, v), (k2, v2) in zip(kv.layers, back.layers):
        assert torch.equal(k, k2) and torch.equal(v, v2)


def test_mha_pool_casts_fp32_chunk_to_pool_dtype():
    kv = _chunk(GQA, 5, torch.float32)
    pool = _mha(GQA, 2, 1, torch.bfloat16)
    io = SGLangKVPool(pool, GQA)
    io.write(kv, torch.arange(1, 6))
    back = io.read(torch.arange(1, 6))
    assert back.dtype == torch.bfloat16 and torch.equal(back.layers[1][0], kv.layers[1][0].bfloat16())


@pytest.mark.parametrize("kv_heads,tp_size", [(4, 2), (2, 4)])
def test_gqa_tp_sharding_writes_each_ranks_heads(kv_heads, tp_size):
    layout = KVLayout("gqa", 2, ((kv_heads, 16), (kv_heads, 16)), 0)
    kv = _chunk(layout, 9)
    loc = torch.arange(16, 25)  # page 1 (page 0 is the dummy sink)
    seen = []
    for rank in range(tp_size):
        a, b = kv_heads_for_rank(kv_heads, rank, tp_size)
        seen.append((a, b))
        pool = _mha(layout, b - a, 16)
        io = SGLangKVPool(pool, layout, tp_rank=rank, tp_size=tp_size)
        io.write(kv, loc)
        for l, (k, v) in enumerate(kv.layers):
            assert torch.equal(pool.k_buffer[l][loc], k[a:b].transpose(0, 1))
            assert torch.equal(pool.v_buffer[l][loc], v[a:b].transpose(0, 1))
        back = io.read(loc)
        assert back.layout == io.local_layout and back.layout.slot_shapes[0][0] == b - a
        for (k, v), (k2, v2) in zip(io.shard(kv).layers, back.layers):
            assert torch.equal(k, k2) and torch.equal(v, v2)
        io.write(io.shard(kv), loc)  # an already-sharded chunk is accepted as is
        assert torch.equal(pool.k_buffer[1][loc], kv.layers[1][0][a:b].transpose(0, 1))
    if kv_heads >= tp_size:  # contiguous blocks
        assert seen == [(0, 2), (2, 4)]
    else:  # replicated: consecutive ranks share one head
        assert seen == [(0, 1), (0, 1), (1, 2), (1, 2)]


def test_pipeline_stage_pool_writes_only_its_layers():
    kv = _chunk(GQA, 4)
    pool = _mha(GQA, 2, 1, layer_num=2, start_layer=1, end_layer=3)
    io = SGLangKVPool(pool, GQA)
    io.write(kv, torch.arange(1, 5))
    for i, l in enumerate((1, 2)):
        assert torch.equal(pool.k_buffer[i][1:5], kv.layers[l][0].transpose(0, 1))
    with pytest.raises(KVShapeError):
        io.read(torch.arange(1, 5))


MLA = KVLayout("mla", 4, ((1, 64), (1, 16)), 1)


def _mla(page_size: int, dtype=torch.bfloat16, size=128):
    return MLATokenToKVPool(size=size, page_size=page_size, dtype=dtype, kv_lora_rank=64, qk_rope_head_dim=16,
                            layer_num=4, device="cpu", enable_memory_saver=False)


@pytest.mark.parametrize("page_size", [1, 16])
def test_mla_pool_row_is_latent_then_gptj_k_pe(page_size):
    cfg = build("tiny-deepseek-v3").config
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim) == (64, 16)
    kv = _chunk(MLA, 19)  # transformers layout: k_pe half-split
    pool = _mla(page_size)
    assert pool.kv_buffer[0].shape == (128 + page_size, 1, 80)
    before = [pool.kv_buffer[l].clone() for l in range(4)]
    io = SGLangKVPool.from_config(pool, MLA, cfg, tp_rank=1, tp_size=2)  # MLA rows are replicated on ranks
    assert (io.src_pairing, io.pool_pairing) == ("half", "interleaved")
    loc = _loc(page_size, 19)
    io.write(kv, loc)
    other = torch.ones(128 + page_size, dtype=torch.bool)
    other[loc] = False
    for l, (lat, kpe) in enumerate(kv.layers):
        row = pool.kv_buffer[l][loc]  # [S, 1, 64 + 16]
        assert torch.equal(row[..., :64], lat.transpose(0, 1))
        assert torch.equal(row[..., 64:], half_to_interleaved(kpe).transpose(0, 1))
        assert torch.equal(pool.get_value_buffer(l)[loc], lat.transpose(0, 1))  # SGLang's V view = latent
        assert torch.equal(pool.kv_buffer[l][other], before[l][other])
    back = io.read(loc)
    assert back.layout == MLA
    for (a, b), (a2, b2) in zip(kv.layers, back.layers):
        assert torch.equal(a, a2) and torch.equal(b, b2)


def test_mla_pool_source_sglang_writes_k_pe_as_is():
    cfg = build("tiny-deepseek-v3").config
    kv_tf = _chunk(MLA, 6)
    kv_sg = convert_pairing(kv_tf, RopeSpec.from_config(cfg), RopeSpec.from_config(cfg, engine="sglang"))
    pool = _mla(1)
    io = SGLangKVPool.from_config(pool, MLA, cfg, source="sglang")
    io.write(kv_sg, torch.arange(1, 7))
    assert torch.equal(pool.kv_buffer[2][1:7, :, 64:], kv_sg.layers[2][1].transpose(0, 1))
    back = io.read(torch.arange(1, 7))
    assert torch.equal(back.layers[2][1], kv_sg.layers[2][1])
    # DeepSeek-V2 and GQA models need no re-pairing
    assert RopeSpec.from_config(build("tiny-deepseek-v2").config, engine="sglang").pairing == "interleaved"
    assert RopeSpec.from_config(build("tiny-deepseek-v2").config).pairing == "interleaved"
    assert convert_pairing(kv_tf, "half", "half") is kv_tf


def test_relocated_chunk_written_to_pool_matches_sglang_rotation(sg_rope):
    """End to end for MLA: canonical k_pe (SGLang-rotated at 0..S-1, stored in transformers layout),
    relocated by windowkit and written, equals SGLang's own k_pe at the target positions in the pool."""
    cfg = build("tiny-deepseek-v3").config
    rope = _sg_deepseek_rope(sg_rope, cfg)
    g = torch.Generator().manual_seed(7)
    S, delta = 10, 300
    raw = torch.randn(S, 1, 16, generator=g)
    pos = torch.arange(S)
    canon = _chunk(MLA, S, torch.float32)
    kpe_tf = interleaved_to_half(_sg_keys(rope, pos, raw)).transpose(0, 1)  # [1, S, 16], transformers layout
    canon = ChunkKV([(lat, kpe_tf) for lat, _ in canon.layers], MLA, pos)
    spec = RopeSpec.from_config(cfg)  # transformers layout
    moved = canon.relocate(delta, spec)
    pool = _mla(16, torch.float32)
    io = SGLangKVPool.from_config(pool, MLA, cfg)
    loc = slots_for_pages(torch.tensor([3]), 16, S)
    io.write(moved, loc)
    want = _sg_keys(rope, pos + delta, raw)  # [S, 1, 16], GPT-J pairs
    torch.testing.assert_close(pool.kv_buffer[0][loc, :, 64:], want, atol=3e-5, rtol=0)


def test_bad_pool_inputs_raise_windowkit_errors():
    kv = _chunk(GQA, 4)
    pool = _mha(GQA, 2, 16)
    io = SGLangKVPool(pool, GQA)
    with pytest.raises(KVShapeError):  # the first page is SGLang's dummy sink
        io.write(kv, torch.arange(0, 4))
    with pytest.raises(KVShapeError):
        io.write(kv, torch.arange(16, 19))  # 3 slots for 4 tokens
    with pytest.raises(KVShapeError):
        io.write(kv, torch.tensor([16, 17, 17, 18]))
    with pytest.raises(KVShapeError):
        io.write(kv, torch.arange(200, 204))  # past the pool
    with pytest.raises(KVShapeError):  # rank 0 of 2 holds 1 head, the pool 2
        SGLangKVPool(pool, GQA, tp_rank=0, tp_size=2)
    with pytest.raises(KVShapeError):
        SGLangKVPool(_mla(1), MLA, tp_rank=2, tp_size=2)
    with pytest.raises(KVShapeError):
        SGLangKVPool(_mla(1), KVLayout("mla", 4, ((1, 32), (1, 16)), 1))
    with pytest.raises(KVShapeError):
        slots_for_pages(torch.tensor([1]), 16, 17)
