"""Public defaults tested as defaults: each call leaves the argument out and checks what the value does
(the rank of the patch held, the forwards an orbit costs, ...), not the attribute. The signatures are read
only to check that code and docs/window.md agree on the values.

Expected values are written here (EXPECTED); a default changed in code without this file and the docs
failing is what the test is for.
"""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

import windowkit as wk
from windowkit.backends.tiny import build
from windowkit.kv import form_patch, place
from windowkit.kv.patch import form_orbit_patch, form_removal_patch, patch_from_deficit, deficit
from windowkit.store import chunk_key, context_hash

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]

# the documented public defaults (docs/window.md, windowkit/kv/patch.py)
EXPECTED = {"rank": 32, "mode": "patch", "form": "lazy", "cascade": "plan", "removal_rank": 64,
            "orbit_samples": 24, "patch_layers": None, "svd": "exact", "removal_patches": False, "prefix": None,
            "store": None}


from model_helpers import llama, mla  # noqa: E402,F401  (module-scoped fixtures, tests/model_helpers.py)


from model_helpers import text  # noqa: E402  (tests/model_helpers.py)


def keep_as_is() -> dict:
    """Pin survivor repair off where this version has it, so one default is tested at a time."""
    return {"repair": "none"} if "repair" in inspect.signature(wk.Window.__init__).parameters else {}


def stored_patch(win, chunk, ante):
    fp = win.backend.fingerprint()
    return win.store.get_patch(chunk_key(chunk.content_hash(), fp),
                               context_hash([chunk_key(c.content_hash(), fp) for c in ante], prefix=""))


# ----------------------------------------------------------------------------- docs agree with code
def test_window_signature_matches_docs_and_expected():
    sig = {k: p.default for k, p in inspect.signature(wk.Window.__init__).parameters.items()
           if p.default is not inspect.Parameter.empty}
    for k, v in EXPECTED.items():
        assert sig[k] == v, f"Window default {k}={sig[k]!r}, expected {v!r} (update this test and docs/window.md)"
    block = re.search(r"```python\n(.*?)```", (ROOT / "docs/window.md").read_text(), re.S).group(1)
    doc = dict(re.findall(r"(\w+)=([^,\n)]+)", block.split("wk.Window(", 1)[1]))
    for k, v in doc.items():
        assert k in sig and repr(sig[k]).replace("'", '"') == v, f"docs/window.md says {k}={v}, code {sig.get(k)!r}"
    for k in EXPECTED:
        assert k in doc, f"docs/window.md's signature does not show the default of {k}"


def test_patch_function_defaults_match_expected():
    assert inspect.signature(form_patch).parameters["rank"].default == 32
    assert inspect.signature(form_orbit_patch).parameters["rank"].default == 32
    assert inspect.signature(form_removal_patch).parameters["rank"].default == 64
    assert inspect.signature(patch_from_deficit).parameters["rope_rank"].default is None
    assert inspect.signature(place).parameters["patch"].default is None


# ----------------------------------------------------------------------------- Window defaults, by effect
def test_default_rank_is_32_and_patches_every_layer(llama):
    """A default window's stored patch has rank 32 on every layer and slot (40 tokens x 64 features, so 32
    is a real truncation) and is the patch of an explicit rank=32, patch_layers=None, svd="exact" window."""
    a, b = text(llama, 20, 1, "a"), text(llama, 40, 2, "b")
    wins = [wk.Window(llama, form="eager"), wk.Window(llama, rank=32, patch_layers=None, svd="exact", form="eager")]
    for w in wins:
        w.admit(a)
        w.admit(b)
    p, q = (stored_patch(w, b, [a]) for w in wins)
    assert p.rank == 32 and p.layers == list(range(llama.layout.num_layers))
    for k, (us, vt) in p.factors.items():
        assert us.shape == (40, 32) and vt.shape == (32, 64), k
        assert torch.equal(us, q.factors[k][0]) and torch.equal(vt, q.factors[k][1])
    full = wk.Window(llama, rank=None, form="eager")
    full.admit(a)
    full.admit(b)
    assert stored_patch(full, b, [a]).factors[(1, 0)][0].shape[1] == 40  # rank=None keeps all min(40, 64)


