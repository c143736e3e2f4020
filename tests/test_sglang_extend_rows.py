"""The plugin's row-only extend attention (windowkit/backends/sglang/extend_rows.py) against SGLang's own
``TorchNativeAttnBackend._run_sdpa_forward_extend``: the same rows, on batches that mix plain prefills and
extends over cached prefixes, GQA and MHA. The live engine tests (test_sglang_live.py) run with it installed."""
from __future__ import annotations

import pytest
import torch

from windowkit.backends.sglang import extend_rows
from windowkit.backends.sglang.cpu_engine import cpu_env, gpu_env

import sglang.srt.layers.attention.torch_native_backend as native  # noqa: E402  (sglang: a test dependency)
ORIGINAL = native.TorchNativeAttnBackend._run_sdpa_forward_extend


class _Self:  # the original reads self only for sliding-window masks
    _make_sliding_window_mask = native.TorchNativeAttnBackend._make_sliding_window_mask


def _batch(seed: int, heads: int, kv_heads: int, prefixes: list[int], news: list[int], dim: int = 16):
    g = torch.Generator().manual_seed(seed)
    pool = sum(p + n for p, n in zip(prefixes, news)) + 8
    k_cache = torch.randn(pool, kv_heads, dim, generator=g)
    v_cache = torch.randn(pool, kv_heads, dim, generator=g)
    req_to_token = torch.zeros(len(prefixes) + 2, 64 + max(p + n for p, n in zip(prefixes, news)), dtype=torch.long)
    slots = torch.randperm(pool, generator=g)  # pool slots scattered, as in a live pool
    at = 0
    for r, (p, n) in enumerate(zip(prefixes, news)):
        req_to_token[r + 1, : p + n] = slots[at: at + p + n]
        at += p + n
    query = torch.randn(sum(news), heads, dim, generator=g)
    args = (k_cache, v_cache, req_to_token, torch.arange(1, len(prefixes) + 1),
            torch.tensor([p + n for p, n in zip(prefixes, news)]), torch.tensor(prefixes), torch.tensor(news))
    return query, args


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4)])
def test_the_rows_equal_sglangs_padded_square(heads, kv_heads):
    # a plain prefill, extends over cached prefixes (new rows only), a decode-like row, a short prefix (the square)
    prefixes, news = [0, 37, 96, 5], [11, 30, 1, 64]
    query, args = _batch(0, heads, kv_heads, prefixes, news)
    kw = dict(scaling=0.25, enable_gqa=heads != kv_heads, causal=True)
    want = ORIGINAL(_Self(), query, torch.zeros_like(query), *args, **kw)
    before = dict(extend_rows.COUNTS)
    got = extend_rows.extend_rows_attention(ORIGINAL, _Self(), query, torch.zeros_like(query), *args, **kw)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    assert extend_rows.COUNTS["calls"] == before["calls"] + 1
    assert extend_rows.COUNTS["rows_skipped"] == before["rows_skipped"] + 37 + 96  # the padding not computed


def test_a_changed_prefix_key_changes_only_rows_that_read_it():
    # the mask is the point: a key at position j is read by new rows at positions >= j and by no earlier row
    query, args = _batch(1, 4, 2, [20], [10])
    kw = dict(scaling=0.25, enable_gqa=True, causal=True)
    a = extend_rows.extend_rows_attention(ORIGINAL, _Self(), query, torch.zeros_like(query), *args, **kw)
    k_cache, req_to_token = args[0], args[2]
    k_cache[req_to_token[1, 25]] += 3.0  # the key of position 25 = new row 5
    b = extend_rows.extend_rows_attention(ORIGINAL, _Self(), query, torch.zeros_like(query), *args, **kw)
    changed = (a - b).abs().amax(dim=(1, 2)) > 1e-6
    assert changed.tolist() == [False] * 5 + [True] * 5


def test_other_calls_go_to_sglangs_method():
    query, args = _batch(2, 4, 4, [8], [8])
    seen = []

    def original(*a, **kw):
        seen.append(kw)
        return "sglang's"
    out = torch.zeros_like(query)
    for kw in (dict(causal=False), dict(causal=True, sliding_window_size=4), dict(causal=True, is_cross_attn=True),
               dict(causal=True, encoder_lens=torch.tensor([3]))):
        assert extend_rows.extend_rows_attention(original, _Self(), query, out, *args, **kw) == "sglang's"
    assert len(seen) == 4


def test_the_engine_environment_turns_it_on_unless_told_not_to():
    assert cpu_env({})[extend_rows.ENV] == "1" and gpu_env({})[extend_rows.ENV] == "1"
    assert cpu_env({extend_rows.ENV: "0"})[extend_rows.ENV] == "0"
    assert extend_rows.enabled({extend_rows.ENV: "1"}) and not extend_rows.enabled({})
