"""Survivor repair (``Window(repair=...)``, ``HFBackend.recompute``) against transformers' own forward.

Ground truth is the model itself: a re-prefill of the survivors (``model(input_ids=...)``), a direct forward of
a chunk's first tokens, and an independent token-by-token computation of CacheBlend semantics (each chosen
token run alone over a cache holding exactly what it may attend to: no 4-D mask involved).
"""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import windowkit as wk
from windowkit.backends.tiny import build
from windowkit.errors import ChunkError, UnsupportedModelError, WindowkitError
from windowkit.kv import kl_divergence
from windowkit.window import FIDELITY, RepairRule

QUERY = torch.tensor([11, 12, 13, 14])


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2"])
def be(request):
    return wk.HFBackend(build(request.param))


@pytest.fixture(scope="module")
def llama():
    return wk.HFBackend(build("tiny-llama"))


from model_helpers import reference_logits, text  # noqa: E402,F401  (tests/model_helpers.py)


def model_kv(be, ids):
    """The model's own KV of ``ids`` from position 0: per layer (K [H, S, D], V [H, S, D])."""
    with torch.no_grad():
        out = be.model(input_ids=ids[None], position_ids=torch.arange(len(ids))[None], use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]


def window_of(be, chunks, prefix=None, **kw):
    win = wk.Window(be, prefix=prefix, **kw)
    for c in chunks:
        win.admit(c)
    win.flush()  # the admissions' prefills wait for the next read: run them, so a test counts only its own op
    return win


# ---------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("with_prefix", [False, True])
def test_repair_all_after_head_eviction_equals_reprefill(be, with_prefix):
    prefix = text(be, 6, 90, "sys") if with_prefix else None
    chunks = [text(be, 10 + i, i) for i in range(4)]
    win = window_of(be, chunks, prefix, repair="all")
    win.evict("head")
    assert kl_divergence(reference_logits(be, chunks[1:], QUERY, prefix), win.forward(QUERY)) <= 1e-6
    assert win.stats.repaired_tokens == sum(len(c) for c in chunks[1:])
    assert not [e for e in win.plan() if e.op == "refresh-patch"]  # every survivor is exact for its context
    # keep-as-is is measurably not exact here: the repair is what closed the gap
    keep = window_of(be, chunks, prefix, repair="none")
    keep.evict("head")
    assert kl_divergence(reference_logits(be, chunks[1:], QUERY, prefix), keep.forward(QUERY)) > 1e-4


def test_repair_runs_before_the_next_admit(be):
    """evict + admit with repair "all" equals the re-prefill of survivors + the new chunk."""
    chunks = [text(be, 9, 10 + i) for i in range(5)]
    win = window_of(be, chunks[:4], repair="all")
    win.evict("head")
    win.admit(chunks[4])
    assert kl_divergence(reference_logits(be, chunks[1:], QUERY), win.forward(QUERY)) <= 1e-6


@pytest.mark.parametrize("edit", ["evict-middle", "admit-middle", "recall-middle"])
def test_repair_all_after_middle_edits_equals_reprefill(be, edit):
    chunks = [text(be, 8 + i, 20 + i) for i in range(5)]
    win = window_of(be, chunks[:4], repair="all")
    if edit == "evict-middle":
        win.evict(chunks[1].id)
        want = [chunks[0], chunks[2], chunks[3]]
    elif edit == "admit-middle":
        win.admit(chunks[4], at=2)
        want = chunks[:2] + [chunks[4]] + chunks[2:4]
    else:
        win.evict(chunks[3].id)  # the tail: no survivor behind it
        win.recall(chunks[3].id, at=1)
        want = [chunks[0], chunks[3], chunks[1], chunks[2]]
    assert win.ids == [c.id for c in want]
    assert kl_divergence(reference_logits(be, want, QUERY), win.forward(QUERY)) <= 1e-6


