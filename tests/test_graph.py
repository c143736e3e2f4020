"""windowkit.graph: the conditioning dependency graph, recall cascades and the divergence signal.

Pure Python (no model, no tensor work except the embed hook test); no timing here (see bench/bench_plan.py).
"""
from __future__ import annotations

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from windowkit.errors import ChunkNotFoundError, WindowkitError
from windowkit.graph import (Cascade, CascadeStep, DependencyGraph, PatchNotFoundError, PatchRef, TokenCostModel,
                             divergence, reuse_decision)


def chain():
    """A <- B <- C: B formed on [A], C formed on [B] only (short-range binding)."""
    g = DependencyGraph()
    for c in "ABC":
        g.add_chunk(c, tokens=10)
    g.add_patch("B", "b|A", ["A"])
    g.add_patch("C", "c|B", ["B"])
    return g


# ---------------------------------------------------------------- structure and staleness
def test_graph_shape_and_queries():
    g = chain()
    G = g.graph
    assert isinstance(G, nx.DiGraph)
    assert set(G.edges) == {("A", PatchRef("B", "b|A")), (PatchRef("B", "b|A"), "B"),
                            ("B", PatchRef("C", "c|B")), (PatchRef("C", "c|B"), "C")}
    assert g.patches_of("B") == [PatchRef("B", "b|A")]
    assert g.dependents("A") == [PatchRef("B", "b|A")]
    assert g.dependents("C") == [] and g.patches_of("nope") == []
    assert g.current_patch("C") == ("C", "c|B")
    assert g.current_dependents("B") == {"C"}
    info = g.patch_info("B", "b|A")
    assert info["antecedents"] == ("A",) and info["kind"] == "fresh" and info["current"] and not info["stale"]
    assert g.tokens("B") == 10 and len(g) == 3 and g.num_patches == 2
    with pytest.raises(nx.NetworkXError):
        g.graph.add_node("Z")  # a read-only view


def test_evict_marks_dependents_stale_and_recall_clears():
    g = chain()
    assert g.on_evict("A") == [PatchRef("B", "b|A")]
    assert g.is_stale("B", "b|A") and not g.is_stale("C", "c|B")
    assert g.stale_patches() == {PatchRef("B", "b|A")}
    assert g.on_evict("A") == [PatchRef("B", "b|A")]  # idempotent
    g.on_evict("B")
    assert g.stale_patches() == {PatchRef("B", "b|A"), PatchRef("C", "c|B")}
    assert g.current_patch("B") is None  # an evicted chunk wears nothing
    g.on_recall("A", ["A", "C"])
    assert g.stale_patches() == {PatchRef("C", "c|B")}
    g.on_recall("B", ["A", "B", "C"])
    assert g.stale_patches() == set()
    assert g.on_evict("never-seen") == []


def test_patch_with_two_evicted_antecedents_stays_stale_until_both_return():
    g = DependencyGraph()
    g.add_patch("C", "c", ["A", "B"])
    g.on_evict("A"), g.on_evict("B")
    g.on_recall("A", ["A"])
    assert g.is_stale(PatchRef("C", "c"))
    g.on_recall("B", ["A", "B"])
    assert not g.is_stale("C", "c")


def test_patch_added_on_an_evicted_antecedent_is_stale_at_once():
    g = DependencyGraph()
    g.on_evict("A")
    g.add_patch("B", "b", ["A"])
    assert g.is_stale("B", "b")


def test_bad_input_is_rejected():
    g = DependencyGraph()
    with pytest.raises(WindowkitError, match="itself"):
        g.add_patch("A", "a", ["B", "A"])
    with pytest.raises(WindowkitError, match="kind"):
        g.add_patch("A", "a", ["B"], kind="weird")
    with pytest.raises(WindowkitError, match="string"):
        g.add_patch("A", "a", "B")
    with pytest.raises(WindowkitError):
        g.add_patch(3, "a", ["B"])
    with pytest.raises(PatchNotFoundError) as e:
        g.remove_patch("A", "nope")
    assert isinstance(e.value, ChunkNotFoundError) and isinstance(e.value, KeyError)
    with pytest.raises(PatchNotFoundError):
        g.is_stale("A", "nope")
    g.add_patch("B", "b", ["A"])
    with pytest.raises(WindowkitError, match="not in the window"):
        g.on_recall("A", ["B"])
    with pytest.raises(WindowkitError, match="twice"):
        g.cascade("A", ["A", "B", "B"])
    assert not g.is_evicted("A")


