"""SharedPatchBasis: coordinated coefficient rotation, shared-subspace exactness, bytes, tiny-model e2e."""
import gc

import pytest
import torch

from windowkit.errors import KVShapeError
from windowkit.kv import ChunkKV, KVLayout, deficit, place, reconstruction_error
from windowkit.kv.basis import SharedPatchBasis, deficit_hat
from windowkit.kv.patch import patch_from_deficit

LAYOUT = KVLayout("gqa", 2, ((2, 8), (2, 8)), 0)  # F = 16 per slot
F = 16


def _kv(mats: dict, s: int) -> ChunkKV:
    """ChunkKV from {(layer, slot): [S, F]} matrices (missing ones zero)."""
    layers = []
    for l in range(LAYOUT.num_layers):
        pair = []
        for slot in (0, 1):
            h, d = LAYOUT.slot_shapes[slot]
            m = mats.get((l, slot), torch.zeros(s, h * d))
            pair.append(m.reshape(s, h, d).transpose(0, 1).contiguous())
        layers.append(tuple(pair))
    return ChunkKV(layers, LAYOUT)


def _subspace_deficit(bases: dict, s: int, g: torch.Generator, scales=None) -> ChunkKV:
    mats = {}
    for key, b in bases.items():  # b: [F, r] orthonormal
        c = torch.randn(s, b.shape[1], generator=g)
        if scales is not None:
            c = c * scales
        mats[key] = c @ b.T
    return _kv(mats, s)


def _bases(r: int, g: torch.Generator, offset: int = 0) -> dict:
    out = {}
    for l in range(2):
        for s in (0, 1):
            q = torch.linalg.qr(torch.randn(F, F, generator=g))[0]
            out[(l, s)] = q[:, offset:offset + r]
    return out


def _all_hat(p):
    return {key: deficit_hat(p, *key) for key in p.factors}


def _max_err(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)) for k in b)


# ---------------------------------------------------------------------- coordinated update
def test_rotation_keeps_reconstruction_and_stale_does_not():
    g = torch.Generator().manual_seed(0)
    q = {key: torch.linalg.qr(torch.randn(F, F, generator=g))[0] for key in [(l, s) for l in range(2) for s in (0, 1)]}
    first = {k: v[:, :4] for k, v in q.items()}
    wider = {k: v[:, :9] for k, v in q.items()}  # contains the first span, adds 5 directions
    basis = SharedPatchBasis(LAYOUT, 12, auto_rotate=False)
    basis.observe(_subspace_deficit(first, 20, g))
    assert all(basis.k(*key) == 4 for key in basis)
    d = _subspace_deficit(first, 10, g)
    p = basis.encode(d)
    before = _all_hat(p)
    old_bt = {key: basis.basis(*key).clone() for key in basis}
    # new rows with much more energy in new directions: the basis turns (and grows 4 -> 9)
    basis.observe(_subspace_deficit(wider, 40, g, scales=torch.linspace(3.0, 0.5, 9)))
    assert all(basis.k(*key) == 9 for key in basis)
    assert not basis.is_current(p)
    # unrotated: the patch's vt is the moved shared buffer -> C·B_newᵀ, the stale-coordinates error
    stale = _all_hat(p)
    for key in p.factors:
        c = p.factors[key][0].float()
        expect = c @ basis.basis(*key)[:4].float()
        assert torch.allclose(stale[key], expect, atol=1e-6)
        assert torch.allclose(before[key], c @ old_bt[key].float(), atol=1e-5)
    assert _max_err(stale, before) > 0.1
    basis.rotate(p)
    assert basis.is_current(p)
    after = _all_hat(p)
    assert _max_err(after, before) < 1e-5
    assert all(u.shape[1] == 9 for u, _ in p.factors.values())  # rank growth: width follows k


def test_auto_rotation_multi_step_keep_width_and_strip_attach():
    g = torch.Generator().manual_seed(1)
    q = {key: torch.linalg.qr(torch.randn(F, F, generator=g))[0] for key in [(l, s) for l in range(2) for s in (0, 1)]}
    basis = SharedPatchBasis(LAYOUT, 16)  # auto_rotate=True
    basis.observe(_subspace_deficit({k: v[:, :3] for k, v in q.items()}, 12, g))
    d = _subspace_deficit({k: v[:, :3] for k, v in q.items()}, 8, g)
    p = basis.encode(d)
    stored = basis.strip(p)
    assert basis.coefficient_bytes(stored) == stored.nbytes  # vt stripped to 0 bytes
    before = _all_hat(p)
    for step in range(3):  # three moves; the live patch follows each, the stored one is rotated once
        basis.observe(_subspace_deficit({k: v[:, :6 + 2 * step] for k, v in q.items()}, 16, g,
                                        scales=torch.linspace(4.0, 1.0, 6 + 2 * step)))
        assert basis.is_current(p)
    assert basis.version == 4
    assert _max_err(_all_hat(p), before) < 1e-5
    back = basis.attach(stored)
    assert basis.is_current(back) and _max_err(_all_hat(back), before) < 1e-5
    # keep_width: fixed bytes, a projection onto the new leading directions (error = the part outside)
    narrow = basis.attach(stored, keep_width=True)
    for key, (u, vt) in narrow.factors.items():
        assert u.shape[1] == 3
        bt = basis.basis(*key)[:3].float()
        proj = before[key] @ bt.T @ bt
        assert torch.allclose(deficit_hat(narrow, *key), proj, atol=1e-5)
    # pruning history makes old stored coefficients unrotatable, and says so
    basis.prune_history()
    with pytest.raises(KVShapeError):
        basis.attach(stored)


