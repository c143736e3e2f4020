"""Tests written against surviving mutants of windowkit/kv (make mutate; docs/testing.md, "Mutation testing").

Expected values are hand-computed (closed forms, textbook Wilson intervals, matrices with a known spectrum) or
come from torch / transformers themselves, never from windowkit's own output fed back.
"""
from __future__ import annotations

import math

import pytest
import torch

from windowkit.kv.metrics import eta, kl_divergence, wilson
from windowkit.kv.svd import Truncated, truncated_svd

# ----------------------------------------------------------------------------------------------- metrics


def test_kl_divergence_closed_form():
    # p = softmax(0, ln 3) = (1/4, 3/4), q = uniform: KL(p || q) = 1/4 ln(1/2) + 3/4 ln(3/2)
    ref = torch.tensor([[0.0, math.log(3.0)]], dtype=torch.float64)
    got = torch.tensor([[5.0, 5.0]], dtype=torch.float64)
    want = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    assert kl_divergence(ref, got) == pytest.approx(want, rel=1e-12)
    # KL(q || p) = 1/2 ln 2 + 1/2 ln(2/3): not symmetric
    assert kl_divergence(got, ref) == pytest.approx(0.5 * math.log(2.0) + 0.5 * math.log(2 / 3), rel=1e-12)
    assert kl_divergence(ref, ref.clone()) == 0.0
    assert isinstance(kl_divergence(ref, got), float)


def test_kl_divergence_is_fp64_for_tiny_gaps():
    # logits 1e-7 apart in fp32 would round to the same distribution; the exact KL is ~ (d^2 / 2) * p(1-p)
    ref = torch.tensor([0.0, 1.0], dtype=torch.float64)
    got = ref + torch.tensor([0.0, 1e-6], dtype=torch.float64)
    p1 = 1 / (1 + math.exp(-1.0))
    assert kl_divergence(ref, got) == pytest.approx(0.5 * 1e-12 * p1 * (1 - p1), rel=1e-3)


def test_eta_by_hand():
    assert eta(0.4, 0.1) == pytest.approx(0.75)
    assert eta(0.2, 0.3) == pytest.approx(-0.5)     # harmful: worse than blind
    assert eta(0.2, 0.0) == 1.0 and eta(0.2, 0.2) == 0.0
    assert math.isnan(eta(0.0, 0.1)) and math.isnan(eta(-1.0, 0.1))


def test_wilson_textbook_intervals():
    lo, hi = wilson(5, 10)
    assert (lo, hi) == (pytest.approx(0.2366, abs=1e-4), pytest.approx(0.7634, abs=1e-4))
    lo, hi = wilson(10, 10)
    assert lo == pytest.approx(0.7225, abs=1e-4) and hi == 1.0
    lo, hi = wilson(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
    assert wilson(0, 0) == [0.0, 1.0]
    # all hits / no hits: the bounds are exactly 1 / 0 in exact arithmetic; fp64 lands 2e-16 outside at n = 5
    assert wilson(5, 5)[1] == 1.0 and wilson(0, 5)[0] == 0.0
    assert wilson(3, 4, z=0.0) == [0.75, 0.75]
    # z = 1 (68%): 8/10 -> centre (0.8 + 1/20) / 1.1, half sqrt(0.016 + 1/400) / 1.1
    lo, hi = wilson(8, 10, z=1.0)
    c, h = 0.85 / 1.1, math.sqrt(0.016 + 0.0025) / 1.1
    assert lo == pytest.approx(c - h, rel=1e-12) and hi == pytest.approx(c + h, rel=1e-12)


# ----------------------------------------------------------------------------------------------- svd


def test_truncated_svd_of_a_diagonal():
    t = truncated_svd(torch.diag(torch.tensor([3.0, 2.0, 1.0])), 2)
    assert t.us.shape == (3, 2) and t.vt.shape == (2, 3)
    assert t.kept_energy == pytest.approx(13.0) and t.total_energy == pytest.approx(14.0)
    assert t.tail_energy == pytest.approx(1.0)
    assert torch.allclose(t.us @ t.vt, torch.diag(torch.tensor([3.0, 2.0, 0.0])), atol=1e-6)
    assert t.us.dtype == torch.float32 and t.vt.dtype == torch.float32


def test_truncated_svd_clips_rank_and_handles_zero():
    x = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]], dtype=torch.float64)
    t = truncated_svd(x, 10)
    assert t.us.shape == (2, 2) and t.vt.shape == (2, 3) and t.tail_energy == pytest.approx(0.0, abs=1e-6)
    assert t.us.dtype == torch.float32
    z = truncated_svd(torch.zeros(4, 5), 3)
    assert z.us.shape == (4, 3) and z.vt.shape == (3, 5) and (z.kept_energy, z.total_energy) == (0.0, 0.0)
    assert not z.us.any() and not z.vt.any()
    r0 = truncated_svd(torch.ones(2, 2), 0)
    assert r0.us.shape == (2, 0) and r0.vt.shape == (0, 2) and r0.total_energy == 4.0 and r0.tail_energy == 4.0


def _known_spectrum(s_, f_, sigma, seed=0):
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(s_, len(sigma), generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(f_, len(sigma), generator=g, dtype=torch.float64))
    return (u * torch.tensor(sigma, dtype=torch.float64)) @ v.T


@pytest.mark.parametrize("method", ["exact", "randomized"])
def test_truncated_svd_keeps_the_top_of_a_known_spectrum(method):
    sigma = [10.0, 5.0, 2.0, 1.0] + [0.5] * 8   # kept 100 + 25 + 4 + 1 = 130, tail 8 * 0.25 = 2
    x = _known_spectrum(60, 50, sigma)
    t = truncated_svd(x, 4, method=method)
    assert t.kept_energy == pytest.approx(130.0, rel=1e-3)
    assert t.total_energy == pytest.approx(132.0, rel=1e-6)
    assert t.tail_energy == pytest.approx(2.0, rel=0.03)
    err = float(((t.us.double() @ t.vt.double()) - x).pow(2).sum())
    assert err == pytest.approx(2.0, rel=0.03)   # Eckart-Young: the error is the tail energy


def test_randomized_without_power_iterations_still_spans_an_exact_low_rank():
    x = _known_spectrum(40, 30, [4.0, 3.0, 2.0])
    t = truncated_svd(x, 3, method="randomized", niter=0, oversample=2)
    assert torch.allclose(t.us.double() @ t.vt.double(), x, atol=1e-4)


def test_unknown_svd_method_is_refused():
    with pytest.raises(ValueError, match="unknown SVD method 'qr'"):
        truncated_svd(torch.eye(3), 2, method="qr")


def test_tail_energy_is_never_negative():
    assert Truncated(torch.zeros(1, 1), torch.zeros(1, 1), 5.0, 4.0).tail_energy == 0.0
    assert Truncated(torch.zeros(1, 1), torch.zeros(1, 1), 3.0, 4.0).tail_energy == 1.0


# ----------------------------------------------------------------------------------------------- layout

from windowkit.errors import KVShapeError  # noqa: E402
from windowkit.kv.layout import ChunkKV, KVLayout, concat, mean  # noqa: E402

GQA = KVLayout("gqa", 2, ((2, 4), (2, 3)), 0)
MLA = KVLayout("mla", 1, ((1, 8), (1, 2)), 1)


def _kv(s=5, layout=GQA, start=0.0, dtype=torch.float32, positions=None):
    """Entries count up from ``start``, so every value is known by hand."""
    layers, v = [], start
    for _ in range(layout.num_layers):
        pair = []
        for h, d in layout.slot_shapes:
            pair.append(torch.arange(v, v + h * s * d, dtype=torch.float64).reshape(h, s, d).to(dtype))
            v += h * s * d
        layers.append(tuple(pair))
    return ChunkKV(layers, layout, positions)


def test_layout_names_and_description():
    assert GQA.slot_names == ("k", "v") and MLA.slot_names == ("latent", "k_pe")
    assert GQA.describe() == "gqa: 2 layers, k[2x4] v[2x3], rope on k"
    assert MLA.describe() == "mla: 1 layers, latent[1x8] k_pe[1x2], rope on k_pe"


def test_chunk_kv_facts_by_hand():
    kv = _kv()
    assert kv.num_tokens == 5 and kv.dtype == torch.float32 and kv.device == torch.device("cpu")
    assert kv.nbytes == 2 * (2 * 5 * 4 + 2 * 5 * 3) * 4      # 2 layers of (K + V), fp32
    assert _kv(dtype=torch.bfloat16).nbytes == 2 * (40 + 30) * 2


def test_chunk_kv_shape_errors_say_where():
    k, v = torch.zeros(2, 5, 4), torch.zeros(2, 5, 3)
    with pytest.raises(KVShapeError, match="1 layers given, layout has 2"):
        ChunkKV([(k, v)], GQA)
    with pytest.raises(KVShapeError, match=r"layer 1 slot 1: shape \(2, 5, 4\), expected \[2, S, 3\]"):
        ChunkKV([(k, v), (k, k)], GQA)
    with pytest.raises(KVShapeError, match=r"layer 0 slot 0: shape \(3, 5, 4\)"):
        ChunkKV([(torch.zeros(3, 5, 4), v), (k, v)], GQA)
    with pytest.raises(KVShapeError, match=r"layer 0 slot 0: shape \(2, 5\)"):
        ChunkKV([(torch.zeros(2, 5), v), (k, v)], GQA)
    with pytest.raises(KVShapeError, match="layer 1 slot 0: 6 tokens, expected 5"):
        ChunkKV([(k, v), (torch.zeros(2, 6, 4), torch.zeros(2, 6, 3))], GQA)
    with pytest.raises(KVShapeError, match="layer 0 slot 1: 4 tokens, expected 5"):
        ChunkKV([(k, torch.zeros(2, 4, 3)), (k, v)], GQA)
    with pytest.raises(KVShapeError, match="positions cover 4 tokens, KV has 5"):
        _kv(positions=torch.arange(4))