def test_readd_remove_forget():
    g = DependencyGraph()
    g.add_patch("C", "c", ["A", "B"], nbytes=5, tokens=7)
    g.add_patch("C", "c", ["A", "B"], nbytes=9)  # same key, same antecedents: updated in place
    assert g.patch_info("C", "c")["nbytes"] == 9 and g.patch_info("C", "c")["tokens"] == 7
    g.add_patch("C", "c", ["B"])  # same key, new antecedents: edges rebuilt
    assert g.dependents("A") == [] and g.dependents("B") == [PatchRef("C", "c")]
    g.on_evict("B")
    g.remove_patch(PatchRef("C", "c"))
    assert g.stale_patches() == set() and g.current_patch("C") is None and g.current_dependents("B") == set()
    g.add_patch("D", "d", ["C"])
    g.add_patch("C", "c2", ["A"])
    assert set(g.forget("C")) == {PatchRef("D", "d"), PatchRef("C", "c2")}
    assert "C" not in g and g.num_patches == 0 and g.current_patch("D") is None
    assert g.forget("C") == []


def test_copy_is_independent():
    g = chain()
    h = g.copy()
    h.on_evict("A")
    h.add_patch("C", "c|A", ["A"])
    assert g.stale_patches() == set() and g.current_patch("C") == ("C", "c|B")
    assert h.stale_patches() == {PatchRef("B", "b|A"), PatchRef("C", "c|A")}
    assert g.cascade("A", ["A", "B", "C"]).ids == ["B", "C"]
    assert h.on_recall("A", ["A", "B", "C"]).ids == ["B", "C"]
    assert g.num_patches == 2 and h.num_patches == 3


def test_auto_ctx_and_orbit_key():
    g = DependencyGraph()
    r1 = g.add_patch("C", None, ["A", "B"], kind="orbit")
    r2 = g.add_patch("C", None, ["B", "A"], kind="orbit")
    r3 = g.add_patch("C", None, ["B", "A"])
    assert r1 == r2 != r3


# ---------------------------------------------------------------- cascades
def test_chain_cascade_is_transitive_in_window_order():
    g = chain()
    g.on_evict("A")
    c = g.on_recall("A", ["A", "B", "C"])
    assert isinstance(c, Cascade) and c.ids == ["B", "C"] and len(c) == 2
    assert [(s.chunk_id, s.index, s.depth, s.via) for s in c] == [("B", 1, 1, ("A",)), ("C", 2, 2, ("B",))]
    assert c.root.chunk_id == "A" and c.root.depth == 0 and c.root.patch is None
    assert c[1].patch == PatchRef("C", "c|B")
    assert c.antecedents(c[1]) == ("A", "B")
    assert c.depth == 2


def test_diamond_cascade():
    g = DependencyGraph()
    g.add_patch("B", "b", ["A"])
    g.add_patch("C", "c", ["A", "B"])
    g.add_patch("D", "d", ["B", "C"])
    g.add_patch("E", "e", ["X"])  # unrelated, in the window
    c = g.cascade("A", ["X", "A", "B", "C", "E", "D"])
    assert c.ids == ["B", "C", "D"]
    by = {s.chunk_id: s for s in c}
    assert by["C"].via == ("A", "B") and by["C"].depth == 2
    assert by["D"].via == ("B", "C") and by["D"].depth == 3
    assert [s.index for s in c] == c.indices == [2, 3, 5]


def test_cascade_only_moves_forward_and_follows_worn_patches():
    g = DependencyGraph()
    g.add_patch("B", "b", ["A"])
    g.add_patch("C", "c", ["A", "B"])
    # A recalled after B: B cannot see A, so only C (via A; B is no member) re-conditions
    c = g.cascade("A", ["B", "A", "C"])
    assert c.ids == ["C"] and c[0].via == ("A",)
    # C's worn patch is one that was not formed on A: no cascade through an old patch
    g.add_patch("C", "c2", ["X"])
    assert g.cascade("A", ["A", "B", "C"]).ids == ["B"]
    g.set_current("C", "c")
    assert g.cascade("A", ["A", "B", "C"]).ids == ["B", "C"]
    g.set_current("B", None)
    assert g.cascade("A", ["A", "B", "C"]).ids == ["C"]
    # a chunk not in the window never cascades
    assert g.cascade("A", ["A", "B"]).ids == []


