"""Placement policies, the Belady store policy and patch-refresh policies on hand-made traces.

Every expected order and cost is worked out by hand in the comments. The unit cost model
(``PatchHitCost()``) charges 1 per token of a chunk that misses (kept and hit chunks are free).
"""
from __future__ import annotations

import itertools
import random

import pytest

from policies.placement import (PLACEMENTS, Arrival, GreedyPatchHit, History, Listed, OfflineOptimal, OrbitSet,
                                PatchHitCost, make_placement, model_cost, step_cost)
from policies.refresh import Always, Budgeted, DivergenceThreshold, Never, make_refresh
from windowkit.errors import WindowkitError
from windowkit.store import chunk_key
from windowkit.trace import ChunkRef, CostModelBackend, Step, Trace, simulate
from windowkit.trace.generators import grow_interleave, random_lookback, random_lookback_set, sliding_window
from windowkit.trace.simulate import WindowkitStrategy, resolve_orders, resolve_placement

A, B, C, D = (ChunkRef(id=k, tokens=n) for k, n in (("A", 4), ("B", 2), ("C", 3), ("D", 1)))
from hand_trace import P  # noqa: E402  (the unit profile of tests/test_simulate.py)


def unordered(*contexts) -> list[Step]:
    return [Step(step=i, context=list(c), ordered=False) for i, c in enumerate(contexts)]


def ids(orders) -> list[str]:
    return ["".join(c.id for c in o) for o in orders]


def run(name: str, steps, profile=None):
    pol = make_placement(name)
    pol.reset(profile)
    pol.prepare(steps)
    orders = pol.resolve(steps)
    return orders, model_cost(orders, pol.cost)[0], pol


# -------------------------------------------------------------------- the cost model
def test_step_cost_kinds_by_hand() -> None:
    h = History()
    assert step_cost([A, B], h, PatchHitCost()) == (6.0, ["miss", "miss"])
    h.observe([A, B])
    # B at the head: seen -> its canonical is stored (hit); A behind (B,): never formed -> miss 4
    assert step_cost([B, A], h, PatchHitCost()) == (4.0, ["hit", "miss"])
    # same order as the previous step: both kept
    assert step_cost([A, B, C], h, PatchHitCost()) == (3.0, ["kept", "kept", "miss"])
    # profile weights: a kept chunk 0; B hit at the head: replay 2*0.5; A miss behind B: (1 + 0.125) * 4
    assert step_cost([B, A], h, PatchHitCost(P))[0] == pytest.approx(1.0 + 4.5)


# -------------------------------------------------------------------- online policies, by hand
def test_online_orders_and_costs_by_hand() -> None:
    # s0 {A,B} listed [A,B]; s1 {B,C} listed [B,C]; s2 {A,B} listed [A,B]
    steps = unordered([A, B], [B, C], [A, B])
    # listed: [A,B] 6 | [B,C]: B head hit, C miss 3 | [A,B]: A head hit, B behind (A,) formed at s0: 0 -> 9
    # arrival: [A,B] 6 | [B,C] 3 | survivor B then new A: [B,A]: B kept (head both times), A miss 4 -> 13
    # greedy: s2 tries runs [A,B] (cost 0) and [B] (+A miss 4): [A,B] -> 9
    # orbit: first-seen A, B, C: [A,B], [B,C], [A,B] -> 9
    want = {"listed": (["AB", "BC", "AB"], 9), "arrival": (["AB", "BC", "BA"], 13),
            "greedy": (["AB", "BC", "AB"], 9), "orbit": (["AB", "BC", "AB"], 9), "optimal": (["AB", "BC", "AB"], 9)}
    for name, (orders, cost) in want.items():
        got, total, _ = run(name, steps)
        assert (ids(got), total) == (orders, cost), name