def test_positions_are_int64_rows():
    kv = _kv(positions=torch.arange(10, 15, dtype=torch.int32))
    assert kv.positions.dtype == torch.int64 and kv.positions.tolist() == [[10, 11, 12, 13, 14]]
    three = torch.arange(15).reshape(3, 5)
    assert _kv(positions=three).positions.tolist() == three.tolist()


def test_slice_to_clone_map():
    kv = _kv(positions=torch.arange(10, 15))
    sl = kv.slice(1, 3)
    assert sl.num_tokens == 2 and sl.positions.tolist() == [[11, 12]]
    # layer 0 K is arange(40).reshape(2, 5, 4): head 0, token 1 starts at 4
    assert sl.layers[0][0][0, 0].tolist() == [4.0, 5.0, 6.0, 7.0]
    assert sl.layers[1][1][1, 1].tolist() == kv.layers[1][1][1, 2].tolist()
    assert _kv().slice(0, 2).positions is None
    b = kv.to(dtype=torch.bfloat16)
    assert b.dtype == torch.bfloat16 and b.layers[1][1].dtype == torch.bfloat16 and b.positions is kv.positions
    c = kv.clone()
    c.layers[0][0].zero_()
    c.positions.zero_()
    assert kv.layers[0][0][0, 1, 0] == 4.0 and kv.positions[0, 0] == 10
    seen = []

    def fn(layer, slot, t):
        seen.append((layer, slot))
        return t + 100 * layer + 10 * slot

    m = kv.map(fn)
    assert seen == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert m.layers[1][1][0, 0, 0] == kv.layers[1][1][0, 0, 0] + 110 and m.positions is kv.positions


def test_check_compatible_messages():
    kv = _kv()
    kv.check_compatible(_kv(start=7.0))
    with pytest.raises(KVShapeError, match=r"patch: layout mla: 1 layers.* != gqa: 2 layers"):
        kv.check_compatible(_kv(layout=MLA), "patch")
    with pytest.raises(KVShapeError, match="KV: 3 tokens != 5"):
        kv.check_compatible(_kv(s=3))
    with pytest.raises(KVShapeError, match="KV: dtype torch.float64 != torch.float32"):
        kv.check_compatible(_kv(dtype=torch.float64))


def test_tensor_round_trip_and_names():
    kv = _kv(positions=torch.arange(5))
    t = kv.to_tensors("c/")
    assert sorted(t) == ["c/0.0", "c/0.1", "c/1.0", "c/1.1", "c/positions"]
    assert torch.equal(t["c/1.0"], kv.layers[1][0])
    back = ChunkKV.from_tensors(t, GQA, "c/")
    assert all(torch.equal(a, b) for p, q in zip(back.layers, kv.layers) for a, b in zip(p, q))
    assert back.positions.tolist() == [[0, 1, 2, 3, 4]]
    assert sorted(_kv().to_tensors()) == ["0.0", "0.1", "1.0", "1.1"]
    assert ChunkKV.from_tensors(_kv().to_tensors(), GQA).positions is None
    with pytest.raises(KVShapeError, match=r"missing tensor 'c/1.1' for gqa: 2 layers"):
        ChunkKV.from_tensors({k: v for k, v in t.items() if k != "c/1.1"}, GQA, "c/")


def test_concat_by_hand():
    a, b = _kv(s=2, positions=torch.arange(2)), _kv(s=3, start=1000.0, positions=torch.arange(5, 8))
    c = concat([a, b])
    assert c.num_tokens == 5 and c.positions.tolist() == [[0, 1, 5, 6, 7]]
    assert torch.equal(c.layers[1][0][:, :2], a.layers[1][0]) and torch.equal(c.layers[1][0][:, 2:], b.layers[1][0])
    assert torch.equal(c.layers[0][1][:, 2:], b.layers[0][1])
    assert concat([a, _kv(s=3)]).positions is None               # one chunk's positions unknown
    assert concat([a, _kv(s=3, positions=torch.zeros(3, 3))]).positions is None   # 1-D next to M-RoPE
    assert concat([a]) is a
    with pytest.raises(KVShapeError, match="nothing to concatenate"):
        concat([])
    with pytest.raises(KVShapeError, match="different layouts"):
        concat([a, _kv(layout=MLA)])


def test_mean_by_hand():
    a, b = _kv(s=2, dtype=torch.bfloat16, positions=torch.arange(2)), _kv(s=2, start=2.0)
    m = mean([a, b, b])
    assert m.dtype == torch.float32 and m.positions.tolist() == [[0, 1]]
    # a counts from 0, b from 2: the mean of (x, x + 2, x + 2) is x + 4/3
    want = a.layers[1][1].float() + 4 / 3
    assert torch.allclose(m.layers[1][1], want, atol=1e-5)
    assert torch.allclose(mean(iter([a])).layers[0][0], a.layers[0][0].float())
    with pytest.raises(KVShapeError, match="mean of no KV"):
        mean([])


# ----------------------------------------------------------------------------------------------- rope

from types import SimpleNamespace  # noqa: E402

from windowkit.errors import UnsupportedModelError  # noqa: E402
from windowkit.kv.rope import (RopeSpec, bf16_ulp, relocate_keys, relocate_keys_many, rotation,  # noqa: E402
                               shift_positions)

SPEC = RopeSpec(torch.tensor([1.0, 0.5]))                     # 2 frequencies, rot_dim 4, rotate_half pairs
SPEC_I = RopeSpec(torch.tensor([1.0, 0.5]), pairing="interleaved")


def test_spec_facts():
    assert (SPEC.n_freq, SPEC.rot_dim, SPEC.n_axes) == (2, 4, 1) and SPEC.axis.tolist() == [0, 0]
    m = RopeSpec(torch.ones(6), mrope="blocked", mrope_section=(2, 2, 2))
    assert m.n_axes == 3 and m.axis.tolist() == [0, 0, 1, 1, 2, 2]
    assert RopeSpec(torch.ones(6), mrope="blocked", mrope_section=(1, 2, 3)).axis.tolist() == [0, 1, 1, 2, 2, 2]
    # Qwen3-VL interleaving: j % 3 == 1 -> h while j < 3 * s1, j % 3 == 2 -> w while j < 3 * s2
    assert RopeSpec(torch.ones(6), mrope="interleaved", mrope_section=(2, 2, 2)).axis.tolist() == [0, 1, 2, 0, 1, 2]
    assert RopeSpec(torch.ones(6), mrope="interleaved", mrope_section=(4, 1, 1)).axis.tolist() == [0, 1, 2, 0, 0, 0]
    q = RopeSpec(torch.ones(6), mrope="blocked", mrope_section=(2, 2, 2), rope_type="yarn").with_inv_freq(torch.ones(6))
    assert (q.mrope, q.mrope_section, q.rope_type) == ("blocked", (2, 2, 2), "yarn")
    # interleaved with s1 = 2, s2 = 3 of 12: h at 1, 4 (j < 6), w at 2, 5, 8 (j < 9)
    assert RopeSpec(torch.ones(12), mrope="interleaved", mrope_section=(4, 2, 3)).axis.tolist() == [
        0, 1, 2, 0, 1, 2, 0, 0, 2, 0, 0, 0]
    w = SPEC.with_inv_freq(torch.tensor([2.0, 3.0], dtype=torch.float64))
    assert w.inv_freq.dtype == torch.float32 and w.inv_freq.tolist() == [2.0, 3.0] and w.pairing == "half"
    assert SPEC_I.with_inv_freq(torch.ones(2)).pairing == "interleaved"


def test_rotation_by_hand_both_pairings():
    k = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    c1, s1, c5, s5 = math.cos(1.0), math.sin(1.0), math.cos(0.5), math.sin(0.5)
    # half: pairs (x0, x2) at angle 1 and (x1, x3) at angle 0.5
    want = [1 * c1 - 3 * s1, 2 * c5 - 4 * s5, 3 * c1 + 1 * s1, 4 * c5 + 2 * s5]
    assert torch.allclose(relocate_keys(k, 1, SPEC), torch.tensor([want]), atol=1e-6)
    # interleaved: pairs (x0, x1) at angle 1 and (x2, x3) at angle 0.5
    want = [1 * c1 - 2 * s1, 2 * c1 + 1 * s1, 3 * c5 - 4 * s5, 4 * c5 + 3 * s5]
    assert torch.allclose(relocate_keys(k, 1, SPEC_I), torch.tensor([want]), atol=1e-6)
    # delta 2 (angles 2 and 1), bf16 keys come back in bf16
    c2, s2 = math.cos(2.0), math.sin(2.0)
    kb = k.to(torch.bfloat16)
    out = relocate_keys(kb, 2, SPEC)
    assert out.dtype == torch.bfloat16
    want = torch.tensor([[1 * c2 - 3 * s2, 2 * c1 - 4 * s1, 3 * c2 + 1 * s2, 4 * c1 + 2 * s1]])
    assert torch.allclose(out.float(), want, atol=3e-2)


def test_zero_delta_returns_the_keys_themselves():
    k = torch.randn(2, 3, 4)
    for d in (0, (0, 0, 0), torch.tensor(0), torch.zeros(3, dtype=torch.long)):
        assert relocate_keys(k, d, SPEC) is k
    assert relocate_keys_many([k], 0, SPEC)[0] is k and relocate_keys_many([], 5, SPEC) == []


