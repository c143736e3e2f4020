"""Window v0 against transformers' own forward over the window's tokens (the re-prefill ceiling)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import windowkit as wk
from windowkit.backends.tiny import build
from windowkit.kv import kl_divergence


from model_helpers import llama, mla  # noqa: E402,F401  (module-scoped fixtures, tests/model_helpers.py)


from model_helpers import reference_logits, text  # noqa: E402,F401  (tests/model_helpers.py)


QUERY = torch.tensor([11, 12, 13, 14])


@pytest.mark.parametrize("mode", ["exact", "patch"])
def test_admit_only_window_equals_fresh_prefill(llama, mode):
    """Admission keeps the chunk's conditioned prefill, so an admit-only window is exact at any rank."""
    win = wk.Window(llama, mode=mode, rank=4)
    chunks = [text(llama, 12 + i, i) for i in range(4)]
    for c in chunks:
        win.admit(c)
    assert kl_divergence(reference_logits(llama, chunks, QUERY), win.forward(QUERY)) <= 1e-6
    pos = win.window_kv().positions[0]
    assert torch.equal(pos, torch.arange(win.next_position))


def test_window_with_prefix(mla):
    prefix = text(mla, 7, 99, "sys")
    win = wk.Window(mla, mode="patch", prefix=prefix)
    chunks = [text(mla, 10, 40 + i) for i in range(3)]
    for c in chunks:
        win.admit(c)
    assert win.starts() == [7, 17, 27]
    assert kl_divergence(reference_logits(mla, chunks, QUERY, prefix), win.forward(QUERY)) <= 1e-6


def test_forward_does_not_change_the_window(llama):
    win = wk.Window(llama, mode="patch")
    for i in range(3):
        win.admit(text(llama, 9, 60 + i))
    before = win.window_kv()
    l1 = win.forward(QUERY)
    l2 = win.forward(QUERY)
    after = win.window_kv()
    assert torch.equal(l1, l2)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(before.layers, after.layers))


def test_generate_matches_transformers_greedy(llama):
    chunks = [text(llama, 10, 70 + i) for i in range(3)]
    win = wk.Window(llama, mode="exact")
    for c in chunks:
        win.admit(c)
    ids = torch.cat([c.input_ids for c in chunks] + [QUERY])
    with torch.no_grad():
        ref = llama.model.generate(ids[None], max_new_tokens=6, do_sample=False, pad_token_id=0)[0, len(ids):]
    assert win.generate(QUERY, max_new_tokens=6) == ref.tolist()


def test_survivors_relocate_and_recall_gets_a_fresh_patch(llama):
    """Slide a window of 3 over 6 chunks, then recall the first: the fresh patch on its new context beats
    replaying the patch frozen at its first admission (the paper's stale-patch finding)."""
    cs = [text(llama, 16, 100 + i) for i in range(6)]
    win = wk.Window(llama, mode="patch", rank=8, form="eager", repair="none")
    for c in cs[:3]:
        win.admit(c)
    forms0 = win.stats.patch_forms
    for c in cs[3:]:
        win.evict("head")
        win.admit(c)
    assert win.ids == [c.id for c in cs[3:]]
    assert win.stats.relocations > 0
    win.evict("head")
    win.recall(cs[0].id)
    assert win.ids == [cs[4].id, cs[5].id, cs[0].id]
    # every admit after the first eviction, and the recall, runs its conditioned forward over kept-as-is
    # (stale) survivors: that KV is not KV(B | context), so no patch is stored for the context (it would be
    # served as exact later: tests/test_window_oracles.py::test_patch_formed_on_a_stale_past_is_not_served_as_exact)
    assert win.stats.patch_forms == forms0 == 2
    ref = reference_logits(llama, [cs[4], cs[5], cs[0]], QUERY)
    kl_win = kl_divergence(ref, win.forward(QUERY))
    blind = wk.Window(llama, mode="blind")
    for c in (cs[4], cs[5], cs[0]):
        blind.admit(c)
    kl_blind = kl_divergence(ref, blind.forward(QUERY))
    assert kl_win < kl_blind, (kl_win, kl_blind)


def test_reorder_uses_orbit_patch_and_context_reuse(llama):
    cs = [text(llama, 12, 200 + i, f"r{i}") for i in range(3)]
    win = wk.Window(llama, mode="patch", rank=16, form="eager", repair="none")
    for c in cs:
        win.admit(c)
    win.reorder(["r2", "r0", "r1"])
    order = [cs[2], cs[0], cs[1]]
    ref = reference_logits(llama, order, QUERY)
    kl_patch = kl_divergence(ref, win.forward(QUERY))
    blind = wk.Window(llama, mode="blind")
    for c in order:
        blind.admit(c)
    kl_blind = kl_divergence(ref, blind.forward(QUERY))
    assert kl_patch < kl_blind, (kl_patch, kl_blind)
    # the same context recurring reuses the stored patch: no new forms, no new forwards for it
    win2 = wk.Window(llama, store=win.store, mode="patch", rank=16, form="eager", repair="none")
    for c in cs:
        win2.admit(c)
    forms, fwd = win2.stats.patch_forms, win2.stats.forwards
    # (the head chunk needs no patch: with nothing in front, its canonical is exact)
    assert forms == 0 and win2.stats.patch_reuses == 2 and fwd == 0


def test_assign_diffs_into_edits(llama):
    cs = {i: text(llama, 8, 300 + i, f"a{i}") for i in range(6)}
    win = wk.Window(llama, mode="exact")
    win.assign([cs[0], cs[1], cs[2]])
    assert win.ids == ["a0", "a1", "a2"]
    win.assign([cs[1], cs[2], cs[3]])
    assert win.ids == ["a1", "a2", "a3"] and win.evicted_ids == ["a0"]
    edits = win.assign([cs[0], cs[3], cs[1]])
    assert win.ids == ["a0", "a3", "a1"]
    # a3 stays; a1 and a2 are not in the wanted order or set... a2 evicted, a1 moved, a0 recalled
    assert ("evict", "a2") in edits and ("recall", "a0") in edits
    ref = reference_logits(llama, [cs[0], cs[3], cs[1]], QUERY)
    assert kl_divergence(ref, win.forward(QUERY)) <= 1e-6