def test_recompute_with_every_token_chosen_equals_prefill(be):
    """HFBackend.recompute over a stale past, every survivor token chosen = a prefill of the survivors."""
    chunks = [text(be, 7 + i, 30 + i) for i in range(4)]
    win = window_of(be, chunks, repair="none")
    win.evict("head")  # survivors keep stale KV (conditioned on the evicted chunk), relocated
    past = win.window_kv()
    starts = win.starts()
    new = be.recompute(past, chunks[1:], starts, [torch.arange(len(c)) for c in chunks[1:]])
    ref = model_kv(be, torch.cat([c.input_ids for c in chunks[1:]]))
    off = 0
    for c, kv in zip(chunks[1:], new):
        for (k, v), (rk, rv) in zip(kv.layers, ref):
            assert torch.allclose(k, rk[:, off:off + len(c)], atol=1e-5)
            assert torch.allclose(v, rv[:, off:off + len(c)], atol=1e-5)
        assert torch.equal(kv.positions[0], torch.arange(off, off + len(c)))
        off += len(c)


def test_sink_with_only_the_head_stale_equals_a_direct_forward(be):
    """[A, B], evict A: B is the only stale survivor, at position 0. sink:N recomputes B's first N tokens;
    with nothing unchosen in front of them their fresh KV is the model's own forward of B[:N] at 0, and B's
    other tokens keep their stale KV (relocated)."""
    a, b = text(be, 9, 40), text(be, 12, 41)
    win = window_of(be, [a, b], repair="sink:4")
    stale = window_of(be, [a, b], repair="none")
    win.evict("head")
    stale.evict("head")
    got, kept = win.window_kv(), stale.window_kv()
    ref = model_kv(be, b.input_ids[:4])
    for (k, v), (sk, sv), (rk, rv) in zip(got.layers, kept.layers, ref):
        assert torch.allclose(k[:, :4], rk, atol=1e-5) and torch.allclose(v[:, :4], rv, atol=1e-5)
        assert torch.equal(k[:, 4:], sk[:, 4:]) and torch.equal(v[:, 4:], sv[:, 4:])
    assert win.stats.repaired_tokens == 4


def _blend_by_hand(be, past, ids, chosen):
    """CacheBlend semantics computed token by token with no mask: each chosen position p runs alone over a
    cache of [stale KV of unchosen positions < p] + [fresh KV of chosen positions < p], in position order."""
    fresh: dict[int, list] = {}
    for p in chosen:
        keep = [j for j in range(p) if j not in chosen]
        layers = []
        for l, (k, v) in enumerate(past.layers):
            ks = [k[:, j:j + 1] if j in keep else fresh[j][l][0] for j in range(p)]
            vs = [v[:, j:j + 1] if j in keep else fresh[j][l][1] for j in range(p)]
            layers.append((torch.cat(ks, 1)[None], torch.cat(vs, 1)[None]) if ks else None)
        cache = DynamicCache([x for x in layers]) if p > 0 else DynamicCache()
        with torch.no_grad():
            emb = be.model.get_input_embeddings()(ids[p:p + 1])[None]
            out = be.model(inputs_embeds=emb, position_ids=torch.tensor([[p]]), use_cache=True,
                           **{be.adapter.cache_kw: cache})
        c = getattr(out, "cache", None) or out.past_key_values
        fresh[p] = [(layer.keys[0, :, -1:], layer.values[0, :, -1:]) for layer in c.layers]
    return fresh


def test_recompute_matches_a_token_by_token_computation(be):
    """Scattered chosen tokens (not a prefix): the 4-D-mask forward equals the mask-free computation."""
    chunks = [text(be, 6, 50 + i) for i in range(3)]
    win = window_of(be, chunks, repair="none")
    win.evict("head")
    past = win.window_kv()
    ids = torch.cat([c.input_ids for c in chunks[1:]])
    picks = [torch.tensor([0, 3, 4]), torch.tensor([1, 5])]
    new = be.recompute(past, chunks[1:], win.starts(), picks)
    chosen = [0, 3, 4, 6 + 1, 6 + 5]
    hand = _blend_by_hand(be, past, ids, chosen)
    got = [(new[0], i) for i in range(3)] + [(new[1], i) for i in range(2)]
    for p, (kv, i) in zip(chosen, got):
        for l, (k, v) in enumerate(kv.layers):
            assert torch.allclose(k[:, i:i + 1], hand[p][l][0], atol=1e-5), (p, l)
            assert torch.allclose(v[:, i:i + 1], hand[p][l][1], atol=1e-5), (p, l)


