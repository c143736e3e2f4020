"""Tests written against surviving mutants of windowkit/window/plan.py (make mutate; docs/testing.md, "Mutation
testing"). Every expected token count is worked out by hand from the rules in plan.py's docstrings (assign's
order of edits: evictions, survivor moves, one repair, inserts, one repair), never read back from windowkit.
"""
from __future__ import annotations

import math

import pytest

from windowkit.errors import WindowkitError
from windowkit.window.plan import (RepairRule, StepChoice, WindowView, choose_step, common_prefix, edit_tokens,
                                   longest_increasing, measured_front, movers_of, orbit_forwards, repair_rule,
                                   rule_for_kl)

# ----------------------------------------------------------------------------------------------- repair rules


def test_rule_counts_by_hand():
    assert RepairRule.parse("head+sink:5").counts([40, 40, 3]) == [40, 5, 3]
    assert RepairRule.parse("sink:2").counts([1, 5, 9]) == [1, 2, 2]
    assert RepairRule.parse("head").counts([7, 8]) == [7, 0]
    assert RepairRule.parse("all").counts([3, 4]) == [3, 4]
    assert RepairRule.parse("none").counts([3, 4]) == [0, 0]


def test_query_part_spent_by_position_by_hand():
    """by_position (a backend that reads no attention): the query:N budget continues the head and sinks in window
    order, topping up each stale survivor from its start until N tokens are spent."""
    r = RepairRule.parse("head:4+query:6").by_position()
    assert (r.name, r.query, r.extra, r.head_max) == ("head:4+query:6@position", 0, 6, 4)
    assert r.counts([5, 5, 5]) == [5, 5, 0]  # head 4, then 1 more of the first, 5 of the second
    assert RepairRule.parse("head:128+query:96").by_position().counts([7, 7]) == [7, 7]  # the binding frames
    assert RepairRule.parse("sink:2+query:3").by_position().counts([4, 4, 4]) == [4, 3, 2]
    q = RepairRule.parse("query:8")
    assert q.is_none and not q.by_position().is_none and q.by_position().counts([3, 3, 3]) == [3, 3, 2]
    h = RepairRule.parse("head")
    assert h.by_position() is h  # no query part: unchanged


def test_rule_parse_spellings():
    none = RepairRule.parse(None)
    assert none == RepairRule("none") and none.is_none
    for s in ("none", "keep", "keep-as-is", " NONE "):
        assert RepairRule.parse(s) == RepairRule("none")
    for s in ("all", "exact", "All"):
        r = RepairRule.parse(s)
        assert r == RepairRule("all", full=True) and not r.is_none
    assert RepairRule.parse("head") == RepairRule("head", head=True)
    assert RepairRule.parse(" Head + Sink : 0 ") == RepairRule("head+sink:0", sink=0, head=True)
    assert RepairRule.parse("sink:3") == RepairRule("sink:3", sink=3)
    assert RepairRule.parse("head+sink:12") == RepairRule("head+sink:12", sink=12, head=True)
    r = RepairRule("sink:4", sink=4)
    assert RepairRule.parse(r) is r
    assert not RepairRule("sink:1", sink=1).is_none and not RepairRule("head", head=True).is_none


@pytest.mark.parametrize("spec", ["sink:0", "sink:-2", "sink:x", "head+sink:-1", "head+sink:", "sinks:3", "half",
                                  "head:0", "head:", "head:x", "head:4+head", "sink"])
def test_rule_parse_rejects(spec):
    with pytest.raises(WindowkitError, match=r"not understood: use 'none', 'all', or one or more of 'head' "
                                             r"\(or 'head:N', N >= 1\), 'sink:N' \(N >= 1; 0 after head\), "
                                             r"'query:N' \(N >= 1\) joined by '\+'"):
        RepairRule.parse(spec)


def test_a_capped_head_recomputes_its_first_n_tokens():
    rule = RepairRule.parse("Head:32 + sink:5+query:96")
    assert rule == RepairRule("head:32+sink:5+query:96", sink=5, head=True, query=96, head_max=32)
    assert rule.counts([40, 40, 3]) == [32, 5, 3]
    assert rule.counts([32, 40]) == [32, 5] and rule.counts([20, 40]) == [20, 5]  # a chunk within the cap: whole
    assert RepairRule.parse("head:4+sink:9").counts([40, 40]) == [9, 9]  # the sinks still hold for the head
    assert RepairRule.parse("head:8").counts([40, 40]) == [8, 0] and not RepairRule.parse("head:8").is_none
    assert RepairRule.parse("head:1000").counts([765, 10]) == RepairRule.parse("head").counts([765, 10])


