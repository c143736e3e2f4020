"""Simulator accounting on hand-made traces, with every expected cost computed by hand below."""
from __future__ import annotations

from pathlib import Path

import pytest

from windowkit import Window
from windowkit.trace import ChunkRef, CostModelBackend, Step, Trace, simulate
from windowkit.trace.generators import grow_interleave, random_lookback, sliding_window
from windowkit.errors import WindowkitError
from windowkit.trace.simulate import WindowkitStrategy, load_trace_arg, resolve_orders

from hand_trace import A, B, C, P, T  # noqa: E402  (tests/hand_trace.py)


@pytest.fixture(scope="module")
def res():
    return simulate(T, P, strategies=["recompute", "radix", "blind", "blend", "windowkit", "windowkit-eager", "floor"],
                    progress=False)


def _ms(res, name):
    return [round(c.total_ms, 6) for c in res.steps[name]]


def test_full_recompute(res):
    # s0: vision A 4*2=8 + prefill (6+1)*1=7 -> 15; s1: vision C 8 + prefill 7 -> 15; s2: vision A,C 16 + prefill 10 -> 26
    assert _ms(res, "recompute") == [15, 15, 26]
    t = res.totals("recompute")
    assert t["prefill_tokens"] == 24 and t["vision_encodes"] == 4 and t["bytes_peak"] == 10 * 100


def test_radix(res):
    # s0: miss [A B]: vision 8 + prefill 7 -> 15, tree 6 tokens
    # s1: no context starts with B: miss [B C]: vision C 8 + prefill 7 -> 15, tree 12
    # s2: hit A,B (the s0 path); miss C: prefill 4 (C's vision is cached) -> 4, tree 16
    assert _ms(res, "radix") == [15, 15, 4]
    t = res.totals("radix")
    assert t["prefill_tokens"] == 18 and t["vision_encodes"] == 2 and t["bytes_peak"] == 1600
    assert t["relocations"] == 0


def test_blind(res):
    # s0: A, B new (first antecedents () and (A,)): vision 8 + prefill 7 -> 15; stored 6 + live 6 tokens
    # s1: B moved 4 -> 0: replay 2*0.5=1, antecedents () != (A,): risk 1; C new: prefill 4+1, vision 8 -> 14
    # s2: A back (not resident): replay 4 -> 2; B moves 0 -> 4: 1; C moves 2 -> 6: 2, antecedents (A,B) != (B,): risk
    assert _ms(res, "blind") == [15, 14, 5]
    t = res.totals("blind")
    assert (t["relocations"], t["binding_risk"], t["prefill_tokens"]) == (4, 2, 12)
    assert t["bytes_peak"] == (10 + 10) * 100


def test_blend(res):
    # blind + ceil(15% of the tokens) of each at-risk reused chunk: s1 B ceil(0.3)=1 token, s2 C ceil(0.6)=1 token
    assert _ms(res, "blend") == [15, 15, 6]
    assert res.totals("blend")["prefill_tokens"] == 14


def test_windowkit(res):
    # the defaults: form="lazy" (deferred forming), fidelity="balanced" (repair "head:128+query:96"; the cost
    # model runs no query focus), the step cap
    # s0: A and B new: the edits (A 4 + B 2) tie with the prefix cache's plan and a tie runs it (exact): one
    #     forward of A B (6) + vision 8; A's KV at 0 is its canonical (1 encode, no extra forward), B's KV behind A
    #     is kept as its conditioned KV for context (A); query 1 -> 15
    # s1: [A B] -> [B C]: repairing B wholly (2) + C's conditioned 4 ties with prefilling B C: one forward of 6
    #     + vision 8; B at 0 stored as its canonical (1 encode), C kept as conditioned on (B); query 1 -> 15
    # s2: recall A at the head (canonical from the store: free); B behind A again: its conditioned KV of s0 (exact,
    #     kept where it stood, at position 4, where the same context puts it again: read as is, no rotation and no
    #     patch, so no relocation and no charge, as the radix tree's hit on that branch); C is stale: the whole
    #     first stale survivor, 4 tokens -> 4
    assert _ms(res, "windowkit") == [15, 15, 4]
    t = res.totals("windowkit")
    assert (t["encodes"], t["patch_forms"], t["patch_applies"], t["relocations"]) == (2, 0, 0, 0)
    assert (t["prefill_tokens"], t["vision_encodes"], t["binding_risk"]) == (18, 2, 0)
    # canonicals A 4 + B 2, conditioned B|A 2 + C|B 4, the live window 10; no patch stored
    assert t["bytes_peak"] == (4 + 2 + 2 + 4 + 10) * 100
    assert res.steps["windowkit"][0].prefill_tokens == 7
    assert [c.encode_ms for c in res.steps["windowkit"]] == [0, 0, 0]
    s = res.summary()
    assert s["ratios"]["windowkit/radix"] == pytest.approx(34 / 34)
    assert s["ratios"]["windowkit/recompute"] == pytest.approx(34 / 56)