def test_a_slide_repairs_a_survivor_behind_the_new_chunk_once(llama):
    """A slide in front of a question ([f0 f1 f2 q] -> [f1 f2 f3 q]): f1 and f2 are repaired before f3 is
    admitted behind them (f3 is conditioned on them), and q, behind f3, is repaired once, on the context it ends
    with (repairing it after the eviction too would pay its tokens twice for the same KV). With every stale
    survivor recomputed wholly the window equals transformers' forward over the new order."""
    fs = [text(llama, 8, 2600 + i, f"f{i}") for i in range(5)]
    q = text(llama, 6, 2599, "q")
    win = wk.Window(llama, mode="patch", repair="all", cap=False)  # the edit itself, not the step cap's choice
    win.assign(fs[:3] + [q])
    win.forward(QUERY)
    for s in (3, 4):
        r0 = win.stats.repaired_tokens
        want = fs[s - 2:s + 1] + [q]
        win.assign(want)
        logits = win.forward(QUERY)
        assert win.stats.repaired_tokens - r0 == len(fs[s - 2]) + len(fs[s - 1]) + len(q)  # 8 + 8 + 6, not + 6
        assert kl_divergence(reference_logits(llama, want, QUERY), logits) <= 1e-6
    # a look-back in front of every survivor: they are stale after the eviction and again after it lands, and are
    # repaired once, after it
    r0 = win.stats.repaired_tokens
    want = [fs[0], fs[3], fs[4], q]
    win.assign(want)
    assert kl_divergence(reference_logits(llama, want, QUERY), win.forward(QUERY)) <= 1e-6
    assert win.stats.repaired_tokens - r0 == len(fs[3]) + len(fs[4]) + len(q)


def test_assign_refuses_an_id_reused_for_other_content(llama):
    """assign matches chunks by id; new content under a known id would silently reuse the old KV."""
    a, b = text(llama, 8, 400, "a"), text(llama, 8, 401, "b")
    win = wk.Window(llama, mode="exact")
    win.assign([a, b])
    win.assign([b])  # a evicted, still known
    same = text(llama, 8, 400, "a")  # an equal chunk object under the same id is fine
    assert win.assign([same, b]) == [("recall", "a")] and win.ids == ["a", "b"]
    other = text(llama, 8, 402, "a")
    with pytest.raises(wk.ChunkError, match="already known with other content"):
        win.assign([other, b])
    assert win.ids == ["a", "b"]  # nothing edited


def test_assign_moves_the_fewest_chunks(llama):
    cs = {n: text(llama, 6, 900 + i, n) for i, n in enumerate("abcdefg")}
    win = wk.Window(llama, mode="patch", rank=4, cap=False)  # the edit matching itself, without the step cap
    win.assign([cs[n] for n in "abcdef"])
    edits = win.assign([cs[n] for n in "bcdefa"])  # rotate by one: move only "a"
    assert edits == [("evict", "a"), ("recall", "a")]
    edits = win.assign([cs[n] for n in "bcgdefa"])  # one new chunk in the middle
    assert edits == [("admit", "g")]
    edits = win.assign([cs[n] for n in "afedgcb"])  # mostly reversed: one reorder beats many moves
    assert [op for op, _ in edits] == ["reorder"]
    assert win.ids == list("afedgcb")


def test_window_errors(llama):
    win = wk.Window(llama)
    c = text(llama, 5, 400, "x")
    with pytest.raises(wk.ChunkNotFoundError):
        win.evict("head")
    win.admit(c)
    with pytest.raises(wk.WindowkitError):
        win.admit(c)
    with pytest.raises(wk.ChunkNotFoundError):
        win.evict("nope")
    with pytest.raises(wk.ChunkNotFoundError):
        win.recall("never-seen")
    with pytest.raises(wk.WindowkitError):
        win.reorder(["x", "y"])
    with pytest.raises(wk.WindowkitError):
        wk.Window(llama, mode="fast")
    with pytest.raises(wk.ChunkError):
        win.admit("not a chunk")


# ----------------------------------------------------------------------------- property test
ops = st.lists(st.tuples(st.sampled_from(["admit", "evict_head", "evict_tail", "evict_mid", "recall", "reorder"]),
                         st.integers(0, 1000)), min_size=3, max_size=9)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seq=ops)
def test_random_edit_sequences(llama, seq):
    """Exact mode always equals a fresh prefill of its contents; positions stay contiguous in every
    mode; evict then recall restores the same content."""
    budget = 120_000  # bytes: a few canonicals and patches; forces store evictions
    stores = {m: wk.ChunkStore(budget_bytes=budget, model_fingerprint=llama.fingerprint(), layout=llama.layout)
              for m in ("exact", "patch", "blind")}
    wins = {m: wk.Window(llama, store=stores[m], mode=m, rank=8, orbit_samples=3) for m in ("exact", "patch", "blind")}
    pool = [text(llama, 5 + (i % 4), 500 + i, f"p{i}") for i in range(8)]
    fresh = iter(pool)
    contents: list = []
    evicted: list = []
    for op, r in seq:
        if op == "admit":
            c = next(fresh, None)
            if c is None:
                continue
            for w in wins.values():
                w.admit(c)
            contents.append(c)
        elif op.startswith("evict") and contents:
            idx = {"evict_head": 0, "evict_tail": len(contents) - 1, "evict_mid": r % len(contents)}[op]
            c = contents.pop(idx)
            for w in wins.values():
                assert w.evict(c.id if op == "evict_mid" else op.split("_")[1]) == c.id
            evicted.append(c)
        elif op == "recall" and evicted:
            c = evicted.pop(r % len(evicted))
            at = r % (len(contents) + 1)
            for w in wins.values():
                w.recall(c.id, at=at)
            contents.insert(at, c)
        elif op == "reorder" and len(contents) > 1:
            g = torch.Generator().manual_seed(r)
            contents = [contents[i] for i in torch.randperm(len(contents), generator=g).tolist()]
            for w in wins.values():
                w.reorder([c.id for c in contents])
        for w in wins.values():
            assert w.ids == [c.id for c in contents]
            assert w.store.nbytes <= budget
    if not contents:
        return
    ref = reference_logits(llama, contents, QUERY)
    assert kl_divergence(ref, wins["exact"].forward(QUERY)) <= 1e-6
    for m in ("patch", "blind"):
        kv = wins[m].window_kv()
        assert torch.equal(kv.positions[0], torch.arange(sum(len(c) for c in contents)))
        assert torch.isfinite(wins[m].forward(QUERY)).all()
    # every token of every chunk is where a fresh prefill would put it
    toks = torch.cat([c.input_ids for c in contents])
    assert torch.equal(torch.cat([wins["patch"].chunk(i).input_ids for i in wins["patch"].ids]), toks)