def test_per_token_and_per_axis_deltas_by_hand():
    k = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    out = relocate_keys(k, torch.tensor([1, 2]), SPEC)      # token 0 by 1, token 1 by 2
    assert torch.allclose(out[:, 0], torch.tensor([math.cos(1.0), math.cos(2.0)]), atol=1e-6)
    assert torch.allclose(out[:, 2], torch.tensor([math.sin(1.0), math.sin(2.0)]), atol=1e-6)
    # a 0-d tensor is a uniform delta: angles 3 * 1 and 3 * 0.5
    assert torch.allclose(relocate_keys(k, torch.tensor(3), SPEC)[0],
                          torch.tensor([math.cos(3.0), 0.0, math.sin(3.0), 0.0]), atol=1e-6)
    k2 = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])   # the second frequency (inv 0.5)
    assert torch.allclose(relocate_keys(k2, torch.tensor(3), SPEC)[0, 1], torch.tensor(math.cos(1.5)), atol=1e-6)
    out = relocate_keys(k2, torch.tensor([1, 2]), SPEC)
    assert torch.allclose(out[:, 1], torch.tensor([math.cos(0.5), math.cos(1.0)]), atol=1e-6)
    # M-RoPE (blocked 1, 1, 0 of 2 freqs): freq 0 reads t, freq 1 reads h
    m = RopeSpec(torch.tensor([1.0, 0.5]), mrope="blocked", mrope_section=(1, 1, 0))
    k1 = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    out = relocate_keys(k1, (2, 4, 7), m)                   # angles 2 * 1 and 4 * 0.5
    assert torch.allclose(out, torch.tensor([[math.cos(2.0), math.cos(2.0), math.sin(2.0), math.sin(2.0)]]),
                          atol=1e-6)
    out = relocate_keys(k1, torch.tensor([[2, 4, 7]]), m)  # the same per token
    assert torch.allclose(out, torch.tensor([[math.cos(2.0), math.cos(2.0), math.sin(2.0), math.sin(2.0)]]),
                          atol=1e-6)
    assert torch.allclose(relocate_keys(k1, (3, 3, 3), SPEC), relocate_keys(k1, 3, SPEC))  # uniform: 1-D


def test_exact_angles_with_positions_by_hand():
    # keys at positions 5, 6 moved by 2: the angle is fl32(7 * inv) - fl32(5 * inv) = 2 * inv here (exact)
    k = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    out = relocate_keys(k, 2, SPEC, positions=torch.tensor([5, 6]))
    assert torch.allclose(out[0], torch.tensor([math.cos(2.0), 0.0, math.sin(2.0), 0.0]), atol=1e-6)
    assert torch.allclose(out[1], torch.tensor([0.0, math.cos(1.0), 0.0, math.sin(1.0)]), atol=1e-6)
    cos, sin = rotation(2, SPEC, k, torch.tensor([5, 6]))
    assert cos.dtype == torch.float32 and cos.shape == (2, 2)
    assert torch.allclose(cos, torch.tensor([[math.cos(2.0), math.cos(1.0)]] * 2), atol=1e-7)
    # per-token and per-axis deltas with positions
    out = relocate_keys(k, torch.tensor([1, 2]), SPEC, positions=torch.tensor([[5, 6]]))
    assert torch.allclose(out[1], torch.tensor([0.0, math.cos(1.0), 0.0, math.sin(1.0)]), atol=1e-6)
    m = RopeSpec(torch.tensor([1.0, 0.5]), mrope="blocked", mrope_section=(1, 1, 0))
    pos3 = torch.tensor([[0, 0], [10, 10], [20, 20]])
    out = relocate_keys(k, (2, 4, 7), m, positions=pos3)
    assert torch.allclose(out[0], torch.tensor([math.cos(2.0), 0.0, math.sin(2.0), 0.0]), atol=1e-6)
    assert torch.allclose(out[1], torch.tensor([0.0, math.cos(2.0), 0.0, math.sin(2.0)]), atol=1e-6)
    out = relocate_keys(k, torch.tensor([[2, 4, 7], [2, 4, 7]]), m, positions=pos3)
    assert torch.allclose(out[1], torch.tensor([0.0, math.cos(2.0), 0.0, math.sin(2.0)]), atol=1e-6)
    # at a large position the fp32 angle rounding of the model is reproduced: angle = fl(p'+inv) - fl(p*inv)
    big = torch.tensor([100003])
    a = (torch.tensor([100003 + 7], dtype=torch.float32) * 0.5).double() - (big.float() * 0.5).double()
    cos, _sin = rotation(7, SPEC, k[:1], big)
    assert cos[0, 1].item() == pytest.approx(math.cos(float(a)), abs=1e-7)


def test_relocate_many_equals_one_at_a_time():
    g = torch.Generator().manual_seed(0)
    ks = [torch.randn(2, 3, 4, generator=g), torch.randn(1, 5, 4, generator=g).to(torch.bfloat16),
          torch.randn(2, 3, 4, generator=g)]
    many = relocate_keys_many(ks, 9, SPEC)
    for k, m in zip(ks, many):
        assert m.dtype == k.dtype and torch.equal(m, relocate_keys(k, 9, SPEC))
    many = relocate_keys_many(ks[:1] + ks[2:], torch.tensor([1, 2, 3]), SPEC)
    assert torch.equal(many[1], relocate_keys(ks[2], torch.tensor([1, 2, 3]), SPEC))


def test_shift_positions_by_hand():
    p = torch.tensor([[0, 1, 2]])
    assert shift_positions(p, 5).tolist() == [[5, 6, 7]]
    assert shift_positions(p, torch.tensor(2)).tolist() == [[2, 3, 4]]
    assert shift_positions(p, torch.tensor([1, 0, 3])).tolist() == [[1, 1, 5]]
    p3 = torch.tensor([[0, 1], [0, 1], [0, 1]])
    assert shift_positions(p3, (1, 2, 3)).tolist() == [[1, 2], [2, 3], [3, 4]]
    assert shift_positions(p3, torch.tensor([[1, 2, 3], [4, 5, 6]])).tolist() == [[1, 5], [2, 6], [3, 7]]


def test_bf16_ulp_by_hand():
    assert bf16_ulp(torch.tensor([1.0, 3.0, -0.5, 256.0])).tolist() == [2.0 ** -7, 2.0 ** -6, 2.0 ** -8, 2.0]
    assert bf16_ulp(torch.tensor([0.0])).item() == torch.finfo(torch.bfloat16).tiny * 2.0 ** -7


def test_rope_errors_say_what_is_wrong():
    k = torch.zeros(5, 4)
    cases = [
        (lambda: relocate_keys(torch.zeros(5, 4, dtype=torch.long), 1, SPEC), "keys must be a floating-point tensor"),
        (lambda: relocate_keys([[0.0] * 4], 1, SPEC), "keys must be a floating-point tensor"),
        (lambda: relocate_keys(torch.zeros(5, 6), 1, SPEC), "keys have 6 trailing dims, the RoPE spec rotates 4"),
        (lambda: relocate_keys_many([torch.zeros(5, 4, dtype=torch.int32)], 1, SPEC), "floating-point"),
        (lambda: relocate_keys_many([k, torch.zeros(5, 2)], 1, SPEC), "keys have 2 trailing dims, the RoPE spec rotates 4"),
        (lambda: relocate_keys(k, torch.tensor([1, 2, 3]), SPEC), "per-token delta has 3 entries for 5 tokens"),
        (lambda: relocate_keys(k, torch.ones(5, 3, dtype=torch.long), SPEC), "per-axis deltas given for a 1-D RoPE spec"),
        (lambda: relocate_keys(k, torch.ones(2, 2, dtype=torch.long), SPEC), r"cannot read delta of shape \(2, 2\)"),
        (lambda: relocate_keys(k, (1, 2), SPEC), r"a per-axis delta needs 3 entries \(t, h, w\), got 2"),
        (lambda: relocate_keys(k, (1, 2, 3), SPEC), "per-axis deltas differ but the RoPE spec is 1-D"),
        (lambda: rotation("x", SPEC, k), "delta must be an int, a \\(dt, dh, dw\\) tuple or a tensor, got 'x'"),
        # the zero-delta check in front of every relocation says the same (it used to raise a bare ValueError),
        # and a fractional offset is refused, never truncated into the rotation of another position
        (lambda: relocate_keys(k, "x", SPEC), "delta must be an int, a \\(dt, dh, dw\\) tuple or a tensor, got 'x'"),
        (lambda: relocate_keys(k, 1.5, SPEC), "got 1.5"),
        (lambda: relocate_keys_many([k], (1, 0.5, 0), SPEC), "got 0.5"),
        (lambda: relocate_keys(k, 1, SPEC, positions=torch.arange(4)), "positions cover 4 tokens, keys have 5"),
        (lambda: relocate_keys(k, 1, SPEC, positions=torch.zeros(2, 5, dtype=torch.long)),
         r"positions of shape \(2, 5\) do not fit a 1-axis RoPE spec"),
    ]
    m = RopeSpec(torch.ones(2), mrope="blocked", mrope_section=(1, 1, 0))
    cases.append((lambda: relocate_keys(k, torch.ones(4, 3, dtype=torch.long), m),
                  "per-token delta has 4 rows for 5 tokens"))
    for fn, msg in cases:
        with pytest.raises(KVShapeError, match=msg):
            fn()


def _cfg(**kw):
    base = dict(model_type="llama", rope_theta=10000.0, head_dim=4, rope_scaling=None)
    base.update(kw)
    return SimpleNamespace(**base)


def test_from_config_default_rope_by_hand():
    s = RopeSpec.from_config(_cfg())
    # inv_freq = 1 / 10000 ** (2i / 4), i = 0, 1
    assert s.inv_freq.tolist() == [1.0, pytest.approx(0.01)] and s.pairing == "half" and s.mrope == "none"
    assert s.rope_type == "default" and s.inv_freq.dtype == torch.float32
    s = RopeSpec.from_config(_cfg(rope_theta=100.0, head_dim=None, hidden_size=24, num_attention_heads=4))
    assert s.inv_freq.tolist() == pytest.approx([1.0, 100 ** (-1 / 3), 100 ** (-2 / 3)])   # head_dim 24 / 4 = 6
    s = RopeSpec.from_config(_cfg(rope_parameters={"rope_type": "default", "rope_theta": 16.0}))  # transformers 5
    assert s.inv_freq.tolist() == [1.0, 0.25]
    s = RopeSpec.from_config(SimpleNamespace(model_type="x", text_config=_cfg(rope_theta=16.0)))  # a VLM's text
    assert s.inv_freq.tolist() == [1.0, 0.25]
    s = RopeSpec.from_config(_cfg(), inv_freq=torch.tensor([3.0, 4.0], dtype=torch.float64))
    assert s.inv_freq.tolist() == [3.0, 4.0] and s.inv_freq.dtype == torch.float32
    s = RopeSpec.from_config(_cfg(rope_scaling={"type": "default"}, rope_theta=16.0))        # old "type" key
    assert s.rope_type == "default" and s.inv_freq.tolist() == [1.0, 0.25]


