"""Query-aware survivor repair (``Window.focus``, ``repair="...+query:N"``, ``HFBackend.query_attention``).

Ground truth is transformers itself: its eager attention weights over the same tokens (``output_attentions``),
a mask-free token-by-token computation of CacheBlend semantics for the recomputed tokens, and re-prefill logits.
"""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import windowkit as wk
from windowkit.backends.tiny import build
from windowkit.errors import WindowkitError
from windowkit.kv import kl_divergence
from windowkit.kv.layout import ChunkKV
from windowkit.window import RepairRule

from model_helpers import reference_logits, text  # noqa: E402  (tests/model_helpers.py)
from test_repair import _blend_by_hand  # noqa: E402  (the mask-free CacheBlend computation)
from test_repair import window_of as _window_of  # noqa: E402


def window_of(be, chunks, **kw):
    """A flushed window with no per-step cost ceiling on focus (the tests of the ceiling set it)."""
    return _window_of(be, chunks, **{"focus_budget": None, **kw})

QUERY = torch.tensor([11, 12, 13, 14, 15])
LOOK = wk.Window.FOCUS_LOOKAHEAD  # the greedy tokens a probe also decodes


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2"])
def be(request):
    return wk.HFBackend(build(request.param))


def eager_attention(be, past, query, start, lookahead=0):
    """transformers' own eager attention weights of the query's last token over ``past``: [past tokens], summed
    over heads, averaged over layers (``past=None``: ``query`` holds the whole sequence from position 0). With
    ``lookahead``: also the rows of that many greedy tokens, computed by re-running the whole sequence
    (query + the tokens decoded so far) from scratch over ``past``, and averaged with the query's row."""
    if lookahead:
        rows, ids = [], query
        for _ in range(lookahead + 1):
            rows.append(eager_attention(be, past, ids, start))
            logits = _eager_logits(be, past, ids, start)
            ids = torch.cat([ids, logits.argmax().reshape(1)])
        n = past.num_tokens if past is not None else None
        return torch.stack([r[:n] for r in rows]).mean(0)
    model = be.model
    impl = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            if past is None:
                out = model(input_ids=query[None], position_ids=torch.arange(len(query))[None], output_attentions=True)
            else:
                cache = DynamicCache([(k[None], v[None]) for k, v in past.layers])
                out = model(input_ids=query[None], position_ids=torch.arange(start, start + len(query))[None],
                            past_key_values=cache, use_cache=True, output_attentions=True)
    finally:
        model.set_attn_implementation(impl)
    return torch.stack([a[0, :, -1].float().sum(0) for a in out.attentions]).mean(0)


def _eager_logits(be, past, ids, start):
    cache = DynamicCache([(k[None], v[None]) for k, v in past.layers])
    with torch.no_grad():
        out = be.model(input_ids=ids[None], position_ids=torch.arange(start, start + len(ids))[None],
                       past_key_values=cache, use_cache=True)
    return out.logits[0, -1]


# ---------------------------------------------------------------------------------------------- the probe
def test_query_attention_equals_transformers_eager_on_the_whole_sequence(be):
    """On an exact window, the probe over the window KV reads the same weights as one eager forward of
    [prefix · chunks · query] from scratch, and the model's attention implementation is put back."""
    prefix = text(be, 5, 70, "sys")
    chunks = [text(be, 9 + i, 71 + i) for i in range(3)]
    win = wk.Window(be, mode="exact", prefix=prefix)
    for c in chunks:
        win.admit(c)
    past = win.window_kv()
    impl = be.model.config._attn_implementation
    got = be.query_attention(past, wk.Chunk.text(QUERY), win.next_position)
    assert be.model.config._attn_implementation == impl
    ids = torch.cat([prefix.input_ids] + [c.input_ids for c in chunks] + [QUERY])
    want = eager_attention(be, None, ids, 0)[:past.num_tokens]
    assert got.shape == (past.num_tokens,)
    assert torch.allclose(got, want, atol=1e-5)
    assert float(got.sum()) < be.model.config.num_attention_heads  # the rest of each row: the query's own tokens


