"""Shared patch basis: one per-(layer, slot) dictionary of deficit directions, per-item coefficients only.

The Kamera paper ("Kamera: Unified Position-Invariant Multimodal KV Cache for Training-Free Reuse", arXiv
2606.23581; section "The shape of the lost term dictates a feature patch" and App. C.2, "the deficit is
intrinsically thin") reports that conditioning-patch directions are *shared across items*: a fixed
per-layer basis pooled over (A, B) pairs recovers a held-out deficit as well as that item's own SVD, so
only the coefficients are item-specific. This module maintains such a basis online and issues patches
whose factors are coefficients on it::

    Δ [S, F] ≈ C Bₖᵀ        C = Δ Bₖ [S, k] (per patch)     Bₖᵀ [k, F] (shared, one tensor per layer-slot)

``F = H·D`` (the deficit read as a matrix, as in ``patch.py``). The basis is kept with
``IncrementalSVD`` (iS-KV's block update). We feed it the *deficit rows* Δ, not the per-item patch
rows: the pooled basis is then the (uncentred) principal subspace of every deficit row seen, which is
what minimises held-out reconstruction error, and it keeps directions that are small in each item (below
its own top-m) but consistent across items. Feeding patch rows (``observe_patch``) is cheaper (m rows
per item, and the Window already has the SVD) but biases the basis to each item's own top-m.

Only ``diag(S) Bᵀ`` is kept between updates (the left factor is dropped): it has the same Gram matrix as
every row folded so far, so later updates give the same basis as if the history were kept, and memory
stays ``O(k·F)`` per layer-slot however many deficits are observed.

The coordinated update (the iS-KV review, "iS-KV: When the Basis Moves, the History Must Move with It", section
"Prerequisites: attention, rank, and two kinds of compression"): a coefficient row means something only
relative to its basis.
The shared ``Bₖᵀ`` lives in one preallocated buffer per layer-slot that is updated *in place* when the
basis moves; every issued patch holds a view of it. After a move each issued coefficient set ``C`` is
rotated, ``C ← C·(B_oldᵀ B_new)``, which reproduces the same Δ̂ exactly whenever the old span survives
in the new basis (always, unless the basis rank cap truncates a direction away). A patch left unrotated
reconstructs ``C B_newᵀ`` instead: the stale-coordinates error. Issued patches are registered (weakly)
and rotated automatically by ``observe`` (``auto_rotate=True``); ``rotate(patch)`` brings any patch from
its recorded version to the current one using the kept step transforms.

Rank growth: when the basis gains directions (k grows), an exactly-rotated patch needs all ``k_new``
coefficients (its old span is spread over the new directions); ``rotate(..., keep_width=True)`` keeps
its width instead and projects onto the new leading directions (bytes fixed, a projection error).

    basis = SharedPatchBasis(backend.layout, rank=32)
    for cond, canon, delta in training_pairs:
        basis.observe(deficit(cond, canon, delta, backend.rope))
    p = basis.encode(deficit(cond_new, canon_new, delta, backend.rope), rank=16)   # a Patch
    kv = place(canon_new, delta, backend.rope, p)                                     # zero forwards
"""
from __future__ import annotations

import itertools
import weakref
from typing import Iterator, Optional

import torch

from windowkit.errors import KVShapeError
from windowkit.kv.isvd import IncrementalSVD
from windowkit.kv.layout import ChunkKV, KVLayout
from windowkit.kv.patch import Layers, Patch, as_matrix, select_layers

Key = tuple[int, int]
_uids = itertools.count()