def test_orbit_brings_a_recurring_set_back_in_one_order() -> None:
    # s0 {A,B} listed [A,B]; s1 {C}; s2 {A,B} listed [B,A]
    # arrival / listed: s2 has no survivors, so the listed [B,A]: B head hit, A behind (B,) never formed: 4
    #   -> 6 + 3 + 4 = 13; orbit: first-seen A, B -> [A,B]: both hits -> 9 (greedy finds the same run)
    steps = unordered([A, B], [C], [B, A])
    want = {"listed": (["AB", "C", "BA"], 13), "arrival": (["AB", "C", "BA"], 13), "orbit": (["AB", "C", "AB"], 9),
            "greedy": (["AB", "C", "AB"], 9), "optimal": (["AB", "C", "AB"], 9)}
    for name, (orders, cost) in want.items():
        got, total, _ = run(name, steps)
        assert (ids(got), total) == (orders, cost), name


def test_offline_optimal_beats_greedy_by_hand() -> None:
    # s0 {A,B,C}; s1 {A,C} (listed [C,A]); s2 {A,C,D} (listed [D,A,C])
    steps = unordered([A, B, C], [C, A], [D, A, C])
    # greedy / arrival / orbit: [A,B,C] 9 | [A,C]: A kept, C behind (A,) never formed: 3 | [A,C,D]: A, C kept, D 1 -> 13
    # listed: [A,B,C] 9 | [C,A]: C head hit, A miss 4 | [D,A,C]: all miss 1+4+3 -> 21
    # optimal: [A,C,B] 9 | [A,C] both kept 0 | [A,C,D] D 1 -> 10 = every chunk missed exactly once (a lower bound)
    want = {"greedy": 13, "arrival": 13, "orbit": 13, "listed": 21, "optimal": 10}
    for name, cost in want.items():
        orders, total, pol = run(name, steps)
        assert total == cost, name
    orders, _, pol = run("optimal", steps)
    assert ids(orders) == ["ACB", "AC", "ACD"]
    assert pol.counters["exact_components"] == 1 and pol.counters["fallback_steps"] == 0


def test_offline_optimal_falls_back_above_the_size_limit() -> None:
    big = [ChunkRef(id=f"f{i}", tokens=1) for i in range(9)]
    steps = unordered(big, big[:8])
    orders, total, pol = run("optimal", steps)
    assert pol.counters["fallback_steps"] == 2 and pol.counters["exact_components"] == 0
    # the best online order: 9 misses, then the same set minus f8 kept -> 9
    assert total == 9


def test_offline_optimal_search_budget_keeps_the_incumbent() -> None:
    # the hand trace above with a budget of 1 candidate order: the search stops at once and keeps the best
    # online policy's orders (13), saying so in its counters
    steps = unordered([A, B, C], [C, A], [D, A, C])
    pol = OfflineOptimal(max_nodes=1)
    pol.reset()
    pol.prepare(steps)
    assert model_cost(pol.resolve(steps))[0] == 13
    assert pol.counters["budget_components"] == 1 and pol.counters["exact_components"] == 0


def test_policy_places_and_registry() -> None:
    assert Arrival().place(1, [C, A, B], [A, B]) == [A, B, C]
    assert Listed().place(1, [B, A], [A, B]) == [A, B] and Listed().place(1, [C, A], [A, B]) == [C, A]
    o = OrbitSet()
    o.observe([B, A])
    assert o.place(1, [C, A, B], None) == [B, A, C]
    assert set(PLACEMENTS) == {"listed", "arrival", "greedy", "orbit", "optimal"}
    assert isinstance(make_placement("Greedy"), GreedyPatchHit) and make_placement(None) is None
    with pytest.raises(ValueError, match="unknown placement"):
        make_placement("tsp")
    with pytest.raises(WindowkitError):
        simulate(Trace(unordered([A])), P, ["radix"], placement="tsp", progress=False)


# -------------------------------------------------------------------- optimal against brute force and the others
def _random_steps(rng: random.Random, n_steps: int, max_chunks: int) -> list[Step]:
    pool = [ChunkRef(id=f"c{i}", tokens=rng.randint(1, 5)) for i in range(6)]
    out = []
    for i in range(n_steps):
        ctx = rng.sample(pool, rng.randint(1, max_chunks))
        out.append(Step(step=i, context=ctx, ordered=rng.random() < 0.15))
    return out