def test_query_attention_with_lookahead_equals_transformers_decoding(be):
    """lookahead=2: the query's row and those of the two greedy tokens after it, each as transformers computes it
    re-running the sequence from scratch over the same past (no cache reuse between the rows)."""
    chunks = [text(be, 7, 75 + i) for i in range(3)]
    win = window_of(be, chunks, repair="none")
    win.evict("head")
    past = win.window_kv()  # a stale window: the probe reads what it holds, whatever it is
    got = be.query_attention(past, wk.Chunk.text(QUERY), win.next_position, lookahead=2)
    want = eager_attention(be, past, QUERY, win.next_position, lookahead=2)
    assert torch.allclose(got, want, atol=1e-5)
    with pytest.raises(wk.ChunkError):
        be.query_attention(past, wk.Chunk.text(QUERY), win.next_position, lookahead=-1)


@pytest.mark.parametrize("sparse", [False, True], ids=["prefill", "masked"])
def test_recompute_probe_reads_the_row_transformers_eager_reads(be, sparse):
    """recompute(probe=True): the query rides behind recomputed tokens (a plain prefill of the last chunk, or a few
    tokens of a middle chunk under the 4-D mask) and its last row's weights come back with the forward. Reference:
    transformers' eager attention of the query over the window with those tokens' fresh KV spliced in (the query
    reads each position once: stale where not chosen, fresh where chosen), and the logits of that same run."""
    chunks = [text(be, 9, 80 + i) for i in range(3)]
    win = window_of(be, chunks, repair="none")
    win.evict("head")
    past = win.window_kv()  # stale survivors: the weights must follow what the forward reads, not re-prefill
    at, starts = win.next_position, win.starts()
    i = 0 if sparse else 1
    off = torch.tensor([0, 3, 4, 7]) if sparse else torch.arange(len(win.chunk(win.ids[i])))
    chunk = win.chunk(win.ids[i])
    outs, logits, w = be.recompute(past, [chunk, wk.Chunk.text(QUERY)], [starts[i], at],
                                   [off, torch.arange(len(QUERY))], return_logits=True, probe=True)
    assert w.shape == (at + len(QUERY),)
    layers = []
    for (k, v), (a, b) in zip(past.layers, outs[0].layers):
        k, v = k.clone(), v.clone()
        k[:, starts[i] + off], v[:, starts[i] + off] = a, b
        layers.append((k, v))
    spliced = ChunkKV(layers, past.layout, past.positions)
    want = eager_attention(be, spliced, QUERY, at)
    assert torch.allclose(w, want, atol=1e-5)  # the window and the query's own tokens
    assert torch.allclose(logits, _eager_logits(be, spliced, QUERY, at).float(), atol=1e-4)
    with pytest.raises(wk.ChunkError, match="return_logits"):
        be.recompute(past, [wk.Chunk.text(QUERY)], [at], [torch.arange(len(QUERY))], probe=True)


def test_query_attention_rejects_an_empty_past(be):
    with pytest.raises(wk.ChunkError):
        be.query_attention(None, wk.Chunk.text(QUERY), 0)


# ---------------------------------------------------------------------------------------------- focus
def _fresh(win):
    return {e.id: (e.fresh[1].nonzero().reshape(-1).tolist() if e.fresh is not None else []) for e in win._entries}


def test_focus_recomputes_the_stale_tokens_the_query_reads_most(be):
    """evict the head with keep-as-is: focus(tokens=6) recomputes the 6 stale tokens with the largest eager
    attention weight of the query over the stale window, and their KV equals the mask-free CacheBlend
    computation (the other tokens keep their stale KV)."""
    chunks = [text(be, 8, 80 + i) for i in range(4)]
    win = window_of(be, chunks, repair="none")
    win.evict("head")
    past = win.window_kv()  # the stale window, positions 0..23
    weights = eager_attention(be, past, QUERY, win.next_position, lookahead=LOOK)[:past.num_tokens]
    picked_want = sorted(weights.topk(6).indices.tolist())  # every survivor is stale: all 24 tokens are candidates
    p0, f0 = win.stats.prefill_tokens, win.stats.forwards
    assert win.focus(QUERY, tokens=6) == 6
    starts = dict(zip(win.ids, win.starts()))
    picked = sorted(starts[cid] + o for cid, offs in _fresh(win).items() for o in offs)
    assert picked == picked_want
    assert win.stats.prefill_tokens - p0 == 6 + len(QUERY) + LOOK and win.stats.probe_tokens == len(QUERY) + LOOK
    assert win.stats.forwards - f0 == 2 + LOOK and win.stats.repaired_tokens == 6
    ids = torch.cat([c.input_ids for c in chunks[1:]])
    hand = _blend_by_hand(be, past, ids, picked)
    now = win.window_kv()
    for p in range(past.num_tokens):
        for l, (k, v) in enumerate(now.layers):
            if p in hand:
                assert torch.allclose(k[:, p:p + 1], hand[p][l][0], atol=1e-5), (p, l)
                assert torch.allclose(v[:, p:p + 1], hand[p][l][1], atol=1e-5), (p, l)
            else:
                assert torch.equal(k[:, p], past.layers[l][0][:, p]) and torch.equal(v[:, p], past.layers[l][1][:, p])