def test_cycle_in_history_does_not_loop():
    g = DependencyGraph()
    g.add_patch("B", "b", ["A"])
    g.add_patch("A", "a", ["B"])  # later, after a reorder, A was conditioned on B
    assert g.cascade("A", ["A", "B"]).ids == ["B"]
    assert g.cascade("B", ["B", "A"]).ids == ["A"]


def test_cascade_cost_and_table():
    calls = []

    def cost(cid, tokens):
        calls.append(cid)
        return tokens * 0.5, tokens * 100

    g = DependencyGraph(cost_model=cost)
    g.add_chunk("A", 4)
    g.add_patch("B", "b", ["A"], tokens=8)
    g.add_patch("C", "c", ["B"], tokens=2)
    c = g.on_recall("A", ["A", "B", "C"])
    assert calls == ["A", "B", "C"]
    assert [s.ms for s in (c.root, *c)] == [2.0, 4.0, 1.0]
    assert c.total_ms == 7.0 and c.total_bytes == 1400
    text = str(c)
    assert "2 dependent(s)" in text and "(recalled)" in text
    assert [ln.split()[2] for ln in text.splitlines()[3:]] == ["A", "B", "C"]
    assert c.as_dict()["steps"][2]["via"] == ["B"]
    assert "Cascade(root='A'" in repr(c)


def test_token_cost_model_batch_matches_call():
    m = TokenCostModel(ms_per_token=0.1, bytes_per_token=10, ms_fixed=1.0)
    ms, nb = m.batch(["a", "b"], [3, 5])
    assert [m("a", 3), m("b", 5)] == list(zip(ms, nb))
    g = DependencyGraph()
    g.add_patch("B", "b", ["A"], tokens=10)
    assert g.cascade("A", ["A", "B"])[0].ms == pytest.approx(0.5)


# ---------------------------------------------------------------- divergence
@pytest.mark.parametrize("n", [2, 3, 5, 8, 16])
def test_divergence_ordering(n):
    f = [f"f{i}" for i in range(n)]
    identical = divergence(f, list(f))
    reorder = divergence(f, f[::-1])
    swap = divergence(f, [f[1], f[0]] + f[2:])
    replace_one = divergence(f, f[:-1] + ["x"])
    replace_first = divergence(f, ["x"] + f[1:])
    disjoint = divergence(f, [f"x{i}" for i in range(n)])
    assert identical == 0.0
    assert 0 < swap <= reorder < min(replace_one, replace_first) < disjoint == 1.0
    if n > 2:
        dropdup = divergence(f, [f[0]] + f[:1] + f[2:])  # drop f1, duplicate f0
        drop = divergence(f, f[:1] + f[2:])
        assert 0 < dropdup < replace_one and 0 < drop < replace_one
    for x in (identical, reorder, replace_one, disjoint):
        assert 0.0 <= x <= 1.0


def test_reuse_decision():
    assert reuse_decision(["a", "b"], ("a", "b")) == (0.0, False)
    s, rebuild = reuse_decision(["a", "b"], ["a", "b", "x"])  # superset: rebuild
    assert rebuild and 0 < s < 1
    assert reuse_decision([], ["a"])[1]  # formed on nothing, now behind something
    assert reuse_decision(["a", "b"], ["b", "a", "x"])[1]
    assert not reuse_decision(["a", "b", "c"], ["a", "x", "c"])[1]  # replace: soft signal only
    assert reuse_decision(["a"], ["x"]) == (1.0, True)  # nothing shared
    assert reuse_decision(["a"], ["x"], threshold=None) == (1.0, False)
    assert reuse_decision(["a", "b"], ["a", "x"], threshold=0.5)[1]
    assert not reuse_decision(["a", "b", "c"], ["a", "a", "c"])[1]  # drop/duplicate is no superset
    assert divergence(["a", "b"], ["b", "a"], ordered=False) == 0.0
    with pytest.raises(WindowkitError):
        divergence("ab", ["a"])