def test_fork_is_copy_on_write_and_clean_fork_reconditions(llama):
    cs = [text(llama, 10, 600 + i, f"f{i}") for i in range(3)]
    win = wk.Window(llama, mode="patch", rank=None, form="eager", repair="none")
    for c in cs:
        win.admit(c)
    ref = reference_logits(llama, cs, QUERY)
    fork = win.fork()
    fork.evict("head")
    assert win.ids == ["f0", "f1", "f2"] and fork.ids == ["f1", "f2"]
    assert kl_divergence(ref, win.forward(QUERY)) <= 1e-6  # the parent is untouched by the fork's edit
    clean = win.fork(clean=True)
    blind = wk.Window(llama, mode="blind")
    for c in cs:
        blind.admit(c)
    assert kl_divergence(blind.forward(QUERY), clean.forward(QUERY)) <= 1e-9  # context-clean = canonical view
    clean.recondition()  # full-rank stored patches: back to exact, with no new forward
    assert clean.stats.forwards == 0
    assert kl_divergence(ref, clean.forward(QUERY)) <= 1e-6


def test_is_disposable_matches_brute_force(llama):
    cs = [text(llama, 10, 700 + i, f"d{i}") for i in range(3)]
    win = wk.Window(llama, mode="patch", rank=None)
    for c in cs:
        win.admit(c)
    for cid in win.ids:
        # brute force: a window where that one chunk is blind, everything else conditioned
        expect_same = None
        order = [c for c in cs]
        full = reference_logits(llama, order, QUERY)
        parts = []
        for j, c in enumerate(order):
            kv = win._kv_at(win._entries[j], win.starts()[j])
            if c.id == cid:
                kv = wk.kv.place(llama.encode(c), win.starts()[j], llama.rope)
            parts.append(kv)
        logits = llama.forward([wk.Chunk.text(QUERY)], win.next_position, wk.kv.concat(parts)).logits
        expect_same = int(full.argmax()) == int(logits.argmax())
        assert win.is_disposable(cid, QUERY) == expect_same
    assert win.is_disposable("d0", QUERY)  # the head has no conditioning to drop


@pytest.mark.parametrize("cascade", ["plan", "apply"])
def test_recall_cascade_is_computed_and_applied(llama, cascade):
    """[a b c] -evict b-> [a c] -admit d-> [a c d] -recall b at 1-> [a b c d]. d's patch was formed on c,
    whose conditioning changes with b back: the cascade lists d; "apply" re-conditions it and the window
    (full rank) equals a fresh prefill again."""
    a, b, c, d = (text(llama, 9, 800 + i, n) for i, n in enumerate("abcd"))
    win = wk.Window(llama, mode="patch", rank=None, cascade=cascade, form="eager", repair="none")
    for x in (a, b, c):
        win.admit(x)
    win.evict("b")
    assert win.graph.is_stale("c", win._entries[1].ctx)  # c's patch was formed on the evicted b
    win.admit(d)
    win.recall("b", at=1)
    assert win.ids == ["a", "b", "c", "d"]
    assert "d" in win.last_cascade.ids and win.last_cascade.total_ms >= 0
    ref = reference_logits(llama, [a, b, c, d], QUERY)
    kl = kl_divergence(ref, win.forward(QUERY))
    refresh = [e.chunk_id for e in win.plan() if e.op == "refresh-patch"]
    if cascade == "apply":
        assert kl <= 1e-6 and refresh == []
    else:
        assert refresh == ["d"] and kl > 1e-6
        win.recondition()
        assert kl_divergence(ref, win.forward(QUERY)) <= 1e-6


def test_superset_context_rebuilds_and_limited_recondition(llama):
    """[a c] -> recall b at 1 -> [a b c]: c's context grew (superset of the one it was formed on): plan()
    flags it for rebuild, "apply" rebuilds it; recondition(limit=1) refreshes the most diverged first."""
    a, b, c = (text(llama, 8, 1000 + i, n) for i, n in enumerate("abc"))
    for cascade in ("plan", "apply"):
        win = wk.Window(llama, mode="patch", rank=None, cascade=cascade, form="eager", repair="none")
        win.admit(a)
        win.admit(b)
        win.evict("b")
        win.admit(c)  # formed on (a)
        win.recall("b", at=1)
        ref = reference_logits(llama, [a, b, c], QUERY)
        if cascade == "apply":
            assert kl_divergence(ref, win.forward(QUERY)) <= 1e-6
        else:
            (edit,) = [e for e in win.plan() if e.op == "refresh-patch"]
            assert edit.chunk_id == "c" and edit.rebuild and 0 < edit.divergence < 1
            assert win.recondition(limit=1) == ["c"]
            assert kl_divergence(ref, win.forward(QUERY)) <= 1e-6