def test_a_second_focus_picks_other_tokens_and_a_slide_clears_the_mark(be):
    chunks = [text(be, 8, 90 + i) for i in range(5)]
    win = window_of(be, chunks[:4], repair="none")
    win.evict("head")
    win.focus(QUERY, tokens=4)
    first = {k: set(v) for k, v in _fresh(win).items()}
    win.focus(QUERY, tokens=4)
    second = {k: set(v) for k, v in _fresh(win).items()}
    assert sum(map(len, first.values())) == 4 and sum(map(len, second.values())) == 8
    assert all(first[k] <= second[k] for k in first)
    win.evict("head")  # the survivors' antecedents change: what was fresh is stale again
    p0 = win.stats.repaired_tokens
    assert win.focus(QUERY, tokens=3) == 3 and win.stats.repaired_tokens - p0 == 3
    valid = [e.fresh[1] for i, e in enumerate(win._entries) if e.fresh is not None and e.fresh[0] == tuple(win.ids[:i])]
    assert sum(int(m.sum()) for m in valid) == 3  # only this focus's tokens count as recomputed on today's context


def test_focus_with_the_head_repaired_moves_toward_reprefill(be):
    """Partly repaired windows: recomputing every stale token the cap allows (all but len(query)) leaves a
    window much nearer re-prefill than the head rule alone (the gap closes as tokens grow)."""
    chunks = [text(be, 10, 100 + i) for i in range(5)]
    ref = reference_logits(be, chunks[1:], QUERY)
    kls = []
    for n in (0, 8, 1000):
        win = window_of(be, chunks, repair="head")
        win.evict("head")
        win.focus(QUERY, tokens=n)
        kls.append(kl_divergence(ref, win.forward(QUERY)))
    assert kls[0] > 1e-6 and kls[2] < kls[0] / 4, kls


def test_focus_never_exceeds_the_stale_tokens(be):
    """probe + recompute <= the stale survivors' tokens (what a prefix cache re-prefills for this step)."""
    chunks = [text(be, 6, 110 + i) for i in range(3)]
    win = window_of(be, chunks, repair="none")
    win.evict("head")  # 12 stale tokens
    p0 = win.stats.prefill_tokens
    assert win.focus(QUERY, tokens=1000) == 12 - len(QUERY) - LOOK
    assert win.stats.prefill_tokens - p0 == 12
    assert win.focus(QUERY, tokens=1000) == 0  # what is left is smaller than the probe


def test_focus_is_a_no_op_where_nothing_is_stale_or_nothing_can_be_read(be):
    chunks = [text(be, 6, 120 + i) for i in range(3)]
    assert window_of(be, chunks, repair="none").focus(QUERY, tokens=4) == 0  # admitted at the tail: exact
    win = window_of(be, chunks, repair="all")
    win.evict("head")
    assert win.focus(QUERY, tokens=4) == 0  # repaired wholly
    ex = window_of(be, chunks, mode="exact")
    ex.evict("head")
    assert ex.focus(QUERY, tokens=4) == 0
    win = window_of(be, chunks, repair="none")
    with pytest.raises(WindowkitError):
        win.focus(QUERY, tokens=-1)


