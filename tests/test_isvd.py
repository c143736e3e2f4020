"""Tests for windowkit.kv.isvd: block-incremental SVD with coordinated updates (Zhongzhu Zhou's review "iS-KV:
When the Basis Moves, the History Must Move with It"; sections and equations below are the review's).

Ground truth is always the input rows or a fresh torch.linalg.svd of them, never the code under test.
"""
from __future__ import annotations

import math

import pytest
import torch

from windowkit.errors import KVShapeError
from windowkit.kv.isvd import (
    IncrementalSVD,
    break_even_rows,
    dense_bytes,
    excess_error,
    persistent_bytes,
)

F32 = torch.float32
BF16 = torch.bfloat16


def low_rank_rows(n: int, d: int, t: int, *, noise: float = 0.0, seed: int = 0) -> torch.Tensor:
    """[n, d] rows of true rank t (spectrum spread 10:1) plus optional iid Gaussian noise."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(d, t, generator=g))[0]  # [d, t]
    coef = torch.randn(n, t, generator=g) * torch.logspace(0, -1, t)  # [n, t]
    return coef @ basis.T + noise * torch.randn(n, d, generator=g)


def fold(isvd: IncrementalSVD, X: torch.Tensor, block: int) -> IncrementalSVD:
    for blk in X.split(block):
        isvd.update(blk)
    return isvd


def fresh_rank_r(X: torch.Tensor, r: int) -> torch.Tensor:
    U, S, Vh = torch.linalg.svd(X.double(), full_matrices=False)
    return ((U[:, :r] * S[:r]) @ Vh[:r]).float()


# --------------------------------------------------------------------------- constructed facts


@pytest.mark.parametrize("store", [F32, BF16])
def test_rank1_local_vs_global_optimum(store):
    # The review's section "Why the optimum is local": block diag(4, 3) at rank 1 keeps x (σ=4) and discards y;
    # the new row (0, 3) gives the incremental target squared singular values 16 and 9, so it still keeps x. The complete
    # history has 16 and 18, so a fresh rank-1 SVD keeps y. Errors: sqrt(18) vs 4.
    isvd = IncrementalSVD(1, store_dtype=store)
    isvd.update(torch.tensor([[4.0, 0.0], [0.0, 3.0]]))
    assert isvd.k == 1 and float(isvd.S[0]) == 4.0
    isvd.update(torch.tensor([[0.0, 3.0]]))
    X = torch.tensor([[4.0, 0.0], [0.0, 3.0], [0.0, 3.0]])
    err_inc = float(torch.linalg.matrix_norm(isvd.reconstruct() - X))
    err_fresh = float(torch.linalg.matrix_norm(fresh_rank_r(X, 1) - X))
    assert err_inc == pytest.approx(math.sqrt(18), abs=1e-5)
    assert err_fresh == pytest.approx(4.0, abs=1e-5)
    assert isvd.n_rows == 3 and isvd.k == 1 and float(isvd.S[0]) == pytest.approx(4.0)


def test_break_even_rows_matches_review_and_byte_formula():
    # the review's section "Returning to attention: costs that the small core does not remove":
    # "just over 146 rows; the first integer is 147"
    assert break_even_rows(1024, 128) == 147
    # eq. (13) is the crossing of eq. (12) (no exact rows) and dense storage at equal precision
    assert persistent_bytes(146, 1024, 128) >= dense_bytes(146, 1024)
    assert persistent_bytes(147, 1024, 128) < dense_bytes(147, 1024)
    for d, r in [(2, 1), (64, 16), (128, 127), (4096, 512), (10, 5)]:
        n = break_even_rows(d, r)
        assert n * (d - r) > r * (d + 1) >= (n - 1) * (d - r)
    with pytest.raises(KVShapeError):
        break_even_rows(128, 128)
    with pytest.raises(KVShapeError):
        break_even_rows(128, 0)


def test_persistent_bytes_counts_factors_and_exact_rows():
    # eq. (12) per path: βf k (n + d + 1) + βe d e
    assert persistent_bytes(10, 8, 3, 5, factor_bytes=2, exact_bytes=4) == 2 * 3 * 19 + 4 * 8 * 5
    # review Figure 5: d=1024, r=128, 192 exact rows; ratio to dense tends to d/r = 8
    n = 10_000_000
    ratio = dense_bytes(n + 192, 1024) / persistent_bytes(n, 1024, 128, 192)
    assert 7.9 < ratio < 8.0
    # the instance's own stored bytes agree with the formula
    for store in (F32, BF16):
        isvd = fold(IncrementalSVD(16, store_dtype=store), low_rank_rows(200, 48, 10, noise=0.1), 40)
        esize = torch.finfo(store).bits // 8
        assert isvd.nbytes == persistent_bytes(isvd.n_rows, isvd.d, isvd.k, factor_bytes=esize)


def test_stale_coordinates_rotation_error_analytic():
    # Review eq. (3) / Figure 3, constructed explicitly: full orthonormal basis B rotated by θ.
    B = torch.eye(2, dtype=torch.float64)
    row = torch.tensor([[0.6, 0.8]], dtype=torch.float64)  # unit row
    c = row @ B  # its coordinates
    for theta in [0.05, 0.5, math.pi / 3, math.pi / 2, 2.0, 3.0]:
        R = torch.tensor([[math.cos(theta), -math.sin(theta)], [math.sin(theta), math.cos(theta)]],
                         dtype=torch.float64)
        B_new = B @ R
        stale = c @ B_new.T  # coordinates kept, basis moved
        coordinated = (c @ R) @ B_new.T  # C+ = C R
        assert float((stale - row).norm()) == pytest.approx(2 * math.sin(theta / 2), abs=1e-12)
        assert float((coordinated - row).norm()) < 1e-12


@pytest.mark.parametrize("store", [F32, BF16])
def test_update_rotates_old_coordinates_with_basis(store):
    # Same fact through the class: history = one unit row e1; the block (1, 1) makes M = [[1,0],[1,1]],
    # whose leading right singular vector is at angle θ = atan(2)/2 from e1 (MᵀM = [[2,1],[1,1]]).
    # Reusing the old coordinate on the new leading vector (a basis-only update) errs by 2 sin(θ/2);
    # the coordinated update reproduces the row.
    row = torch.tensor([[1.0, 0.0]])
    isvd = IncrementalSVD(2, store_dtype=store)
    isvd.update(row)
    c_old = (isvd.U.float() * isvd.S.float())[0, 0]  # scalar coordinate on b_old
    b_old = isvd.B.float()[:, 0]
    isvd.update(torch.tensor([[1.0, 1.0]]))
    b_new = isvd.B.float()[:, 0]
    theta = math.acos(min(1.0, abs(float(b_old @ b_new))))
    b_new = b_new * torch.sign(b_old @ b_new)  # SVD sign convention is arbitrary; align it
    assert theta == pytest.approx(math.atan(2) / 2, abs=1e-2 if store == BF16 else 1e-5)  # ~0.554
    stale_err = float((c_old * b_new - row[0]).norm())
    assert stale_err == pytest.approx(2 * math.sin(theta / 2), abs=1e-2 if store == BF16 else 1e-6)
    tol = 1e-2 if store == BF16 else 1e-6
    assert float((isvd.reconstruct()[0] - row[0]).norm()) < tol


# --------------------------------------------------------------------------- exactness


@pytest.mark.parametrize(
    "n,d,t,rank,blocks",
    [
        (300, 40, 6, 8, [17]),  # total rank 6 < rank 8
        (240, 40, 8, 8, [64, 1, 1, 30]),  # total rank == rank, uneven blocks incl. single rows
        (90, 5, 5, 8, [7]),  # full row rank d=5 < rank: k reaches d, no residual expansion
    ],
)
def test_exact_when_total_rank_fits(n, d, t, rank, blocks):
    X = low_rank_rows(n, d, t, seed=n)
    isvd = IncrementalSVD(rank, store_dtype=F32)
    i, j = 0, 0
    while i < n:
        b = blocks[j % len(blocks)]
        isvd.update(X[i : i + b])
        i, j = i + b, j + 1
    assert isvd.n_rows == n and isvd.d == d and isvd.k == min(t, d)
    R = isvd.reconstruct()
    assert R.dtype == F32 and R.shape == X.shape
    assert float(torch.linalg.matrix_norm(R - X)) <= 1e-5 * float(torch.linalg.matrix_norm(X))
    assert torch.allclose(R, X, rtol=0, atol=1e-4 * float(X.abs().max()))


def test_exact_when_new_direction_arrives_late():
    # Rows confined to a 3-D subspace for 5 blocks, then a block that adds 2 new directions:
    # the residual expansion (eqs. (5)-(7)) must pick them up without disturbing old rows.
    g = torch.Generator().manual_seed(3)
    basis = torch.linalg.qr(torch.randn(32, 5, generator=g))[0]  # [32, 5]
    X1 = torch.randn(100, 3, generator=g) @ basis[:, :3].T
    X2 = torch.randn(20, 5, generator=g) @ basis.T
    X = torch.cat([X1, X2])
    isvd = fold(IncrementalSVD(6, store_dtype=F32), X1, 20)
    assert isvd.k == 3
    isvd.update(X2)
    assert isvd.k == 5
    assert torch.allclose(isvd.reconstruct(), X, rtol=0, atol=1e-5 * float(X.abs().max()))


def test_exact_bf16_to_storage_rounding():
    # bf16 factors: same stream is reproduced to bf16 rounding (unit roundoff 2^-9 ≈ 2e-3 per
    # factor; U is rewritten every fold, so rounding accumulates ~ sqrt(#folds): measured 0.8% here).
    X = low_rank_rows(300, 40, 6, seed=300)
    isvd = fold(IncrementalSVD(8), X, 17)
    assert isvd.U.dtype == BF16 and isvd.S.dtype == BF16 and isvd.B.dtype == BF16
    rel = float(torch.linalg.matrix_norm(isvd.reconstruct() - X) / torch.linalg.matrix_norm(X))
    assert rel < 2e-2


def test_each_fold_is_best_rank_r_of_current_approx_plus_block():
    # Eq. (9): one fold is the optimal rank-r approximation of M = [A; F] where A is the *maintained*
    # approximation (not the original rows). Check against a fresh SVD of that stacked matrix.
    X = low_rank_rows(160, 24, 12, noise=0.05, seed=7)
    isvd = fold(IncrementalSVD(6, store_dtype=F32), X[:128], 32)
    M = torch.cat([isvd.reconstruct(), X[128:]])
    isvd.update(X[128:])
    assert torch.allclose(isvd.reconstruct(), fresh_rank_r(M, 6), rtol=0, atol=1e-5)
    sv = torch.linalg.svdvals(M.double())[:6].float()
    assert torch.allclose(isvd.S.float(), sv, rtol=1e-5, atol=1e-6)


def test_zero_rows_and_empty_blocks():
    isvd = IncrementalSVD(2, store_dtype=F32)
    isvd.update(torch.zeros(3, 4))
    assert isvd.k == 0 and isvd.n_rows == 3 and isvd.d == 4
    isvd.update(torch.zeros(0, 4))  # no-op
    isvd.update(torch.tensor([[2.0, 0.0, 0.0, 0.0]]))
    X = torch.cat([torch.zeros(3, 4), torch.tensor([[2.0, 0.0, 0.0, 0.0]])])
    assert isvd.k == 1 and torch.allclose(isvd.reconstruct(), X)


# --------------------------------------------------------------------------- excess error, eq. (14)


@pytest.mark.parametrize(
    "noise,store,bound",
    [
        # Measured max over seeds 0-4 (n=1024, d=128, true rank 12, rank 16, blocks of 32):
        #   noise 0.01: fp32 3.9e-4, bf16 1.4e-3 (bf16 rounding of the factors dominates)
        #   noise 0.05: fp32 2.2e-3, bf16 2.4e-3
        # Excess error comes from noise energy that earlier folds truncated away and later rows
        # would have made worth keeping (the review's "Why the optimum is local"); it grows with the noise,
        # not with drift of the arithmetic. Bounds are ~2x the measured worst case.
        (0.01, F32, 1e-3),
        (0.01, BF16, 3e-3),
        (0.05, F32, 5e-3),
        (0.05, BF16, 5e-3),
    ],
)
def test_excess_error_small_on_low_rank_plus_noise(noise, store, bound):
    for seed in range(3):
        X = low_rank_rows(1024, 128, 12, noise=noise, seed=seed)
        isvd = fold(IncrementalSVD(16, store_dtype=store), X, 32)
        delta = excess_error(isvd.reconstruct(), X, 16)
        # fresh SVD is optimal (eq. (2)), so δ >= 0 up to rounding; and it is small
        assert -1e-5 < delta < bound, (seed, delta)
        # cross-check eq. (14) by hand with a dense fresh rank-16 approximation
        nx = float(torch.linalg.matrix_norm(X))
        by_hand = (float(torch.linalg.matrix_norm(isvd.reconstruct() - X))
                   - float(torch.linalg.matrix_norm(fresh_rank_r(X, 16) - X))) / nx
        assert delta == pytest.approx(by_hand, abs=1e-5)


# --------------------------------------------------------------------------- reorthogonalize (eq. 11)


def test_reorthogonalize_restores_orthogonality_keeps_product():
    X = low_rank_rows(512, 64, 10, noise=0.02, seed=11)
    bf = fold(IncrementalSVD(12), X, 64)  # bf16 factors: orthogonality lost to rounding
    U0, S0, B0 = bf.U.float(), bf.S.float(), bf.B.float()
    I = torch.eye(bf.k)
    assert float((U0.T @ U0 - I).norm()) > 1e-3  # really not orthonormal before
    # Skew U further so the test does not depend on how small bf16 drift happens to be.
    skew = torch.eye(bf.k) + 0.05 * torch.randn(bf.k, bf.k, generator=torch.Generator().manual_seed(0))
    U0 = U0 @ skew
    isvd = IncrementalSVD.from_factors(U0, S0, B0, rank=12, store_dtype=F32)
    before = isvd.reconstruct()
    assert torch.allclose(before, (U0 * S0) @ B0.T)
    isvd.reorthogonalize()
    after = isvd.reconstruct()
    U, B = isvd.U.float(), isvd.B.float()
    assert float((after - before).norm()) <= 1e-5 * float(before.norm())
    assert float((U.T @ U - I).abs().max()) < 1e-5
    assert float((B.T @ B - I).abs().max()) < 1e-5
    assert bool((isvd.S[:-1] >= isvd.S[1:]).all())
    # and updates keep working afterwards (exact on a block inside the current span)
    inside = isvd.project(X[:8]) @ B.T
    isvd.update(inside)
    assert torch.allclose(isvd.reconstruct()[-8:], inside, atol=1e-4)


def test_reorthogonalize_bf16_store_stays_at_rounding_level():
    X = low_rank_rows(512, 64, 10, noise=0.02, seed=12)
    isvd = fold(IncrementalSVD(12), X, 64)
    before = isvd.reconstruct()
    isvd.reorthogonalize()
    rel = float((isvd.reconstruct() - before).norm() / before.norm())
    U = isvd.U.float()
    assert rel < 1e-2  # bf16 re-rounding of the new factors
    assert float((U.T @ U - torch.eye(isvd.k)).abs().max()) < 2e-2


# --------------------------------------------------------------------------- project


def test_project_gives_coordinates_on_current_basis():
    X = low_rank_rows(200, 32, 5, seed=5)
    isvd = fold(IncrementalSVD(8, store_dtype=F32), X, 50)
    new = low_rank_rows(7, 32, 5, seed=5)  # same generator basis: lies in span(B)
    coeffs = isvd.project(new)
    assert coeffs.shape == (7, isvd.k) and coeffs.dtype == F32
    assert torch.allclose(coeffs @ isvd.B.float().T, new, atol=1e-5)
    # component outside span(B) projects to ~0; projecting changes nothing
    out = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    out = out - (out @ isvd.B.float()) @ isvd.B.float().T
    assert float(isvd.project(out).abs().max()) < 1e-5
    assert isvd.n_rows == 200
    assert IncrementalSVD(4).project(torch.ones(2, 3)).shape == (2, 0)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("rank", [0, -1, 1.5, True, "4"])
def test_bad_rank_raises(rank):
    with pytest.raises(KVShapeError):
        IncrementalSVD(rank)


def test_bad_blocks_raise_and_leave_state_unchanged():
    isvd = IncrementalSVD(4)
    with pytest.raises(KVShapeError):
        isvd.update(torch.ones(5))  # 1-D
    isvd.update(torch.randn(6, 8, generator=torch.Generator().manual_seed(0)))
    snapshot = isvd.reconstruct()
    bad = [
        torch.ones(3, 7),  # wrong width
        torch.ones(2, 3, 8),  # 3-D
        torch.ones(8),  # 1-D
        torch.tensor([[float("nan")] + [0.0] * 7]),
        torch.tensor([[float("inf")] + [0.0] * 7]),
        torch.full((2, 8), float("-inf"), dtype=BF16),
        torch.ones(2, 8, dtype=torch.complex64),
        [[1.0] * 8],  # not a tensor
    ]
    for blk in bad:
        with pytest.raises(KVShapeError):
            isvd.update(blk)
    for rows in bad[:5]:
        with pytest.raises(KVShapeError):
            isvd.project(rows)
    assert isvd.n_rows == 6 and torch.equal(isvd.reconstruct(), snapshot)
    assert issubclass(KVShapeError, ValueError)  # callers may catch ValueError


def test_from_factors_validates():
    U, S, B = torch.eye(4, 2), torch.ones(2), torch.eye(3, 2)
    with pytest.raises(KVShapeError):
        IncrementalSVD.from_factors(U, torch.ones(3), B)
    with pytest.raises(KVShapeError):
        IncrementalSVD.from_factors(U, S, B, rank=1)
    with pytest.raises(KVShapeError):
        IncrementalSVD.from_factors(U, torch.tensor([1.0, float("nan")]), B)
    isvd = IncrementalSVD.from_factors(U, S, B)
    assert (isvd.rank, isvd.k, isvd.n_rows, isvd.d, isvd.store_dtype) == (2, 2, 4, 3, F32)


def test_residual_threshold_never_adds_noise_directions():
    """Rows exactly in a rank-3 span, perturbed far below the eq. (5) threshold: the effective rank stays 3
    however many blocks arrive (no rounding-level direction is admitted), and real new directions above
    the threshold are still admitted."""
    d, t = 48, 3
    X = low_rank_rows(600, d, t, seed=11)
    g = torch.Generator().manual_seed(12)
    X = X + 1e-9 * torch.randn(X.shape, generator=g)  # well under tau = 1e-6
    isvd = IncrementalSVD(rank=16, store_dtype=F32)
    for blk in X.split(20):
        isvd.update(blk)
        assert isvd.k <= t, f"effective rank grew to {isvd.k} on sub-threshold noise"
    assert isvd.k == t
    new_dir = torch.zeros(1, d)
    new_dir[0, 0] = 1.0
    new_dir = new_dir - (new_dir @ isvd.B.float()) @ isvd.B.float().T  # orthogonal to the span: a real direction
    isvd.update(new_dir * 0.5)
    assert isvd.k == t + 1