def test_removal_patches_recondition_survivors(mla):
    """removal_patches=True: after an eviction the survivors are re-conditioned on what is left, so a
    full-rank window equals a fresh prefill of the survivors (keep-as-is does not)."""
    cs = [text(mla, 10, 1100 + i, f"s{i}") for i in range(3)]
    ref = reference_logits(mla, cs[1:], QUERY)
    kls = {}
    for flag in (False, True):
        win = wk.Window(mla, mode="patch", rank=None, removal_patches=flag, repair="none")
        for c in cs:
            win.admit(c)
        win.evict("head")
        kls[flag] = kl_divergence(ref, win.forward(QUERY))
    assert kls[True] <= 1e-6 < kls[False], kls


def test_vision_tower_runs_once_per_image_chunk():
    """An image chunk admitted, evicted, recalled and moved never re-runs the vision tower."""
    from windowkit.backends.tiny import synthetic_image_chunk

    be = wk.HFBackend(build("tiny-qwen2.5-vl"))
    imgs = [synthetic_image_chunk(be.model, (1, 4, 4), seed=i, id=f"img{i}") for i in range(3)]
    win = wk.Window(be, mode="patch", rank=8)
    for c in imgs:
        win.admit(c)
    win.flush()  # admissions behind a chunk are deferred to the next read: run them now
    assert win.stats.vision_calls == 3
    win.evict("head")
    win.recall("img0", at=1)
    win.reorder(["img0", "img2", "img1"])
    assert torch.isfinite(win.forward(torch.tensor([11, 12]))).all()
    assert win.stats.vision_calls == 3


def test_lazy_forming_skips_canonical_encodes(llama):
    """form="lazy" (keep-as-is survivors here): a sliding window with a recall does one forward per admitted or
    recalled chunk and no canonical encode beyond the first chunk's (its prefill at position 0 is its canonical).
    (The default fidelity adds one repair forward per edit that leaves stale survivors: tests/test_repair.py.)"""
    cs = [text(llama, 12, 1200 + i, f"z{i}") for i in range(5)]
    outs, stats = {}, {}
    for form in ("eager", "lazy"):
        win = wk.Window(llama, mode="patch", rank=8, form=form, repair="none")
        for c in cs[:3]:
            win.admit(c)
        for c in cs[3:]:
            win.evict("head")
            win.admit(c)
        win.recall("z1", at=1)
        outs[form], stats[form] = win.forward(QUERY), win.stats
    assert stats["lazy"].encodes == 1  # only z0 at the head: its prefill at 0 is its canonical
    assert stats["eager"].encodes > stats["lazy"].encodes
    assert stats["lazy"].patch_forms == 0
    # every admitted or recalled chunk prefilled once (6 x 12 tokens), in 5 forwards: admissions at the tail wait
    # for the next read or edit, so z1 and z2 (admitted back to back) run as one forward
    assert stats["lazy"].prefill_tokens == 6 * 12
    assert stats["lazy"].forwards == 5 < stats["eager"].forwards
    assert torch.isfinite(outs["lazy"]).all()


def test_window_with_shared_basis_reuses_rotated_coefficients(llama):
    """basis=SharedPatchBasis: fresh patches are stored as coefficients on a shared basis that keeps moving;
    a recurring context re-attaches them (rotated to the current basis) and, at full rank, is exact."""
    from windowkit.kv.basis import SharedPatchBasis

    basis = SharedPatchBasis(llama.layout, rank=64)
    cs = [text(llama, 10, 1300 + i, f"sb{i}") for i in range(4)]
    win = wk.Window(llama, mode="patch", rank=64, basis=basis, form="eager")
    for c in cs:
        win.admit(c)  # the basis moves with every formed patch
    win2 = wk.Window(llama, store=win.store, mode="patch", rank=64, basis=basis, form="eager")
    for c in cs:
        win2.admit(c)
    assert win2.stats.patch_reuses == 3 and win2.stats.forwards == 0
    assert kl_divergence(reference_logits(llama, cs, QUERY), win2.forward(QUERY)) <= 1e-6


# ---------------------------------------------------------------------------------------------- deferred forming
def test_default_defers_forming_to_need_or_prefetch(llama):
    """The default (form="lazy"): admissions at the tail and a recall to the tail into a new context are just
    their conditioned prefills (no canonical encode, no patch); a recall into a context the chunk was prefilled
    behind before reuses that exact KV (zero forwards); prefetch() forms canonicals and patches between steps,
    after which the same context recurring in another window costs zero forwards."""
    cs = [text(llama, 10, 1400 + i, f"d{i}") for i in range(4)]
    win = wk.Window(llama, rank=None, fidelity="fast")
    assert win.form == "lazy"
    for c in cs[:3]:
        win.admit(c)
    assert (win.stats.encodes, win.stats.patch_forms) == (1, 0)  # d0's prefill at 0 is its canonical
    win.evict("d2")  # the tail: no survivor behind it
    f0 = win.stats.forwards
    win.recall("d2")  # back behind (d0, d1): the exact KV it was prefilled with there, relocated, no forward
    assert win.stats.forwards == f0
    assert kl_divergence(reference_logits(llama, cs[:3], QUERY), win.forward(QUERY)) <= 1e-6
    win.evict("d2")
    p0, f0 = win.stats.prefill_tokens, win.stats.forwards
    win.admit(cs[3])
    win.recall("d2")  # behind (d0, d1, d3): a context it never had, no stored patch: its conditioned prefill
    assert win.stats.forwards == f0  # both prefills wait for the next read ...
    assert kl_divergence(reference_logits(llama, [cs[0], cs[1], cs[3], cs[2]], QUERY), win.forward(QUERY)) <= 1e-6
    # ... where they run with the query as one forward
    assert win.stats.forwards - f0 == 1 and win.stats.prefill_tokens - p0 == len(cs[3]) + len(cs[2])
    assert (win.stats.encodes, win.stats.patch_forms) == (1, 0)
    win.evict("d3")  # d2 behind (d0, d1) again: its stored conditioned KV makes it exact, free
    done = win.prefetch()
    # d1, d2 encoded once; their patches on (d0,), (d0, d1); no guess (the guess policy has seen one window)
    assert done == {"encodes": 2, "patch_forms": 2, "guess": None, "prefilled": 0}
    assert win.prefetch() == {"encodes": 0, "patch_forms": 0, "guess": None, "prefilled": 0}
    # the context recurs in another window on the same store: zero forwards, exact (d1 and d2 take the exact KV
    # kept for that context before the patches prefetch() formed for it: those approximate it below full rank)
    win2 = wk.Window(llama, store=win.store, rank=None)
    for c in cs[:3]:
        win2.admit(c)
    assert win2.stats.forwards == 0 and win2.stats.patch_reuses == 0 and win2.stats.reused_tokens == 20
    assert kl_divergence(reference_logits(llama, cs[:3], QUERY), win2.forward(QUERY)) <= 1e-6