def test_from_config_pairings_and_mrope():
    ds2 = _cfg(model_type="deepseek_v2", qk_rope_head_dim=4, head_dim=64)
    assert RopeSpec.from_config(ds2).pairing == "interleaved"
    assert RopeSpec.from_config(ds2).inv_freq.tolist() == [1.0, pytest.approx(0.01)]   # qk_rope_head_dim first
    ds3 = _cfg(model_type="deepseek_v3", rope_interleave=True)
    assert RopeSpec.from_config(ds3).pairing == "half"
    assert RopeSpec.from_config(ds3, engine="sglang").pairing == "interleaved"
    assert RopeSpec.from_config(_cfg(model_type="deepseek_v3", rope_interleave=False), engine="sglang").pairing == "half"
    assert RopeSpec.from_config(_cfg(model_type="kimi_k2"), engine="sglang").pairing == "interleaved"
    assert RopeSpec.from_config(_cfg(model_type="llama"), engine="sglang").pairing == "half"
    # partial rotary is accepted for DeepSeek (its rope dims are their own head): dim 8 * 0.5 = 4
    s = RopeSpec.from_config(_cfg(model_type="deepseek_v3", head_dim=8, rope_scaling={"partial_rotary_factor": 0.5}))
    assert s.n_freq == 2
    q = RopeSpec.from_config(_cfg(model_type="qwen2_5_vl", head_dim=12, rope_scaling={"mrope_section": [2, 2, 2]}))
    assert q.mrope == "blocked" and q.mrope_section == (2, 2, 2) and q.axis.tolist() == [0, 0, 1, 1, 2, 2]
    q = RopeSpec.from_config(_cfg(model_type="qwen3_vl", head_dim=12, rope_scaling={"mrope_section": [2, 2, 2]}))
    assert q.mrope == "interleaved" and q.axis.tolist() == [0, 1, 2, 0, 1, 2]


def test_from_config_refusals_say_why():
    with pytest.raises(UnsupportedModelError, match="unknown engine 'vllm'; expected 'transformers' or 'sglang'"):
        RopeSpec.from_config(_cfg(), engine="vllm")
    with pytest.raises(UnsupportedModelError, match="rope_type='longrope' changes its frequencies"):
        RopeSpec.from_config(_cfg(rope_scaling={"rope_type": "longrope"}))
    with pytest.raises(UnsupportedModelError, match=r"unsupported rope_type='weird' \(model_type='llama'\)"):
        RopeSpec.from_config(_cfg(rope_scaling={"rope_type": "weird"}))
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor < 1 is not supported yet"):
        RopeSpec.from_config(_cfg(rope_scaling={"partial_rotary_factor": 0.5}))
    with pytest.raises(UnsupportedModelError, match=r"mrope_section \(2, 2, 1\) does not sum to 6 frequencies"):
        RopeSpec.from_config(_cfg(model_type="qwen2_5_vl", head_dim=12, rope_scaling={"mrope_section": [2, 2, 1]}))
    # Qwen3-VL's interleaved sections need not sum to the frequency count
    RopeSpec.from_config(_cfg(model_type="qwen3_vl", head_dim=12, rope_scaling={"mrope_section": [2, 2, 1]}))


# ----------------------------------------------------------------------------------------------- patch

from windowkit.kv.patch import (Patch, apply_patch, deficit, form_orbit_patch, form_patch,  # noqa: E402
                                form_removal_patch, orderings, patch_from_deficit, place, reconstruction_error,
                                select_layers)

# one KV head of rot_dim 4 (SPEC) for keys, values of dim 3; two layers
L2 = KVLayout("gqa", 2, ((1, 4), (1, 3)), 0)
ML = KVLayout("mla", 1, ((1, 8), (1, 4)), 1)