def test_offline_optimal_is_exact_and_never_worse() -> None:
    rng = random.Random(0)
    for trial in range(25):
        steps = _random_steps(rng, 3, 4)
        profile = P if trial % 2 else None
        costs = {name: run(name, steps, profile)[1] for name in PLACEMENTS}
        for name, c in costs.items():
            assert costs["optimal"] <= c + 1e-9, (trial, name, costs)
        # brute force over every order of every unordered step (at most 24^3 combinations)
        choices = [[list(s.context)] if s.ordered else [list(p) for p in itertools.permutations(s.context)]
                   for s in steps]
        cost = PatchHitCost(profile)
        brute = min(model_cost(combo, cost)[0] for combo in itertools.product(*choices))
        assert costs["optimal"] == pytest.approx(brute), trial
    for trial in range(6):  # larger: 5 steps of up to 5 chunks, only the comparison
        steps = _random_steps(rng, 5, 5)
        costs = {name: run(name, steps, P)[1] for name in PLACEMENTS}
        assert all(costs["optimal"] <= c + 1e-9 for c in costs.values()), costs


# -------------------------------------------------------------------- simulator integration
def test_arrival_equals_resolve_orders_on_ordered_traces() -> None:
    for t in (sliding_window(steps=30), grow_interleave(episodes=5), random_lookback(steps=30)):
        steps = list(t)
        base = ids(resolve_orders(steps))
        for name in PLACEMENTS:
            assert ids(resolve_placement(steps, name)[0]) == base, (t.name, name)
    # listed reproduces resolve_orders on unordered steps too
    steps = list(random_lookback_set(steps=40))
    assert ids(resolve_placement(steps, "listed")[0]) == ids(resolve_orders(steps))


def test_every_strategy_sees_the_placed_order() -> None:
    # s0 {A,B} [A,B]; s1 {A,B,C} listed [C,A,B]
    t = Trace(unordered([A, B], [C, A, B]), name="two")
    # radix, listed: 6 | no prefix starts with C: 9 -> 15; arrival puts C at the tail: [A,B] hit, C 3 -> 9
    none = simulate(t, P, ["radix"], progress=False)
    arr = simulate(t, P, ["radix", "blind"], placement="arrival", progress=False)
    assert none.totals("radix")["total_ms"] == 15 and arr.totals("radix")["total_ms"] == 9
    # blind under arrival: A, B stay where they were, C is new: prefill 6 then 3, nothing relocates
    assert arr.totals("blind")["total_ms"] == 9 and arr.totals("blind")["relocations"] == 0
    s = arr.summary()
    assert s["placement"] == "arrival" and s["meta"]["placement_counters"]["placed"] == 2
    assert "placement" not in none.summary()


# -------------------------------------------------------------------- Belady store policy in the simulator
def _paging_trace() -> Trace:
    one = {k: ChunkRef(id=k, tokens=4) for k in "ABC"}
    return Trace([Step(step=i, context=[one[k]]) for i, k in enumerate("ABCABCA")], name="paging")


@pytest.mark.parametrize("mode", ["blind", "patch"])
def test_belady_store_encodes_fewer_than_lru(mode: str) -> None:
    # one 4-token chunk per step; a canonical is 4 * 16 fake bytes; budget: two canonicals, the live one pinned.
    # LRU: A B C A B C A all encode (7). Belady: A B C, A hit, B (evict A: next use 6 > C's 5), C hit,
    # A (encode) -> 5 encodes (see tests/test_policies.py for the same sequence on the policy alone)
    enc = {}
    for pol in ("lru", "belady", "gds"):
        s = WindowkitStrategy(mode=mode, store_budget_bytes=2 * 4 * 16, store_policy=pol)
        res = simulate(_paging_trace(), P, [s], progress=False)
        enc[pol] = res.totals("windowkit")["encodes"]
    assert enc["lru"] == 7 and enc["belady"] == 5 and enc["gds"] == 7
    # simulate-level options reach the windowkit strategy built from its name
    res = simulate(_paging_trace(), P, ["windowkit"], store_budget_bytes=128, store_policy="belady", progress=False)
    assert res.totals("windowkit")["encodes"] == 5 and res.meta["windowkit_store"]["policy"] == "belady"