# ---------------------------------------------------------------------- shared subspace
def test_shared_subspace_recovers_held_out_exactly():
    g = torch.Generator().manual_seed(2)
    shared = _bases(6, g)
    basis = SharedPatchBasis(LAYOUT, 8, rows_per_update=40)
    for _ in range(5):
        basis.observe(_subspace_deficit(shared, 12, g))
    assert basis.pending_rows == 12 and basis.version == 1  # 48 rows folded at once, 12 still pending
    held = _subspace_deficit(shared, 10, g)
    p = basis.encode(held, rank=6)  # encode folds what is pending first
    assert basis.pending_rows == 0 and basis.version == 2
    assert all(basis.k(*key) == 6 for key in basis)
    own = patch_from_deficit(held, 6)
    for key in p.factors:
        l, s = key
        target = held.layers[l][s].transpose(0, 1).reshape(10, F)
        assert float((deficit_hat(p, *key) - target).norm() / target.norm()) < 1e-5
        assert float((deficit_hat(own, *key) - target).norm() / target.norm()) < 1e-5
        kept, total = p.energy[key]
        assert abs(kept - total) / total < 1e-5
    # a deficit outside the shared span is not recovered (the basis is not the item's own SVD)
    other = _subspace_deficit(_bases(6, g), 10, g)
    q = basis.encode(other, rank=6)
    assert max(1 - q.energy[k][0] / q.energy[k][1] for k in q.factors) > 0.3


def test_observe_patch_matches_observe_deficit_at_full_rank():
    g = torch.Generator().manual_seed(3)
    shared = _bases(5, g)
    a = SharedPatchBasis(LAYOUT, 8)
    b = SharedPatchBasis(LAYOUT, 8)
    for _ in range(3):
        d = _subspace_deficit(shared, 12, g)
        a.observe(d)
        b.observe_patch(patch_from_deficit(d, None))
    for key in a:
        assert torch.allclose(a.singular_values(*key), b.singular_values(*key), rtol=1e-4)
        pa, pb = a.basis(*key).float(), b.basis(*key).float()
        assert torch.allclose(pa.T @ pa, pb.T @ pb, atol=1e-4)  # same subspace


# ---------------------------------------------------------------------- bytes
def test_bytes_accounting_and_shared_vt():
    g = torch.Generator().manual_seed(4)
    shared = _bases(6, g)
    basis = SharedPatchBasis(LAYOUT, 8)
    basis.observe(_subspace_deficit(shared, 30, g))
    p1 = basis.encode(_subspace_deficit(shared, 10, g), rank=4)
    p2 = basis.encode(_subspace_deficit(shared, 10, g), rank=4)
    assert basis.coefficient_bytes(p1) == 4 * (10 * 4) * 4  # 4 layer-slots x S x m x fp32
    assert basis.basis_bytes() == 4 * (8 * F * 4 + 6 * 4)  # allocated [rank, F] buffers + singular values
    assert basis.basis_bytes(allocated=False) == 4 * (6 * F * 4 + 6 * 4)
    for key in p1.factors:  # the basis is one tensor, not copied per patch
        assert p1.factors[key][1].data_ptr() == p2.factors[key][1].data_ptr() == basis.basis(*key).data_ptr()
    assert len(basis.live_patches()) == 2
    assert basis.patch_bytes(p1) == basis.coefficient_bytes(p1) + basis.basis_bytes() / 2
    del p2
    gc.collect()
    assert len(basis.live_patches()) == 1
    assert basis.patch_bytes(p1) == basis.coefficient_bytes(p1) + basis.basis_bytes()
    assert basis.patch_bytes(p1, amortize_over=100) == basis.coefficient_bytes(p1) + basis.basis_bytes() / 100
    half = SharedPatchBasis(LAYOUT, 8, dtype=torch.bfloat16)
    half.observe(_subspace_deficit(shared, 30, g))
    ph = half.encode(_subspace_deficit(shared, 10, g), rank=4)
    assert half.coefficient_bytes(ph) == basis.coefficient_bytes(p1) // 2


