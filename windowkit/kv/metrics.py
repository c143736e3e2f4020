"""Fidelity metrics: next-token KL to the re-prefill ceiling and eta (fraction of the blind gap closed)."""
from __future__ import annotations

import math

import torch


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


__all__ = ["kl_divergence", "eta", "wilson"]


def wilson(hits: int, n: int, z: float = 1.96) -> list:
    """Wilson score interval [lo, hi] of a binomial proportion hits/n (z=1.96: 95%)."""
    if n == 0:
        return [0.0, 1.0]
    p = hits / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return [max(0.0, centre - half), min(1.0, centre + half)]
