"""Truncated SVD of a deficit matrix, exact or randomized.

The patch keeps the top-m singular triplets of Δ [S, F] (tokens x features). By Eckart-Young the rank-m
reconstruction error is exactly the tail energy sum_{i>m} σ_i², which tests check against.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Method = Literal["exact", "randomized"]


@dataclass
class Truncated:
    us: torch.Tensor  # [S, m] = U_m diag(σ_m), fp32
    vt: torch.Tensor  # [m, F] = V_mᵀ, fp32
    kept_energy: float  # sum of kept σ²
    total_energy: float  # ||Δ||_F²

    @property
    def tail_energy(self) -> float:
        return max(self.total_energy - self.kept_energy, 0.0)


def truncated_svd(delta: torch.Tensor, rank: int, method: Method = "exact", oversample: int = 8,
                  niter: int = 2, generator_seed: int = 0) -> Truncated:
    """Top-``rank`` factors of ``delta`` [S, F] in fp32; rank is clipped to min(S, F).

    randomized: Halko-Martinsson-Tropp range finder with ``niter`` power iterations; it costs
    O(S·F·(m+p)) instead of O(S·F·min(S,F)), which is what brings forming close to one extra encode.
    """
    x = delta.float()
    s_, f_ = x.shape
    m = max(0, min(int(rank), s_, f_))
    total = float((x * x).sum())
    if m == 0 or total == 0.0:
        return Truncated(x.new_zeros(s_, m), x.new_zeros(m, f_), 0.0, total)
    if method == "randomized" and m + oversample < min(s_, f_):
        g = torch.Generator(device="cpu").manual_seed(generator_seed)
        omega = torch.randn(f_, m + oversample, generator=g).to(x.device)
        y = x @ omega  # [S, m+p]
        for _ in range(niter):  # power iterations sharpen the spectrum's decay
            y, _r = torch.linalg.qr(y)
            y = x @ (x.T @ y)
        q, _r = torch.linalg.qr(y)  # [S, m+p] orthonormal range basis
        b = q.T @ x  # [m+p, F]
        ub, s, vh = torch.linalg.svd(b, full_matrices=False)
        u = q @ ub
    elif method in ("exact", "randomized"):
        u, s, vh = torch.linalg.svd(x, full_matrices=False)
    else:
        raise ValueError(f"unknown SVD method {method!r}")
    us = u[:, :m] * s[:m]
    return Truncated(us, vh[:m].contiguous(), float((s[:m] ** 2).sum()), total)


__all__ = ["Truncated", "truncated_svd", "Method"]