def _rand_kv(layout=L2, s=5, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return ChunkKV([tuple(torch.randn(h, s, d, generator=g).to(dtype) for h, d in layout.slot_shapes)
                    for _ in range(layout.num_layers)], layout)


def _rank1(layout=L2, s=5, seed=1):
    """A deficit whose every (layer, slot) matrix [S, H*D] is the outer product of two known vectors."""
    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(layout.num_layers):
        pair = []
        for h, d in layout.slot_shapes:
            u, v = torch.randn(s, generator=g), torch.randn(h * d, generator=g)
            pair.append(torch.outer(u, v).reshape(s, h, d).transpose(0, 1).contiguous())
        layers.append(tuple(pair))
    return ChunkKV(layers, layout)


def _plus(a, b):
    return ChunkKV([(x0 + y0, x1 + y1) for (x0, x1), (y0, y1) in zip(a.layers, b.layers)], a.layout, a.positions)


def _close(a, b, atol=1e-5):
    return all(torch.allclose(x.float(), y.float(), atol=atol) for p, q in zip(a.layers, b.layers) for x, y in zip(p, q))


def test_select_layers():
    assert select_layers(None, 5) == [0, 1, 2, 3, 4] and select_layers("all", 3) == [0, 1, 2]
    assert select_layers("deep", 5) == [2, 3, 4] and select_layers("deep", 4) == [2, 3]
    assert select_layers([3, 1, 1], 5) == [1, 3]
    with pytest.raises(KVShapeError, match="layers must be None, 'all', 'deep' or a list of ints, got 'half'"):
        select_layers("half", 5)
    for bad, msg in (([], r"layer ids \[\] outside 0..4"), ([-1, 2], r"layer ids \[-1, 2\] outside 0..4"),
                     ([5], r"layer ids \[5\] outside 0..4")):
        with pytest.raises(KVShapeError, match=msg):
            select_layers(bad, 5)
    assert select_layers([0, 4], 5) == [0, 4]


def test_deficit_undoes_the_rotation_for_every_delta_type():
    base, d = _rand_kv(), _rank1()
    for delta in (3, torch.tensor(3), (3, 3, 3)):
        cond = _plus(base, d).relocate(delta, SPEC)
        got = deficit(cond, base, delta, SPEC)
        assert got.dtype == torch.float32 and _close(got, d)
    per_tok = torch.tensor([1, 2, 3, 4, 5])
    assert _close(deficit(_plus(base, d).relocate(per_tok, SPEC), base, per_tok, SPEC), d)
    with pytest.raises(KVShapeError, match="conditioned KV: 4 tokens != 5"):
        deficit(_rand_kv(s=4), base, 0, SPEC)


def test_rank_one_patch_restores_the_conditioned_kv():
    base, d = _rand_kv(), _rank1()
    p = patch_from_deficit(d, 1)
    assert (p.rank, p.rope_rank, p.num_tokens, p.layers) == (1, 1, 5, [0, 1])
    assert all(u.shape == (5, 1) for u, _v in p.factors.values())
    assert _close(apply_patch(base, p), _plus(base, d))
    # nbytes: per (layer, slot) us [5, 1] + vt [1, 4] or [1, 3], fp32
    assert p.nbytes == 4 * (2 * (5 + 4) + 2 * (5 + 3))
    assert p.fraction_of(base) == pytest.approx(p.nbytes / base.nbytes)
    assert p.tail_energy(0, 0) == pytest.approx(0.0, abs=1e-4)
    kept, total = p.energy[(1, 1)]
    assert kept == pytest.approx(float(d.layers[1][1].pow(2).sum()), rel=1e-5) and total == pytest.approx(kept)
    # placed at 3: R(3) (base + d), the model's KV of the conditioned chunk at 3
    assert _close(place(base, 3, SPEC, p), _plus(base, d).relocate(3, SPEC))


def test_patch_ranks_layers_and_dtypes():
    d = _rank1()
    full = patch_from_deficit(d, None)
    assert full.rank == 5 and full.rope_rank == 5      # max(S, H*D) = max(5, 4, 3)
    with pytest.raises(KVShapeError, match="patch rank must be >= 1, got 0"):
        patch_from_deficit(d, 0)
    deep = patch_from_deficit(d, 2, layers="deep", dtype=torch.bfloat16, meta={"k": "v"})
    assert deep.layers == [1] and sorted(deep.factors) == [(1, 0), (1, 1)] and deep.meta == {"k": "v"}
    assert all(u.dtype == torch.bfloat16 and v.dtype == torch.bfloat16 for u, v in deep.factors.values())
    m = patch_from_deficit(_rank1(ML), 8)               # MLA: the k_pe band gets rank 8 // 4 = 2
    assert (m.rank, m.rope_rank) == (8, 2) and m.factors[(0, 1)][0].shape == (5, 2)
    assert m.factors[(0, 0)][0].shape == (5, 5)         # latent: rank 8 clipped to min(5, 8)
    assert patch_from_deficit(_rank1(ML), 3).rope_rank == 1          # max(1, 3 // 4)
    assert patch_from_deficit(_rank1(ML), None).rope_rank == 8       # full rank: k_pe full too
    assert patch_from_deficit(_rank1(ML), 8, rope_rank=3).rope_rank == 3
    # apply_patch with only layer 1 patched leaves layer 0 as it is
    base = _rand_kv()
    out = apply_patch(base, deep)
    assert out.layers[0][0] is base.layers[0][0] and out.layers[0][1] is base.layers[0][1]
    assert apply_patch(base, None) is base


def test_form_patch_keeps_the_canonical_dtype_and_checks_shapes():
    base, d = _rand_kv(dtype=torch.bfloat16), _rank1()
    cond = _plus(base, d).relocate(2, SPEC).to(dtype=torch.bfloat16)
    p = form_patch(cond, base, 2, SPEC, rank=1)
    assert p.factors[(0, 0)][0].dtype == torch.bfloat16 and p.meta == {}
    out = apply_patch(base, p)
    assert out.dtype == torch.bfloat16 and _close(out, _plus(base, d), atol=0.1)
    assert form_patch(cond, base, 2, SPEC, rank=1, dtype=torch.float32).factors[(0, 0)][0].dtype == torch.float32
    with pytest.raises(KVShapeError, match="patch is for 5 tokens, KV has 4"):
        apply_patch(_rand_kv(s=4), p)
    with pytest.raises(KVShapeError, match=r"patch layout gqa: 2 layers.* != KV layout mla: 1 layers"):
        place(_rand_kv(ML), 2, SPEC, p)


def test_orbit_patch_is_the_mean_deficit():
    base, d1, d2 = _rand_kv(), _rank1(seed=1), _rank1(seed=2)
    p = form_orbit_patch([_plus(base, d1), _plus(base, d2)], base, 0, SPEC, rank=None)
    mean_d = ChunkKV([((a0 + b0) / 2, (a1 + b1) / 2) for (a0, a1), (b0, b1) in zip(d1.layers, d2.layers)], L2)
    assert _close(apply_patch(base, p), _plus(base, mean_d))
    assert p.meta == {"kind": "orbit", "orderings": "2"}
    q = form_orbit_patch([_plus(base, d1)], base, 0, SPEC, rank=1, meta={"kind": "mine", "x": "1"})
    assert q.meta == {"kind": "mine", "x": "1", "orderings": "1"}
    assert q.rank == 1 and q.factors[(0, 0)][0].shape == (5, 1)
    b16 = base.to(dtype=torch.bfloat16)
    assert form_orbit_patch([_plus(base, d1).to(dtype=torch.bfloat16)], b16, 0, SPEC, rank=1) \
        .factors[(0, 0)][0].dtype == torch.bfloat16
    with pytest.raises(KVShapeError, match="^an orbit patch needs at least one ordering$"):
        form_orbit_patch([], base, 0, SPEC)


def test_removal_patch_defaults():
    kept, d = _rand_kv(), _rank1()
    p = form_removal_patch(_plus(kept, d).relocate(4, SPEC), kept, 4, SPEC)
    assert p.rank == 64 and p.meta == {"kind": "removal"} and _close(apply_patch(kept, p), _plus(kept, d))
    q = form_removal_patch(_plus(kept, d).to(dtype=torch.bfloat16), kept.to(dtype=torch.bfloat16), 0, SPEC, rank=2,
                           meta={"kind": "k"})
    assert q.meta == {"kind": "k"} and q.factors[(0, 0)][0].dtype == torch.bfloat16


def test_patch_serialisation_round_trip():
    p = patch_from_deficit(_rank1(), 1, meta={"kind": "fresh"})
    tensors, meta = p.to_tensors()
    assert sorted(tensors) == ["0.0.us", "0.0.vt", "0.1.us", "0.1.vt", "1.0.us", "1.0.vt", "1.1.us", "1.1.vt"]
    assert (meta["num_tokens"], meta["rank"], meta["rope_rank"]) == ("5", "1", "1")
    back = Patch.from_tensors(tensors, meta, L2)
    assert (back.num_tokens, back.rank, back.rope_rank, back.meta) == (5, 1, 1, {"kind": "fresh"})
    assert back.energy == {k: pytest.approx(v) for k, v in p.energy.items()}
    assert all(torch.equal(back.factors[k][i], p.factors[k][i]) for k in p.factors for i in (0, 1))
    meta.pop("meta")
    assert Patch.from_tensors(tensors, meta, L2).meta == {}
    h = p.to(dtype=torch.float16)
    assert h.factors[(1, 1)][1].dtype == torch.float16 and h.energy == p.energy and h.meta == p.meta
    assert (h.layout, h.num_tokens, h.rank, h.rope_rank) == (L2, 5, 1, 1)
    assert h.nbytes == p.nbytes // 2


def test_place_paths():
    base = _rand_kv()
    base = ChunkKV(base.layers, base.layout, torch.arange(5))
    d = _rank1()
    p = patch_from_deficit(d, 1)
    out = place(base, 0, SPEC, p)                        # zero delta: just the patch
    assert _close(out, _plus(base, d)) and out.positions.tolist() == [[0, 1, 2, 3, 4]]
    out = place(base, 7, SPEC)                            # blind: the canonical moved, values shared
    assert out.layers[1][1] is base.layers[1][1] and out.positions.tolist() == [[7, 8, 9, 10, 11]]
    assert _close(out, base.relocate(7, SPEC))
    out = place(base, 7, SPEC, p)
    assert _close(out, _plus(base, d).relocate(7, SPEC)) and out.positions.tolist() == [[7, 8, 9, 10, 11]]
    per_tok = torch.tensor([1, 1, 2, 2, 3])
    out = place(base, per_tok, SPEC, p)
    assert _close(out, _plus(base, d).relocate(per_tok, SPEC)) and out.positions.tolist() == [[1, 2, 4, 5, 7]]
    b16 = base.to(dtype=torch.bfloat16)
    out = place(b16, 7, SPEC, p)
    assert out.dtype == torch.bfloat16 and out.layers[0][1].dtype == torch.bfloat16
    assert _close(out, _plus(base, d).relocate(7, SPEC), atol=0.1)


def test_orderings():
    assert orderings(["a", "b", "c"]) == [("a", "b", "c"), ("a", "c", "b"), ("b", "a", "c"), ("b", "c", "a"),
                                          ("c", "a", "b"), ("c", "b", "a")]
    assert len(orderings(range(4))) == 24 and orderings([]) == [()]
    s = orderings(range(6), limit=10)
    assert len(s) == 10 and len(set(s)) == 10 and s[0] == (0, 1, 2, 3, 4, 5)
    assert all(sorted(o) == list(range(6)) for o in s)
    assert orderings(range(6), limit=10) == s and orderings(range(6), limit=10, seed=1) != s
    assert len(orderings(range(5), limit=200)) == 120     # every ordering of 5, then it stops trying
    assert len(orderings(range(5))) == 24


def test_reconstruction_error_by_hand():
    t = ChunkKV([(torch.ones(1, 2, 4), torch.ones(1, 2, 3))] * 2, L2)
    a = ChunkKV([(2 * torch.ones(1, 2, 4), torch.ones(1, 2, 3)), (torch.ones(1, 2, 4), torch.ones(1, 2, 3))], L2)
    # layer 0 slot 0 off by 1 in 8 entries; ||t||^2 = 2 * (8 + 6) = 28 -> sqrt(8 / 28)
    assert reconstruction_error(a, t) == pytest.approx(math.sqrt(8 / 28))
    assert reconstruction_error(a, t, layers=[0]) == pytest.approx(math.sqrt(8 / 14))
    assert reconstruction_error(a, t, layers=[1]) == 0.0
    z = ChunkKV([(torch.zeros(1, 2, 4), torch.zeros(1, 2, 3))] * 2, L2)
    assert reconstruction_error(z, z) == 0.0
    assert reconstruction_error(t, z) == pytest.approx(math.sqrt(28 / 1e-30))


def test_randomized_svd_defaults_and_determinism():
    x = _known_spectrum(60, 50, [10.0, 5.0, 2.0, 1.0] + [0.5] * 8)
    a = truncated_svd(x, 4, "randomized")
    b = truncated_svd(x, 4, "randomized", oversample=8, niter=2, generator_seed=0)   # the documented defaults
    assert torch.equal(a.us, b.us) and torch.equal(a.vt, b.vt)
    c = truncated_svd(x, 4, "randomized", generator_seed=1)
    assert not torch.equal(a.us, c.us) and c.kept_energy == pytest.approx(a.kept_energy, rel=1e-3)


def test_randomized_is_a_range_finder_and_falls_back_to_exact_when_small():
    # a flat spectrum, no power iteration, no oversampling: the sketch misses part of the top-5 energy
    g = torch.Generator().manual_seed(3)
    x = torch.randn(50, 50, generator=g)
    exact = truncated_svd(x, 5, "exact")
    rough = truncated_svd(x, 5, "randomized", oversample=0, niter=0)
    assert rough.kept_energy < 0.95 * exact.kept_energy
    # m + oversample >= min(S, F): the exact SVD itself (10 + 0 < 10 is false; 2 + 8 < 10 is false)
    y = torch.randn(10, 12, generator=g)
    for rank, over in ((10, 0), (2, 8)):
        r, e = truncated_svd(y, rank, "randomized", oversample=over), truncated_svd(y, rank, "exact")
        assert torch.equal(r.us, e.us) and torch.equal(r.vt, e.vt)
    assert truncated_svd(torch.eye(5), 2, "randomized").kept_energy == pytest.approx(2.0)


def test_rank_is_clipped_by_the_feature_count_too():
    assert truncated_svd(torch.zeros(5, 2), 10).us.shape == (5, 2)
    t = truncated_svd(torch.ones(5, 2), 10)
    assert t.us.shape == (5, 2) and t.vt.shape == (2, 2)


def test_relocate_moves_positions_and_clone_without_positions():
    kv = _kv(s=5, layout=KVLayout("gqa", 1, ((1, 4), (1, 3)), 0), positions=torch.arange(5))
    moved = kv.relocate(3, SPEC)
    assert moved.positions.tolist() == [[3, 4, 5, 6, 7]] and moved.layers[0][1] is kv.layers[0][1]
    assert torch.allclose(moved.layers[0][0], relocate_keys(kv.layers[0][0], 3, SPEC))
    bare = _kv(s=5, layout=KVLayout("gqa", 1, ((1, 4), (1, 3)), 0))
    assert bare.relocate(3, SPEC).positions is None and bare.clone().positions is None


def test_kv_messages_exactly():
    kv = _kv()
    with pytest.raises(KVShapeError, match=r"^KV: device meta != cpu$"):
        kv.check_compatible(kv.to(device="meta"))
    with pytest.raises(KVShapeError, match="^nothing to concatenate$"):
        concat([])
    with pytest.raises(KVShapeError, match="^cannot concatenate KV of different layouts$"):
        concat([kv, _kv(layout=MLA)])
    with pytest.raises(KVShapeError, match="^mean of no KV$"):
        mean([])


from windowkit.kv.patch import _from_matrix, as_matrix as _as_matrix  # noqa: E402


def test_matrix_views_by_hand():
    t = torch.arange(12.0).reshape(2, 3, 2)           # [H=2, S=3, D=2]
    m = _as_matrix(t)
    # row s holds head 0's features then head 1's: token 1 -> [2, 3, 8, 9]
    assert m.shape == (3, 4) and m[1].tolist() == [2.0, 3.0, 8.0, 9.0]
    assert torch.equal(_from_matrix(m, 2, 2), t)


def test_deficit_keeps_the_base_positions_and_defaults():
    base = _rand_kv()
    base = ChunkKV(base.layers, base.layout, torch.arange(5))
    assert deficit(base, base, 0, SPEC).positions.tolist() == [[0, 1, 2, 3, 4]]
    d = _rank1(KVLayout("gqa", 1, ((1, 40), (1, 40)), 0), s=40)
    p = patch_from_deficit(d)
    assert p.rank == 32 and p.rope_rank == 32            # the documented default rank
    m = patch_from_deficit(_rank1(ML), 10)                # MLA k_pe: 10 // 4 = 2 (an int)
    assert m.rope_rank == 2 and isinstance(m.rope_rank, int) and m.to_tensors()[1]["rope_rank"] == "2"
    p = form_patch(base, base, 0, SPEC, rank=1, meta={"a": "b"})
    assert p.meta == {"a": "b"}


def test_method_is_passed_to_the_svd():
    lay = KVLayout("gqa", 1, ((1, 40), (1, 40)), 0)
    g = torch.Generator().manual_seed(5)
    d = ChunkKV([(torch.randn(1, 40, 40, generator=g), torch.randn(1, 40, 40, generator=g))], lay)
    want = truncated_svd(_as_matrix(d.layers[0][1]), 2, "randomized")
    exact = truncated_svd(_as_matrix(d.layers[0][1]), 2, "exact")
    p = patch_from_deficit(d, 2, method="randomized")
    assert torch.equal(p.factors[(0, 1)][0], want.us) and not torch.equal(p.factors[(0, 1)][0], exact.us)
    zero = ChunkKV([(torch.zeros(1, 40, 40), torch.zeros(1, 40, 40))], lay)
    q = form_patch(_plus(zero, d), zero, 0, RopeSpec(torch.ones(20)), rank=2, method="randomized")
    assert torch.equal(q.factors[(0, 1)][0], want.us)


def test_fraction_of_an_empty_kv():
    p = Patch({(0, 0): (torch.zeros(0, 1), torch.zeros(1, 4))}, L2, 0, 1, 1)
    empty = ChunkKV([(torch.zeros(1, 0, 4), torch.zeros(1, 0, 3))] * 2, L2)
    assert p.nbytes == 16 and p.fraction_of(empty) == 16.0   # over max(0, 1) bytes


def test_a_values_only_patch_is_applied():
    base, d = _rand_kv(), _rank1()
    full = patch_from_deficit(d, 1)
    p = Patch({(1, 1): full.factors[(1, 1)]}, L2, 5, 1, 1)
    out = apply_patch(base, p)
    assert out.layers[1][0] is base.layers[1][0]
    assert torch.allclose(out.layers[1][1], base.layers[1][1] + d.layers[1][1], atol=1e-5)


def test_place_details():
    base, d = _rand_kv(), _rank1()
    p = patch_from_deficit(d, 1)
    a, b = place(base, torch.tensor(7), SPEC, p), place(base, 7, SPEC, p)   # a 0-d tensor is a plain delta
    assert all(torch.equal(x, y) for pa, pb in zip(a.layers, b.layers) for x, y in zip(pa, pb))
    one = KVLayout("gqa", 1, ((1, 4), (1, 3)), 0)
    k1 = _rand_kv(one)
    assert _close(place(k1, 2, SPEC), k1.relocate(2, SPEC))               # a one-layer KV
    # keys at large positions: the exact per-token angles, the same rotation as relocate with positions
    spec = RopeSpec(torch.tensor([1.0, 0.1]))
    far = ChunkKV(k1.layers, one, torch.arange(100003, 100008))
    assert torch.equal(place(far, 7, spec).layers[0][0], far.relocate(7, spec).layers[0][0])
    # MLA without a patch: the latent (slot 0) is shared, k_pe (slot 1) rotated
    mla = _rand_kv(ML)
    out = place(mla, 3, SPEC)
    assert out.layers[0][0] is mla.layers[0][0]
    assert torch.allclose(out.layers[0][1], relocate_keys(mla.layers[0][1], 3, SPEC), atol=1e-6)


def test_exact_angles_more_delta_kinds():
    k = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    out = relocate_keys(k, torch.tensor(2), SPEC, positions=torch.tensor([5, 6]))
    assert torch.allclose(out[1], torch.tensor([0.0, math.cos(1.0), 0.0, math.sin(1.0)]), atol=1e-6)
    with pytest.raises(KVShapeError, match=r"positions of shape \(3, 2\) do not fit a 1-axis RoPE spec"):
        relocate_keys(k, 2, SPEC, positions=torch.zeros(3, 2, dtype=torch.long))


def test_keys_of_any_rank_and_exact_messages():
    one = torch.tensor([1.0, 0.0, 0.0, 0.0])                        # a single key, no token axis
    two = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    a, b = relocate_keys_many([one, two], 2, SPEC)
    assert torch.allclose(a, torch.tensor([math.cos(2.0), 0.0, math.sin(2.0), 0.0]), atol=1e-6)
    assert torch.allclose(b[0], a, atol=0)
    for fn in (lambda k: relocate_keys(k, 1, SPEC), lambda k: relocate_keys_many([k], 1, SPEC)):
        with pytest.raises(KVShapeError, match=r"^keys have 6 trailing dims, the RoPE spec rotates 4$"):
            fn(torch.zeros(2, 5, 6))
        with pytest.raises(KVShapeError, match="^keys must be a floating-point tensor$"):
            fn(torch.zeros(2, 5, 4, dtype=torch.long))
    k = torch.zeros(5, 4)
    with pytest.raises(KVShapeError, match="^per-axis deltas given for a 1-D RoPE spec$"):
        relocate_keys(k, torch.ones(5, 3, dtype=torch.long), SPEC)
    with pytest.raises(KVShapeError, match="^per-axis deltas differ but the RoPE spec is 1-D$"):
        relocate_keys(k, (1, 2, 3), SPEC)


def test_from_config_model_type_lookup():
    # a VLM wrapper: the text config's own model_type decides (DeepSeek-V2 pairs are interleaved)
    inner = _cfg(model_type="deepseek_v2")
    assert RopeSpec.from_config(SimpleNamespace(model_type="wrapper", text_config=inner)).pairing == "interleaved"
    # a text config without model_type: the outer one's
    bare = SimpleNamespace(rope_theta=10000.0, head_dim=4, rope_scaling=None)
    assert RopeSpec.from_config(SimpleNamespace(model_type="deepseek_v2", text_config=bare)).pairing == "interleaved"
    # no model_type anywhere: named as '' in the refusal
    odd = SimpleNamespace(rope_theta=10000.0, head_dim=4, rope_scaling={"rope_type": "weird"})
    with pytest.raises(UnsupportedModelError, match=r"^unsupported rope_type='weird' \(model_type=''\)$"):
        RopeSpec.from_config(odd)


def test_from_config_rope_type_keys_and_defaults():
    with pytest.raises(UnsupportedModelError, match="rope_type='dynamic'"):      # the old "type" key
        RopeSpec.from_config(_cfg(rope_scaling={"type": "dynamic"}))
    assert RopeSpec.from_config(_cfg(rope_scaling={"rope_type": None})).rope_type == "default"
    lin = RopeSpec.from_config(_cfg(rope_scaling={"rope_type": "linear", "factor": 2.0}), inv_freq=torch.ones(2))
    assert lin.rope_type == "linear"
    with pytest.raises(UnsupportedModelError, match=r"cannot be re-rotated exactly; windowkit supports default, "
                                                    r"linear, llama3, yarn$"):
        RopeSpec.from_config(_cfg(rope_scaling={"rope_type": "dynamic"}))
    with pytest.raises(UnsupportedModelError, match=r"^partial_rotary_factor < 1 is not supported yet \(rotary dims "
                                                    r"must be last\)$"):
        RopeSpec.from_config(_cfg(rope_scaling={"partial_rotary_factor": 0.5}))
    # a factor given as None reads as 1: the whole head rotates
    assert RopeSpec.from_config(_cfg(rope_scaling={"partial_rotary_factor": None})).n_freq == 2
    # no rope_theta and no rope_scaling attribute at all (transformers 4.x): theta 10000
    plain = SimpleNamespace(model_type="llama", head_dim=4)
    assert RopeSpec.from_config(plain).inv_freq.tolist() == [1.0, pytest.approx(0.01)]
    # transformers 5 rope_parameters without a theta: 10000
    s = RopeSpec.from_config(SimpleNamespace(model_type="llama", head_dim=4, rope_parameters={"rope_type": "default"}))
    assert s.inv_freq.tolist() == [1.0, pytest.approx(0.01)]
    # no head_dim attribute: hidden_size // num_attention_heads
    s = RopeSpec.from_config(SimpleNamespace(model_type="llama", rope_theta=16.0, hidden_size=16, num_attention_heads=4))
    assert s.inv_freq.tolist() == [1.0, 0.25]


# ----------------------------------------------------------------------------------------------- isvd

import inspect  # noqa: E402

from windowkit.kv.isvd import (IncrementalSVD, _stream, break_even_rows, excess_error, measure,  # noqa: E402
                               persistent_bytes)


def test_isvd_argument_checks_exactly():
    cases = [
        (lambda: IncrementalSVD(0), r"^rank must be an int >= 1, got 0$"),
        (lambda: IncrementalSVD(2, tol=-1), r"^tol must be a finite float >= 0, got -1.0$"),
        (lambda: IncrementalSVD(2, tol=float("inf")), r"^tol must be a finite float >= 0, got inf$"),
        (lambda: IncrementalSVD(2, store_dtype=torch.int32), r"^store_dtype must be a floating dtype, got torch.int32$"),
        (lambda: IncrementalSVD(2).update([[1.0]]), r"^block must be a torch.Tensor, got list$"),
        (lambda: IncrementalSVD(2).update(torch.zeros(3)), r"^block must be 2-D \[rows, d\], got shape \(3,\)$"),
        (lambda: IncrementalSVD(2).update(torch.zeros(2, 2, dtype=torch.complex64)),
         r"^block must be real, got dtype torch.complex64$"),
        (lambda: IncrementalSVD(2).update(torch.zeros(2, 0)), r"^block has width 0$"),
        (lambda: IncrementalSVD(2).update(torch.tensor([[1.0, float("nan")]])), r"^block contains NaN or inf$"),
        (lambda: IncrementalSVD(2).project(torch.zeros(3)), r"^rows must be 2-D \[rows, d\], got shape \(3,\)$"),
    ]
    for fn, msg in cases:
        with pytest.raises(KVShapeError, match=msg):
            fn()
    s = IncrementalSVD(2)
    s.update(torch.ones(2, 3))
    with pytest.raises(KVShapeError, match=r"^block has width 4, expected d=3$"):
        s.update(torch.ones(2, 4))


def test_isvd_constructor_values():
    s = IncrementalSVD(2, tol=0.5, device="cpu")
    assert s.tol == 0.5 and s.device == torch.device("cpu")
    assert IncrementalSVD(2, tol=0.0).tol == 0.0 and IncrementalSVD(2).tol == 1e-6
    fresh = IncrementalSVD(3)
    assert (fresh.k, fresh.n_rows, fresh.d, fresh.device) == (0, 0, None, None)
    assert fresh.S.shape == (0,) and fresh.U.shape == (0, 0) and fresh.nbytes == 0
    one = IncrementalSVD(2, store_dtype=torch.float32)      # width 1 is a width
    one.update(torch.tensor([[2.0], [0.0]]))
    assert one.k == 1 and one.S.tolist() == [2.0]


def test_isvd_thresholds_by_hand():
    # tol is a strict threshold: diag(1, 0.5) with tol 0.5 keeps only the 1
    s = IncrementalSVD(4, tol=0.5, store_dtype=torch.float32)
    s.update(torch.diag(torch.tensor([1.0, 0.5])))
    assert s.k == 1
    # the scale-aware floor eps * max(b, d) * ||F||_F: a 1e-2 direction under a 1e4 one is rounding noise
    # (floor = 1.19e-7 * 64 * 1e4 = 0.076), whatever tol says
    g = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(64, 2, generator=g))
    v, _ = torch.linalg.qr(torch.randn(64, 2, generator=g))
    f = 1e4 * torch.outer(u[:, 0], v[:, 0]) + 1e-2 * torch.outer(u[:, 1], v[:, 1])
    s = IncrementalSVD(4, store_dtype=torch.float32)
    s.update(f)
    assert s.k == 1
    s = IncrementalSVD(4, store_dtype=torch.float32)    # alone, the 1e-2 direction is kept
    s.update(1e-2 * torch.outer(u[:, 1], v[:, 1]))
    assert s.k == 1 and s.S[0].item() == pytest.approx(1e-2, rel=1e-5)