def test_look_back_served_from_kept_copies_is_one_forward(llama):
    """A look-back whose recalled chunks sit behind contexts they had before (their exact conditioned copies, kept
    by earlier steps) and whose only new chunk is at the tail: the recalls are placed with no forward and the new
    chunk's prefill rides with the query, ONE model forward for the step, equal to the model's own forward."""
    cs = [text(llama, 9, 1600 + i, f"s{i}") for i in range(6)]
    bos = text(llama, 2, 1599, "bos")
    win = wk.Window(llama, prefix=bos)  # the default budget (an exact one batches no repair in front of s5)
    for want in ([1, 2], [3, 4]):  # s1, s2 prefilled behind [bos], [bos, s1]; then another pair
        win.assign([cs[i] for i in want])
        win.forward(QUERY)
        win.flush()
    f0, p0 = llama.stats.forwards, win.stats.prefill_tokens
    look = [cs[1], cs[2], cs[5]]  # s1, s2 behind the contexts of their kept copies, s5 new
    win.assign(look)
    logits = win.forward(QUERY)
    assert llama.stats.forwards - f0 == 1  # the query's forward carries s5's prefill
    assert win.stats.prefill_tokens - p0 == len(cs[5])
    assert kl_divergence(reference_logits(llama, look, QUERY, prefix=bos), logits) <= 1e-6


@pytest.mark.parametrize("fidelity", ["balanced", "exact"])
def test_prefetch_next_prepares_the_next_slide(llama, fidelity):
    """``prefetch(next=win.ids[1:])`` between steps forms the survivors' exact conditioned KV with the head gone,
    in one idle forward. The slide is then ONE model forward (the new chunk's prefill riding with the query),
    prefilling only the new chunk, and equals transformers' own forward over the whole new window."""
    cs = [text(llama, 8, 1800 + i, f"p{i}") for i in range(7)]
    bos = text(llama, 3, 1799, "bos")
    win = wk.Window(llama, prefix=bos, fidelity=fidelity)
    win.assign(cs[:3])
    win.forward(QUERY)
    for s in range(3, 7):
        win.flush()
        assert win.prefetch(next=win.ids[1:]) == {"prefilled": 16}  # both survivors: new contexts
        assert win.prefetch(next=win.ids[1:]) == {"prefilled": 0}  # already prepared
        f0, p0 = llama.stats.forwards, win.stats.prefill_tokens
        want = cs[s - 2:s + 1]
        win.assign(want)
        logits = win.forward(QUERY)
        assert llama.stats.forwards - f0 == 1 and win.stats.prefill_tokens - p0 == len(cs[s])
        assert win.last_choice.route == "edit"
        assert kl_divergence(reference_logits(llama, want, QUERY, prefix=bos), logits) <= 1e-6


@pytest.mark.parametrize("fidelity", ["balanced", "exact"])
def test_prefetch_next_prepares_a_rewrite_the_agent_writes_in_place(llama, fidelity):
    """WebVoyager's context rule: the observation that leaves the last k turns into its text where it stood. The
    agent writes that text itself, so ``prefetch(next=[..., clip, ...])`` takes the new Chunk with the survivors
    behind it: one idle forward forms the clip's and the survivors' exact KV in their next contexts. The step
    then prefills only the new observation (one forward, with the query) and equals transformers' own forward
    over the whole new window, the clip admitted by the step's edits at its place."""
    task = text(llama, 5, 2300, "task")
    shots = [text(llama, 9, 2310 + i, f"shot{i}") for i in range(6)]
    clips = [text(llama, 4, 2330 + i, f"text{i}") for i in range(6)]
    bos = text(llama, 2, 2299, "bos")
    win = wk.Window(llama, prefix=bos, fidelity=fidelity)
    win.assign([task, *shots[:3]])
    win.forward(QUERY)
    for t in range(3, 6):
        win.flush()
        nxt = [task, *clips[:t - 2], *shots[t - 2:t]]  # shot t-3 becomes text t-3 where it stood
        assert win.prefetch(next=[x if x.id not in win else x.id for x in nxt]) == {
            "prefilled": len(clips[t - 3]) + 2 * len(shots[0])}  # the clip and the two shots behind it
        f0, p0 = llama.stats.forwards, win.stats.prefill_tokens
        want = nxt + [shots[t]]
        win.assign(want)
        logits = win.forward(QUERY)
        assert llama.stats.forwards - f0 == 1 and win.stats.prefill_tokens - p0 == len(shots[t])
        # the planner counts what the edits run: the new screenshot alone (the clip and the survivors are free)
        assert win.last_choice.route == "edit" and win.last_choice.edit_tokens == len(shots[t])
        assert win.ids == [c.id for c in want]
        assert kl_divergence(reference_logits(llama, want, QUERY, prefix=bos), logits) <= 1e-6
    with pytest.raises(wk.ChunkError, match="other content"):  # one id, one content (as assign)
        win.prefetch(next=[task.id, text(llama, 4, 2399, "text0")])
    with pytest.raises(wk.ChunkError, match="chunk ids or windowkit.Chunk"):
        win.prefetch(next=[task.id, 7])
    with pytest.raises(wk.ChunkNotFoundError):
        win.prefetch(next=["never-seen"])