def test_the_belady_future_is_every_read_of_an_unbounded_dry_run() -> None:
    """WindowkitStrategy.reads: the entries the same Window reads at each step with nothing evicted. Checked against
    the store's own read counter (every read of an unbounded run is a hit) and by hand on one entry: the canonical
    of A, stored when A first leads (s0) and read back when A is recalled at the head (s2)."""
    t = Trace(unordered([A, B], [B, C], [A, B, C], [C, B, A]), name="mix")
    s = WindowkitStrategy(form="eager")  # eager forming stores a canonical and a patch per conditioned admission
    res = simulate(t, P, [s], placement="listed", progress=False)
    fut = WindowkitStrategy(form="eager").reads(list(t), resolve_orders(list(t)), P)
    assert sum(len(v) for v in fut.values()) == s.store.stats.hits > 0
    assert set(fut) <= set(s.store._entries)  # nothing read that the store does not hold
    a = ("c", chunk_key(CostModelBackend.chunk("A", A.tokens).content_hash(), s.backend.fingerprint()), "")
    assert fut[a] == [2]
    assert res.totals("windowkit")["patch_forms"] > 0


# -------------------------------------------------------------------- patch refresh
A_img, C_img = ChunkRef(id="A", tokens=4, kind="image"), ChunkRef(id="C", tokens=4, kind="image")
B2 = ChunkRef(id="B", tokens=2)
T_SIM = Trace([Step(step=0, context=[A_img, B2], query_tokens=1), Step(step=1, context=[B2, C_img], query_tokens=1),
               Step(step=2, context=[A_img, B2, C_img], query_tokens=0)], name="hand")


@pytest.mark.parametrize("refresh,ms2,risk", [
    (None, 3.5, 1), ("never", 3.5, 1), ("budget:0", 3.5, 1),
    # C's patch was formed on (B,), it now sits behind (A, B): Jaccard distance of {B} and {A, B} = 1/2
    ("threshold:0.6", 3.5, 1), ("threshold:0.5", 6.0, 0), ("always", 6.0, 0), ("budget:1", 6.0, 0)])
def test_refresh_policies_on_the_hand_trace(refresh, ms2, risk) -> None:
    # tests/test_simulate.py's trace: at s2 A is recalled at the head, B gets its stored patch on (A,), C is kept
    # as-is (3.5 ms: B replay 1 + apply 0.5, C relocation 2 -> 6: replay 2). A refresh of C instead: one
    # conditioned forward of C (4 tokens: 4 ms) + its SVD (4 * 0.125 = 0.5), formed in place (no relocation):
    # 1 + 0.5 + 4 + 0.5 = 6.0, and no binding risk left.
    # the costs below are counted for the former defaults (eager forming, survivors kept as-is until a refresh):
    # the refresh policies act on kept-as-is survivors, so pin them
    # (s1: B's canonical placed at 0 is read as is, charged nothing: 17.5, tests/test_simulate.py)
    res = simulate(T_SIM, P, [WindowkitStrategy(form="eager", repair="none", refresh=refresh)], progress=False)
    ms = [round(c.total_ms, 6) for c in res.steps["windowkit"]]
    assert ms == [17.25, 17.5, ms2]
    assert res.steps["windowkit"][2].binding_risk == risk
    if refresh is not None:
        assert res.meta["windowkit_refresh"]["refreshed"] == (1 if risk == 0 else 0)


