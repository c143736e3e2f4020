"""How far a chunk's antecedent context has drifted from the one its patch was formed on (paper, App. D).

A stored patch is conditioned on one specific antecedent context. When the context in front of the chunk
drifts (reorder, a dropped or duplicated frame, a replaced predecessor, extra material), the patch still
transfers, gracefully and in step with how far the context moved, until it does not. The paper measures:

  drop / duplicate a frame      stays as good as a fresh patch
  reorder, replace one          still most of the gain
  replace all (a different clip) the stale patch turns harmful
  superset (extra distractors)  rebuild, do not reuse: the stale patch decays with every extra chunk

and finds the divergence signal a *soft* hint: the safe and unsafe medians separate, but as a hard
reuse-vs-rebuild gate it is too weak. So here it ranks refreshes (most diverged first) and only two
structural facts force a rebuild: a strict superset, and (by default) nothing in common.

    divergence(["a", "b", "c"], ["a", "b", "c"])   # 0.0   identical
    divergence(["a", "b", "c"], ["c", "b", "a"])   # 0.25  reorder
    divergence(["a", "b", "c"], ["a", "a", "c"])   # 0.33  drop b, duplicate a
    divergence(["a", "b", "c"], ["a", "x", "c"])   # 0.5   replace one
    divergence(["a", "b", "c"], ["x", "y", "z"])   # 1.0   disjoint
    reuse_decision(["a", "b"], ["a", "b", "x"])    # (0.33, True): superset -> rebuild

Pure Python on chunk ids; the optional ``embed`` hook is the only place tensors appear.
"""
from __future__ import annotations

import math
from operator import sub
from typing import Any, Callable, Optional, Sequence

import torch

from windowkit.errors import WindowkitError

Embed = Callable[[str], Any]  # chunk id -> tensor-like embedding ([d] or [tokens, d])


def _distinct(ids: Sequence[str]) -> list[str]:
    if isinstance(ids, str):  # a lone string would read as its characters
        raise WindowkitError(f"an antecedent context is a sequence of chunk ids, not the string {ids!r}")
    return list(dict.fromkeys(ids))


def _as_seq(ids: Sequence[str]) -> Sequence[str]:
    if isinstance(ids, str):  # a lone string would read as its characters
        raise WindowkitError(f"an antecedent context is a sequence of chunk ids, not the string {ids!r}")
    return ids if isinstance(ids, (list, tuple)) else list(ids)


def _same(a: Sequence[str], b: Sequence[str]) -> bool:
    return len(a) == len(b) and (a == b if type(a) is type(b) else list(a) == list(b))


def _footrule(first: Sequence[str], second: Sequence[str]) -> float:
    """Normalised Spearman footrule between two orders of the same n distinct items, in [0, 1].

    O(n) and C-level, within a factor of two of the Kendall tau distance (Diaconis-Graham)."""
    n = len(first)
    if n < 2:
        return 0.0
    rank = dict(zip(first, range(n)))
    moved = sum(map(abs, map(sub, map(rank.__getitem__, second), range(n))))
    return moved / (n * n // 2)


def _structural(formed_on: Sequence[str], current: Sequence[str], ordered: bool) -> tuple[float, bool]:
    """(score, current is a strict superset of formed_on) on chunk ids; O(n)."""
    fd, cd = dict.fromkeys(_as_seq(formed_on)), dict.fromkeys(_as_seq(current))
    nf, nc = len(fd), len(cd)
    if not nf and not nc:
        return 0.0, False
    common = fd.keys() & cd.keys()
    inter = len(common)
    superset = inter == nf and nc > nf
    if not inter:
        return 1.0, superset
    jac = 1.0 - inter / (nf + nc - inter)  # share of the antecedent set that changed (a duplicate adds nothing)
    order = 0.0
    if ordered and inter > 1:
        a = list(fd) if inter == nf else list(filter(common.__contains__, fd))
        b = list(cd) if inter == nc else list(filter(common.__contains__, cd))
        if a != b:
            order = _footrule(a, b)
    # A full reversal of the common part weighs at most half of one replaced antecedent, so for contexts of the
    # same length: identical (0) < any reorder (<= 1/(n+1)) < any single replacement (>= 2/(n+1)) < disjoint (1).
    return jac + (1.0 - jac) * order / (inter + 1), superset


def _mean_embedding(ids: list[str], embed: Embed):
    vecs = []
    for i in ids:
        e = torch.as_tensor(embed(i)).detach().float()
        vecs.append(e.reshape(-1, e.shape[-1]).mean(0) if e.dim() > 1 else e.reshape(-1))
    return torch.stack(vecs).mean(0)


def _cosine(formed_on: Sequence[str], current: Sequence[str], embed: Embed) -> float:
    f, c = _distinct(formed_on), _distinct(current)
    if not f and not c:
        return 0.0
    if not f or not c:
        return 1.0

    a, b = _mean_embedding(list(formed_on), embed), _mean_embedding(list(current), embed)
    if a.shape != b.shape:
        raise WindowkitError(f"embed returned vectors of different sizes: {tuple(a.shape)} vs {tuple(b.shape)}")
    cos = float(torch.nn.functional.cosine_similarity(a[None], b[None], eps=1e-12)[0])
    if math.isnan(cos):
        return 1.0
    return min(1.0, max(0.0, 1.0 - cos))


def divergence(formed_on: Sequence[str], current: Sequence[str], embed: Optional[Embed] = None, *,
               ordered: bool = True) -> float:
    """How far ``current`` (the antecedents a chunk has now) drifted from ``formed_on`` (the antecedents its
    patch was formed on), in [0, 1].

    Without ``embed`` it is structural, on chunk ids: the Jaccard distance of the two antecedent *sets* (a
    dropped, duplicated or replaced antecedent) plus a small order term (normalised Spearman footrule over the
    shared antecedents, weighted so that any reorder scores below any single replacement). 0 for the same
    ordered context, 1 when nothing is shared. ``ordered=False`` drops the order term (orbit patches serve
    every order of their set).

    With ``embed(chunk_id) -> tensor`` ([d] or [tokens, d]) it is the paper's signal: the cosine divergence
    ``1 - cos`` of the mean embeddings of the two contexts, clipped to [0, 1] (order-free; a whole different
    clip measured about 0.43 in the paper).
    """
    f, c = _as_seq(formed_on), _as_seq(current)
    if _same(f, c):
        return 0.0
    if embed is not None:
        return _cosine(f, c, embed)
    return _structural(f, c, ordered)[0]


def reuse_decision(formed_on: Sequence[str], current: Sequence[str], embed: Optional[Embed] = None, *,
                   ordered: bool = True, threshold: Optional[float] = 1.0) -> tuple[float, bool]:
    """``(score, rebuild)`` for reusing a patch formed on ``formed_on`` when the chunk now sits behind ``current``.

    ``rebuild`` is True when ``current`` is a strict superset of ``formed_on`` (App. D: with extra material
    in the context, rebuild rather than reuse; the stale patch decays with every distractor), or when
    ``score >= threshold``. The default threshold 1.0 rebuilds only when nothing is shared; the paper finds the
    score too weak for a tighter hard gate, so lower it only as a deliberate policy. ``threshold=None`` keeps
    just the superset rule.
    """
    f, c = _as_seq(formed_on), _as_seq(current)
    if _same(f, c):
        return 0.0, False
    if embed is None:
        score, superset = _structural(f, c, ordered)
    else:
        score = _cosine(f, c, embed)
        superset = set(c) > set(f)
    rebuild = superset or (threshold is not None and score >= threshold)
    return score, rebuild


__all__ = ["divergence", "reuse_decision", "Embed"]