def test_windowkit_eager(res):
    # the former default: form="eager", repair "none" (keep-as-is)
    # s0: admit A at the head: its prefill is its canonical (4 tokens, encode 1, vision 8);
    #     admit B behind A: conditioned forward (2) + canonical encode (2) + patch form (SVD 2*0.125);
    #     query 1 token -> prefill 9 + vision 8 + 0.25 = 17.25
    # s1: evict A; B now leads: its canonical is placed at 0 (read as is: no rotation, no patch, no charge);
    #     admit C behind B: conditioned 4 + canonical 4 + SVD 4*0.125=0.5; vision C 8; query 1 -> 9+8+0.5 = 17.5
    # s2: recall A at the head (canonical from the store: free); B behind A finds the patch formed on (A,) at s0:
    #     placed at 4 with the patch (replay 2 -> 1 ms, apply 2*0.25 -> 0.5 ms); C keeps its KV (formed on (B,),
    #     binding risk 1) and relocates 2 -> 6 (replay 4 -> 2 ms) -> 3.5
    assert _ms(res, "windowkit-eager") == [17.25, 17.5, 3.5]
    t = res.totals("windowkit-eager")
    assert (t["encodes"], t["patch_forms"], t["patch_applies"], t["relocations"]) == (3, 2, 1, 2)
    assert (t["prefill_tokens"], t["vision_encodes"], t["binding_risk"]) == (18, 2, 1)
    # canonicals 10 + live window 10 tokens of KV, patches of B (2) and C (4) tokens
    assert t["bytes_peak"] == 20 * 100 + 6 * 10
    # canonical encodes of chunks already prefilled in context: B at s0 (2 tokens), C at s1 (4 tokens)
    assert [c.encode_ms for c in res.steps["windowkit-eager"]] == [2, 4, 0]
    s = res.summary()
    assert s["ratios"]["windowkit-eager/radix"] == pytest.approx(38.25 / 34)


def test_windowkit_encodes_each_distinct_chunk_once():
    """With an unbounded store every distinct chunk is encoded at most once (form="eager": exactly once; the
    default form="lazy" only when something needs the canonical), and seen by vision once."""
    for trace in (sliding_window(steps=25, k=3, seed=1), random_lookback(steps=25, p=0.5, seed=2),
                  grow_interleave(episodes=3, seed=3)):
        res = simulate(trace, P, strategies=["windowkit", "windowkit-eager"], progress=False)
        chunks = trace.distinct_chunks()
        assert res.totals("windowkit-eager")["encodes"] == len(chunks), trace.name
        assert res.totals("windowkit")["encodes"] <= len(chunks), trace.name
        t = res.totals("windowkit")
        assert t["vision_encodes"] == sum(1 for c in chunks.values() if c.kind != "text")
        assert "windowkit_approximated_steps" not in res.meta  # patch tokens were metered exactly