def test_errors():
    basis = SharedPatchBasis(LAYOUT, 4)
    with pytest.raises(KVShapeError):
        basis.encode(_kv({}, 4))  # empty basis
    with pytest.raises(KVShapeError):
        SharedPatchBasis(LAYOUT, 0)
    other = SharedPatchBasis(LAYOUT, 4)
    g = torch.Generator().manual_seed(5)
    other.observe(_subspace_deficit(_bases(2, g), 6, g))
    p = other.encode(_subspace_deficit(_bases(2, g), 6, g))
    with pytest.raises(KVShapeError):
        basis.rotate(p)  # not this basis's patch


# ---------------------------------------------------------------------- tiny models, end to end
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-deepseek-v3"])
def test_tiny_model_full_rank_reproduces_conditioned_kv(name):
    import windowkit as wk
    from windowkit.backends.tiny import build
    from windowkit.kv import concat, kl_divergence

    be = wk.HFBackend(build(name), verify=False)
    V = be.vocab_size
    g = torch.Generator().manual_seed(0)
    F_max = max(h * d for h, d in be.layout.slot_shapes)
    basis = SharedPatchBasis(be.layout, F_max)
    items = []
    for _ in range(2):  # 2 x 20 rows < F: the pooled basis is a proper subspace, not all of R^F
        a = wk.Chunk.text(torch.randint(10, V, (16,), generator=g))
        b = wk.Chunk.text(torch.randint(10, V, (20,), generator=g))
        truth = be.forward([a, b], 0)  # the model's own forward over [A, B]
        cond = truth.kv.slice(len(a), len(a) + len(b))
        canon = be.encode(b)
        d = deficit(cond, canon, len(a), be.rope)
        basis.observe(d)
        items.append((a, b, truth, cond, canon, d))
    assert 0 < max(basis.k(*key) for key in basis) < F_max
    qc = wk.Chunk.text(torch.randint(10, V, (4,), generator=g))
    for a, b, truth, cond, canon, d in items:
        p = basis.encode(d)  # full rank on the pooled basis; the item's rows lie in its span
        kv = place(canon, len(a), be.rope, p)
        assert reconstruction_error(kv, cond) < 1e-5
        ka = truth.kv.slice(0, len(a))
        ref = be.forward([qc], len(a) + len(b), past=truth.kv).logits
        got = be.forward([qc], len(a) + len(b), past=concat([ka, kv])).logits
        assert kl_divergence(ref, got) < 1e-8


def test_strip_store_attach_round_trip(tmp_path):
    """The Window path: store coefficients only, attach (rotate to the current basis) on the way out."""
    from windowkit.store import ChunkStore, context_hash

    g = torch.Generator().manual_seed(6)
    q = {key: torch.linalg.qr(torch.randn(F, F, generator=g))[0] for key in [(l, s) for l in range(2) for s in (0, 1)]}
    basis = SharedPatchBasis(LAYOUT, 12)
    basis.observe(_subspace_deficit({k: v[:, :4] for k, v in q.items()}, 16, g))
    p = basis.encode(_subspace_deficit({k: v[:, :4] for k, v in q.items()}, 8, g), meta={"context": "c"})
    before = _all_hat(p)
    for path in (None, tmp_path / "store"):
        store = ChunkStore(path, layout=LAYOUT)
        ctx = context_hash(["a"])
        store.put_patch("k", ctx, basis.strip(p))
        assert store.stats.bytes_written == basis.coefficient_bytes(p)  # no basis copy in the store
        basis.observe(_subspace_deficit({k: v[:, :8] for k, v in q.items()}, 16, g,
                                        scales=torch.linspace(3.0, 1.0, 8)))  # the basis moves meanwhile
        got = basis.attach(store.get_patch("k", ctx))
        assert basis.is_current(got) and got.meta["context"] == "c"
        assert _max_err(_all_hat(got), before) < 1e-5


def test_bf16_basis_does_not_inflate_rank_and_rotation_stays_close():
    g = torch.Generator().manual_seed(7)
    q = {key: torch.linalg.qr(torch.randn(F, F, generator=g))[0] for key in [(l, s) for l in range(2) for s in (0, 1)]}
    basis = SharedPatchBasis(LAYOUT, 12, dtype=torch.bfloat16)
    basis.observe(_subspace_deficit({k: v[:, :4] for k, v in q.items()}, 16, g))
    p = basis.encode(_subspace_deficit({k: v[:, :4] for k, v in q.items()}, 8, g))
    assert all(u.dtype == torch.bfloat16 and vt.dtype == torch.bfloat16 for u, vt in p.factors.values())
    before = _all_hat(p)
    for _ in range(4):
        basis.observe(_subspace_deficit({k: v[:, :8] for k, v in q.items()}, 16, g,
                                        scales=torch.linspace(3.0, 1.0, 8)))
    assert all(basis.k(*key) == 8 for key in basis)  # fp32 master: bf16 rounding is not a new direction
    assert _max_err(_all_hat(p), before) < 2e-2  # bf16 coefficients/basis: rounding per rotation only