class SharedPatchBasis:
    """Online per-(layer, slot) basis of deficit directions; issues coefficient-only patches.

    Args:
        layout: the model's KV layout (``backend.layout``).
        rank: maximum basis size k per layer-slot (capped at the slot width F = H·D).
        dtype: storage dtype of the basis and of issued coefficients (math is fp32).
        rows_per_update: fold observed rows into the basis only once at least this many are pending
            (one basis move, one version, one rotation of issued patches per fold); ``None`` folds on
            every ``observe``. ``flush()`` folds whatever is pending.
        layers: layers to keep a basis for (None/'all', 'deep', or ids), as in ``patch_from_deficit``.
        auto_rotate: rotate every live registered patch when the basis moves (default True).
        tol: residual threshold of the incremental SVD (``None``: its default).
    """

    def __init__(self, layout: KVLayout, rank: int, *, dtype: torch.dtype = torch.float32,
                 rows_per_update: Optional[int] = None, layers: Layers = None, auto_rotate: bool = True,
                 tol: Optional[float] = None, device: torch.device | str | None = None):
        if int(rank) < 1:
            raise KVShapeError(f"basis rank must be >= 1, got {rank}")
        if rows_per_update is not None and int(rows_per_update) < 1:
            raise KVShapeError(f"rows_per_update must be >= 1 or None, got {rows_per_update}")
        self.layout = layout
        self.rank = int(rank)
        self.dtype = dtype
        self.rows_per_update = None if rows_per_update is None else int(rows_per_update)
        self.layers = select_layers(layers, layout.num_layers)
        self.auto_rotate = auto_rotate
        self.tol = tol
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.uid = f"basis-{next(_uids)}"
        self.version = 0
        self.rows_seen = 0
        widths = [h * d for h, d in layout.slot_shapes]
        self._keys: list[Key] = [(l, s) for l in self.layers for s in (0, 1)]
        self._cap = {key: min(self.rank, widths[key[1]]) for key in self._keys}
        # Bᵀ, preallocated [cap, F]; rows >= k are zero. Issued patches hold views buf[:w].
        self._buf = {key: torch.zeros(self._cap[key], widths[key[1]], dtype=dtype, device=self.device)
                     for key in self._keys}
        self._sig = {key: torch.zeros(0) for key in self._keys}  # fp32 singular values [k]
        # fp32 master B [F, k] the updates run on (a rounded bf16 basis would leak rounding noise in
        # as new directions and inflate k); the serving buffer is its rounding to ``dtype``
        self._master = {key: torch.zeros(widths[key[1]], 0, device=self.device) for key in self._keys}
        self._pending: dict[Key, list[torch.Tensor]] = {key: [] for key in self._keys}
        self._pending_rows = 0
        # version v -> {key: T [k_{v-1}, k_v]} with B_vᵀ-coordinates = B_{v-1}ᵀ-coordinates @ T
        self._steps: dict[int, dict[Key, torch.Tensor]] = {}
        self._registry: dict[int, weakref.ref] = {}
        self._pids = itertools.count()

    # ------------------------------------------------------------------ facts
    def k(self, layer: int, slot: int) -> int:
        """Current basis size of a layer-slot."""
        return int(self._sig[(layer, slot)].numel())

    def basis(self, layer: int, slot: int) -> torch.Tensor:
        """The shared Bₖᵀ [k, F] (a view of the live buffer: it changes when the basis moves)."""
        return self._buf[(layer, slot)][: self.k(layer, slot)]

    def singular_values(self, layer: int, slot: int) -> torch.Tensor:
        return self._sig[(layer, slot)].clone()

    @property
    def pending_rows(self) -> int:
        return self._pending_rows

    def live_patches(self) -> list[Patch]:
        """Registered patches still alive (weakly held)."""
        out = []
        for pid, ref in list(self._registry.items()):
            p = ref()
            if p is None:
                del self._registry[pid]
            else:
                out.append(p)
        return out

    # ------------------------------------------------------------------ bytes
    def basis_bytes(self, *, allocated: bool = True) -> int:
        """Bytes of the shared Bₖᵀ buffers (+ singular values). ``allocated=False``: used rows only."""
        n = 0
        for key, buf in self._buf.items():
            rows = buf.shape[0] if allocated else self.k(*key)
            n += rows * buf.shape[1] * buf.element_size() + self._sig[key].numel() * 4
        return n

    def state_bytes(self) -> int:
        """Bytes of the fp32 master basis the updates run on (learning state, not served)."""
        return sum(t.numel() * t.element_size() for t in self._master.values())

    def history_bytes(self) -> int:
        """Bytes of the kept step transforms (what ``rotate`` of an old patch needs)."""
        return sum(t.numel() * t.element_size() for step in self._steps.values() for t in step.values())

    @staticmethod
    def coefficient_bytes(patch: Patch) -> int:
        """Per-patch bytes of a basis-backed patch: its coefficients only (Σ S·w per layer-slot)."""
        return sum(u.numel() * u.element_size() for u, _ in patch.factors.values())

    def patch_bytes(self, patch: Patch, amortize_over: Optional[int] = None) -> float:
        """Coefficient bytes + basis bytes shared over ``amortize_over`` patches (default: the live ones)."""
        n = amortize_over if amortize_over is not None else max(len(self.live_patches()), 1)
        return self.coefficient_bytes(patch) + self.basis_bytes() / max(int(n), 1)

    # ------------------------------------------------------------------ learning the basis
    def _check(self, kv: ChunkKV, what: str) -> None:
        if kv.layout != self.layout:
            raise KVShapeError(f"{what}: layout {kv.layout.describe()} != basis layout {self.layout.describe()}")

    @torch.no_grad()
    def observe(self, deficit: ChunkKV) -> bool:
        """Add a deficit's rows Δ [S, F] per layer-slot; returns True if the basis moved (a new version)."""
        self._check(deficit, "observe")
        for key in self._keys:
            l, s = key
            self._pending[key].append(as_matrix(deficit.layers[l][s]).to(self.device))
        return self._queued(deficit.num_tokens)

    @torch.no_grad()
    def observe_patch(self, patch: Patch) -> bool:
        """Add a per-item patch's rows U Vᵀ (as R·Vᵀ, us = Q·R: the same Gram matrix, w rows not S)."""
        if patch.layout != self.layout:
            raise KVShapeError("observe_patch: patch layout differs from the basis layout")
        if patch.meta.get("basis") == self.uid:
            raise KVShapeError("observe_patch: patch is backed by this basis already")
        rows = 0
        for key in self._keys:
            f = patch.factors.get(key)
            if f is None:
                continue
            us, vt = f[0].float().to(self.device), f[1].float().to(self.device)
            r = torch.linalg.qr(us, mode="r")[1]  # [min(S, w), w]
            self._pending[key].append(r @ vt)
            rows = max(rows, r.shape[0])
        return self._queued(rows)

    def _queued(self, rows: int) -> bool:
        self._pending_rows += int(rows)
        if self.rows_per_update is None or self._pending_rows >= self.rows_per_update:
            return self.flush()
        return False

    @torch.no_grad()
    def flush(self) -> bool:
        """Fold all pending rows into the basis: one version, one rotation of issued patches."""
        if self._pending_rows == 0 and not any(self._pending.values()):
            return False
        old = {key: self.basis(*key).float().clone() for key in self._keys}
        step: dict[Key, torch.Tensor] = {}
        for key in self._keys:
            blocks = self._pending[key]
            self._pending[key] = []
            if not blocks:
                continue
            x = torch.cat(blocks, 0)
            k = self.k(*key)
            cap = self._cap[key]
            if k == 0:
                isvd = IncrementalSVD(cap, tol=self.tol, store_dtype=torch.float32, device=self.device)
            else:  # the sketch diag(S)·Bᵀ: same Gram matrix as every row folded so far
                isvd = IncrementalSVD.from_factors(torch.eye(k, device=self.device), self._sig[key],
                                                   self._master[key], rank=cap, tol=self.tol,
                                                   store_dtype=torch.float32, device=self.device)
            isvd.update(x)
            knew = isvd.k
            buf = self._buf[key]
            buf.zero_()
            self._master[key] = isvd.B.float().contiguous()
            buf[:knew] = self._master[key].T.to(buf.dtype)
            self._sig[key] = isvd.S.float().clone()
            # coordinates on the stored (rounded) bases: C_new = C_old @ (B_old^T B_new)
            step[key] = old[key] @ buf[:knew].float().T  # [k_old, k_new]
        self.rows_seen += self._pending_rows
        self._pending_rows = 0
        self.version += 1
        self._steps[self.version] = step
        if self.auto_rotate:
            for p in self.live_patches():
                self.rotate(p)
        return True

    def prune_history(self, upto: Optional[int] = None) -> int:
        """Drop step transforms for versions <= ``upto`` (default: oldest version of any live patch).

        Patches (or stored coefficient sets) older than that can no longer be rotated. Returns bytes freed.
        """
        if upto is None:
            live = [int(p.meta["basis_version"]) for p in self.live_patches()]
            upto = min(live) if live else self.version
        before = self.history_bytes()
        for v in [v for v in self._steps if v <= upto]:
            del self._steps[v]
        return before - self.history_bytes()

    # ------------------------------------------------------------------ issuing patches
    @torch.no_grad()
    def encode(self, deficit: ChunkKV, rank: Optional[int] = None, *, rope_rank: Optional[int] = None,
               register: bool = True, meta: Optional[dict[str, str]] = None) -> Patch:
        """A Patch with ``us = Δ·Bₘ`` [S, m] and ``vt = Bₘᵀ`` (a view of the shared buffer).

        ``rank=None`` uses the whole current basis. For MLA the rope slot (k_pe) uses ``rope_rank``
        (default ``max(1, m // 4)`` when ``rank`` is given, as ``patch_from_deficit``).
        """
        self._check(deficit, "encode")
        if self._pending_rows:
            self.flush()
        if all(self.k(*key) == 0 for key in self._keys):
            raise KVShapeError("the shared basis is empty: observe() some deficits first")
        m = None if rank is None else int(rank)
        if m is not None and m < 1:
            raise KVShapeError(f"patch rank must be >= 1, got {rank}")
        if rope_rank is None and self.layout.family == "mla" and m is not None:
            rope_rank = max(1, m // 4)
        factors, energy = {}, {}
        for key in self._keys:
            l, s = key
            is_rope = self.layout.family == "mla" and s == self.layout.rope_slot
            want = rope_rank if (is_rope and rope_rank is not None) else m
            w = self.k(*key) if want is None else min(int(want), self.k(*key))
            x = as_matrix(deficit.layers[l][s]).to(self.device)
            vt = self._buf[key][:w]
            c = x @ vt.float().T  # [S, w]
            factors[key] = (c.to(self.dtype), vt)
            energy[key] = (float((c ** 2).sum()), float((x ** 2).sum()))
        full = max(max(self.k(*key) for key in self._keys), 1)
        pm = dict(meta or {})
        pm.update({"kind": pm.get("kind", "basis"), "basis": self.uid, "basis_version": str(self.version)})
        p = Patch(factors, self.layout, deficit.num_tokens, m if m is not None else full,
                  rope_rank if rope_rank is not None else (m if m is not None else full), energy, pm)
        if register:
            self.register(p)
        return p

    def register(self, patch: Patch) -> Patch:
        """Track a basis-backed patch (weakly) so ``observe`` rotates it when the basis moves."""
        self._own(patch)
        pid = next(self._pids)
        patch.meta["basis_patch"] = str(pid)
        self._registry[pid] = weakref.ref(patch)
        return patch

    def unregister(self, patch: Patch) -> None:
        pid = patch.meta.pop("basis_patch", None)
        if pid is not None:
            self._registry.pop(int(pid), None)

    def _own(self, patch: Patch) -> None:
        if patch.meta.get("basis") != self.uid:
            raise KVShapeError(f"patch is not backed by {self.uid} (meta basis={patch.meta.get('basis')!r})")
        v = int(patch.meta.get("basis_version", -1))
        if v > self.version or v < 0:
            raise KVShapeError(f"patch basis version {v} outside 0..{self.version}")

    def is_current(self, patch: Patch) -> bool:
        self._own(patch)
        return int(patch.meta["basis_version"]) == self.version

    @torch.no_grad()
    def rotate(self, patch: Patch, *, keep_width: bool = False) -> Patch:
        """Bring a patch's coefficients from its recorded basis version to the current one, in place.

        Exact (same Δ̂) unless a direction was truncated away by the rank cap. The width grows to the
        current k (rank growth); ``keep_width=True`` keeps each layer-slot's width and projects onto the
        leading new directions instead. Returns the patch.
        """
        self._own(patch)
        v = int(patch.meta["basis_version"])
        if v == self.version:
            return patch
        missing = [u for u in range(v + 1, self.version + 1) if u not in self._steps]
        if missing:
            raise KVShapeError(f"cannot rotate from basis version {v}: step transforms {missing} were pruned")
        for key, (us, _) in list(patch.factors.items()):
            c = us.float().to(self.device)
            for u in range(v + 1, self.version + 1):
                t = self._steps[u].get(key)
                if t is not None:
                    c = c @ t[: c.shape[1]]
            w = min(us.shape[1], self.k(*key)) if keep_width else c.shape[1]
            patch.factors[key] = (c[:, :w].to(us.dtype), self._buf[key][:w])
        patch.meta["basis_version"] = str(self.version)
        return patch

    # ------------------------------------------------------------------ storage helpers
    def strip(self, patch: Patch) -> Patch:
        """A coefficient-only copy for storage: ``vt`` replaced by an empty [w, 0] tensor (0 bytes).

        Bring it back with ``attach``; it records the basis version its coefficients are on.
        """
        self._own(patch)
        f = {key: (u.detach().clone(), u.new_zeros(u.shape[1], 0)) for key, (u, _) in patch.factors.items()}
        meta = {k: v for k, v in patch.meta.items() if k != "basis_patch"}
        meta["basis_stripped"] = "1"
        return Patch(f, patch.layout, patch.num_tokens, patch.rank, patch.rope_rank, dict(patch.energy), meta)

    def attach(self, patch: Patch, *, register: bool = False, keep_width: bool = False) -> Patch:
        """Inverse of ``strip``: shared ``vt`` views back in, coefficients rotated to the current version."""
        self._own(patch)
        v = int(patch.meta["basis_version"])
        # put views of the basis the coefficients were issued on: width checks only (rotate replaces them)
        f = {key: (u, self._buf[key][: u.shape[1]]) for key, (u, _) in patch.factors.items()}
        meta = {k: val for k, val in patch.meta.items() if k not in ("basis_stripped", "basis_patch")}
        meta["basis_version"] = str(v)
        p = Patch(f, patch.layout, patch.num_tokens, patch.rank, patch.rope_rank, dict(patch.energy), meta)
        self.rotate(p, keep_width=keep_width)
        if register:
            self.register(p)
        return p

    def detach(self, patch: Patch) -> Patch:
        """A self-contained copy (own ``vt``, not tracked): valid forever, no longer shares bytes."""
        self._own(patch)
        self.rotate(patch)
        f = {key: (u.clone(), v.clone()) for key, (u, v) in patch.factors.items()}
        meta = {k: v for k, v in patch.meta.items() if k not in ("basis", "basis_version", "basis_patch")}
        meta["kind"] = "basis-detached"
        return Patch(f, patch.layout, patch.num_tokens, patch.rank, patch.rope_rank, dict(patch.energy), meta)

    def __iter__(self) -> Iterator[Key]:
        return iter(self._keys)

    def __repr__(self) -> str:
        ks = sorted({self.k(*key) for key in self._keys})
        return (f"SharedPatchBasis({self.uid}, rank={self.rank}, version={self.version}, k={ks}, "
                f"rows_seen={self.rows_seen}, live_patches={len(self.live_patches())})")


def deficit_hat(patch: Patch, layer: int, slot: int) -> torch.Tensor:
    """Δ̂ = us @ vt [S, F] (fp32) of one layer-slot of any patch."""
    us, vt = patch.factors[(layer, slot)]
    return us.float() @ vt.float()


__all__ = ["SharedPatchBasis", "deficit_hat"]