def test_a_query_rule_focuses_inside_forward_and_generate(be):
    chunks = [text(be, 8, 130 + i) for i in range(4)]
    for call in ("forward", "generate"):
        win = window_of(be, chunks, repair="head+query:8")
        win.evict("head")
        getattr(win, call)(QUERY) if call == "forward" else win.generate(QUERY, max_new_tokens=2)
        # answering, the probe is the query's own run: extra are the lookahead and the re-run last query token
        assert win.stats.probe_tokens == LOOK + 1 and win.stats.repaired_tokens == 8 + 8
    plain = window_of(be, chunks, repair="head")
    plain.evict("head")
    plain.forward(QUERY)
    assert plain.stats.probe_tokens == 0


def test_a_query_rule_answers_from_the_repaired_window_and_the_probes_query_kv(be):
    """forward() with a query rule: its logits are transformers' run of the query's last token over [the window
    after the focus + the KV of the query's other tokens as they ran over the window before it], and the window
    changed in exactly the focused positions."""
    chunks = [text(be, 10, 160 + i) for i in range(5)]
    win = window_of(be, chunks, repair="head+query:8")
    win.evict("head")
    twin = window_of(be, chunks, repair="head")  # the same window up to the focus
    twin.evict("head")
    twin.forward(QUERY)  # the head's repair runs with the query riding along, as in ``win`` (the same bits)
    stale = twin.window_kv()
    logits = win.forward(QUERY)
    after = win.window_kv()
    changed = sum(int(not torch.equal(a[:, p], b[:, p])) for p in range(stale.num_tokens)
                  for a, b in [(after.layers[-1][0], stale.layers[-1][0])])
    assert changed == 8 and win.stats.repaired_tokens == 10 + 8
    start, q = stale.num_tokens, len(QUERY)
    with torch.no_grad():
        cache = DynamicCache([(k[None], v[None]) for k, v in stale.layers])
        be.model(input_ids=QUERY[:-1][None], position_ids=torch.arange(start, start + q - 1)[None],
                 past_key_values=cache, use_cache=True)
        probe = [(layer.keys[0, :, start:], layer.values[0, :, start:]) for layer in cache.layers]
        cache = DynamicCache([(torch.cat([k, a], 1)[None], torch.cat([v, b], 1)[None])
                              for (k, v), (a, b) in zip(after.layers, probe)])
        out = be.model(input_ids=QUERY[-1:][None], position_ids=torch.tensor([[start + q - 1]]),
                       past_key_values=cache, use_cache=True)
    assert torch.allclose(out.logits[0, -1].float(), logits, atol=1e-4)
    assert kl_divergence(out.logits[0, -1].float(), logits) <= 1e-6
    # generate decodes on from there: transformers' greedy continuation over the same cache
    want, pos = [int(out.logits[0, -1].argmax())], start + q
    with torch.no_grad():
        for _ in range(3):
            nxt = be.model(input_ids=torch.tensor([[want[-1]]]), position_ids=torch.tensor([[pos]]),
                           past_key_values=cache, use_cache=True)
            want.append(int(nxt.logits[0, -1].argmax()))
            pos += 1
    again = window_of(be, chunks, repair="head+query:8")
    again.evict("head")
    assert again.generate(QUERY, max_new_tokens=4) == want
    assert kl_divergence(again.last_logits, logits) <= 1e-9


def test_focus_is_a_no_op_on_the_cost_model_and_on_mla():
    from windowkit.trace.backend import CostModelBackend
    from windowkit.trace.costs import load_profile

    cm = CostModelBackend(load_profile("h100-kamera"))
    win = wk.Window(cm, repair="head+query:8")
    for i in range(3):
        win.admit(cm.chunk(f"c{i}", 16, "text"))
    win.evict("head")
    assert win.focus([1, 2, 3]) == 0 and win.stats.probe_tokens == 0
    mla = wk.HFBackend(build("tiny-deepseek-v3"))
    win = window_of(mla, [text(mla, 6, 140 + i) for i in range(3)], repair="sink:2+query:4")
    win.evict("head")
    assert win.focus(QUERY) == 0


def _slides(win, chunks, steps):
    """Fill ``win`` with ``chunks[:4]``, then yield each step number; from the second step on, the head is evicted
    and the next chunk admitted before the yield (the caller reads the window there)."""
    for c in chunks[:4]:
        win.admit(c)
    for step in range(steps):
        if step:
            win.evict("head")
            win.admit(chunks[3 + step])
        yield step