def test_default_mode_is_patch(llama):
    """Default mode: per-chunk KV that relocates on an eviction (exact mode re-prefills and never relocates;
    blind mode drops the conditioning): the default window equals mode="patch" bit for bit."""
    cs = [text(llama, 10, 10 + i, f"m{i}") for i in range(3)]
    q = torch.tensor([11, 12])
    out = {}
    for mode in (None, "patch", "exact", "blind"):
        w = wk.Window(llama, **({} if mode is None else {"mode": mode}))
        for c in cs:
            w.admit(c)
        w.evict("head")
        out[mode] = (w.forward(q), w.stats.relocations)
    assert torch.equal(out[None][0], out["patch"][0]) and out[None][1] == out["patch"][1] > 0
    assert out["exact"][1] == 0
    assert not torch.equal(out[None][0], out["blind"][0])


def test_default_form(llama):
    """form="lazy" by default: an admission behind a chunk keeps its conditioned prefill only (one forward,
    no canonical encode, no patch); form="eager" also encodes the canonical and stores a patch."""
    a, b = text(llama, 12, 20, "a"), text(llama, 12, 21, "b")
    got = {}
    for form in (None, "eager"):
        w = wk.Window(llama, **({} if form is None else {"form": form}), **keep_as_is())
        w.admit(a)
        w.admit(b)
        w.flush()  # b's conditioned prefill waits for the next read; run it now
        got[form] = (w.stats.forwards, w.stats.encodes, w.stats.patch_forms, stored_patch(w, b, [a]) is not None)
    assert got["eager"] == (3, 2, 1, True)
    assert got[None] == {"lazy": (2, 1, 0, False), "eager": (3, 2, 1, True)}[EXPECTED["form"]]


def test_default_cascade_plans_but_does_not_apply(llama):
    """[a b c] -evict b-> [a c] -admit d-> -recall b at 1-> [a b c d]: the default lists d in the cascade and
    leaves it to recondition() (a refresh-patch in plan()); cascade="apply" re-conditions it at once."""
    a, b, c, d = (text(llama, 9, 30 + i, n) for i, n in enumerate("abcd"))
    refresh = {}
    for cascade in (None, "apply"):
        w = wk.Window(llama, rank=None, form="eager", **({} if cascade is None else {"cascade": cascade}),
                      **keep_as_is())
        for x in (a, b, c):
            w.admit(x)
        w.evict("b")
        w.admit(d)
        w.recall("b", at=1)
        assert "d" in w.last_cascade.ids
        refresh[cascade] = [e.chunk_id for e in w.plan() if e.op == "refresh-patch"]
    assert "d" in refresh[None] and "d" not in refresh["apply"]


def test_default_orbit_samples_is_24(llama):
    """Reorder [c0..c5] -> [c1 c0 c2 c3 c4 c5]: every chunk from index 1 has new antecedents; an orbit over
    K antecedents runs all K! orderings for K <= 4 and orbit_samples of them above: 1 + 2 + 6 + 24 + 24 = 57
    forwards by default, 1 + 2 + 6 + 24 + 2 = 35 with orbit_samples=2 (canonicals already stored: eager)."""
    cs = [text(llama, 4, 40 + i, f"o{i}") for i in range(6)]
    cost = {}
    for samples in (None, 2):
        w = wk.Window(llama, form="eager", **({} if samples is None else {"orbit_samples": samples}))
        for c in cs:
            w.admit(c)
        f0 = w.stats.forwards
        w.reorder(["o1", "o0", "o2", "o3", "o4", "o5"])
        cost[samples] = w.stats.forwards - f0
    assert cost == {None: 57, 2: 35}


def test_default_removal_rank_is_64(mla):
    """removal_patches=True with the default removal_rank equals removal_rank=64 bit for bit and differs from
    a rank-4 removal patch (the tiny models have 64 features per slot, so 64 is full rank here)."""
    cs = [text(mla, 70, 50 + i, f"s{i}") for i in range(3)]
    kvs = {}
    for rr in (None, 64, 4):
        w = wk.Window(mla, rank=None, removal_patches=True, form="eager",
                      **({} if rr is None else {"removal_rank": rr}))
        for c in cs:
            w.admit(c)
        w.evict("head")
        kvs[rr] = w.window_kv()
    same = all(torch.equal(x, y) for lx, ly in zip(kvs[None].layers, kvs[64].layers) for x, y in zip(lx, ly))
    diff = any(not torch.equal(x, y) for lx, ly in zip(kvs[None].layers, kvs[4].layers) for x, y in zip(lx, ly))
    assert same and diff


