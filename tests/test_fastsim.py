"""WindowkitFast (bookkeeping-only model) against the real Window strategy, step by step, field by field.

The reference is ``WindowkitStrategy``: a real ``Window`` on the cost-model backend. Both run in the same
``simulate`` call, so they see the same resolved orders; every StepCost field must be *equal* (floats
included: the model adds the same per-forward milliseconds in the same order as the backend's ledger).
Two hand-computed traces pin the numbers independently of either implementation.
"""
from __future__ import annotations

from dataclasses import asdict

import pytest
from hypothesis import given, settings, strategies as st

from windowkit.errors import WindowkitError
from windowkit.trace import ChunkRef, Step, Trace, load_videotree, simulate
from windowkit.trace.fastsim import WindowkitFast, patch_nbytes
from windowkit.trace.generators import GENERATORS
from windowkit.trace.simulate import WindowkitStrategy

from hand_trace import P, T  # noqa: E402  (tests/hand_trace.py)

SMALL = {"sliding-3": dict(steps=30), "grow-interleave": dict(episodes=6), "append-zoom": dict(episodes=4),
         "random-lookback": dict(steps=30)}
# the default (form="lazy", fidelity="balanced"), the former default (eager, keep-as-is), every repair rule kind
CONFIGS = [dict(mode="patch", form="eager", repair="none"), dict(mode="patch", form="lazy", repair="none"),
           dict(mode="patch", form="lazy"), dict(mode="patch", form="eager", repair="head+sink:1"),
           dict(mode="patch", form="lazy", repair="sink:2"), dict(mode="patch", form="lazy", repair="all"),
           dict(mode="blind"), dict(mode="exact")]


def _run_both(trace, profile="h100-kamera", **kw):
    """Per-step StepCost dicts of the real Window strategy and of WindowkitFast, in one simulate call."""
    real = WindowkitStrategy(name="real", **kw)
    fast = WindowkitFast(name="fast", **kw)
    res = simulate(trace, profile, [real, fast], progress=False)
    assert "windowkit_approximated_steps" not in res.meta  # the reference metered every patch exactly
    return [asdict(c) for c in res.steps["real"]], [asdict(c) for c in res.steps["fast"]]


def _assert_equal_steps(trace, **kw):
    real, fast = _run_both(trace, **kw)
    assert len(real) == len(fast) == len(trace)
    for i, (r, f) in enumerate(zip(real, fast)):
        assert r == f, f"{trace.name} {kw} step {i}: " + ", ".join(
            f"{k}: real {r[k]} fast {f[k]}" for k in r if r[k] != f[k])
    return real


# ---------------------------------------------------------------------------------------------- by hand
def test_hand_trace_matches_hand_numbers():
    """The costs tests/test_simulate.py derives by hand for the real Window (form="eager", keep-as-is), now
    from the model."""
    res = simulate(T, P, [WindowkitFast(form="eager", repair="none")], progress=False)
    c = res.steps["windowkit-fast"]
    assert [x.total_ms for x in c] == [17.25, 18.5, 3.5]
    assert [x.encode_ms for x in c] == [2, 4, 0]
    assert [(x.encodes, x.patch_forms, x.patch_applies, x.relocations, x.binding_risk) for x in c] == \
        [(2, 1, 0, 0, 0), (1, 1, 0, 0, 0), (0, 0, 1, 2, 1)]
    assert max(x.bytes_held for x in c) == 20 * 100 + 6 * 10


def test_hand_trace_default_lazy_balanced_by_hand():
    """The defaults (form="lazy", fidelity="balanced" = repair "head+sink:5+query:96", whose query part the cost
    model does not run) on the hand trace.

    s0: A and B are new: the edits (A's prefill 4 at the head, B's conditioned 2) tie with the prefix cache's
        plan (prefill A B: 6), and a tie goes to the prefix plan: one forward of 6 + vision 8; A's KV at 0 is
        its canonical, stored (1 encode, no extra forward); query 1 -> 15.
    s1: [A B] -> [B C]: the edits (repair B wholly 2 + C's conditioned 4) tie with prefilling B C (6): one
        forward of 6 + vision 8 (C is new); B at 0 is stored as its canonical (1 encode); query 1 -> 15.
        Each prefilled chunk behind an exact front keeps its conditioned KV in the store (B behind A, C behind B).
    s2: [B C] -> [A B C]: A recalled at the head from its canonical (free); B behind A finds its conditioned KV
        of s0 (exact, relocated 0 -> 4: 1 relocation, replay 2 x 0.5); C is stale (formed behind B alone): the
        whole first stale survivor, 4 tokens; cheaper than prefilling A B C (10): the edits run -> 5.
    """
    for s in (WindowkitFast(), WindowkitStrategy()):
        c = simulate(T, P, [s], progress=False).steps[s.name]
        assert [x.total_ms for x in c] == [15, 15, 5], s.name
        assert [x.prefill_tokens for x in c] == [7, 7, 4], s.name
        assert [(x.encodes, x.patch_forms, x.relocations, x.binding_risk) for x in c] == \
            [(1, 0, 0, 0), (1, 0, 0, 0), (0, 0, 1, 0)], s.name
        assert (s.win.stats.prefix_plans if hasattr(s, "win") else s.prefix_plans) == 2, s.name