def test_recompute_in_row_blocks_matches_the_token_by_token_computation(be, monkeypatch):
    """Rows run in blocks of 2 (windowkit/backends/attention.py), each over only the past keys its rows may read:
    the same KV as the mask-free computation (the head wholly, scattered tokens behind it, a tail continuation)."""
    import windowkit.backends.attention as attn

    monkeypatch.setattr(attn, "BLOCK_ROWS", 2)
    chunks = [text(be, 6, 60 + i) for i in range(4)]
    win = window_of(be, chunks, repair="none")
    win.evict("head")
    past = win.window_kv()
    ids = torch.cat([c.input_ids for c in chunks[1:]])
    picks = [torch.arange(6), torch.tensor([1, 4]), torch.tensor([0, 5])]
    sel = torch.tensor([0, 1, 2, 3, 4, 5, 6 + 1, 6 + 4, 12 + 0, 12 + 5])
    unchosen = torch.tensor([p for p in range(18) if p not in sel.tolist()])
    plan = attn.block_plan(sel, unchosen, 17)  # the forward's own plan: past cut after position 16
    # by hand: the head's rows (positions 0-5) read no past key; rows at 7, 10 read past keys up to 9 (unchosen
    # 6, 8, 9); rows at 12, 17 up to 16 (the whole cut past); blocks of 2 with the same past keys merged
    assert plan == (17, [(0, 6, 0), (6, 8, 10), (8, 10, 17)])
    new = be.recompute(past, chunks[1:], win.starts(), picks)
    hand = _blend_by_hand(be, past, ids, sel.tolist())
    got = [(new[0], i) for i in range(6)] + [(new[1], i) for i in range(2)] + [(new[2], i) for i in range(2)]
    for p, (kv, i) in zip(sel.tolist(), got):
        for l, (k, v) in enumerate(kv.layers):
            assert torch.allclose(k[:, i:i + 1], hand[p][l][0], atol=1e-5), (p, l)
            assert torch.allclose(v[:, i:i + 1], hand[p][l][1], atol=1e-5), (p, l)


# ---------------------------------------------------------------------------------------------- the front
def test_kl_decreases_none_sink_all(llama):
    """Mean next-token KL vs re-prefill over a few windows: none > sink:3 > all (~0), head+sink:3 < none."""
    kls = {r: [] for r in ("none", "sink:3", "head+sink:3", "all")}
    for s in range(4):
        chunks = [text(llama, 12, 100 * s + i) for i in range(4)]
        ref = reference_logits(llama, chunks[1:], QUERY)
        for r in kls:
            w = window_of(llama, chunks, repair=r)
            w.evict("head")
            kls[r].append(kl_divergence(ref, w.forward(QUERY)))
    mean = {r: sum(v) / len(v) for r, v in kls.items()}
    assert mean["none"] > mean["sink:3"] > mean["all"]
    assert mean["none"] > mean["head+sink:3"] > mean["all"]
    assert mean["all"] <= 1e-6


@pytest.mark.parametrize("rule,expect", [("none", [0, 0, 0]), ("sink:3", [3, 3, 3]), ("sink:50", [10, 11, 12]),
                                         ("head+sink:2", [10, 2, 2]), ("head", [10, 0, 0]), ("all", [10, 11, 12])])