def test_unordered_step_keeps_the_window_order():
    s0 = Step(step=0, context=[A, B, C])
    s1 = Step(step=1, context=[C, A, B], ordered=False)  # same set, any order: nothing should move
    s2 = Step(step=2, context=[C, A], ordered=False)  # a different set: its own order
    orders = resolve_orders([s0, s1, s2])
    assert [x.id for x in orders[1]] == ["A", "B", "C"] and [x.id for x in orders[2]] == ["C", "A"]
    res = simulate(Trace([s0, s1]), P, progress=False)
    assert res.steps["recompute"][1].prefill_tokens == 10
    for name in ("radix", "blind", "blend", "windowkit"):
        assert res.steps[name][1].total_ms == 0, name  # same set in the same order: all reused in place


def test_strategy_selection_and_table():
    res = simulate(T, "h100-kamera", strategies=["radix", "windowkit"], progress=False)
    assert res.strategies == ["radix", "windowkit"]
    assert "windowkit/radix" in res.summary()["ratios"] and "| windowkit |" in res.table()
    with pytest.raises(ValueError):
        simulate(T, P, strategies=["nope"])


def test_cost_model_backend_runs_a_window():
    from windowkit.window import Window

    be = CostModelBackend(P)
    win = Window(be, mode="patch")
    a, b = be.chunk("a", 3, "video"), be.chunk("b", 5)
    win.admit(a)
    win.admit(b)
    win.evict("head")
    win.recall("a", at=0)
    assert win.ids == ["a", "b"] and win.window_kv().num_tokens == 8
    assert be.ledger.vision_encodes == 1  # the video chunk ran the vision tower once
    assert be.ledger.prefill_ms == pytest.approx(be.ledger.prefill_tokens * 1.0)
    assert be.chunk("a", 3).content_hash() != be.chunk("b", 3).content_hash()


def test_radix_tree_matches_any_earlier_prefix():
    from windowkit.trace.simulate import RadixCache

    r = RadixCache()
    r.reset(P)
    seqs = [list("abc"), list("abd"), list("ab"), list("ax"), list("abdy"), list("q"), list("abc")]
    hits = [r._match_insert(s) for s in seqs]
    assert hits == [0, 2, 2, 1, 3, 0, 3]


def test_cli_entry_point(tmp_path, capsys):
    from windowkit.trace.io import write_trace
    from windowkit.trace.simulate import main

    path = write_trace(T, tmp_path / "t.jsonl")
    out = tmp_path / "s.json"
    assert main([str(path), "--strategy", "radix", "--strategy", "windowkit", "--json", str(out)]) == 0
    assert "windowkit/radix" in capsys.readouterr().out
    import json

    assert json.loads(out.read_text())["steps"] == 3


def _random_trace(draw_steps):
    return Trace([Step(step=i, context=[ChunkRef(id=f"c{j}", tokens=1 + j % 3, kind="image" if j % 2 else "text")
                                        for j in ids], ordered=True, query_tokens=q)
                  for i, (ids, q) in enumerate(draw_steps)])


try:
    from hypothesis import given, settings, strategies as st

    _steps = st.lists(st.tuples(st.lists(st.integers(0, 7), unique=True, max_size=6), st.integers(0, 3)),
                      min_size=1, max_size=8)

    @settings(max_examples=40, deadline=None)
    @given(_steps)
    def test_prefill_ordering_property(steps):
        """Only chunks never seen before are certainly missing from every cache, so on any trace:
        blind <= radix <= recompute in prefill tokens, and each strategy pays the vision tower as designed."""
        trace = _random_trace(steps)
        res = simulate(trace, P, strategies=["recompute", "radix", "blind", "blend"], progress=False)
        tot = {n: res.totals(n) for n in res.strategies}
        assert tot["blind"]["prefill_tokens"] <= tot["radix"]["prefill_tokens"] <= tot["recompute"]["prefill_tokens"]
        assert tot["blind"]["prefill_tokens"] <= tot["blend"]["prefill_tokens"]
        visual = sum(1 for c in trace.distinct_chunks().values() if c.kind != "text")
        assert tot["radix"]["vision_encodes"] == tot["blind"]["vision_encodes"] == visual
except ImportError:  # hypothesis is a test extra
    pass