def test_zero_budget_store_reencodes_by_hand():
    """budget_bytes=0: every put is refused, so each canonical need is a fresh encode.

    s0: A at the head: encode (prefill 4, vision 8); B behind A: conditioned forward 2 + canonical encode 2
        (encode_ms 2) + SVD 2*0.125; query 1 -> 17.25, as unbounded.
    s1: evict A: B becomes the head and its canonical is placed at 0, but it was never stored: encode again
        (prefill 2, encode_ms 2) + replay 2*0.5; C: conditioned 4 + vision 8 + canonical 4 (encode_ms 4) +
        SVD 0.5; query 1 -> 20.5.
    s2: A recalled at the head: its canonical was refused, so encode (4, encode_ms 4); no patch for B on (A,)
        was kept: B and C keep their KV (risk 2) and relocate 0->4, 2->6 (replay 6*0.5) -> 7.
    bytes_held counts no stored canonical or patch, only the live window: 6, 6, 10 tokens x 100.
    """
    for s in (WindowkitFast(store_budget_bytes=0, form="eager", repair="none"),
              WindowkitStrategy(store_budget_bytes=0, form="eager", repair="none")):
        c = simulate(T, P, [s], progress=False).steps[s.name]
        assert [x.total_ms for x in c] == [17.25, 20.5, 7], s.name
        assert [x.encode_ms for x in c] == [2, 6, 4], s.name
        assert [x.encodes for x in c] == [2, 2, 1] and [x.binding_risk for x in c] == [0, 0, 2], s.name
        assert [x.bytes_held for x in c] == [600, 600, 1000], s.name


def test_patch_bytes_on_the_fake_layout():
    # 2 slots x (us [S, m] + vt [m, 2]) float32, m = min(rank, S, 2)
    assert patch_nbytes(5, 32) == 2 * (5 * 2 + 2 * 2) * 4 == 112
    assert patch_nbytes(5, 1) == 2 * (5 * 1 + 1 * 2) * 4 == 56
    assert patch_nbytes(1, None) == 2 * (1 + 2) * 4 == 24


def test_bad_knobs_raise_windowkit_errors():
    for kw in (dict(mode="fuzzy"), dict(form="later"), dict(rank=0), dict(store_budget_bytes=-1),
               dict(repair="sink:0"), dict(repair="tail:3"), dict(fidelity="perfect")):
        with pytest.raises(WindowkitError):
            WindowkitFast(**kw)


# ---------------------------------------------------------------------------------------------- vs the real Window
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(c.values()))
@pytest.mark.parametrize("gen", sorted(SMALL))
def test_generators_step_by_step(gen, cfg):
    _assert_equal_steps(GENERATORS[gen](**SMALL[gen], seed=1), **cfg)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(c.values()))
def test_videotree_step_by_step(cfg):
    real = _assert_equal_steps(load_videotree(max_questions=20), **cfg)
    # repair "all" recomputes every survivor that moved behind an edit: nothing is left to relocate
    assert sum(c["relocations"] for c in real) > 0 or cfg["mode"] == "exact" or cfg.get("repair") == "all"


@pytest.mark.parametrize("cfg", [dict(mode="patch", form="eager", repair="none"), dict(mode="patch", form="lazy"),
                                 dict(mode="patch", form="eager", repair="sink:3"), dict(mode="blind")],
                         ids=lambda c: "-".join(c.values()))