def test_refresh_select_and_factory() -> None:
    class E:  # a plan() edit: only op and divergence matter here
        def __init__(self, d):
            self.op, self.divergence = "refresh-patch", d

    edits = [E(0.1), E(0.7), E(0.4)]
    assert [e.divergence for e in DivergenceThreshold(0.4).select(edits)] == [0.7, 0.4]
    assert [e.divergence for e in Budgeted(2).select(edits)] == [0.7, 0.4]
    assert Never().select(edits) == [] and len(Always().select(edits)) == 3
    th = make_refresh("threshold:0.25")
    assert isinstance(th, DivergenceThreshold) and th.tau == 0.25
    assert make_refresh(None) is None and make_refresh("budget:3").k == 3
    for bad in ("sometimes", "threshold:x", "budget:1.5", "always:3"):
        with pytest.raises(ValueError, match="refresh policy"):  # policies stay pure Python: plain ValueError
            make_refresh(bad)
    with pytest.raises(ValueError):
        DivergenceThreshold(0.0)
    # through the simulator, bad knobs are windowkit errors
    for kw in (dict(refresh="sometimes"), dict(refresh="threshold:2"), dict(store_policy="arc")):
        with pytest.raises(WindowkitError):
            simulate(T_SIM, P, ["windowkit"], progress=False, **kw)