def test_empty_steps_and_query_only():
    t = Trace([Step(step=0, context=[A], query_tokens=2), Step(step=1, context=[], query_tokens=3),
               Step(step=2, context=[A], query_tokens=0)])
    res = simulate(t, P, progress=False)
    wk = res.steps["windowkit"]
    # s0: A's prefill 4 + vision 8 + query 2; s1: everything evicted, query 3 over an empty window;
    # s2: A recalled at the head from its stored canonical: free (no relocation: it sits at 0)
    assert [c.total_ms for c in wk] == [14, 3, 0]
    assert [c.encode_ms for c in wk] == [0, 0, 0]


def test_windowkit_lazy_form():
    # s0: A at the head: prefill 4 (its canonical) + vision 8; B behind A: conditioned forward 2 only (no canonical,
    #     no patch); query 1 -> 15
    # s1: evict A: B has no canonical, so it keeps its KV (formed on (A,): risk) and relocates 4 -> 0 before C's
    #     forward (replay 2 -> 1 ms); C: conditioned forward 4 + vision 8; query 1 -> 14
    # s2: A recalled from its canonical (free); B's antecedents are (A,) again; B 0 -> 4 (1 ms) and C 2 -> 6 (2 ms),
    #     C still conditioned on (B,) -> 3
    # (form="lazy" with keep-as-is survivors: fidelity="fast")
    res = simulate(T, P, strategies=["radix", "windowkit-fast-fidelity"], progress=False)
    assert _ms(res, "windowkit-fast-fidelity") == [15, 14, 3]
    t = res.totals("windowkit-fast-fidelity")
    assert (t["encodes"], t["patch_forms"], t["relocations"], t["binding_risk"]) == (1, 0, 3, 2)
    assert res.summary()["ratios"]["windowkit-fast-fidelity/radix"] == pytest.approx(32 / 34)


def test_bounded_store_bytes_held_counts_only_what_the_store_holds():
    """Under a budget, evicted canonicals and patches leave bytes_held: the metered token sums equal the tokens of
    the entries the store still holds (read back from the store itself), and the store stays within budget."""
    from windowkit.trace.generators import random_lookback
    from windowkit.trace.simulate import WindowkitStrategy

    budget = 30_000
    wk = WindowkitStrategy(store_budget_bytes=budget, form="eager")  # eager fills the store: the budget bites
    res = simulate(random_lookback(steps=40, seed=1), "h100-kamera", [wk], progress=False)
    store = wk.store
    assert store.stats.evictions > 0  # the budget really bites
    held_canon = sum(store.get_canonical(k).num_tokens for k in store.keys() if store.has_canonical(k))
    held_patch = sum(store.get_patch(k, c).num_tokens for k in store.keys() for c in store.patches(k))
    assert store.nbytes <= budget
    assert store.canon_sum == held_canon and store.patch_sum == held_patch
    p = wk.p
    last = res.steps[wk.name][-1].bytes_held
    assert last == (held_canon + wk.win.num_tokens) * p.kv_bytes_per_token + held_patch * p.patch_bytes_per_token


def test_simulate_store_options_reach_the_window_and_bad_combinations_are_refused():
    """simulate(store_budget_bytes=...) bounds the windowkit strategies built from names; a store policy
    without a budget is an error rather than silently ignored."""
    from windowkit.errors import WindowkitError
    from windowkit.trace.generators import random_lookback

    trace = random_lookback(steps=30, seed=2)
    # form="eager" fills the store (the default lazy form stores little here): there the budget bites
    res = simulate(trace, "h100-kamera", ["windowkit-eager"], progress=False, store_budget_bytes=40_000)
    unbounded = simulate(trace, "h100-kamera", ["windowkit-eager"], progress=False)
    assert res.meta["windowkit-eager_store"]["budget_bytes"] == 40_000
    assert res.meta["windowkit-eager_store"]["evictions"] > 0
    assert res.totals("windowkit-eager")["encodes"] > unbounded.totals("windowkit-eager")["encodes"]
    with pytest.raises(WindowkitError, match="needs a store budget"):
        simulate(trace, "h100-kamera", ["windowkit"], progress=False, store_policy="lfu")