def test_bounded_store_step_by_step(cfg):
    """A budget small enough to evict and refuse: same LRU victims, same re-encodes."""
    trace = GENERATORS["random-lookback"](steps=40, shot_tokens=20, caption_tokens=4, task_tokens=6, seed=3)
    real = _assert_equal_steps(trace, profile=P, store_budget_bytes=1500, **cfg)
    unbounded = _run_both(trace, profile=P, **cfg)[0]
    if cfg.get("form") == "eager":  # lazy encodes only chunks admitted at the head here: nothing to evict
        assert sum(c["encodes"] for c in real) > sum(c["encodes"] for c in unbounded)  # the budget did bite


@pytest.mark.parametrize("repair", ["none", "head+sink:1"])
@pytest.mark.parametrize("budget", [None, 700])
def test_recurring_contexts_step_by_step(budget, repair):
    """Contexts that recur: a chunk toggled out and back (its fresh patch is served again) and a window
    reversed back and forth (orbit patches formed once, then served)."""
    a, b, c, d = (ChunkRef(id=x, tokens=3 + i, kind="image" if i % 2 else "text") for i, x in enumerate("abcd"))
    wins = [[a, b, c, d], [a, c, d], [a, b, c, d], [d, c, b, a], [a, b, c, d], [d, c, b, a], [a, c, d], [a, b, c, d]]
    trace = Trace([Step(step=i, context=w, query_tokens=2 * (i % 2)) for i, w in enumerate(wins)], name="recur")
    real = _assert_equal_steps(trace, profile=P, store_budget_bytes=budget, form="eager", repair=repair)
    assert sum(x["patch_applies"] for x in real) >= 6 and sum(x["patch_forms"] for x in real) >= 6
    _assert_equal_steps(trace, profile=P, store_budget_bytes=budget, repair=repair)  # lazy


def test_no_vision_cache_and_full_rank():
    _assert_equal_steps(GENERATORS["grow-interleave"](episodes=4, seed=2), vision_cache=False, rank=None)


# ---------------------------------------------------------------------------------------------- random traces
@st.composite
def _traces(draw):
    """Agent-like edit sequences: admit new chunks, evict, look back (recall an old chunk anywhere), reorder,
    swap two, or go back to an earlier step's exact window (so contexts recur and stored patches are served)."""
    window: list[str] = []
    refs: dict[str, ChunkRef] = {}
    history: list[list[str]] = []
    steps = []
    for s in range(draw(st.integers(1, 10))):
        for op in draw(st.lists(st.sampled_from(["admit", "evict", "lookback", "reorder", "swap", "revisit", "back"]),
                                min_size=1, max_size=3)):
            if op == "admit" or not window:
                cid = f"c{len(refs)}"
                refs[cid] = ChunkRef(id=cid, tokens=draw(st.integers(1, 5)),
                                     kind=draw(st.sampled_from(["text", "image", "video"])))
                window.insert(draw(st.integers(0, len(window))), cid)
            elif op == "evict":
                window.pop(draw(st.integers(0, len(window) - 1)))
            elif op == "lookback":
                old = [c for c in refs if c not in window]
                if old:
                    window.insert(draw(st.integers(0, len(window))), draw(st.sampled_from(old)))
            elif op == "reorder":
                window = draw(st.permutations(window))
            elif op == "swap" and len(window) > 1:
                i, j = draw(st.integers(0, len(window) - 1)), draw(st.integers(0, len(window) - 1))
                window[i], window[j] = window[j], window[i]
            elif op == "revisit" and history:
                window = list(draw(st.sampled_from(history)))
            elif op == "back" and len(history) > 1:  # undo the last step: its evicted chunks come back in place
                window = list(history[-2])
        window = window[:7]
        history.append(list(window))
        steps.append(Step(step=s, context=[refs[c] for c in window], ordered=draw(st.booleans()),
                          query_tokens=draw(st.sampled_from([0, 3]))))
    return Trace(steps, name="hypothesis")


_configs = st.fixed_dictionaries({
    "mode": st.sampled_from(["patch", "patch", "blind", "exact"]), "form": st.sampled_from(["eager", "lazy"]),
    "repair": st.sampled_from(["none", "sink:1", "sink:3", "head+sink:2", "head", "all"]),
    "rank": st.sampled_from([32, 1, None]), "store_budget_bytes": st.sampled_from([None, None, 0, 100, 300, 1000]),
    "vision_cache": st.booleans()})


@settings(max_examples=120, deadline=None)
@given(_traces(), _configs)
def test_random_traces_step_by_step(trace, cfg):
    _assert_equal_steps(trace, profile=P, **cfg)