# ----------------------------------------------------------------------------- operator defaults
def _cond_and_canon(be, n_a=16, n_b=48):
    a, b = text(be, n_a, 60, "a"), text(be, n_b, 61, "b")
    kv_a = be.encode(a)
    cond = be.forward([b], start=n_a, past=kv_a).kv
    return cond, be.encode(b), n_a


def test_form_patch_default_rank_32_gqa(llama):
    cond, canon, delta = _cond_and_canon(llama)
    p = form_patch(cond, canon, delta, llama.rope)
    assert (p.rank, p.rope_rank) == (32, 32)  # GQA: keys and values both rank 32
    assert all(us.shape == (48, 32) for us, _ in p.factors.values())
    assert len(p.factors) == 2 * llama.layout.num_layers  # every layer, both slots


def test_mla_patch_splits_latent_and_rope_ranks(mla):
    """MLA: the latent gets rank m, the shared k_pe band m // 4 (32 -> 8 of its 16 dims); full rank keeps both."""
    cond, canon, delta = _cond_and_canon(mla)
    p = form_patch(cond, canon, delta, mla.rope)
    assert (p.rank, p.rope_rank) == (32, 8)
    for (l, slot), (us, vt) in p.factors.items():
        assert us.shape[1] == (8 if slot == mla.layout.rope_slot else 32), (l, slot)
    full = form_patch(cond, canon, delta, mla.rope, rank=None)
    assert full.rope_rank == full.rank  # no split at full rank
    assert full.factors[(0, 1)][0].shape[1] == 16 and full.factors[(0, 0)][0].shape[1] == 48
    # the split is what makes the patch: k_pe at rank 8 reconstructs less than at its full 16 dims
    d = deficit(cond, canon, delta, mla.rope)
    eight = patch_from_deficit(d, 32)
    sixteen = patch_from_deficit(d, 32, rope_rank=16)
    assert eight.tail_energy(1, 1) > sixteen.tail_energy(1, 1) and sixteen.tail_energy(1, 1) <= 1e-6 * sixteen.energy[(1, 1)][1]


def test_place_defaults_to_blind(llama):
    cond, canon, delta = _cond_and_canon(llama)
    placed = place(canon, delta, llama.rope)  # no patch: R(δ) only
    moved = canon.relocate(delta, llama.rope)
    assert all(torch.allclose(x, y, atol=1e-5) for lx, ly in zip(placed.layers, moved.layers) for x, y in zip(lx, ly))


def test_orbit_and_removal_patch_default_ranks(llama):
    cond, canon, delta = _cond_and_canon(llama, n_b=80)
    assert form_orbit_patch([cond], canon, delta, llama.rope).factors[(0, 0)][0].shape == (80, 32)
    assert form_removal_patch(cond, canon, delta, llama.rope).factors[(0, 0)][0].shape == (80, 64)


# ----------------------------------------------------------------------------- ChunkStore defaults
def test_chunkstore_defaults_unbounded_lru_no_shared(llama):
    """No budget: nothing is ever evicted; with a budget and the default policy the least recently used goes;
    no shared tier and no cold tier unless asked."""
    kvs = [llama.encode(text(llama, 8, 70 + i, f"x{i}")) for i in range(4)]
    s = wk.ChunkStore(model_fingerprint=llama.fingerprint(), layout=llama.layout)
    for i, kv in enumerate(kvs * 10):
        s.put_canonical(f"k{i}", kv)
    assert s.stats.evictions == 0 and all(s.has_canonical(f"k{i}") for i in range(40))
    assert s.shared is None if hasattr(s, "shared") else True
    probe = wk.ChunkStore(model_fingerprint=llama.fingerprint(), layout=llama.layout)
    probe.put_canonical("p", kvs[0])
    one = probe.nbytes  # payload of one entry as the budget counts it (KV + positions)
    lru = wk.ChunkStore(budget_bytes=3 * one, model_fingerprint=llama.fingerprint(), layout=llama.layout)
    for i in range(3):
        lru.put_canonical(f"k{i}", kvs[i])
    lru.get_canonical("k0")  # k0 used: k1 is now the least recently used
    lru.put_canonical("k3", kvs[3])
    assert [lru.has_canonical(f"k{i}") for i in range(4)] == [True, False, True, True]