def test_layering_eviction_does_not_pull_placement_and_windowkit_not_policies() -> None:
    import subprocess
    import sys

    code = ("import sys, policies.eviction, policies; "
            "assert 'policies.placement' not in sys.modules and 'policies.refresh' not in sys.modules; "
            "from policies import OrbitSet, make_refresh; assert 'policies.placement' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
    # one-way: windowkit (the store included) never imports policies
    code = ("import sys, windowkit, windowkit.store, windowkit.registry; "
            "assert not any(m == 'policies' or m.startswith('policies.') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_store_finds_policies_by_name_through_the_registry() -> None:
    """A fresh process: ChunkStore(policy="lfu") loads the policies package on demand (entry point or import)."""
    import subprocess
    import sys

    code = ("import sys; from windowkit.store import ChunkStore; "
            "assert 'policies' not in sys.modules; s = ChunkStore(policy='LFU'); "
            "assert type(s.policy).__name__ == 'LFU' and 'policies.eviction' in sys.modules; "
            "from windowkit.registry import make_policy; assert make_policy('refresh', 'budget:2').k == 2")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_placement_and_store_flags_reach_the_run(tmp_path):
    """``windowkit simulate --placement/--store-budget/--store-policy`` are passed to simulate() and recorded."""
    import json

    from windowkit.cli import main as cli_main

    out = tmp_path / "s.json"
    rc = cli_main(["simulate", "grow-interleave-set-small", "--placement", "arrival", "--strategy", "radix",
                   "--strategy", "windowkit", "--max-steps", "8", "--store-budget", "200000", "--store-policy",
                   "belady", "--no-progress", "--json", str(out)])
    assert rc == 0
    s = json.loads(out.read_text())
    assert s["placement"] == "arrival" and s["meta"]["placement"] == "arrival"
    assert s["meta"]["windowkit_store"]["policy"] == "belady"
    assert s["meta"]["windowkit_store"]["budget_bytes"] == 200000


def test_cli_policy_flag_routes_each_name_to_its_family(tmp_path):
    """``--policy`` takes any policy name and sets its family; unknown or conflicting names are errors."""
    import json

    from windowkit.cli import main as cli_main

    out = tmp_path / "s.json"
    assert cli_main(["simulate", "grow-interleave-set-small", "--policy", "greedy", "--policy", "belady",
                     "--policy", "threshold:0.5", "--store-budget", "200000", "--strategy", "windowkit",
                     "--max-steps", "6", "--no-progress", "--json", str(out)]) == 0
    s = json.loads(out.read_text())
    assert s["placement"] == "greedy"
    assert s["meta"]["windowkit_store"]["policy"] == "belady"
    assert "threshold" in s["meta"]["windowkit_refresh"]["policy"].lower()
    assert cli_main(["simulate", "sliding-3", "--policy", "nonsense", "--no-progress"]) == 1
    assert cli_main(["simulate", "sliding-3", "--policy", "greedy", "--placement", "orbit", "--no-progress"]) == 1


def test_registry_lists_the_names_of_each_family() -> None:
    """``windowkit.registry.names``: the providers' own name lists, in their order; unknown families are errors."""
    from policies.refresh import REFRESH_POLICIES
    from windowkit.registry import names
    from windowkit.store.eviction import EVICTION_POLICIES, eviction_names

    assert names("placement") == list(PLACEMENTS) == ["listed", "arrival", "greedy", "orbit", "optimal"]
    assert names("refresh") == list(REFRESH_POLICIES) == ["never", "always", "threshold", "budget"]
    assert eviction_names() == list(EVICTION_POLICIES) and {"lru", "lfu", "fifo", "size", "belady"} <= set(eviction_names())
    with pytest.raises(WindowkitError, match="no nonsense policies"):
        names("nonsense")


def test_cli_choices_come_from_the_registries(monkeypatch) -> None:
    """``windowkit simulate``'s strategy, placement and store-policy choices are the registries' names: a name
    registered there is accepted without touching the CLI."""
    import argparse

    from policies.eviction import LRU
    from windowkit.store import eviction
    from windowkit.trace import cli
    from windowkit.trace.run import STRATEGIES

    def choices(p: argparse.ArgumentParser, flag: str) -> list:
        return next(a.choices for a in p._actions if flag in a.option_strings)

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    assert choices(p, "--strategy") == list(STRATEGIES)
    assert choices(p, "--placement") == list(PLACEMENTS)
    assert choices(p, "--store-policy") == list(eviction.EVICTION_POLICIES) + ["gds"]

    class MRU(LRU):
        name = "mru"

    monkeypatch.setitem(eviction.EVICTION_POLICIES, "mru", MRU)
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    assert "mru" in choices(p, "--store-policy")
    args = p.parse_args(["sliding-3", "--policy", "mru"])
    cli._route_policy(args, "mru")
    assert args.store_policy == "mru"


def test_simulate_module_keeps_every_name_it_had() -> None:
    """``from windowkit.trace.simulate import X`` works for every name the module had before its split, and each
    is the object of the module that now holds it."""
    import importlib

    from windowkit.trace import cli, orders, placement, result, run, strategies
    from windowkit.trace import simulate as simulate_function

    sim = importlib.import_module("windowkit.trace.simulate")  # ``import ... as`` would find the function

    homes = {"main": cli, "load_trace_arg": cli, "add_arguments": cli, "run_cli": cli, "resolve_orders": orders,
             "resolve_placement": orders, "compare_placements": placement, "placement_table": placement,
             "SimResult": result, "simulate": run, "STRATEGIES": run, "DEFAULT_STRATEGIES": run,
             "make_strategies": run, **{n: strategies for n in ("StepCost", "Strategy", "FullRecompute", "RadixCache",
                                                                "BlindReuse", "TokenBlend", "WindowkitStrategy")}}
    assert set(homes) == set(sim.__all__)
    for name, mod in homes.items():
        assert getattr(sim, name) is getattr(mod, name), name
    assert simulate_function is run.simulate  # the package's ``simulate`` is the function, not the module


def test_compare_placements_runs_every_registered_placement_by_default() -> None:
    """The default set is the registry's (``windowkit.registry.names("placement")``), not a list written by hand."""
    import inspect

    from windowkit.registry import names
    from windowkit.trace.generators import GENERATORS
    from windowkit.trace.placement import compare_placements

    assert inspect.signature(compare_placements).parameters["placements"].default is None
    rows = compare_placements(GENERATORS["grow-interleave-set-small"](episodes=2), profile="cpu-tiny",
                              strategies=("radix",))
    assert list(rows["placements"]) == names("placement")