def test_a_guessed_rewrite_brought_with_other_content_is_not_served(llama):
    """``prefetch(next=[a, clip, c])`` names a new chunk; the step brings other content under the same id (the agent
    wrote the clip again). What was prepared for the old content is neither planned on nor served: the planner's
    view has no exact KV for the new clip, and the step equals transformers' forward over the new window."""
    a, b, c = (text(llama, 6, 2400 + i, f"a{i}") for i in range(3))
    bos = text(llama, 2, 2399, "bos")
    win = wk.Window(llama, prefix=bos)
    win.assign([a, b, c])
    win.forward(QUERY)
    win.flush()
    old, new = text(llama, 4, 2410, "clip"), text(llama, 4, 2411, "clip")
    assert win.prefetch(next=["a0", old, "a2"]) == {"prefilled": 4 + 6}
    want = [a, new, c]
    view = win._view(want)
    assert not view.has_exact("clip", ("a0",)) and view.has_exact("a0", ())
    win.assign(want)
    assert kl_divergence(reference_logits(llama, want, QUERY, prefix=bos), win.forward(QUERY)) <= 1e-6


def test_a_prepared_step_recalls_the_question_behind_each_new_frame(llama):
    """A video agent's window keeps its question behind each new frame: [f0 f1 f2 q] -> [f1 f2 f3 q]. After
    ``prefetch(next=[f1, f2])`` the step takes the prepared route with the live question recalled behind the new
    frame: it prefills the frame and re-conditions the question (7 + 5 tokens, in one forward), with no store
    read of the prepared frames, and equals transformers' forward over the new window at every step."""
    fs = [text(llama, 7, 2300 + i, f"f{i}") for i in range(6)]
    q = text(llama, 5, 2399, "question")
    bos = text(llama, 2, 2298, "bos")
    win = wk.Window(llama, prefix=bos)
    win.assign(fs[:3] + [q])
    win.forward(QUERY)
    for t in range(3, 6):
        win.flush()
        win.prefetch(next=win.ids[1:-1])
        want = fs[t - 2:t + 1] + [q]
        p0, f0, r0 = win.stats.prefill_tokens, win.stats.forwards, win.stats.reused_tokens
        win.assign(want)
        logits = win.forward(QUERY)
        assert kl_divergence(reference_logits(llama, want, QUERY, prefix=bos), logits) <= 1e-6
        assert win.last_choice.route == "edit" and win.ids == [c.id for c in want]
        assert win.stats.prefill_tokens - p0 == 7 + 5  # (the query is not window prefill)
        assert win.stats.forwards - f0 == 1
        assert win.stats.reused_tokens - r0 <= len(q)  # the prepared frames: no replay (at most the question's)


def test_a_prepared_step_takes_the_planners_choice_without_asking_it(llama, monkeypatch):
    """The step ``prefetch(next=...)`` prepared (the window unchanged since, the wanted window opening with the
    prepared chunks in their order, the rest of the window dropped or recalled behind them) gets the planner's own
    answer without running the planner: the same route, kept prefix and prefill, an edit bound no lower than the
    planner's. Any other step asks the planner: the window edited since, another order, a step where the prefix
    cache keeps every prepared chunk. Every step equals transformers' forward over the new window."""
    import windowkit.window.window as window_mod
    from windowkit.window.plan import choose_step

    asked = []
    monkeypatch.setattr(window_mod, "choose_step", lambda *a, **k: asked.append(a[1]) or choose_step(*a, **k))
    cs = [text(llama, 7, 2100 + i, f"r{i}") for i in range(9)]
    bos = text(llama, 2, 2099, "bos")
    win = wk.Window(llama, prefix=bos)

    def step(want):
        win.assign(want)
        logits = win.forward(QUERY)
        assert kl_divergence(reference_logits(llama, want, QUERY, prefix=bos), logits) <= 1e-6
        win.flush()

    step(cs[:3])
    win.prefetch(next=win.ids[1:])
    want = cs[1:4]
    planner = choose_step(win._view(want), [c.id for c in want], win.repair)
    n = len(asked)
    step(want)
    got = win.last_choice
    assert len(asked) == n and planner.route == got.route == "edit"
    assert (got.keep, got.prefill_tokens) == (planner.keep, planner.prefill_tokens)
    assert got.edit_tokens >= planner.edit_tokens
    from windowkit.graph.dependency import PatchRef
    for e in list(win._entries)[1:]:  # the graph (its links deferred off the step) reads what each one wears
        assert win.graph.current_patch(e.id) == PatchRef(e.id, e.ctx) and win.graph.antecedents(e.id, e.ctx) == e.ante
    win.prefetch(next=win.ids[1:])
    win.evict("head")
    win.recall("r1", at=0)  # the window is back where it was, but edited since the guess: the planner decides
    n = len(asked)
    step([cs[2], cs[3], cs[4]])
    assert len(asked) == n + 1
    win.prefetch(next=win.ids[1:])
    want = [cs[3], cs[4], cs[2]]  # the guess opens the step and the head moves behind it (a question kept at the
    planner = choose_step(win._view(want), [c.id for c in want], win.repair)  # tail): recalled there, unasked
    n = len(asked)
    step(want)
    got = win.last_choice
    assert len(asked) == n and planner.route == got.route == "edit"
    assert (got.keep, got.prefill_tokens) == (planner.keep, planner.prefill_tokens)
    assert got.edit_tokens >= planner.edit_tokens and win.ids == ["r3", "r4", "r2"]
    win.prefetch(next=win.ids[1:])
    win.admit(cs[5])  # the window changed since: the guess no longer holds
    step([cs[4], cs[2], cs[5], cs[6]])
    assert asked[-1] == ["r4", "r2", "r5", "r6"]
    win.prefetch(next=win.ids[1:])
    n = len(asked)
    step([cs[5], cs[2], cs[6], cs[7]])  # not the guessed order
    assert len(asked) == n + 1
    assert win.prefetch(next=win.ids[1:]) == {"prefilled": 14}  # r2's copy is in the store, not held: the
    n = len(asked)  # planner decides (it sees what the store holds at the step)
    step([cs[2], cs[6], cs[7], cs[8]])
    assert len(asked) == n + 1
    assert win.prefetch(next=["r6", "r7"]) == {"prefilled": 14}  # both made now, as for the first step above
    win.prefetch(next=[])  # a later guess replaces it (here: none)
    n = len(asked)
    step([cs[6], cs[7], cs[0]])
    assert len(asked) == n + 1
    win.prefetch(next=win.ids[1:])
    win.assign([cs[7], cs[0], cs[1]])  # no flush: the graph records of the step wait for the graph's next read
    win.forward(QUERY)
    twin = win.fork()  # a fork copies the graph as read now
    for g in (twin.graph, win.graph):
        for e in list(win._entries)[1:]:
            assert g.current_patch(e.id) == PatchRef(e.id, e.ctx) and g.antecedents(e.id, e.ctx) == e.ante
    fast = wk.Window(llama, prefix=bos, fidelity="fast")  # survivors kept as-is: stale after the eviction
    fast.assign(cs[:3])
    fast.forward(QUERY)
    fast.evict("head")
    fast.prefetch(next=fast.ids)  # their exact KV where they stand: the prefix cache keeps them too
    n = len(asked)
    fast.assign([cs[1], cs[2], cs[8]])  # ("fast" keeps its stale survivors: no exactness to compare here)
    assert len(asked) == n + 1 and fast.last_choice.keep == 2