def _factors(n=5, k=2, d=4):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, k, generator=g), torch.rand(k, generator=g) + 1, torch.randn(d, k, generator=g)


def test_from_factors_checks_exactly():
    U, S, B = _factors()
    cases = [
        ((U[:, 0], S, B), r"^U must be a 2-D tensor$"), (([[1.0]], S, B), r"^U must be a 2-D tensor$"),
        ((U, S[None], B), r"^S must be a 1-D tensor$"), ((U, S, B[:, 0]), r"^B must be a 2-D tensor$"),
        ((U * float("nan"), S, B), r"^U must be a finite floating tensor$"),
        ((U, S.long(), B), r"^S must be a finite floating tensor$"),
        ((U, S, B * float("inf")), r"^B must be a finite floating tensor$"),
        ((U, S, torch.randn(4, 3)), r"^inconsistent factors: U \(5, 2\), S \(2,\), B \(4, 3\)$"),
        ((torch.randn(5, 3), S, B), r"^inconsistent factors: U \(5, 3\), S \(2,\), B \(4, 2\)$"),
        ((U, S, torch.randn(0, 2)), r"^inconsistent factors: U \(5, 2\), S \(2,\), B \(0, 2\)$"),
    ]
    for args, msg in cases:
        with pytest.raises(KVShapeError, match=msg):
            IncrementalSVD.from_factors(*args)
    with pytest.raises(KVShapeError, match=r"^rank 1 < number of stored triplets 2$"):
        IncrementalSVD.from_factors(U, S, B, rank=1)


