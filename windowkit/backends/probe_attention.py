"""Read a few query rows' attention weights out of a normal SDPA forward.

transformers returns attention weights only from its eager attention, which builds every row's
[heads, queries, keys] matrix in Python-level ops and runs slower than SDPA on CPU. The query-aware repair
(``Window.focus``) needs only the last one or two rows (the question's last token, one greedy token). So this
module registers one more attention implementation with transformers: SDPA for the output, plus the softmax of
those rows recomputed from the same query / key tensors and the same mask (a few rows: cheap), summed over heads.

    with capture_rows(model, rows=1) as rows:        # rows: one [rows, keys] tensor per layer after the call
        model(inputs_embeds=..., position_ids=..., past_key_values=cache, attention_mask=mask_4d)

Exactness: the same query (after RoPE), keys (the cache after the update), scaling and mask SDPA receives;
tests/test_focus.py compares the rows with transformers' eager ``output_attentions``.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "windowkit_probe"
_rows: Optional[list[torch.Tensor]] = None  # the rows of the forward running now (None: plain SDPA)
_want = 1


def _probe_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None, **kw: Any):
    out = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kw)
    if _rows is not None:
        r = min(_want, query.shape[2])
        q = query[0, :, -r:].float()  # [H, r, D]
        k = repeat_kv(key, query.shape[1] // key.shape[1])[0].float()  # [H, T, D]
        s = (q @ k.transpose(-1, -2)) * (scaling if scaling is not None else q.shape[-1] ** -0.5)  # [H, r, T]
        t = k.shape[1]
        if attention_mask is None:  # SDPA's causal path: query row i of Lq sits at key index t - Lq + i
            seen = torch.arange(t, device=s.device)[None] <= torch.arange(t - r, t, device=s.device)[:, None]
            s = s.masked_fill(~seen, float("-inf"))
        else:
            m = attention_mask[0, 0, -r:, :t]  # [r, T] (bool: True = attend; float: additive)
            s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.float()
        _rows.append(torch.softmax(s, -1).sum(0))  # [r, T], summed over heads
    return out


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        AttentionInterface.register(NAME, _probe_attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        _registered = True


@contextmanager
def capture_rows(model: Any, rows: int = 1) -> Iterator[list[torch.Tensor]]:
    """Within the block, every forward of ``model`` also appends, per layer, the attention weights of its last
    ``rows`` query rows over all keys, summed over heads ([rows, keys] float32). The model's attention
    implementation is restored on exit."""
    global _rows, _want
    _register()
    impl = model.config._attn_implementation
    got: list[torch.Tensor] = []
    model.set_attn_implementation(NAME)
    _rows, _want = got, max(1, int(rows))
    try:
        yield got
    finally:
        _rows = None
        model.set_attn_implementation(impl)
