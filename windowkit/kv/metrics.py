"""Fidelity metrics: next-token KL to the re-prefill ceiling and eta (fraction of the blind gap closed)."""
from __future__ import annotations

import math

import torch

from windowkit.errors import WindowkitError


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(p_ref || p) of next-token distributions, in nats (fp64 for small values)."""
    p = torch.log_softmax(ref_logits.double().reshape(-1), -1)
    q = torch.log_softmax(logits.double().reshape(-1), -1)
    return float((p.exp() * (p - q)).sum().clamp_min(0.0))


def eta(kl_blind: float, kl_arm: float) -> float:
    """Fraction of the blind-reuse -> re-prefill KL gap an arm closes (1 = ceiling, 0 = blind, <0 harmful)."""
    if kl_blind <= 0:
        return float("nan")
    return 1.0 - kl_arm / kl_blind


__all__ = ["kl_divergence", "eta", "wilson", "paired_delta"]


def wilson(hits: int, n: int, z: float = 1.96) -> list:
    """Wilson score interval [lo, hi] of a binomial proportion hits/n (z=1.96: 95%)."""
    if n == 0:
        return [0.0, 1.0]
    p = hits / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return [max(0.0, centre - half), min(1.0, centre + half)]


def paired_delta(lost: int, gained: int, n: int, z: float = 1.96) -> tuple[float, list]:
    """Accuracy of a method minus its reference's on the same ``n`` items, and a 95% interval of that difference
    (z=1.96). Only the discordant items move a paired difference: ``lost`` (reference right, method wrong) and
    ``gained`` (the other way); items where both agree cancel. The interval is Bonett & Price's adjusted Wald
    interval for paired proportions (2012: one pseudo-item added to each discordant cell), which keeps its
    95% coverage down to a handful of discordant items, where the plain Wald interval collapses. Returns
    (difference, [lo, hi]) as fractions (x100 for points).

        paired_delta(11, 3, 200)     # (-0.04, [-0.078, -0.001]): 4 points lost, not noise at 95%
        paired_delta(3, 1, 200)      # (-0.01, [-0.034, 0.014]): within noise of no loss
    """
    if n <= 0:
        raise WindowkitError(f"paired_delta needs n >= 1, got {n}")
    if lost < 0 or gained < 0 or lost + gained > n:
        raise WindowkitError(f"paired_delta: lost={lost}, gained={gained} do not fit n={n}")
    a, b = (gained + 1) / (n + 2), (lost + 1) / (n + 2)
    half = z * math.sqrt(max(a + b - (a - b) ** 2, 0.0) / (n + 2))
    return (gained - lost) / n, [max(a - b - half, -1.0), min(a - b + half, 1.0)]