def test_zero_budget_store_reencodes_by_hand():
    """budget_bytes=0: every put is refused, so each canonical need is a fresh encode (form="eager", keep-as-is).

    s0: A at the head: encode (prefill 4, vision 8); B behind A: conditioned forward 2 + canonical encode 2
        (encode_ms 2) + SVD 2*0.125; query 1 -> 17.25, as unbounded.
    s1: evict A: B becomes the head and its canonical is placed at 0, but it was never stored: encode again
        (prefill 2, encode_ms 2), used as is (no charge); C: conditioned 4 + vision 8 + canonical 4 (encode_ms 4)
        + SVD 0.5; query 1 -> 19.5.
    s2: A recalled at the head: its canonical was refused, so encode (4, encode_ms 4); no patch for B on (A,)
        was kept: B and C keep their KV (risk 2) and relocate 0->4, 2->6 (replay 6*0.5) -> 7.
    bytes_held counts no stored canonical or patch, only the live window: 6, 6, 10 tokens x 100.
    """
    from windowkit.trace.simulate import WindowkitStrategy

    s = WindowkitStrategy(store_budget_bytes=0, form="eager", repair="none")
    c = simulate(T, P, [s], progress=False).steps[s.name]
    assert [x.total_ms for x in c] == [17.25, 19.5, 7]
    assert [x.encode_ms for x in c] == [2, 6, 4]
    assert [x.encodes for x in c] == [2, 2, 1] and [x.binding_risk for x in c] == [0, 0, 2]
    assert [x.bytes_held for x in c] == [600, 600, 1000]


