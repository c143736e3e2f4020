"""windowkit's attention function for transformers forwards: SDPA, plus two things SDPA alone does not give.

1. **Row probes.** transformers returns attention weights only from its eager attention, which builds every
   row's [heads, queries, keys] matrix and runs slower than SDPA on CPU. The query-aware repair
   (``Window.focus``) needs only the last one or two rows (the question's last token, one greedy token): their
   softmax is recomputed from the same query (after RoPE), keys and mask SDPA receives, summed over heads.
2. **Blocks for a selective recompute.** ``HFBackend.recompute`` runs chosen tokens over ``[past | the chosen
   tokens' fresh KV]`` under a 4-D mask, and SDPA computes the whole rectangle. A chosen token early in the window
   (the head survivor right behind an eviction) reads only the few past keys in front of it and the fresh keys of
   the chosen tokens before it. So the rows are run in blocks, each over the past keys up to the last one its rows
   may read and the fresh keys up to its last row: the same masked softmax over fewer masked-out keys.

    with attention(model, rows=1, blocks=(cut, [(r0, r1, past_keys), ...])) as rows:
        model(inputs_embeds=..., position_ids=..., past_key_values=cache, attention_mask=mask_4d)

The settings of the block are module state: forwards inside it run one at a time (as HFBackend runs them).

Exactness: tests/test_focus.py compares the rows with transformers' eager ``output_attentions``;
tests/test_repair.py and tests/test_focus.py compare recompute's KV and logits with transformers' own forwards.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "windowkit"
_rows: Optional[list[torch.Tensor]] = None  # the rows of the forward running now (None: no probe)
_want = 1
_blocks: Optional[tuple[int, list[tuple[int, int, int]]]] = None  # (cut, [(row0, row1, past keys)]) or None
BLOCK_ROWS = 64  # rows per block of a recompute forward (HFBackend.recompute makes the plan)


def _sdpa_in_blocks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, cut: int,
                    blocks: list[tuple[int, int, int]], scaling: Optional[float]) -> torch.Tensor:
    """SDPA of rows [r0, r1) over keys [0, lp) + [cut, cut + r1): every key those rows may read (the mask's
    columns for them, in the same order). query [B, H, q, D]; key, value [B, H_kv, cut + q, D] (grouped heads are
    not copied: SDPA's enable_gqa); mask [1, 1, q, cut + q]. Returns [B, q, H, D] as ``sdpa_attention_forward``."""
    gqa = query.shape[1] != key.shape[1]
    outs = []
    for r0, r1, lp in blocks:
        if lp >= cut:  # reads the whole past: one contiguous prefix of the keys
            k, v, m = key[:, :, :cut + r1], value[:, :, :cut + r1], mask[:, :, r0:r1, :cut + r1]
        else:
            k = torch.cat([key[:, :, :lp], key[:, :, cut:cut + r1]], 2)
            v = torch.cat([value[:, :, :lp], value[:, :, cut:cut + r1]], 2)
            m = torch.cat([mask[:, :, r0:r1, :lp], mask[:, :, r0:r1, cut:cut + r1]], 3)
        outs.append(F.scaled_dot_product_attention(query[:, :, r0:r1], k, v, attn_mask=m, scale=scaling,
                                                   enable_gqa=gqa))  # [B, H, r, D]
    return torch.cat(outs, 2).transpose(1, 2).contiguous()


def _attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None, **kw: Any):
    if _blocks is not None and attention_mask is not None and attention_mask.dim() == 4:
        out = (_sdpa_in_blocks(query, key, value, attention_mask, *_blocks, scaling), None)
    else:
        out = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kw)
    if _rows is not None:
        r = min(_want, query.shape[2])
        h, h_kv, d = query.shape[1], key.shape[1], query.shape[3]
        # grouped heads without repeat_kv's copy of every key: query head i reads kv head i // (h / h_kv)
        q = query[0, :, -r:].float().reshape(h_kv, (h // h_kv) * r, d)  # [H_kv, group * r, D]
        k = key[0].float()  # [H_kv, T, D]
        t = k.shape[1]
        s = (q @ k.transpose(-1, -2)).reshape(h, r, t)  # [H, r, T]
        s = s * (scaling if scaling is not None else d ** -0.5)
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
        AttentionInterface.register(NAME, _attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        _registered = True


@contextmanager
def attention(model: Any, rows: int = 0, blocks: Optional[tuple[int, list[tuple[int, int, int]]]] = None
              ) -> Iterator[list[torch.Tensor]]:
    """Within the block, ``model`` runs windowkit's attention: with ``rows`` > 0 every forward also appends, per
    layer, the attention weights of its last ``rows`` query rows over all keys, summed over heads ([rows, keys]
    float32); with ``blocks`` = ``(cut, [(row0, row1, past_keys), ...])`` a forward under a 4-D mask runs its rows
    in those blocks (``HFBackend.recompute``'s plan). The model's attention implementation is restored on exit."""
    global _rows, _want, _blocks
    _register()
    impl = model.config._attn_implementation
    got: list[torch.Tensor] = []
    model.set_attn_implementation(NAME)
    _rows, _want, _blocks = (got if rows else None), max(1, int(rows)), blocks
    try:
        yield got
    finally:
        _rows, _blocks = None, None
        model.set_attn_implementation(impl)


def capture_rows(model: Any, rows: int = 1):
    """``attention(model, rows=rows)``: the last ``rows`` rows' weights of every forward in the block."""
    return attention(model, rows=rows)


def block_plan(sel: torch.Tensor, unchosen: torch.Tensor, cut: int, block: Optional[int] = None
               ) -> Optional[tuple[int, list[tuple[int, int, int]]]]:
    """Blocks for a recompute forward: rows are the chosen tokens at window positions ``sel`` (increasing);
    ``unchosen`` the sorted positions (< ``cut``) of the past entries they may read (each row reads those before
    its own position). Per block of ``block`` rows: (row0, row1, past keys its rows may read). None where blocks
    would save nothing (every block reads the whole past, or one block)."""
    block = BLOCK_ROWS if block is None else int(block)
    q = int(sel.numel())
    if q <= block:
        return None
    # past keys row j may read: unchosen positions < sel[j]; the prefix up to the last of them
    n_before = torch.searchsorted(unchosen, sel)  # [q] how many unchosen positions lie before each row
    last = torch.where(n_before > 0, unchosen[(n_before - 1).clamp(min=0)] + 1, torch.zeros_like(sel))
    blocks: list[tuple[int, int, int]] = []
    for r0 in range(0, q, block):
        r1 = min(q, r0 + block)
        lp = min(int(last[r1 - 1]), cut)
        if blocks and blocks[-1][2] == lp:  # the same past keys as the block before (e.g. the whole past): merge
            blocks[-1] = (blocks[-1][0], r1, lp)
        else:
            blocks.append((r0, r1, lp))
    if len(blocks) == 1:
        return None
    return cut, blocks
