"""Extend attention over only the rows being prefilled, for SGLang's ``torch_native`` (CPU) backend.

SGLang 0.5.23's ``TorchNativeAttnBackend._run_sdpa_forward_extend`` pads each request's query to the whole
sequence (``per_req_query_redudant``: ``seq_len_kv`` rows, the prefix rows left uninitialised) and runs causal
SDPA over that square, then keeps the last ``extend_seq_len`` rows. A request whose first 2,080 tokens come
from the radix cache or from a windowkit plan and whose last 30 are new pays the attention of a full
2,110-token prefill in every layer (the MLPs and projections do run on the 30 new tokens only). The GPU and
AMX backends compute only the new rows.

``extend_rows_attention`` computes, for a request with fewer new tokens than half its sequence, the new rows and
nothing else: row ``i`` of the new tokens (absolute position ``prefix + i``) attends to keys ``0 .. prefix + i``,
a causal mask aligned to the bottom right. A request that is mostly new (a plain prefill, a short radix hit)
keeps SGLang's padded square, whose causal fast path costs less there than a masked rectangle. Cross-attention, encoder
offsets, sliding windows and non-causal calls go to SGLang's original, unchanged.

windowkit's SGLang plugin installs it as an AROUND hook on that method when the engine processes run with
``WINDOWKIT_SGLANG_EXTEND_ROWS=1`` (``cpu_engine.cpu_env`` sets it unless the variable is already set; ``=0``
leaves SGLang's method as it is). It changes no result beyond float rounding (tests/test_sglang_extend_rows.py
compares it with SGLang's method); it serves every request of the engine alike, with or without a plan.

    out = extend_rows_attention(original, backend, query, output, k_cache, v_cache, req_to_token,
                                req_pool_indices, seq_lens, extend_prefix_lens, extend_seq_lens,
                                scaling=0.125, enable_gqa=True, causal=True)
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch
from torch.nn.functional import scaled_dot_product_attention

ENV = "WINDOWKIT_SGLANG_EXTEND_ROWS"
TARGET = ("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend."
          "_run_sdpa_forward_extend")

# per process: extend calls served here, and the query rows SGLang's padding would have computed in addition
COUNTS = {"calls": 0, "rows_skipped": 0}


def enabled(env: Any = None) -> bool:
    """Whether the engine processes' environment (``os.environ`` by default) asks for the row-only attention."""
    return (os.environ if env is None else env).get(ENV, "") == "1"


def extend_rows_attention(original: Callable, backend: Any, query: torch.Tensor, output: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                          req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, extend_prefix_lens: torch.Tensor,
                          extend_seq_lens: torch.Tensor, encoder_lens: Any = None, scaling: Any = None,
                          enable_gqa: bool = False, causal: bool = False, is_cross_attn: bool = False,
                          sliding_window_size: Any = None) -> torch.Tensor:
    """SGLang's ``_run_sdpa_forward_extend`` (same arguments, ``original`` first), computing only the new rows.

    query / output: [num_new_tokens, H, D]; k_cache / v_cache: [pool tokens, H_kv, D]."""
    if (encoder_lens is not None or is_cross_attn or not causal
            or (sliding_window_size is not None and sliding_window_size > -1)):
        return original(backend, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                        extend_prefix_lens, extend_seq_lens, encoder_lens=encoder_lens, scaling=scaling,
                        enable_gqa=enable_gqa, causal=causal, is_cross_attn=is_cross_attn,
                        sliding_window_size=sliding_window_size)
    q_all = query.movedim(0, query.dim() - 2)  # [H, num_new_tokens, D]
    start_q = 0
    skipped = 0
    for s in range(seq_lens.shape[0]):
        n, p, L = int(extend_seq_lens[s]), int(extend_prefix_lens[s]), int(seq_lens[s])
        q = q_all[:, start_q:start_q + n]  # [H, n, D]
        tokens = req_to_token[req_pool_indices[s], :L]
        k = k_cache[tokens].movedim(0, 1)  # [H_kv, L, D]
        v = v_cache[tokens].movedim(0, 1)
        if not (q.dtype == k.dtype == v.dtype):
            k, v = k.to(q.dtype), v.to(q.dtype)
        if 2 * n < L:  # few new rows (a restored window, a long cached prefix): those rows only, over all keys;
            # new row i sits at position p + i and sees keys 0 .. p + i
            mask = torch.arange(L, device=q.device)[None, :] <= (p + torch.arange(n, device=q.device))[:, None]
            o = scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                             scale=scaling, enable_gqa=enable_gqa)[0]  # [H, n, D]
            skipped += p
        else:  # mostly new rows: SGLang's way (its causal fast path over the square skips the masked half, which
            # costs less than a masked rectangle), the prefix rows zero instead of uninitialised
            if p:
                q = torch.cat([q.new_zeros(q.shape[0], p, q.shape[2]), q], 1)  # [H, L, D]
            o = scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), is_causal=True,
                                             scale=scaling, enable_gqa=enable_gqa)[0, :, p:]  # [H, n, D]
        output[start_q:start_q + n] = o.movedim(query.dim() - 2, 0)  # [n, H, D]
        start_q += n
    COUNTS["calls"] += 1
    COUNTS["rows_skipped"] += skipped
    return output


__all__ = ["extend_rows_attention", "enabled", "ENV", "TARGET", "COUNTS"]