def test_prefill_tokens_counted_equal_the_rules_share(llama, rule, expect):
    chunks = [text(llama, 9 + i, 60 + i) for i in range(4)]  # survivors of 10, 11, 12 tokens
    win = window_of(llama, chunks, repair=rule)
    assert RepairRule.parse(rule).counts([10, 11, 12]) == expect
    p0, f0 = win.stats.prefill_tokens, win.stats.forwards
    win.evict("head")
    assert win.stats.forwards == f0  # the repair waits for the next read ...
    win.flush()  # ... or an explicit flush
    assert win.stats.repaired_tokens == sum(expect)
    assert win.stats.prefill_tokens - p0 == sum(expect)
    assert win.stats.forwards - f0 == (1 if sum(expect) else 0)  # one selective forward, whatever the share
    assert win.stats.fallbacks == 0


def test_assign_repairs_once_after_its_evictions(llama):
    """assign evicting two chunks runs one repair (before its admits), not one per eviction; deferred, it runs
    with the two tail admissions as one forward, and equals the eager order's repair forward + two prefills."""
    chunks = [text(llama, 8, 70 + i) for i in range(6)]
    outs = {}
    for defer in (True, False):
        win = window_of(llama, chunks[:4], repair="sink:2")
        win._defer_work = defer
        f0, p0 = win.stats.forwards, win.stats.prefill_tokens
        win.assign(chunks[2:])
        win.flush()
        # the repair of the 2 stale survivors (2 tokens each) + two conditioned admissions (8 tokens each)
        assert win.stats.repaired_tokens == 4 and win.stats.prefill_tokens - p0 == 4 + 16
        assert win.stats.forwards - f0 == (1 if defer else 3)
        outs[defer] = win.forward(QUERY)
    assert kl_divergence(outs[False], outs[True]) <= 1e-6


def test_mla_falls_back_to_a_full_recondition():
    be = wk.HFBackend(build("tiny-deepseek-v3"))
    assert not be.supports_recompute
    with pytest.raises(UnsupportedModelError):
        be.recompute(None, [text(be, 4, 1)], [0], [torch.arange(2)])
    chunks = [text(be, 8, 80 + i) for i in range(4)]
    win = window_of(be, chunks, repair="sink:2")
    win.evict("head")  # the repair is deferred to the next read and runs there as one forward with the query
    assert kl_divergence(reference_logits(be, chunks[1:], QUERY), win.forward(QUERY)) <= 1e-6
    assert win.stats.fallbacks == 1 and win.stats.repaired_tokens == 24


# ---------------------------------------------------------------------------------------------- knobs
def test_fidelity_presets_and_explicit_repair(llama):
    assert FIDELITY == {"exact": "all", "balanced": "head:128+query:96", "fast": "none"}
    assert wk.Window(llama).repair == RepairRule.parse(FIDELITY["balanced"])
    assert wk.Window(llama, fidelity="exact").repair.full
    assert wk.Window(llama, fidelity="fast").repair.is_none
    assert wk.Window(llama, fidelity="fast", repair="sink:7").repair == RepairRule("sink:7", sink=7)
    assert RepairRule.parse(" Head+Sink:5 ") == RepairRule("head+sink:5", sink=5, head=True)


@pytest.mark.parametrize("spec", ["sink:0", "sink:-1", "sink:x", "sink", "head+sink:", "tail:3", "some", ""])
def test_bad_repair_specs_raise_windowkit_errors(llama, spec):
    with pytest.raises(WindowkitError):
        wk.Window(llama, repair=spec)


def test_bad_fidelity_and_bad_recompute_calls_raise(llama):
    with pytest.raises(WindowkitError):
        wk.Window(llama, fidelity="perfect")
    with pytest.raises(WindowkitError):
        RepairRule.parse(5)
    c = text(llama, 6, 1)
    kv = llama.forward([c], 0).kv
    with pytest.raises(ChunkError):
        llama.recompute(kv, [c], [0], [torch.tensor([6])])  # offset outside the chunk
    with pytest.raises(ChunkError):
        llama.recompute(kv, [c], [0], [torch.tensor([], dtype=torch.long)])  # nothing chosen