@pytest.mark.parametrize("kw", [dict(mode="fuzzy"), dict(form="later"), dict(rank=0), dict(store_budget_bytes=-1),
                                dict(repair="sink:0"), dict(repair="tail:3"), dict(fidelity="perfect")],
                         ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_bad_strategy_knobs_raise_windowkit_errors(kw):
    from windowkit.errors import WindowkitError
    from windowkit.trace.simulate import WindowkitStrategy

    with pytest.raises(WindowkitError):
        simulate(T, P, [WindowkitStrategy(**kw)], progress=False)


def test_windowkit_ahead_moves_the_survivors_conditioning_between_steps():
    """``windowkit-ahead`` (an agent that calls ``prefetch(next=...)`` with the next step's surviving chunks) on a
    sliding window: each step then prefills only what is new and the query, the floor's tokens exactly, and the
    preparation between steps prefills the survivors in their new context: with the step, the prefix cache's
    tokens exactly (it re-prefills the survivors on the step). Every slide takes the prepared route."""
    trace = sliding_window(steps=40, k=3)
    res = simulate(trace, "h100-kamera", ["radix", "windowkit", "windowkit-ahead", "floor"], progress=False)
    ahead, wk = res.totals("windowkit-ahead"), res.totals("windowkit")
    radix, floor = res.totals("radix"), res.totals("floor")
    assert ahead["prefill_tokens"] == floor["prefill_tokens"]
    assert ahead["prefill_tokens"] + ahead["idle_tokens"] == radix["prefill_tokens"]
    assert ahead["idle_tokens"] > 0 and ahead["idle_ms"] > 0 and wk["idle_tokens"] == 0 == wk["idle_ms"]
    assert ahead["total_ms"] < wk["total_ms"]
    assert ahead["total_ms"] == pytest.approx(floor["total_ms"], rel=1e-9)  # relocations of prepared KV: none
    row = next(line for line in res.table().splitlines() if line.startswith("| windowkit-ahead |"))
    assert f"| {ahead['idle_ms']:.1f} |" in row  # the table shows the work between steps beside the steps' own
    assert "idle_ms" not in simulate(trace, "h100-kamera", ["radix", "windowkit"], progress=False).table()
    # look-backs: the agent chose them with the step's answer, so the guess holds them too
    lb = simulate(random_lookback(steps=40), "cpu-tiny", ["windowkit", "windowkit-ahead", "floor"], progress=False)
    assert lb.totals("floor")["total_ms"] <= lb.totals("windowkit-ahead")["total_ms"] <= lb.totals("windowkit")["total_ms"]


def test_windowkit_ahead_prepares_the_agents_own_clip_and_look_back_but_not_an_observation():
    """On WebVoyager's rule (a screenshot leaving the last 3 turns into its text where it stood) the agent writes
    that clip itself: ``windowkit-ahead`` passes it to ``prefetch(next=...)`` with the two screenshots behind it, so
    a slide prefills only the new screenshot and the query (765 + 32), and the preparation before it the clip and
    the two screenshots (96 + 2 x 765). A look-back is the agent's choice too, made with the step's answer: the
    recalled chunk and the live ones behind it are prepared in their next places (the step then prefills only its
    query), while a never-seen screenshot, which comes from outside, ends the guess. Hand counts."""
    from windowkit.trace.generators import sliding_clipped

    trace = sliding_clipped(steps=8, episode_len=(8, 8))
    res = simulate(trace, "h100-kamera", ["radix", "windowkit-ahead", "floor"], progress=False)
    steps = res.steps["windowkit-ahead"]
    assert [c.prefill_tokens for c in steps[3:]] == [765 + 32] * 5  # the floor's step also prefills the clip
    assert [c.prefill_tokens for c in res.steps["floor"][3:]] == [96 + 765 + 32] * 5
    assert [c.idle_tokens for c in steps] == [0, 0] + [96 + 2 * 765] * 5 + [0]  # the last step has no next
    shot, txt = (lambda i: ChunkRef(id=f"s{i}", tokens=40, kind="image")), (lambda i: ChunkRef(id=f"t{i}", tokens=8))
    look = Trace([Step(step=0, context=[txt(0), shot(1), shot(2)], query_tokens=2),
                  Step(step=1, context=[shot(1), shot(2), shot(3)], query_tokens=2),
                  Step(step=2, context=[txt(0), shot(2), shot(3)], query_tokens=2)], name="look-back")
    steps = simulate(look, "h100-kamera", ["windowkit-ahead"], progress=False).steps["windowkit-ahead"]
    assert [(c.prefill_tokens, c.idle_tokens) for c in steps] == [
        (8 + 2 * 40 + 2, 40 + 40),  # next: s1 s2 (s3 is new: the guess ends there), s2 conditioned on s1 anew
        (40 + 2, 40 + 40),  # next: t0 s2 s3, t0 back at the head (its canonical: free), s2 and s3 behind it
        (2, 0)]  # only the query: what the floor prefills (radix: 82, s2 s3 behind the returning t0)
    t = lambda i: ChunkRef(id=f"t{i}", tokens=8)  # noqa: E731
    log = Trace([Step(step=0, context=[t(0), t(1), t(2)], query_tokens=2),
                 Step(step=1, context=[t(1), t(2), t(3)], query_tokens=2),
                 Step(step=2, context=[t(2), t(3), t(4), t(0)], query_tokens=2)], name="text look-back")
    steps = simulate(log, "h100-kamera", ["windowkit-ahead"], progress=False).steps["windowkit-ahead"]
    # new text behind every live chunk is a new entry read at the step, not a rewrite, though a look-back
    # follows it: the guess before the last step is t2 t3 (16), and the step prefills t4, t0 behind it, the query
    assert [(c.prefill_tokens, c.idle_tokens) for c in steps] == [(3 * 8 + 2, 16), (8 + 2, 16), (8 + 8 + 2, 0)]


def test_windowkit_slide_guesses_the_next_slide_from_the_window_alone():
    """``windowkit-slide``: the agent tells nothing; between steps the Window's ``prefetch()`` forms canonicals and
    its guess policy (``policies.guess.SlideGuess``) prepares the last slide repeated. On a pinned-task sliding window (task + the last 2 shots, 40 tokens each) the first slide has
    no guess yet (its survivor re-prefilled: radix's tokens); from then on every step prefills only its new shot
    and the query, and the preparation before it the survivor behind the task. A window that does not slide
    (random look-backs) wastes a guess or two, then the policy stops preparing. Hand counts."""
    shot = lambda i: ChunkRef(id=f"s{i}", tokens=40, kind="image")  # noqa: E731
    task = ChunkRef(id="task", tokens=8)
    wins = [[task, shot(0)], [task, shot(0), shot(1)]] + [[task, shot(i - 1), shot(i)] for i in range(2, 7)]
    trace = Trace([Step(step=i, context=w, query_tokens=2) for i, w in enumerate(wins)], name="pinned")
    strat = WindowkitStrategy(guess="slide", name="windowkit-slide")
    res = simulate(trace, "h100-kamera", ["radix", strat, "floor"], progress=False)
    steps = res.steps["windowkit-slide"]
    assert [c.prefill_tokens for c in steps] == [8 + 40 + 2, 40 + 2, 40 + 40 + 2] + [40 + 2] * 4
    # between steps win.prefetch() (the Window's default loop): the new shot's canonical (40: it was prefilled
    # behind the task), and from the first slide on the guess, s_i behind the task anew (s_i+1 is new: not
    # guessed); the agent does not know the last step is the last
    assert [c.idle_tokens for c in steps] == [40, 40] + [40 + 40] * 5
    assert [c.prefill_tokens for c in res.steps["radix"]][2:] == [40 + 40 + 2] * 5
    assert strat.guess_counters == {"steps": 7, "guesses": 5, "prepared": 5, "hits": 4, "prefilled": 200,
                                    "wasted": 0}  # the last guess awaits a next window that never comes
    strat = WindowkitStrategy(guess="slide", name="windowkit-slide")  # random look-backs: no slide to repeat
    res = simulate(random_lookback(steps=40), "h100-kamera", ["windowkit", strat], progress=False)
    c = strat.guess_counters
    assert c["prepared"] <= 2 < c["guesses"] and c["hits"] == 0 and c["wasted"] == c["prefilled"] > 0
    assert res.totals("windowkit-slide")["prefill_tokens"] <= res.totals("windowkit")["prefill_tokens"]
    with pytest.raises(WindowkitError, match="exclude each other"):
        WindowkitStrategy(anticipate=True, guess="slide")


def test_a_cost_model_window_takes_the_prepared_route_after_prefetch():
    """``prefetch(next=...)`` on the cost-model backend books the survivors' conditioned prefill, and the slide it
    prepared then prefills only the new chunk, its survivors exact (what the simulator's windowkit-ahead charges)."""
    be = CostModelBackend()
    win = Window(be, prefix=be.chunk("sys", 8, "text"))
    cs = [be.chunk(f"s{i}", 32, "image") for i in range(5)]
    win.assign(cs[:3])
    win.forward([1, 2])
    assert win.prefetch(next=win.ids[1:]) == {"prefilled": 64}  # both survivors, in their new contexts
    p0 = win.stats.prefill_tokens
    win.assign(cs[1:4])
    win.forward([1, 2])
    assert win.stats.prefill_tokens - p0 == 32 and win.last_choice.route == "edit"  # only the new chunk
    assert win.stale_ids() == []


def test_simulate_repair_runs_another_point_of_the_front(tmp_path, capsys):
    """``simulate(repair=...)`` / ``windowkit simulate --repair``: the windowkit strategies that keep the default
    rule run the given one instead. Slide [A B C] -> [B C D] (5-token text chunks, a 1-token query): the two
    survivors are stale after A leaves; counted by hand, step 1 prefills D (5) + the query (1) plus what the rule
    recomputes: sink:2 -> 2 + 2, none -> 0, all -> 5 + 5 (= the prefix cache's own step)."""
    from windowkit.errors import WindowkitError
    from windowkit.trace.io import write_trace
    from windowkit.trace.simulate import main

    ref = lambda i: ChunkRef(id="abcd"[i], tokens=5, kind="text")  # noqa: E731
    tr = Trace([Step(step=0, context=[ref(0), ref(1), ref(2)], ordered=True, query_tokens=1),
                Step(step=1, context=[ref(1), ref(2), ref(3)], ordered=True, query_tokens=1)])
    want = {"sink:2": 4, "none": 0, "all": 10}
    for spec, repaired in want.items():
        res = simulate(tr, P, strategies=["radix", "windowkit", "windowkit-eager"], repair=spec, progress=False)
        assert [c.prefill_tokens for c in res.steps["windowkit"]] == [16, 6 + repaired], spec
        assert res.meta["windowkit_repair"] == spec
        assert res.meta["windowkit-eager_repair"] == "none"  # it sets its own rule: untouched
    assert [c.prefill_tokens for c in res.steps["radix"]] == [16, 16]
    default = simulate(tr, P, strategies=["windowkit"], progress=False)
    assert default.meta["windowkit_repair"] != "sink:2"
    with pytest.raises(WindowkitError, match="repair spec"):
        simulate(tr, P, strategies=["windowkit"], repair="bogus", progress=False)
    path = write_trace(tr, tmp_path / "t.jsonl")
    assert main([str(path), "--strategy", "windowkit", "--repair", "sink:2", "--no-progress"]) == 0
    assert "survivor repair: windowkit sink:2" in capsys.readouterr().out


def test_a_visual_trace_spends_the_query_part_by_position_as_a_vlm_window_does():
    """The balanced rule is head:128+query:96. A VLM's backend reads no query attention, so its Window spends the
    query part by position at the edit; a text LLM's focus reads attention within the account and is not modeled.
    Slide [A B C] -> [B C D] of 200-token chunks, a 1-token query, counted by hand: step 1 prefills D (200) + the
    query (1) + the first survivor's first 128 tokens (text) or its first 128 + 96 = 224 (image)."""
    from windowkit.errors import WindowkitError
    from windowkit.trace.strategies import WindowkitStrategy

    def trace(kind):
        ref = lambda i: ChunkRef(id="abcd"[i], tokens=200, kind=kind)  # noqa: E731
        return Trace([Step(step=0, context=[ref(0), ref(1), ref(2)], ordered=True, query_tokens=1),
                      Step(step=1, context=[ref(1), ref(2), ref(3)], ordered=True, query_tokens=1)])

    for kind, repaired, rule in (("text", 128, "head:128+query:96"), ("image", 224, "head:128+query:96@position")):
        res = simulate(trace(kind), P, strategies=["windowkit"], progress=False)
        assert [c.prefill_tokens for c in res.steps["windowkit"]] == [601, 201 + repaired], kind
        assert res.meta["windowkit_repair"] == rule
    forced = simulate(trace("image"), P, strategies=[WindowkitStrategy(reads_attention=True)], progress=False)
    assert forced.steps["windowkit"][1].prefill_tokens == 201 + 128
    with pytest.raises(WindowkitError, match="reads_attention"):
        WindowkitStrategy(reads_attention="yes")


def test_the_belady_future_is_what_this_window_reads_on_a_visual_trace():
    """``reads`` (the Belady oracle's future, from a twin's dry run) lists the store entries the strategy's own
    Window reads at each step: the twin spends the repair rule per model family too (by position on this VLM
    trace), or its survivors' conditioning, and with it the entries read at the look-backs, would differ."""
    from windowkit.trace.costs import load_profile
    from windowkit.trace.strategies import WindowkitStrategy, _ReadLog

    trace = load_trace_arg(str(Path(__file__).resolve().parent.parent / "bench/traces/recorded/long_video_qwen.jsonl"))
    steps, prof = list(trace), load_profile("cpu-tiny")
    orders = resolve_orders(steps)
    oracle = WindowkitStrategy()
    oracle.reset(prof)
    future = oracle.reads(steps, orders)
    real = WindowkitStrategy()
    real.store_policy = _ReadLog  # unbounded and logging, as the oracle's own dry run (it evicts nothing)
    real.reset(prof)
    real.prepare(steps, orders)
    for step, order in zip(steps, orders):
        real.step(step, order)
    assert real.win.repair.name.endswith("@position")
    assert future and future == real.store.policy.uses