def test_divergence_embed_hook():
    import torch
    g = torch.Generator().manual_seed(0)
    clip1 = {f"a{i}": torch.randn(4, 16, generator=g) + 3.0 for i in range(4)}
    clip2 = {f"b{i}": torch.randn(16, generator=g) - 3.0 for i in range(4)}
    emb = {**clip1, **clip2}.__getitem__
    a = list(clip1)
    assert divergence(a, list(a), emb) == 0.0
    assert divergence(a, a[::-1], emb) == pytest.approx(0.0, abs=1e-6)  # mean embedding: order-free
    one = divergence(a, a[:-1] + ["b0"], emb)
    allr = divergence(a, list(clip2), emb)
    assert 0 < one < allr <= 1.0
    assert divergence([], ["a0"], emb) == 1.0
    assert reuse_decision(a[:2], a[:3], emb)[1]


def test_refresh_order_most_diverged_first():
    g = DependencyGraph()
    r_same = g.add_patch("D", "d", ["A", "B", "C"])
    r_reord = g.add_patch("E", "e", ["B", "A", "C", "D"])
    r_repl = g.add_patch("F", "f", ["A", "X", "C", "D", "E"])
    r_orbit = g.add_patch("G", "g", ["F", "E", "D", "C", "B", "A"], kind="orbit")
    window = ["A", "B", "C", "D", "E", "F", "G"]
    ranked = g.refresh_order([r_same, r_orbit, r_reord, r_repl], window)
    assert [r for r, _ in ranked] == [r_repl, r_reord, r_same, r_orbit]  # ties: earlier in the window first
    scores = dict(ranked)
    assert scores[r_same] == 0.0 and scores[r_orbit] == 0.0 and scores[r_repl] > scores[r_reord] > 0
    ranked2 = g.refresh_order([r_same, r_repl], {"D": ["X"], "F": ["A", "X", "C", "D", "E"]})
    assert [r for r, _ in ranked2] == [r_same, r_repl]
    assert g.divergence("E", "e", window[:4]) == scores[r_reord]


# ---------------------------------------------------------------- property: random add / evict / recall
IDS = list("abcdef")


def _brute_stale(patches, evicted):
    return {ref for ref, ante in patches.items() if set(ante) & evicted}


def _brute_cascade(r, window, current, patches):
    pos = {c: i for i, c in enumerate(window)}
    members = {r}
    changed = True
    while changed:
        changed = False
        for d in window:
            if d in members or pos[d] < pos[r] or d not in current:
                continue
            if any(m in patches[current[d]] and pos[m] < pos[d] for m in members):
                members.add(d)
                changed = True
    return sorted(members - {r}, key=pos.__getitem__)


KINDS_OF_OP = ["add", "add", "add", "evict", "recall", "recall", "remove", "current"]