def test_from_factors_values():
    U, S, B = _factors()
    s = IncrementalSVD.from_factors(U, S, B, tol=0.25)
    assert (s.rank, s.k, s.d, s.n_rows, s.tol, s.store_dtype, s.device) == (
        2, 2, 4, 5, 0.25, torch.float32, torch.device("cpu"))
    assert torch.allclose(s.reconstruct(), (U * S) @ B.T, atol=1e-6)
    assert IncrementalSVD.from_factors(U[:, :1], S[:1], B[:, :1]).rank == 1
    empty = IncrementalSVD.from_factors(torch.zeros(5, 0), torch.zeros(0), torch.zeros(4, 0))
    assert (empty.rank, empty.k, empty.d) == (1, 0, 4)
    thin = IncrementalSVD.from_factors(torch.ones(3, 1), torch.ones(1), torch.ones(1, 1))   # d = 1
    assert thin.d == 1 and thin.reconstruct().tolist() == [[1.0], [1.0], [1.0]]


def test_byte_formulas_by_hand():
    # eq. (12): 2 bytes * k (n + d + 1) + 2 bytes * d * exact rows
    assert persistent_bytes(10, 4, 2, exact_rows=3) == 2 * 2 * 15 + 2 * 4 * 3
    assert persistent_bytes(10, 4, 2, 3, factor_bytes=4, exact_bytes=1) == 4 * 2 * 15 + 4 * 3
    for name, args in (("n", (-1, 4, 2)), ("d", (1, -4, 2)), ("k", (1, 4, -2)), ("exact_rows", (1, 4, 2, -3))):
        v = [a for a in args if a < 0][0]
        with pytest.raises(KVShapeError, match=rf"^{name} must be >= 0, got {v}$"):
            persistent_bytes(*args)
    # eq. (13): the first n with n (d - r) > r (d + 1)
    assert break_even_rows(1024, 128) == 147 and break_even_rows(2, 1) == 4     # 4 * 1 > 1 * 3, 3 * 1 = 3
    with pytest.raises(KVShapeError, match=r"^rank 1 >= width 1: factors never use fewer bytes than dense rows$"):
        break_even_rows(1, 1)
    with pytest.raises(KVShapeError, match=r"^need d >= 1 and r >= 1, got d=0, r=1$"):
        break_even_rows(0, 1)
    with pytest.raises(KVShapeError, match=r"^approx \(2, 3\) vs reference \(3, 3\)$"):
        excess_error(torch.zeros(2, 3), torch.eye(3), 1)


def test_stream_by_hand():
    x = _stream(130, 16, 3, 0.0, 0.0, 0)
    assert x.shape == (128, 16)                            # whole blocks of 64 rows
    sv = torch.linalg.svdvals(x.double())
    assert sv[3] < 1e-5 * sv[0]                            # noise-free, no drift: rank 3 exactly
    assert sv[2] > 0.05 * sv[0]                            # ... and all three directions are there
    big = torch.linalg.svdvals(_stream(4096, 16, 3, 0.0, 0.0, 0).double())
    assert 0.08 < float(big[2] / big[0]) < 0.125           # spectrum 1 -> 0.1, log-spaced
    assert 55.0 < float(big[0]) < 75.0                     # the top scale is 1: sigma_0 ~ sqrt(4096) = 64
    noisy = torch.linalg.svdvals(_stream(4096, 16, 3, 0.05, 0.0, 0).double())
    tail_rms = float(noisy[3:].pow(2).mean().sqrt())
    assert tail_rms == pytest.approx(0.05 * math.sqrt(4096), rel=0.15)   # noise 0.05 per entry
    # drift 0.02 turns the subspace a little per 64 rows: each block's directions keep > 90% of their energy
    # in the previous block's row space
    slow = _stream(4096, 16, 3, 0.0, 0.02, 0).double()
    tops = [torch.linalg.svd(slow[i:i + 64], full_matrices=False)[2][:3] for i in range(0, 4096, 64)]
    assert min(float((b @ a.T).pow(2).sum() / 3) for a, b in zip(tops, tops[1:])) > 0.9
    drift = _stream(4096, 16, 3, 0.0, 0.5, 0)
    assert torch.linalg.svdvals(drift.double())[3] > 1e-2 * big[0]     # the subspace turned
    static = _stream(4096, 16, 3, 0.0, 0.0, 0)
    assert torch.equal(drift[:64], static[:64]) and not torch.equal(drift[64:128], static[64:128])
    assert torch.equal(_stream(128, 16, 3, 0.1, 0.1, 7), _stream(128, 16, 3, 0.1, 0.1, 7))
    assert not torch.equal(_stream(128, 16, 3, 0.1, 0.1, 7), _stream(128, 16, 3, 0.1, 0.1, 8))