def test_prefetch_next_wrong_guess_and_bad_input(llama):
    """A wrong guess costs its idle forward and nothing else (the step is what it would have been, exact); a
    guess that starts with what the window already holds exactly costs nothing; bad ids are refused."""
    cs = [text(llama, 6, 1900 + i, f"g{i}") for i in range(5)]
    win = wk.Window(llama, fidelity="exact")
    win.assign(cs[:3])
    win.forward(QUERY)
    assert win.prefetch(next=["g0", "g1"]) == {"prefilled": 0}  # the window's own exact KV
    assert win.prefetch(next=["g2", "g0"]) == {"prefilled": 12}  # g2 alone at 0 is its canonical; g0 behind it
    win.assign([cs[1], cs[3], cs[4]])  # not the guess
    assert kl_divergence(reference_logits(llama, [cs[1], cs[3], cs[4]], QUERY), win.forward(QUERY)) <= 1e-6
    with pytest.raises(wk.ChunkNotFoundError):
        win.prefetch(next=["g1", "never-seen"])
    with pytest.raises(wk.WindowkitError):
        win.prefetch(next=["g1", "g1"])
    assert win.ids == ["g1", "g3", "g4"]


def test_kept_conditioned_copies_are_written_between_steps(llama):
    """The exact conditioned KV a step keeps for later look-backs waits in the Window, not written on the step's
    path; look-ups see it while it waits. ``flush()`` (an agent's idle time) writes it, after which another window
    on the same store places that chunk behind that context with no forward, equal to the model's own forward;
    at most one step's copies ever wait."""
    from windowkit.store import conditioned_key, context_hash

    b, c = text(llama, 7, 1701, "b"), text(llama, 6, 1702, "c")
    win = wk.Window(llama, fidelity="exact")
    win.assign([b, c])
    win.forward(QUERY)
    key = conditioned_key(win._keys["c"], context_hash([win._keys["b"]]))
    assert not win.store.has_canonical(key)  # the step wrote no copy ...
    win.flush()
    assert win.store.has_canonical(key)  # ... its idle time did
    win2 = wk.Window(llama, store=win.store, fidelity="exact")
    f0 = llama.stats.forwards
    win2.assign([b, c])
    logits = win2.forward(QUERY)
    assert llama.stats.forwards - f0 == 1 and win2.stats.prefill_tokens == 0  # only the query's own forward
    assert kl_divergence(reference_logits(llama, [b, c], QUERY), logits) <= 1e-6
    many = [text(llama, 3, 1710 + i, f"m{i}") for i in range(40)]
    for i in range(0, 40, 2):  # 20 steps of 2 new chunks behind the head, never flushed
        win.assign([b, many[i], many[i + 1]])
        win.forward(QUERY)
        assert len(win._unkept) <= 64
    assert 1 <= len(win._unkept) <= 2  # each assign wrote the previous step's copies; this step's wait
    win.evict("head")  # any edit starts a new step: the copies waiting are written first
    assert not win._unkept


def test_prefetch_skips_patches_for_stale_chunks(llama):
    """A survivor kept as-is (formed on other antecedents) gets no patch for its current context from
    prefetch: its KV is not that context's conditioning."""
    cs = [text(llama, 8, 1500 + i, f"e{i}") for i in range(3)]
    win = wk.Window(llama, fidelity="fast")
    for c in cs:
        win.admit(c)
    win.evict("head")
    win.prefetch()
    assert win.stats.patch_forms == 0  # e1, e2 are stale (formed behind e0)
    assert all(win.store.has_canonical(win._keys[c.id]) for c in cs[1:])


@pytest.mark.parametrize("on_disk", [False, True])
def test_survivors_get_a_stored_context_back_for_free(llama, tmp_path, on_disk):
    """A survivor behind a context it was conditioned on before takes its stored exact KV (no forward), on an
    in-memory store (where the Window's known-context set skips the look-ups that cannot hit) and on a disk
    store (where every context is looked up). Exact budget: B, C; then A inserted in front re-conditions both
    (repair "all"); evicting A again puts C back behind [B], whose conditioned KV the store holds: the window
    [B, C] equals the model's own forward with no window forward at all (a miss would recompute C)."""
    b, c, a = text(llama, 7, 501, "b"), text(llama, 6, 502, "c"), text(llama, 5, 503, "a")
    store = wk.ChunkStore(tmp_path / "store", model_fingerprint=llama.fingerprint()) if on_disk else None
    win = wk.Window(llama, store=store, fidelity="exact")
    win.admit(b)
    win.admit(c)
    win.forward(QUERY)
    win.admit(a, at=0)
    assert kl_divergence(reference_logits(llama, [a, b, c], QUERY), win.forward(QUERY)) <= 1e-6
    win.evict("a")
    f0, p0 = win.stats.forwards, win.stats.prefill_tokens
    assert win.stale_ids() == []  # b is the head (its canonical), c is behind b again (its stored conditioned KV)
    assert kl_divergence(reference_logits(llama, [b, c], QUERY), win.forward(QUERY)) <= 1e-6
    assert (win.stats.forwards - f0, win.stats.prefill_tokens - p0) == (0, 0)  # no window forward (stats leave
    # the query's own forward out)