@settings(max_examples=75, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_sequences_match_brute_force(data):
    g = DependencyGraph()
    patches: dict = {}  # ref -> antecedent tuple
    current: dict = {}  # chunk -> worn ref
    evicted: set = set()
    n_ops = data.draw(st.integers(4, 24), label="n_ops")
    for _ in range(n_ops):
        kind = data.draw(st.sampled_from(KINDS_OF_OP))
        if kind == "add":
            cid = data.draw(st.sampled_from(IDS))
            ctx = data.draw(st.sampled_from(["x", "y"]))
            ante = data.draw(st.lists(st.sampled_from([i for i in IDS if i != cid]), min_size=1, max_size=5,
                                      unique=True))
            wear = data.draw(st.sampled_from([True, True, False]))
            ref = g.add_patch(cid, ctx, ante, current=wear)
            if ref in patches and patches[ref] != tuple(ante) and current.get(cid) == ref:
                del current[cid]  # re-keyed with new antecedents: the old node is gone
            patches[ref] = tuple(ante)
            if wear:
                current[cid] = ref
        elif kind == "evict":
            cid = data.draw(st.sampled_from(IDS))
            got = g.on_evict(cid)
            assert set(got) == {r for r, a in patches.items() if cid in a}
            evicted.add(cid)
            current.pop(cid, None)
        elif kind == "recall":
            worn_on = sorted({a for r in current.values() for a in patches[r]})
            cid = data.draw(st.sampled_from(worn_on) if worn_on and data.draw(st.booleans()) else st.sampled_from(IDS))
            others = data.draw(st.permutations([i for i in IDS if i != cid]))
            window = others[:data.draw(st.integers(0, 5))]
            window.insert(data.draw(st.integers(0, len(window))), cid)
            casc = g.on_recall(cid, window)
            evicted.discard(cid)
            assert casc.ids == _brute_cascade(cid, window, current, patches)
            dag = nx.DiGraph([(m, s.chunk_id) for s in casc for m in s.via])
            assert nx.is_directed_acyclic_graph(dag)
            depth = {cid: 0}
            for s in casc:  # via: the members before it in its worn patch's antecedents
                assert s.patch == current[s.chunk_id] and window[s.index] == s.chunk_id
                assert set(s.via) == {m for m in [cid] + casc.ids if m in patches[s.patch]
                                      and window.index(m) < s.index}
                assert s.depth == 1 + max(depth[m] for m in s.via)
                depth[s.chunk_id] = s.depth
        elif kind == "remove":
            if patches:
                ref = data.draw(st.sampled_from(sorted(patches)))
                g.remove_patch(ref)
                del patches[ref]
                if current.get(ref.chunk_id) == ref:
                    del current[ref.chunk_id]
        elif kind == "current":
            cid = data.draw(st.sampled_from(IDS))
            mine = sorted(r for r in patches if r.chunk_id == cid)
            if not mine or data.draw(st.booleans()):
                g.set_current(cid, None)
                current.pop(cid, None)
            else:
                ref = data.draw(st.sampled_from(mine))
                g.set_current(cid, ref.ctx)
                current[cid] = ref
        # invariants after every op
        assert g.stale_patches() == _brute_stale(patches, evicted)
        for ref in patches:
            assert g.is_stale(ref) == bool(set(patches[ref]) & evicted)
        assert set(g.patches()) == set(patches)
        assert {c: g.current_patch(c) for c in IDS if g.current_patch(c)} == current
        G = g.graph
        for ref, ante in patches.items():
            assert ref.chunk_id not in ante  # a patch never depends on its own chunk
            assert set(G.predecessors(ref)) == set(ante)
            assert list(G.successors(ref)) == [ref.chunk_id]
            assert not G.has_edge(ref.chunk_id, ref)  # no chunk -> own patch -> chunk loop
        for c in IDS:
            if c in g:
                assert all(isinstance(p, PatchRef) for p in G.successors(c))
                assert g.current_dependents(c) == {d for d, r in current.items() if c in patches[r]}


def test_cascade_step_is_a_plain_record():
    g = chain()
    s = g.cascade("A", ["A", "B", "C"])[0]
    assert isinstance(s, CascadeStep) and s._asdict()["chunk_id"] == "B"


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_stream_cascades_match_brute_force(data):
    """A stream admitted in window order, each chunk's patch on a random subset of the chunks before it: deep
    cascades; recall any chunk at its place after evicting it."""
    n = data.draw(st.integers(2, 10), label="n")
    ids = [f"k{i}" for i in range(n)]
    g = DependencyGraph()
    patches, current = {}, {}
    for i, cid in enumerate(ids):
        ante = [a for a in ids[:i] if data.draw(st.booleans())]
        if ante or data.draw(st.booleans()):
            ref = g.add_patch(cid, f"ctx{i}", ante, tokens=i + 1)
            patches[ref], current[cid] = tuple(ante), ref
    r = data.draw(st.sampled_from(ids), label="recalled")
    deps = set(g.on_evict(r))
    assert deps == {ref for ref, a in patches.items() if r in a} == g.stale_patches()
    casc = g.on_recall(r, ids)
    assert casc.ids == _brute_cascade(r, ids, current, patches)
    assert g.stale_patches() == set()
    assert casc.total_ms == pytest.approx(sum(TokenCostModel()(c, g.tokens(c))[0] for c in [r] + casc.ids))