def test_the_focus_budget_is_a_running_account_against_the_prefix_cache(be):
    """focus_budget=0.6 over a sliding stream (one chunk out, one in, a query per step): the focus runs only while
    the window's prefill so far, this step's focus included, stays within 0.6 x what a prefix cache spent on the
    same steps (the first fill costs both the same, so the focus waits until the slides have paid that back)."""
    chunks = [text(be, 30, 150 + i) for i in range(10)]
    win = wk.Window(be, repair="query:64", focus_budget=0.6)
    pc = spent = 0
    ran = []
    for step in _slides(win, chunks, 6):
        p0, r0 = win.stats.prefill_tokens, win.stats.probe_tokens
        win.forward(QUERY)
        pc += 4 * 30 + len(QUERY)  # a prefix cache re-prefills every chunk behind the evicted head, + the query
        spent += win.stats.prefill_tokens - p0 + len(QUERY)
        ran.append(win.stats.probe_tokens > r0)
        if ran[-1]:
            assert spent <= 0.6 * pc, (step, spent, pc)
    assert ran[:2] == [False, False] and any(ran[2:]), ran
    # fewer than FOCUS_MIN tokens left is not worth a focus: a tighter share never runs it on this stream
    tight = wk.Window(be, repair="query:64", focus_budget=0.3)
    for _ in _slides(tight, chunks, 6):
        tight.forward(QUERY)
    assert tight.stats.probe_tokens == 0 and tight.stats.repaired_tokens == 0
    with pytest.raises(WindowkitError):
        wk.Window(be, focus_budget=1.5)


def test_the_system_prompt_is_no_step_spending_in_the_focus_account(be):
    """A prefix cache holds the system prompt too, so the Window's own prefill of ``prefix`` (at construction) is
    not booked against the focus budget: with a system prompt, the focus spends on the same steps and the same
    number of tokens as without one. Counted by hand as in the test above: after the first fill (125 tokens for
    both sides) and slides at 125 a step for the prefix cache, the focus first has room at step 2."""
    chunks = [text(be, 30, 150 + i) for i in range(10)]

    def focus_per_step(prefix):
        win = wk.Window(be, prefix=prefix, repair="query:64", focus_budget=0.6)
        got = []
        for _ in _slides(win, chunks, 6):
            r0 = win.stats.repaired_tokens
            win.forward(QUERY)
            got.append(win.stats.repaired_tokens - r0)
        return got

    plain = focus_per_step(None)
    assert plain[:2] == [0, 0] and plain[2] > 0, plain
    assert focus_per_step(text(be, 40, 90, "sys")) == plain
    # a fork carries the account on: it focuses on the next step exactly as its parent does (budget-bound there)
    win = wk.Window(be, prefix=text(be, 40, 90, "sys"), repair="query:64", focus_budget=0.6)
    for _ in _slides(win, chunks, 2):
        win.forward(QUERY)
    twin = win.fork()
    got = []
    for w in (win, twin):
        r0 = w.stats.repaired_tokens
        w.evict("head")
        w.admit(chunks[6])
        w.forward(QUERY)
        got.append(w.stats.repaired_tokens - r0)
    assert got == [plain[2], plain[2]], (got, plain)


# ---------------------------------------------------------------------------------------------- the rule
@pytest.mark.parametrize("spec,name,head,sink,query", [
    ("head+query:32", "head+query:32", True, 0, 32), ("query:8", "query:8", False, 0, 8),
    ("sink:5+query:16", "sink:5+query:16", False, 5, 16),
    ("HEAD + sink:5 + query:4", "head+sink:5+query:4", True, 5, 4),
    ("head+sink:5", "head+sink:5", True, 5, 0)])
def test_query_rules_parse(spec, name, head, sink, query):
    r = RepairRule.parse(spec)
    assert (r.name, r.head, r.sink, r.query) == (name, head, sink, query)
    assert r.is_none == (not head and not sink)


@pytest.mark.parametrize("spec", ["query:0", "query:", "query:x", "query", "head+head", "query:4+query:4",
                                  "all+query:4", "sink:0+query:4", "head:0"])
def test_bad_query_rules_raise(spec):
    with pytest.raises(WindowkitError):
        RepairRule.parse(spec)