def test_rule_parse_rejects_non_strings_by_type():
    with pytest.raises(WindowkitError, match="got int"):
        RepairRule.parse(5)


FRONT = {"none": {"cost_share": 0.0, "mean_kl": 0.5}, "sink:1": {"cost_share": 0.1, "mean_kl": 0.05},
         "head": {"cost_share": 0.3, "mean_kl": 0.01}, "all": {"cost_share": 1.0, "mean_kl": 0.0}}


def test_rule_for_kl_picks_the_cheapest_rule_within_the_target():
    assert rule_for_kl(1.0, FRONT) == "none"
    assert rule_for_kl(0.5, FRONT) == "none"       # at the target counts
    assert rule_for_kl(0.05, FRONT) == "sink:1"
    assert rule_for_kl(0.02, FRONT) == "head"
    assert rule_for_kl(0.0, FRONT) == "all"
    assert rule_for_kl(0.0, {"none": {"cost_share": 0.0, "mean_kl": 0.5}}) == "all"  # none within: exact


@pytest.mark.parametrize("bad", [-1e-3, float("nan")])
def test_rule_for_kl_rejects_negative_and_nan(bad):
    with pytest.raises(WindowkitError, match="nats >= 0"):
        rule_for_kl(bad, FRONT)


def test_measured_front_errors_name_the_file(tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text("{}")
    with pytest.raises(WindowkitError, match="cannot read the measured repair front .*broken.json"):
        measured_front(bad)
    good = tmp_path / "good.json"
    good.write_text('{"rules": {"none": {"cost_share": 0.0, "mean_kl": 0.25}}}')
    assert measured_front(good) == {"none": {"cost_share": 0.0, "mean_kl": 0.25}}


def test_repair_rule_presets_and_override():
    assert repair_rule() == RepairRule("head:128+query:96", head=True, query=96, head_max=128)
    assert repair_rule("balanced") == RepairRule("head:128+query:96", head=True, query=96, head_max=128)
    assert repair_rule("exact") == RepairRule("all", full=True)
    assert repair_rule("fast") == RepairRule("none")
    assert repair_rule("balanced", "sink:2") == RepairRule("sink:2", sink=2)
    assert repair_rule("exact", RepairRule("none")) == RepairRule("none")
    for bad in (True, "nope", None):
        with pytest.raises(WindowkitError, match="fidelity must be one of exact, balanced, fast or a next-token KL"):
            repair_rule(bad)


# ----------------------------------------------------------------------------------------------- matching helpers


def test_longest_increasing_by_hand():
    assert longest_increasing([2, 0, 1], ["a", "b", "c"]) == ["b", "c"]
    assert longest_increasing([], []) == []
    assert longest_increasing([3, 1, 2, 0, 4], list("abcde")) == ["b", "c", "e"]
    assert longest_increasing([0, 1, 2], list("abc")) == ["a", "b", "c"]
    assert len(longest_increasing([1, 1], ["a", "b"])) == 1  # strictly increasing


def test_movers_of_by_hand():
    assert movers_of(["a", "b", "c"], ["c", "a", "b"]) == (["c"], False)
    assert movers_of(["a", "b", "c"], ["a", "b", "c"]) == ([], False)
    mv, one = movers_of(["a", "b", "c"], ["c", "b", "a"])   # only one can stay: two of three move
    assert len(mv) == 2 and one is True
    assert movers_of(["a", "b"], ["b", "a"])[1] is False     # one of two moves: not more than half


def test_orbit_forwards_by_hand():
    assert [orbit_forwards(k) for k in range(5)] == [1, 1, 2, 6, 24]
    assert orbit_forwards(5) == 24 and orbit_forwards(9, samples=10) == 10 and orbit_forwards(3, samples=2) == 6
    assert orbit_forwards(4, samples=10) == 24  # K <= 4: every ordering, whatever the sample count


def test_common_prefix_by_hand():
    assert common_prefix(["a", "b", "c"], ["a", "b", "x"]) == 2
    assert common_prefix([], ["a"]) == 0 and common_prefix(["a"], ["a", "b"]) == 1
    assert common_prefix(["x", "b"], ["a", "b"]) == 0


# ----------------------------------------------------------------------------------------------- step costs

TOK = {"a": 10, "b": 20, "c": 30, "d": 40, "e": 50}
HEAD5 = RepairRule.parse("head+sink:5")


def view(ids=("a", "b", "c"), ante=None, *, canonical=True, patch=(), orbit=(), exact=(), prefix=0):
    """A window whose entries are all exactly conditioned (each on the entries before it) unless ``ante`` says.
    ``canonical``: True (every chunk's canonical is stored), False (none) or the set of ids whose is."""
    ids = list(ids)
    ante = [tuple(ids[:i]) for i in range(len(ids))] if ante is None else ante
    canon = set(TOK) if canonical is True else set() if canonical is False else set(canonical)
    return WindowView(ids, ante, TOK, lambda c: c in canon, lambda c, a: (c, tuple(a)) in patch,
                      lambda c, a: (c, tuple(a)) in orbit, prefix, lambda c, a: (c, tuple(a)) in exact)


def test_a_reorder_leaves_nothing_for_the_repair():
    # [a b c d] -> [d c b]: a evicted, the rest reversed in one reorder; every survivor is re-placed on its new
    # antecedents (orbit), so the repair after the evictions finds nothing stale: head costs what "none" costs
    v = view(("a", "b", "c", "d"))
    base = edit_tokens(v, ["d", "c", "b"], RepairRule.parse("none"), reorder=True)
    assert edit_tokens(v, ["d", "c", "b"], RepairRule.parse("head"), reorder=True) == base
    assert edit_tokens(v, ["d", "c", "b"], HEAD5, reorder=True) == base


def test_evicting_the_head_repairs_the_survivors():
    # [a b c] -> [b c], no canonical stored: both survivors stale; head+sink:5 recomputes b wholly (20) and 5 of c
    v = view(canonical=False)
    assert edit_tokens(v, ["b", "c"], HEAD5) == 25
    assert choose_step(v, ["b", "c"], HEAD5) == StepChoice("edit", 0, 50, 25)
    assert edit_tokens(v, ["b", "c"], RepairRule.parse("sink:1")) == 2
    assert edit_tokens(v, ["b", "c"], RepairRule("none")) == 0
    # "all" recomputes 20 + 30 = the prefix cache's 50: a tie goes to the prefix cache (exact)
    assert choose_step(v, ["b", "c"], RepairRule.parse("all")) == StepChoice("prefill", 0, 50, 50)
    # b's canonical stored: at the head with no prefix it IS b's exact KV, placed free by the eviction (as the
    # Window's ``_refresh_known`` does); c is then the first stale survivor, which the head rule recomputes wholly
    assert edit_tokens(view(), ["b", "c"], HEAD5) == 30
    assert choose_step(view(), ["b", "c"], RepairRule.parse("all")) == StepChoice("edit", 0, 50, 30)


def test_evicting_the_tail_costs_nothing():
    assert edit_tokens(view(), ["a", "b"], HEAD5) == 0
    assert choose_step(view(), ["a", "b"], HEAD5) == StepChoice("prefill", 2, 0, 0)


def test_appending_is_one_conditioned_forward():
    assert edit_tokens(view(), ["a", "b", "c", "d"], HEAD5) == 40
    assert choose_step(view(), ["a", "b", "c", "d"], HEAD5) == StepChoice("prefill", 3, 40, 40)


def test_inserting_in_the_middle():
    # d placed behind a: 40 (one conditioned forward); b and c behind it go stale: head b (20) + 5 of c
    assert edit_tokens(view(), ["a", "d", "b", "c"], HEAD5) == 65
    assert choose_step(view(), ["a", "d", "b", "c"], HEAD5) == StepChoice("edit", 1, 90, 65)
    # a stored patch (with its canonical) or the exact KV for that context makes the placement free
    assert edit_tokens(view(patch={("d", ("a",))}), ["a", "d", "b", "c"], HEAD5) == 25
    assert edit_tokens(view(patch={("d", ("a",))}, canonical=False), ["a", "d", "b", "c"], HEAD5) == 65
    assert edit_tokens(view(exact={("d", ("a",))}), ["a", "d", "b", "c"], HEAD5) == 25
    # an orbit patch is not used for a plain insert
    assert edit_tokens(view(orbit={("d", ("a",))}), ["a", "d", "b", "c"], HEAD5) == 65


def test_survivors_behind_an_insert_take_their_stored_exact_kv_free():
    # [a b c] -> [a d b c] where prefetch(next=[a, d, b, c]) stored d's exact KV behind (a) and b's and c's behind
    # (a, d): the insert and both survivors behind it are free (as admit's _refresh_known finds them)
    ready = {("d", ("a",)), ("b", ("a", "d")), ("c", ("a", "d", "b"))}
    assert edit_tokens(view(exact=ready), ["a", "d", "b", "c"], HEAD5) == 0
    assert choose_step(view(exact=ready), ["a", "d", "b", "c"], HEAD5) == StepChoice("edit", 1, 90, 0)
    # only c's copy: b (right behind d) is the first stale survivor, repaired wholly; c is free
    assert edit_tokens(view(exact={("d", ("a",)), ("c", ("a", "d", "b"))}), ["a", "d", "b", "c"], HEAD5) == 20
    # the copies with a new chunk e at the tail too: e's conditioned forward (50) alone
    assert edit_tokens(view(exact=ready), ["a", "d", "b", "c", "e"], HEAD5) == 50
    # inserted at the front with no prefix: d's canonical is free; a, b, c behind it take their copies
    front = {("a", ("d",)), ("b", ("d", "a")), ("c", ("d", "a", "b"))}
    assert edit_tokens(view(exact=front), ["d", "a", "b", "c"], HEAD5) == 0


def test_inserting_at_the_front_with_and_without_a_prefix():
    # nothing in front: d's canonical is its KV at 0 (free when stored, else its prefill); a b c go stale
    assert edit_tokens(view(), ["d", "a", "b", "c"], HEAD5) == 10 + 5 + 5
    assert edit_tokens(view(canonical=False), ["d", "a", "b", "c"], HEAD5) == 40 + 10 + 5 + 5
    # a fixed prefix in front: d is conditioned on it, one forward
    assert edit_tokens(view(prefix=7), ["d", "a", "b", "c"], HEAD5) == 40 + 20


def test_reorder_one_pass_forms_orbit_patches():
    # [a b c] -> [c b a] as one reorder: c at 0 (canonical, free); b behind (c): orbit over its 1! = 1 ordering,
    # forwards of 30 + 20 tokens; a behind (c, b): 2! = 2 orderings of 30 + 20 + 10 tokens -> 50 + 120
    assert edit_tokens(view(), ["c", "b", "a"], HEAD5, reorder=True) == 170
    assert edit_tokens(view(), ["c", "b", "a"], HEAD5) == 170          # two of three move: one reorder
    assert choose_step(view(), ["c", "b", "a"], HEAD5) == StepChoice("prefill", 0, 60, 170)
    # stored orbit patches make it free
    orbits = {("b", ("c",)), ("a", ("c", "b"))}
    assert edit_tokens(view(orbit=orbits), ["c", "b", "a"], HEAD5, reorder=True) == 0
    # a prefix in front of the window: every member is behind something (prefix 7 counted in each forward)
    assert edit_tokens(view(prefix=7), ["c", "b", "a"], HEAD5, reorder=True) == (
        1 * (7 + 30) + 1 * (7 + 30 + 20) + 2 * (7 + 30 + 20 + 10))


def test_reorder_as_moves():
    # reorder=False: c and b are evicted and re-inserted: c at 0 (canonical, free), b behind c (20); a is then
    # stale behind (c, b) and is the head of the repair: 10
    assert edit_tokens(view(), ["c", "b", "a"], HEAD5, reorder=False) == 30
    assert choose_step(view(), ["c", "b", "a"], HEAD5, reorder=False) == StepChoice("edit", 0, 60, 30)
    # one mover of three: moved, not reordered: [a b c] -> [c a b]: c to the front (free), a b stale: 10 + 5
    assert edit_tokens(view(), ["c", "a", "b"], HEAD5) == 15


def test_already_stale_survivors_are_repaired_after_an_eviction():
    # b was placed blind (its KV formed on nothing); evicting c leaves it behind a, but nothing changed in front
    # of b, so the repair after the eviction (from c's index on) does not touch it
    v = view(ante=[(), (), ("a", "b")])
    assert edit_tokens(v, ["a", "b"], HEAD5) == 0
    # evicting a: b moves to the front, where its KV (formed on nothing) is exact; c is the only stale survivor,
    # so it is the head of the repair: wholly, 30
    assert edit_tokens(v, ["b", "c"], HEAD5) == 30


def test_costs_are_integers_and_finite():
    c = choose_step(view(), ["a", "d", "b", "c"], HEAD5)
    assert all(isinstance(x, int) and math.isfinite(x) for x in (c.keep, c.prefill_tokens, c.edit_tokens))


def test_canonical_is_asked_for_the_placed_chunk():
    # d's patch for (a,) is stored; the placement is free only with d's own canonical
    v = view(patch={("d", ("a",))}, canonical={"a", "b", "c", "d"})
    assert edit_tokens(v, ["a", "d", "b", "c"], HEAD5) == 25
    v = view(patch={("d", ("a",))}, canonical={"a", "b", "c"})
    assert edit_tokens(v, ["a", "d", "b", "c"], HEAD5) == 65


def test_a_one_token_prefix_is_a_prefix():
    assert edit_tokens(view(prefix=1), ["d", "a", "b", "c"], HEAD5) == 40 + 20


def test_reorder_without_canonicals_pays_their_encodes():
    # c at 0 without a canonical: its prefill (30); b: its encode 20 + 1 * (30 + 20); a: 10 + 2 * (30 + 20 + 10)
    assert edit_tokens(view(canonical=False), ["c", "b", "a"], HEAD5, reorder=True) == 30 + 70 + 130


def test_two_evictions_repair_from_the_first():
    # [a b c d] -> [b d]: a and c evicted; b and d stale from index 0: head b (20) + 5 of d
    assert edit_tokens(view(("a", "b", "c", "d"), canonical=False), ["b", "d"], HEAD5) == 25
    # with b's canonical (its exact KV at the head, free) d heads the repair: wholly, 40
    assert edit_tokens(view(("a", "b", "c", "d")), ["b", "d"], HEAD5) == 40


def test_two_inserts_repair_from_the_first():
    # [a b c] -> [a d b e c]: d behind (a) 40, e behind (a d b) 50; then b (head, 20) and 5 of c are stale,
    # e was formed exactly where it stands
    assert edit_tokens(view(), ["a", "d", "b", "e", "c"], HEAD5) == 40 + 50 + 20 + 5


def test_repair_starts_at_the_edit():
    # b was already stale before the step (formed on nothing); evicting c repairs from c's index only: d, the
    # head of that repair, wholly (40); b is left as it is
    v = view(("a", "b", "c", "d"), ante=[(), (), ("a", "b"), ("a", "b", "c")])
    assert edit_tokens(v, ["a", "b", "d"], HEAD5) == 40


def test_a_context_of_the_right_length_but_other_ids_is_stale():
    # d was formed behind (x, c): after b's eviction it stands at index 2 behind (a, c): same length, other ids
    v = view(("a", "b", "c", "d"), ante=[(), ("a",), ("a", "b"), ("x", "c")])
    assert edit_tokens(v, ["a", "c", "d"], HEAD5) == 30 + 5


def test_a_survivor_free_by_a_stored_patch_needs_its_canonical_too():
    # [a b c] -> [b c]: c has a patch for its new context (b); placing it needs c's canonical. With it, c is free
    # and the head rule recomputes only b (20); without it, c stays stale: b (20) + 5 of c
    with_canon = view(canonical={"c"}, patch={("c", ("b",))})
    assert edit_tokens(with_canon, ["b", "c"], HEAD5) == 20
    assert edit_tokens(view(canonical=False, patch={("c", ("b",))}), ["b", "c"], HEAD5) == 25


def test_a_survivor_behind_an_insert_is_repaired_once():
    # [a b c d] -> [b c e d]: b at the head is free; c, in front of e, is repaired before e lands (wholly, 30); e is
    # conditioned on [b c] (50); d, behind e, is repaired only after it (wholly, 40), not also after the eviction
    assert edit_tokens(view(("a", "b", "c", "d")), ["b", "c", "e", "d"], HEAD5) == 30 + 50 + 40
    # [a b c] -> [b d c]: the first stale survivor, c, stands right behind d (conditioned on [b]: 40): c is
    # repaired once, after d lands (30, not 30 + 30)
    assert edit_tokens(view(), ["b", "d", "c"], HEAD5) == 40 + 30


def test_a_survivor_made_free_goes_stale_again_behind_an_insert():
    # [a b c] -> [d b c]: b at the head takes its canonical (free, formed on nothing), so the eviction's repair
    # starts at c (wholly, 30); d (canonical stored: 0) is then placed in front of b, which is stale again: the
    # insert's repair recomputes b (20) and 5 of c
    assert edit_tokens(view(), ["d", "b", "c"], HEAD5) == 30 + 20 + 5