def test_measure_table():
    rows = measure(n=128, d=16, rank=8, true_rank=4, block=32)
    assert [(r["stream"], r["store"]) for r in rows] == [("static", "float32"), ("static", "bfloat16"),
                                                         ("drifting", "float32"), ("drifting", "bfloat16")]
    assert all(set(r) == {"stream", "store", "rel_err_inc", "excess", "bytes", "dense_bytes"} for r in rows)
    # rank 8 of 16 noisy dims: k = 8; bytes = element size * 8 * (128 + 16 + 1), dense = element size * 128 * 16
    assert [r["bytes"] for r in rows] == [4 * 8 * 145, 2 * 8 * 145] * 2
    assert [r["dense_bytes"] for r in rows] == [4 * 128 * 16, 2 * 128 * 16] * 2
    for r, drift in zip(rows, (0.0, 0.0, 0.02, 0.02)):
        x = _stream(128, 16, 4, 0.05, drift, 0).double()       # the documented stream: noise 0.05, seed 0
        sv = torch.linalg.svdvals(x)
        fresh = float(sv[8:].pow(2).sum().sqrt() / sv.pow(2).sum().sqrt())
        assert r["rel_err_inc"] - r["excess"] == pytest.approx(fresh, abs=1e-6)
        assert 0.0 <= r["excess"] < 0.02
    # one block: the incremental SVD is the truncated SVD itself (Eckart-Young), no excess in fp32
    one = measure(n=128, d=16, rank=8, true_rank=4, block=128)
    assert abs(one[0]["excess"]) < 1e-5 and abs(one[2]["excess"]) < 1e-5
    # the table's defaults are docs/isvd.md's: n = 4096, d = 512, rank 64, true rank 48, blocks of 64
    defaults = {k: p.default for k, p in inspect.signature(measure).parameters.items()}
    assert defaults == {"n": 4096, "d": 512, "rank": 64, "true_rank": 48, "block": 64}


# ----------------------------------------------------------------------------------------------- basis

import re  # noqa: E402

from windowkit.kv.basis import SharedPatchBasis, deficit_hat  # noqa: E402

L1 = KVLayout("gqa", 1, ((1, 4), (1, 3)), 0)


def _dir(seed, layout=L1, s=5):
    """A rank-1 deficit (one direction per layer-slot)."""
    return _rank1(layout, s=s, seed=seed)


def test_basis_arguments_exactly():
    with pytest.raises(KVShapeError, match=r"^basis rank must be >= 1, got 0$"):
        SharedPatchBasis(L1, 0)
    with pytest.raises(KVShapeError, match=r"^rows_per_update must be >= 1 or None, got 0$"):
        SharedPatchBasis(L1, 2, rows_per_update=0)
    b = SharedPatchBasis(L1, 1, rows_per_update=1, tol=0.5, device="cpu")
    assert (b.rank, b.rows_per_update, b.tol, b.device) == (1, 1, 0.5, torch.device("cpu"))
    assert SharedPatchBasis(L1, 1).device == torch.device("cpu")
    assert list(SharedPatchBasis(L2, 2, layers="deep")) == [(1, 0), (1, 1)]
    fresh = SharedPatchBasis(L1, 2)
    assert (fresh.rows_seen, fresh.pending_rows, fresh.version, fresh.state_bytes(), fresh.history_bytes()) == (
        0, 0, 0, 0, 0)
    assert fresh.flush() is False and fresh.version == 0
    with pytest.raises(KVShapeError, match=r"^observe: layout mla: 1 layers, .* != basis layout gqa: 1 layers, "):
        fresh.observe(_rank1(ML))


def test_basis_batching_and_bytes_by_hand():
    b = SharedPatchBasis(L1, 2, rows_per_update=10, auto_rotate=False)
    assert b.observe(_dir(1)) is False and b.pending_rows == 5      # 5 of 10 rows pending
    assert b.observe(_dir(2)) is True and b.pending_rows == 0 and b.rows_seen == 10 and b.version == 1
    assert (b.k(0, 0), b.k(0, 1)) == (2, 2)
    c = SharedPatchBasis(L1, 2, rows_per_update=5, auto_rotate=False)
    assert c.observe(_dir(1)) is True and c.version == 1                  # exactly 5: folded
    assert (c.k(0, 0), c.k(0, 1)) == (1, 1)
    # master basis: fp32 [F, k] per slot: (4 + 3) * 1 * 4 bytes
    assert c.state_bytes() == 28
    p = c.encode(_dir(1))
    c.observe(_dir(2))
    # step 1: [k_old 0, k_new 1] (no bytes); step 2: [1, 2] fp32 per slot = 2 * 2 * 4 bytes
    assert c.history_bytes() == 16 and c.version == 2
    assert repr(c) == f"SharedPatchBasis({c.uid}, rank=2, version=2, k=[2], rows_seen=10, live_patches=1)"
    # p (not rotated: auto_rotate off) is on version 1: only step 1 can go
    assert c.prune_history() == 0 and c.history_bytes() == 16
    assert c.prune_history(1) == 0
    del p
    assert c.prune_history() == 16 and c.history_bytes() == 0          # no live patch: up to the current version


def test_basis_register_unregister_and_ownership():
    b = SharedPatchBasis(L1, 2)
    b.observe(_dir(1))
    p = b.encode(_dir(1))
    assert re.fullmatch(r"\d+", p.meta["basis_patch"]) and b.live_patches() == [p]
    b.unregister(p)
    assert "basis_patch" not in p.meta and b.live_patches() == []
    b.unregister(p)                                                     # twice: nothing to do
    q = b.encode(_dir(1))
    copy = q.to(dtype=torch.float16)                                    # a copy carries the registration id
    b.unregister(q)
    b.unregister(copy)                                                  # already gone: nothing to do
    assert b.live_patches() == []
    other = SharedPatchBasis(L1, 2)
    with pytest.raises(KVShapeError, match=rf"^patch is not backed by {re.escape(other.uid)} "
                                           rf"\(meta basis='{re.escape(b.uid)}'\)$"):
        other.is_current(p)
    no_version = Patch(p.factors, L1, 5, 1, 1, meta={"basis": b.uid})
    with pytest.raises(KVShapeError, match=r"^patch basis version -1 outside 0..1$"):
        b.is_current(no_version)
    future = Patch(p.factors, L1, 5, 1, 1, meta={"basis": b.uid, "basis_version": "5"})
    with pytest.raises(KVShapeError, match=r"^patch basis version 5 outside 0..1$"):
        b.is_current(future)
    empty = SharedPatchBasis(L1, 2)
    v0 = Patch({}, L1, 5, 1, 1, meta={"basis": empty.uid, "basis_version": "0"})
    assert empty.is_current(v0) is True


def test_basis_strip_attach_detach():
    b = SharedPatchBasis(L1, 2)
    d1 = _dir(1)
    b.observe(d1)
    p = b.encode(d1, meta={"src": "x"})
    s = b.strip(p)
    assert s.factors[(0, 0)][1].shape == (1, 0) and s.factors[(0, 1)][1].shape == (1, 0)
    assert s.meta == {"src": "x", "kind": "basis", "basis": b.uid, "basis_version": "1", "basis_stripped": "1"}
    b.observe(_dir(2))                                                   # the basis moves to version 2
    n_live = len(b.live_patches())
    a = b.attach(s)
    assert len(b.live_patches()) == n_live                               # not registered by default
    assert a.meta == {"src": "x", "kind": "basis", "basis": b.uid, "basis_version": "2"}
    assert (a.layout, a.num_tokens, a.rank, a.rope_rank) == (L1, 5, p.rank, p.rope_rank) and a.energy == p.energy
    # rotated onto the new basis, it still rebuilds d1 (the basis spans it)
    assert torch.allclose(deficit_hat(a, 0, 0), _as_matrix(d1.layers[0][0]), atol=1e-4)
    r = b.attach(s, register=True)
    assert any(x is r for x in b.live_patches()) and "basis_patch" in r.meta
    again = b.attach(p)                                                 # attaching a live (registered) patch
    assert "basis_patch" not in again.meta
    det = b.detach(p)
    assert det.meta == {"src": "x", "kind": "basis-detached"} and det.energy == p.energy
    assert (det.layout, det.num_tokens, det.rank, det.rope_rank) == (L1, 5, p.rank, p.rope_rank)
    assert torch.allclose(deficit_hat(det, 0, 1), _as_matrix(d1.layers[0][1]), atol=1e-4)
    vt = det.factors[(0, 0)][1].clone()
    b.observe(_dir(3))                                                   # a detached patch no longer moves
    assert torch.equal(det.factors[(0, 0)][1], vt)
    assert det.factors[(0, 0)][1].data_ptr() != b.basis(0, 0).data_ptr()


def test_measure_defaults_reach_the_stream_and_the_isvd(monkeypatch):
    # docs/isvd.md's table: n = 4096, d = 512, true rank 48, noise 0.05, drift 0 / 0.02, seed 0, rank 64, blocks
    # of 64; the stream and the SVD are replaced by recorders so the defaults can be read without the 4096 x 512 run
    import windowkit.kv.isvd as mod

    streams, ranks, blocks = [], [], []

    def fake_stream(n, d, true_rank, noise, drift, seed):
        streams.append((n, d, true_rank, noise, drift, seed))
        return torch.ones(128, 8)

    class FakeSVD:
        def __init__(self, rank, *, store_dtype):
            ranks.append((rank, store_dtype))
            self.U, self.nbytes, self.rows = torch.zeros(1, 1, dtype=store_dtype), 0, []

        def update(self, blk):
            blocks.append(blk.shape[0])
            self.rows.append(blk)

        def reconstruct(self):
            return torch.cat(self.rows)

    monkeypatch.setattr(mod, "_stream", fake_stream)
    monkeypatch.setattr(mod, "IncrementalSVD", FakeSVD)
    rows = measure()
    assert streams == [(4096, 512, 48, 0.05, 0.0, 0), (4096, 512, 48, 0.05, 0.02, 0)]
    assert ranks == [(64, torch.float32), (64, torch.bfloat16)] * 2
    assert blocks == [64, 64] * 4
    assert [r["dense_bytes"] for r in rows] == [4096 * 512 * 4, 4096 * 512 * 2] * 2