def test_a_look_back_to_a_kept_context_reads_the_stored_kv_as_is(llama):
    """[a b c] -> [a d] -> [a b c]: b and c return to the context and places they were conditioned in, so the step
    prefills nothing and reads their kept KV as is (no rotation, no patch: ``reused_as_is``), and its logits are
    re-prefill's. The simulator charges such reads nothing, as a prefix cache's hit on a branch it still holds."""
    a, b, c, d = text(llama, 6, 1), text(llama, 5, 2), text(llama, 7, 3), text(llama, 4, 4)
    q = torch.tensor([11, 12, 13])
    w = wk.Window(llama)
    got = []
    for chunks in ([a, b, c], [a, d], [a, b, c]):
        s0 = w.stats.as_dict()
        w.assign(chunks)
        logits = w.forward(q)
        assert kl_divergence(reference_logits(llama, chunks, q), logits) < 1e-6
        s1 = w.stats.as_dict()
        got.append(tuple(s1[k] - s0[k] for k in ("prefill_tokens", "reused_tokens", "reused_as_is", "relocations",
                                                   "patch_applies", "bytes_moved")))
    assert got == [(18, 0, 0, 0, 0, 0), (4, 0, 0, 0, 0, 0), (0, 12, 12, 0, 0, 0)]


def test_prefetch_prepares_the_next_slide_by_default(llama):
    """``Window()``'s guess policy ("slide"): ``prefetch()`` between steps of a regular slide [t, c_i, c_i+1, c_i+2]
    prepares the next step's survivors in the places they will have, so from the third step on a step prefills only
    its new chunk (its query is not in ``prefill_tokens``), with re-prefill's logits (the first slide, unguessed,
    has the default repair's); ``guess=None`` prepares nothing and prefills the survivors' repair instead. A fork
    continues from its own copy of the history."""
    task = text(llama, 6, 1600, "t")
    cs = [text(llama, 5 + i % 3, 1610 + i, f"s{i}") for i in range(8)]
    q = torch.tensor([11, 12, 13])
    spent, idle = {}, {}
    for guess in ("slide", None):
        win = wk.Window(llama, guess=guess)
        assert (win.guesser is None) == (guess is None)
        spent[guess], idle[guess] = [], []
        for i in range(6):
            chunks = [task, *cs[i:i + 3]]
            p0 = win.stats.prefill_tokens
            win.assign(chunks)
            kl = kl_divergence(reference_logits(llama, chunks, q), win.forward(q))
            if guess is not None and i != 1:  # step 1: the first slide, no guess yet (the default repair's KL)
                assert kl < 1e-6, (i, kl)
            spent[guess].append(win.stats.prefill_tokens - p0)
            done = win.prefetch()
            idle[guess].append(done["prefilled"])
            if guess is not None and i >= 1:  # from the first slide on: [t, s_i+1, s_i+2], the next survivors
                assert done["guess"] == ["t", cs[i + 1].id, cs[i + 2].id]
            if guess is None:
                assert done["guess"] is None and done["prefilled"] == 0
    assert spent["slide"][2:] == [len(cs[i + 2]) for i in range(2, 6)]  # only the new chunk
    assert all(s > n for s, n in zip(spent[None][2:], spent["slide"][2:]))  # the survivors' repair on top
    assert idle["slide"][0] == 0 and all(x > 0 for x in idle["slide"][1:])
    assert wk.Window(llama).guesser.counters == {"steps": 0, "guesses": 0, "prepared": 0, "hits": 0, "prefilled": 0,
                                                 "wasted": 0}
    win = wk.Window(llama)
    for i in range(3):
        win.assign([task, *cs[i:i + 3]])
        win.forward(q)
        win.prefetch()
    assert win.guesser.counters["hits"] == 1 and win.guesser.counters["prepared"] == 2
    fork = win.fork()
    assert fork.guesser is not win.guesser and fork.guesser.counters == win.guesser.counters
    with pytest.raises(wk.WindowkitError, match="unknown guess policy"):
        wk.Window(llama, guess="psychic")


def test_a_recall_takes_its_exact_kept_copy_before_a_patch(llama):
    """b was conditioned behind a and ``prefetch()`` also stored its rank-2 patch for that context; when [a b] comes
    back, b's exact kept KV is taken, not the patch (which approximates it): no patch applied, re-prefill's logits.
    The planner (``plan._place_tokens``) counts the exact copy first too."""
    a, b, c = text(llama, 9, 1700, "a"), text(llama, 8, 1701, "b"), text(llama, 7, 1702, "c")
    q = torch.tensor([11, 12, 13])
    w = wk.Window(llama, rank=2, guess=None)
    w.assign([a, b])
    w.forward(q)
    assert w.prefetch()["patch_forms"] == 1  # b's patch on (a,)
    w.assign([c])
    w.forward(q)
    s0 = w.stats.as_dict()
    w.assign([a, b])
    logits = w.forward(q)
    s1 = w.stats.as_dict()
    assert (s1["patch_applies"] - s0["patch_applies"], s1["patch_reuses"] - s0["patch_reuses"]) == (0, 0)
    assert s1["prefill_tokens"] == s0["prefill_tokens"]  # a's canonical, b's kept copy: no forward but the query's
    assert kl_divergence(reference_logits(llama, [a, b], q), logits) < 1e-6

