"""Tests written against surviving mutants of windowkit/graph (make mutate; docs/testing.md, "Mutation testing").

Every expected number is computed by hand from the definitions in the docstrings (Jaccard distance plus the
footrule order term, ``1 - cos`` of mean embeddings), never read back from windowkit.
"""
from __future__ import annotations

import math

import pytest
import torch

from windowkit.errors import WindowkitError
from windowkit.graph import divergence, reuse_decision

# ----------------------------------------------------------------------------------------------- divergence


def test_full_reversal_of_three_scores_a_quarter():
    # footrule of (a b c) -> (c b a): |2-0| + |1-1| + |0-2| = 4, normalised by floor(9/2) = 4 -> 1.0;
    # no set change (jac 0), order weight 1 / (3 shared + 1) -> 0.25 (the module docstring's number)
    assert divergence(["a", "b", "c"], ["c", "b", "a"]) == pytest.approx(0.25, abs=1e-12)


def test_swap_of_two_scores_a_third():
    # footrule of (a b) -> (b a): 1 + 1 = 2, normalised by floor(4/2) = 2 -> 1.0; weight 1 / (2 + 1)
    assert divergence(["a", "b"], ["b", "a"]) == pytest.approx(1 / 3, abs=1e-12)


def test_dropping_an_antecedent_in_order_is_pure_jaccard():
    # {x, a, b} vs {a, b}: jac = 1 - 2/3; the shared part (a b) is in the same order -> no order term
    assert divergence(["x", "a", "b"], ["a", "b"]) == pytest.approx(1 / 3, abs=1e-12)
    assert divergence(["a", "b"], ["a", "y", "b"]) == pytest.approx(1 / 3, abs=1e-12)


def test_set_change_and_reorder_combine():
    # (a b c) vs (c b a x): jac = 1 - 3/4 = 0.25; shared part reversed: footrule 1.0, weight 1/(3+1);
    # score = 0.25 + (1 - 0.25) * 1.0 / 4 = 0.4375
    assert divergence(["a", "b", "c"], ["c", "b", "a", "x"]) == pytest.approx(0.4375, abs=1e-12)


def test_emptied_context_is_fully_diverged():
    assert divergence(["a", "b"], []) == 1.0
    assert divergence([], ["a"]) == 1.0


def test_any_iterable_of_ids_is_accepted():
    assert divergence((c for c in ["a", "b"]), ["b", "a"]) == pytest.approx(1 / 3, abs=1e-12)
    assert divergence(iter(["a", "b"]), ("a", "b")) == 0.0
    assert reuse_decision(dict.fromkeys(["a", "b"]).keys(), ["a", "b"]) == (0.0, False)


def test_a_lone_string_is_rejected_with_its_value():
    with pytest.raises(WindowkitError, match="not the string 'ab'"):
        divergence("ab", ["a", "b"])
    with pytest.raises(WindowkitError, match="not the string 'xy'"):
        reuse_decision(["a"], "xy")


# ----------------------------------------------------------------------------------------------- reuse_decision


def test_same_context_is_never_rebuilt_even_at_threshold_zero():
    # the same ordered context (list or tuple) is the context the patch was formed on: exact, never rebuilt
    assert reuse_decision(["a", "b"], ["a", "b"], threshold=0.0) == (0.0, False)
    assert reuse_decision(("a", "b"), ["a", "b"], threshold=0.0) == (0.0, False)
    assert reuse_decision(["a", "b"], ("a", "b"), threshold=0.0) == (0.0, False)


def test_reorder_scores_by_default_and_is_not_a_superset():
    score, rebuild = reuse_decision(["a", "b"], ["b", "a"])
    assert score == pytest.approx(1 / 3, abs=1e-12) and rebuild is False
    assert reuse_decision(["a", "b"], ["b", "a"], ordered=False) == (0.0, False)


def test_longer_context_that_lost_an_antecedent_is_not_a_superset():
    # (a b) -> (a x y): shares only a; jac = 1 - 1/4 = 0.75 < threshold 1; not a superset (b is gone)
    score, rebuild = reuse_decision(["a", "b"], ["a", "x", "y"])
    assert score == pytest.approx(0.75, abs=1e-12) and rebuild is False
    # a strict superset is rebuilt
    assert reuse_decision(["a", "b"], ["a", "b", "x"])[1] is True


# ----------------------------------------------------------------------------------------------- embed hook

VEC = {"a": [1.0, 0.0, 0.0], "b": [0.0, 1.0, 0.0], "c": [1.0, 1.0, 0.0]}


def _embed(cid):
    return torch.tensor(VEC[cid])


def test_embed_hook_values_by_hand():
    # mean(a, b) = (.5, .5, 0) is parallel to c: 1 - cos = 0; a vs b orthogonal: 1
    assert divergence(["a", "b"], ["c"], _embed) == pytest.approx(0.0, abs=1e-6)
    assert divergence(["a"], ["b"], _embed) == pytest.approx(1.0, abs=1e-6)
    # a vs c: cos = 1/sqrt(2)
    assert divergence(["a"], ["c"], _embed) == pytest.approx(1 - 1 / math.sqrt(2), abs=1e-6)


def test_embed_hook_empty_side_is_fully_diverged():
    assert divergence(["a"], [], _embed) == 1.0
    assert divergence([], ["a"], _embed) == 1.0


def test_embed_hook_is_scale_free_down_to_tiny_norms():
    # the eps guards only a zero vector: embeddings of norm ~1e-9 give the same 1 - cos as unit ones
    def tiny(cid):
        return torch.tensor(VEC[cid]) * 1e-9

    assert divergence(["a"], ["c"], tiny) == pytest.approx(1 - 1 / math.sqrt(2), abs=1e-6)


def test_embed_hook_token_embeddings_any_leading_shape():
    # [1, tokens, d] (a batch of one) reads like [tokens, d]: the mean over every token
    tok = {"p": [[[1.0, 0.0, 0.0], [1.0, 2.0, 0.0]]], "q": [[[0.0, 0.0, 1.0], [0.0, 2.0, 1.0]]]}
    # means (1, 1, 0) and (0, 1, 1): cos = 1 / (sqrt 2 * sqrt 2) = 0.5
    assert divergence(["p"], ["q"], lambda cid: torch.tensor(tok[cid])) == pytest.approx(0.5, abs=1e-6)


def test_embed_hook_nan_reads_as_fully_diverged():
    nan = {"a": [float("nan"), 1.0], "b": [1.0, 0.0]}
    assert divergence(["a"], ["b"], lambda cid: torch.tensor(nan[cid])) == 1.0


def test_embed_hook_size_mismatch_names_both_shapes():
    sizes = {"a": [1.0, 0.0, 0.0], "b": [1.0, 0.0]}
    with pytest.raises(WindowkitError, match=r"\(3,\) vs \(2,\)"):
        divergence(["a"], ["b"], lambda cid: torch.tensor(sizes[cid]))


def test_reuse_decision_with_embed():
    # a reorder has the same mean embedding (score 0) and is not a superset -> reuse
    score, rebuild = reuse_decision(["a", "b"], ["b", "a"], _embed)
    assert score == pytest.approx(0.0, abs=1e-6) and rebuild is False
    # a vs b: orthogonal -> 1.0 >= threshold 1.0 -> rebuild; a vs c under a threshold of 0.5: 0.29 -> reuse
    score, rebuild = reuse_decision(["a"], ["b"], _embed)
    assert score == pytest.approx(1.0, abs=1e-6) and rebuild is True
    score, rebuild = reuse_decision(["a"], ["c"], _embed, threshold=0.5)
    assert score == pytest.approx(1 - 1 / math.sqrt(2), abs=1e-6) and rebuild is False
    # a strict superset is rebuilt whatever the score
    assert reuse_decision(["a"], ["a", "c"], _embed, threshold=None)[1] is True


# ----------------------------------------------------------------------------------------------- DependencyGraph

from windowkit.graph import DependencyGraph, PatchNotFoundError, PatchRef, TokenCostModel  # noqa: E402
from windowkit.graph.dependency import _fmt_bytes  # noqa: E402


def _four():
    """a <- b (on a), c (on a, b), d (on b); 0.5 ms and 64 bytes per token."""
    g = DependencyGraph(cost_model=TokenCostModel(ms_per_token=0.5, bytes_per_token=64))
    g.add_chunk("a", 10)
    g.add_patch("b", "cb", ["a"], tokens=24)
    g.add_patch("c", "cc", ["a", "b"], tokens=32)
    g.add_patch("d", "cd", ["b"], tokens=16)
    return g


def test_cascade_table_by_hand():
    c = _four().cascade("a", ["a", "b", "c", "d"])
    # ms = tokens / 2, bytes = 64 * tokens: 640 B, 1536 B = 1.5 KiB, 2048 B, 1024 B; total 41 ms, 5248 B = 5.125 KiB
    assert str(c) == "\n".join([
        "recall 'a' at index 0: 3 dependent(s) need a fresh patch, depth 2, total ~41.00 ms, 5.1 KiB",
        "  step  idx  chunk  depth  via         tokens  est ms  est bytes",
        "  ----  ---  -----  -----  ----------  ------  ------  ---------",
        "     0    0  a          0  (recalled)      10   5.000      640 B",
        "     1    1  b          1  a               24  12.000    1.5 KiB",
        "     2    2  c          2  a, b            32  16.000    2.0 KiB",
        "     3    3  d          2  b               16   8.000    1.0 KiB",
    ])


def test_cascade_as_dict_by_hand():
    c = _four().cascade("a", ["a", "b", "c", "d"])
    assert c.as_dict() == {
        "window": ["a", "b", "c", "d"], "total_ms": 41.0, "total_bytes": 5248,
        "steps": [
            {"chunk_id": "a", "index": 0, "depth": 0, "via": [], "patch": None, "tokens": 10, "ms": 5.0, "nbytes": 640},
            {"chunk_id": "b", "index": 1, "depth": 1, "via": ["a"], "patch": ["b", "cb"], "tokens": 24, "ms": 12.0,
             "nbytes": 1536},
            {"chunk_id": "c", "index": 2, "depth": 2, "via": ["a", "b"], "patch": ["c", "cc"], "tokens": 32,
             "ms": 16.0, "nbytes": 2048},
            {"chunk_id": "d", "index": 3, "depth": 2, "via": ["b"], "patch": ["d", "cd"], "tokens": 16, "ms": 8.0,
             "nbytes": 1024},
        ]}


def test_fmt_bytes_units_and_boundaries():
    assert [_fmt_bytes(n) for n in (0, 640, 1023)] == ["0 B", "640 B", "1023 B"]
    assert _fmt_bytes(1024) == "1.0 KiB" and _fmt_bytes(1536) == "1.5 KiB"
    assert _fmt_bytes(102400) == "100.0 KiB"          # 100 * 1024
    assert _fmt_bytes(5 * 2**20) == "5.0 MiB"
    assert _fmt_bytes(3 * 2**30) == "3.0 GiB"
    assert _fmt_bytes(2**40) == "1024.0 GiB"          # GiB is the last unit


def test_cascade_via_is_in_window_order_and_only_members():
    g = DependencyGraph()
    g.add_patch("q", "q1", ["r"])
    g.add_patch("p", "p1", ["r"])
    g.add_patch("s", "s1", ["p", "q"])    # formed when p stood before q
    g.add_patch("t", "t1", ["n", "q"])    # n sits before the recalled r: not a cascade member
    c = g.cascade("r", ["n", "r", "q", "p", "s", "t"])
    assert [(s.chunk_id, s.index, s.depth, s.via) for s in c] == [
        ("q", 2, 1, ("r",)), ("p", 3, 1, ("r",)), ("s", 4, 2, ("q", "p")), ("t", 5, 2, ("q",))]
    h = DependencyGraph()
    h.add_patch("q", "q1", ["r", "x", "y"])  # x, y are not in the window
    h.add_patch("p", "p1", ["q", "x"])
    c = h.cascade("r", ["r", "q", "p"])
    assert [(s.chunk_id, s.depth, s.via) for s in c] == [("q", 1, ("r",)), ("p", 2, ("q",))]


def test_cascade_of_an_unknown_chunk_and_odd_windows():
    g = DependencyGraph(cost_model=TokenCostModel(ms_per_token=1.0, bytes_per_token=1))
    c = g.cascade("zz", ["zz"])
    assert (c.root.chunk_id, c.root.tokens, c.root.ms, c.root.nbytes, len(c)) == ("zz", 0, 0.0, 0, 0)
    g.add_patch("b", "cb", ["a"], tokens=3)
    assert g.cascade("a", iter(["a", "b"])).ids == ["b"]
    assert g.cascade("a", (c for c in ["x", "a", "b"])).indices == [2]
    with pytest.raises(WindowkitError, match="^cascade: the window lists a chunk twice$"):
        g.cascade("a", ["a", "b", "a"])


def test_cost_model_batch_is_used_when_defined():
    class BatchOnly:
        def __call__(self, cid, tokens):
            raise AssertionError("batch is defined: the per-chunk call must not be used")

        def batch(self, ids, toks):
            return [float(len(i) + t) for i, t in zip(ids, toks)], [2 * t for t in toks]

    g = DependencyGraph(cost_model=BatchOnly())
    g.add_chunk("aa", 1)
    g.add_patch("bbb", "c", ["aa"], tokens=5)
    c = g.cascade("aa", ["aa", "bbb"])
    assert (c.root.ms, c.root.nbytes, c[0].ms, c[0].nbytes) == (3.0, 2, 8.0, 10)


def test_token_cost_model_defaults():
    ms, nbytes = TokenCostModel()("x", 10)
    assert ms == pytest.approx(0.5) and nbytes == 40960  # 0.05 ms and 4096 bytes per token


def test_patch_records_and_graph_attributes():
    g = DependencyGraph()
    g.add_chunk("b", 40)
    ref = g.add_patch("b", "cb", ["a"])
    assert g.chunks() == ["b", "a"] and g.tokens("b") == 40 and g.tokens("a") == 0 and g.tokens("nope") == 0
    info = {"chunk_id": "b", "ctx": "cb", "antecedents": ("a",), "kind": "fresh", "nbytes": 0, "tokens": 40,
            "stale": False, "current": True}
    assert g.patch_info("b", "cb") == info and g.patch_info(ref) == info
    assert g.antecedents("b", "cb") == ("a",) and g.antecedents(ref) == ("a",)
    assert dict(g.graph.nodes[ref]) == {"kind": "fresh", "antecedents": ("a",), "nbytes": 0, "tokens": 40}
    assert dict(g.graph.nodes["a"]) == {"tokens": 0}
    g.on_evict("a")  # one antecedent out: stale
    assert g.evicted() == frozenset({"a"}) and g.patch_info(ref)["stale"] is True
    # re-adding the same key with the same antecedents updates kind and bytes in place; tokens=0 keeps 40
    g.add_patch("b", "cb", ["a"], kind="orbit", nbytes=99)
    assert dict(g.graph.nodes[ref]) == {"kind": "orbit", "antecedents": ("a",), "nbytes": 99, "tokens": 40}
    assert g.patch_info(ref)["nbytes"] == 99 and g.patch_info(ref)["kind"] == "orbit"
    g.add_patch("b", "cb", ["a"], tokens=55)   # a size given: the record and the node follow it
    assert dict(g.graph.nodes[ref])["tokens"] == 55 and g.patch_info(ref)["tokens"] == 55


def test_add_chunk_sizes():
    g = DependencyGraph()
    g.add_chunk("x")
    assert g.tokens("x") == 0 and dict(g.graph.nodes["x"]) == {"tokens": 0}
    g.add_chunk("x", 5)
    assert g.tokens("x") == 5 and dict(g.graph.nodes["x"]) == {"tokens": 5}
    g.add_chunk("x")  # no size: unchanged
    assert g.tokens("x") == 5 and dict(g.graph.nodes["x"]) == {"tokens": 5}


def test_copy_keeps_records_and_cost_model():
    g = DependencyGraph(cost_model=TokenCostModel(ms_per_token=1.0, bytes_per_token=2))
    ref = g.add_patch("b", "cb", ["a"], kind="orbit", nbytes=7, tokens=3)
    h = g.copy()
    assert h.patch_info(ref) == {"chunk_id": "b", "ctx": "cb", "antecedents": ("a",), "kind": "orbit", "nbytes": 7,
                                 "tokens": 3, "stale": False, "current": True}
    assert h.divergence(ref, None, ["a"]) == 0.0
    c = h.cascade("a", ["a", "b"])
    assert (c.total_ms, c.total_bytes) == (3.0, 6)


def test_remove_forget_recall_bookkeeping():
    g = DependencyGraph()
    g.add_patch("b", "cb", ["a"])
    g.remove_patch("b", "cb")
    assert g.patches() == [] and g.current_patch("b") is None
    g.add_chunk("x")
    g.on_evict("x")
    assert g.forget("x") == [] and "x" not in g.evicted() and not g.is_evicted("x")
    assert g.dependents("nope") == [] and g.patches_of("nope") == []
    g2 = DependencyGraph()
    g2.on_recall("new", ["new"])
    assert g2.chunks() == ["new"] and len(g2) == 1


def test_graph_divergence_and_refresh_order_with_embed_and_orbit():
    g = DependencyGraph()
    ref = g.add_patch("x", "x1", ["a", "b"])
    # mean(a, b) is parallel to c: 0 with the embed hook, 1 (disjoint ids) without
    assert g.divergence("x", "x1", ["c"], _embed) == pytest.approx(0.0, abs=1e-6)
    assert g.divergence("x", "x1", ["c"]) == 1.0
    [(r, d)] = g.refresh_order([ref], {"x": ["c"]}, _embed)
    assert r == ref and d == pytest.approx(0.0, abs=1e-6)
    o = g.add_patch("o", "o1", ["a", "b"], kind="orbit")
    assert g.divergence("o", "o1", ["b", "a"]) == 0.0  # an orbit patch serves every order of its set
    assert g.divergence(o, None, ["b", "a"]) == 0.0


def test_refresh_order_ties_and_missing_chunks():
    g = DependencyGraph()
    z = g.add_patch("z", "z1", ["a"])
    y = g.add_patch("y", "y1", ["a", "z"])
    w = g.add_patch("w", "w1", ["a", "z", "y"])
    # window order: all three fully fresh (0.0); ties go by window position, w (not in it: the tail) last
    assert g.refresh_order([w, y, z], ["a", "z", "y"]) == [(z, 0.0), (y, 0.0), (w, 0.0)]
    # a mapping: a chunk it does not list has no antecedents (1.0: nothing shared); ties by id
    assert g.refresh_order([z, y, w], {"z": ["a"], "y": ["b"]}) == [(w, 1.0), (y, 1.0), (z, 0.0)]


def test_error_messages_name_the_culprit():
    g = DependencyGraph()
    with pytest.raises(WindowkitError, match="got int 5"):
        g.add_chunk(5)
    g.add_patch("b", "cb", ["a"])
    with pytest.raises(PatchNotFoundError, match=r"PatchRef\('b', None\) is not in the dependency graph"):
        g.is_stale("b")
    assert g.is_stale(PatchRef("b", "cb")) is False


# ----------------------------------------------------------------------------------------------- lazy patch links
# DependencyGraph.add_patch with a LazyCtx defers the patch node and its edges until the graph is next read; its
# contract is that every read sees exactly the graph the eager calls would have built. Each test runs one
# sequence of calls twice, eagerly (ctx a str, ``on_evict``) and lazily (ctx a LazyCtx, ``evict_quietly``),
# and compares everything a reader can see, node and edge order included; the expected node orders are
# written out by hand (call order).

from windowkit.graph.dependency import LazyCtx  # noqa: E402


def _seen(g: DependencyGraph):
    """Everything a reader of the graph can observe."""
    G = g.graph
    refs = g.patches()
    return {
        "nodes": list(G.nodes(data=True)), "edges": list(G.edges(data=True)),
        "in_edges": list(G.in_edges(data=True)), "succ": {n: list(G.succ[n]) for n in G},
        "pred": {n: list(G.pred[n]) for n in G}, "patches": refs, "info": [g.patch_info(r) for r in refs],
        "current": {c: g.current_patch(c) for c in g.chunks()}, "stale": sorted(g.stale_patches()),
        "wearers": {c: sorted(g.current_dependents(c)) for c in g.chunks()},
        "dependents": {c: g.dependents(c) for c in g.chunks()}, "of": {c: g.patches_of(c) for c in g.chunks()},
        "chunks": g.chunks(), "tokens": {c: g.tokens(c) for c in g.chunks()}, "n": (len(g), g.num_patches),
    }


class _Calls:
    """A context-hash function that counts its calls."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)
        return "|".join(args)


def _both(script):
    """Run ``script(g, ctx, evict)`` eagerly and lazily; return both graphs and the lazy run's hash function."""
    eager, lazy, fn = DependencyGraph(), DependencyGraph(), _Calls()
    script(eager, lambda *a: "|".join(a), eager.on_evict)
    script(lazy, lambda *a: LazyCtx(fn, *a), lazy.evict_quietly)
    return eager, lazy, fn


def test_lazy_ctx_computes_once_and_says_so():
    fn = _Calls()
    lc = LazyCtx(fn, "a", "b")
    assert repr(lc) == "LazyCtx(<not computed>)" and fn.calls == []
    assert lc.value == "a|b" and lc.value == "a|b" and fn.calls == [("a", "b")]
    assert repr(lc) == "LazyCtx('a|b')"
    assert LazyCtx(lambda x: x * 2, 21).value == "42"  # the hash as a str


def test_lazy_links_land_in_call_order():
    def script(g, ctx, evict):
        g.add_chunk("a", 10), g.add_chunk("b", 20), g.add_chunk("c", 30)
        g.add_patch("c", ctx("c", "a", "b"), ["a", "b"], nbytes=100, tokens=5)
        g.add_chunk("d", 7)
        g.add_patch("d", ctx("d", "c", "a"), ["c", "a", "c"], kind="orbit", nbytes=50)  # tokens 0: the chunk's
        g.add_chunk("e", 3)
        g.add_chunk("d", 70)  # a new size after the call: d's patch keeps the 7 it was formed with

    eager, lazy, fn = _both(script)
    assert fn.calls == [] and lazy.chunks() == ["a", "b", "c", "d", "e"]  # nothing hashed or linked yet
    assert lazy.tokens("c") == 5 and lazy.tokens("d") == 70  # a patch's tokens > 0 set its chunk's
    seen = _seen(lazy)
    assert len(fn.calls) == 2 and seen == _seen(eager)
    rc, rd = PatchRef("c", "c|a|b"), PatchRef("d", "d|c|a")
    assert [n for n, _ in seen["nodes"]] == ["a", "b", "c", rc, "d", rd, "e"]
    assert seen["patches"] == [rc, rd] and seen["current"] == {"a": None, "b": None, "c": rc, "d": rd, "e": None}
    assert [(i["nbytes"], i["tokens"], i["kind"]) for i in seen["info"]] == [(100, 5, "fresh"), (50, 7, "orbit")]
    assert seen["info"][1]["antecedents"] == ("c", "a", "c")
    assert all(d == {} for *_, d in seen["in_edges"]) and all(d == {} for *_, d in seen["edges"])
    assert lazy.graph.pred[rd] == {"c": {}, "a": {}}
    assert len(fn.calls) == 2  # hashed once each


def test_one_node_after_a_lazy_link_is_reordered():
    def script(g, ctx, evict):
        g.add_chunk("a"), g.add_chunk("b", 4)
        g.add_patch("b", ctx("b", "a"), ["a"], tokens=2)
        g.add_chunk("c", 1)

    eager, lazy, _ = _both(script)
    seen = _seen(lazy)
    assert [n for n, _ in seen["nodes"]] == ["a", "b", PatchRef("b", "b|a"), "c"] and seen == _seen(eager)


def test_lazy_links_after_evictions_and_unwearing():
    def script(g, ctx, evict):
        for c in "abcd":
            g.add_chunk(c, 8)
        g.add_patch("c", ctx("c", "a", "b"), ["a", "b"])
        g.add_patch("d", ctx("d", "a", "b", "c"), ["a", "b", "c"], nbytes=9)
        g.add_patch("b", ctx("b", "a"), ["a"], current=False)
        evict("b")  # b's patches are formed on a: c's and d's miss b; b wears nothing
        evict("d")  # d's own deferred patch: linked, not worn
        g.set_current("c", None)  # c's: linked, not worn
        evict("z")  # an unknown chunk: registered, evicted
        evict("b")  # idempotent

    eager, lazy, _ = _both(script)
    seen = _seen(lazy)
    assert seen == _seen(eager)
    rc, rd, rb = PatchRef("c", "c|a|b"), PatchRef("d", "d|a|b|c"), PatchRef("b", "b|a")
    assert seen["patches"] == [rc, rd, rb] and seen["stale"] == [rc, rd]
    assert all(v is None for v in seen["current"].values()) and seen["chunks"] == ["a", "b", "c", "d", "z"]
    assert [n for n, _ in seen["nodes"]] == ["a", "b", "c", "d", rc, rd, rb, "z"]
    assert lazy.is_stale(rc) and not lazy.is_stale(rb)
    # a later link counts the antecedents evicted before it
    lazy.add_patch("a", LazyCtx(lambda: "late"), ["b", "z", "c"])
    assert lazy.is_stale("a", "late") and lazy.patch_info("a", "late")["current"]


def test_evict_quietly_is_on_evict_without_the_answer():
    eager, lazy = DependencyGraph(), DependencyGraph()
    for g in (eager, lazy):
        g.add_patch("b", "b|a", ["a"])
        g.add_patch("c", "c|a", ["a"])
    assert eager.on_evict("a") == [PatchRef("b", "b|a"), PatchRef("c", "c|a")]
    assert lazy.evict_quietly("a") is None and _seen(lazy) == _seen(eager)
    assert eager.on_evict("b") == [] and lazy.evict_quietly("b") is None and _seen(lazy) == _seen(eager)
    with pytest.raises(WindowkitError) as e:
        lazy.evict_quietly(5)
    assert str(e.value) == "chunk ids are strings, got int 5"


def test_a_lazy_ctx_on_an_unknown_antecedent_links_now():
    g, fn = DependencyGraph(), _Calls()
    g.add_chunk("a")
    assert g.add_patch("c", LazyCtx(fn, "x"), ["a", "new"], tokens=3) == PatchRef("c", "x")
    assert fn.calls == [("x",)] and g.chunks() == ["a", "c", "new"] and g.patches() == [PatchRef("c", "x")]
    assert g.add_patch("d", LazyCtx(fn, "y"), ["a", "c"]) is None and fn.calls == [("x",)]
    assert g.current_patch("d") == PatchRef("d", "y") and fn.calls == [("x",), ("y",)]
    g.set_current("d", "y")  # a deferred patch worn by name: linked first
    assert g.add_patch("e", LazyCtx(fn, "z"), ["d"]) is None
    g.set_current("e", "z")
    assert g.current_patch("e") == PatchRef("e", "z")


def test_a_bad_antecedent_is_refused_before_anything_changes():
    g = DependencyGraph()
    g.add_chunk("a")
    for ante, what in ((["a", 5], "int 5"), ([None], "NoneType None"), (["a", b"b"], "bytes b'b'")):
        with pytest.raises(WindowkitError) as e:
            g.add_patch("c", "x", ante)
        assert str(e.value) == f"chunk ids are strings, got {what}"
        with pytest.raises(WindowkitError):
            g.add_patch("c", LazyCtx(lambda: "y"), ante)
    assert g.chunks() == ["a"] and g.patches() == [] and list(g.graph.nodes) == ["a"]

    class Id(str):
        pass

    assert g.add_patch("c", "x", [Id("a")]) == PatchRef("c", "x")  # a str subclass is a chunk id


def test_lazy_and_eager_links_mixed():
    def script(g, ctx, evict):
        g.add_chunk("a", 1)
        g.add_patch("b", "b|a", ["a"])  # eager in both graphs
        g.add_patch("c", ctx("c", "a", "b"), ["a", "b"])
        g.add_chunk("d", 2)
        g.add_patch("e", "e|d", ["d", "x"])  # eager: links the deferred one first; x is new
        g.add_patch("f", ctx("f", "e"), ["e"])
        g.add_patch("g", "g|a", ["a"])
        g.add_chunk("h", 3)
        g.add_patch("b", ctx("b", "c"), ["c"])

    eager, lazy, fn = _both(script)
    seen = _seen(lazy)
    assert seen == _seen(eager)
    R = PatchRef
    assert [n for n, _ in seen["nodes"]] == ["a", "b", R("b", "b|a"), "c", R("c", "c|a|b"), "d", "e", R("e", "e|d"),
                                             "x", "f", R("f", "f|e"), "g", R("g", "g|a"), "h", R("b", "b|c")]
    assert seen["current"]["b"] == R("b", "b|c") and len(fn.calls) == 3
    lazy.add_patch("h", LazyCtx(fn, "h", "a"), ["a"])
    lazy.add_chunk("i")
    eager.add_patch("h", "h|a", ["a"])
    eager.add_chunk("i")
    assert _seen(lazy) == _seen(eager) and list(lazy.graph.nodes)[-2:] == [R("h", "h|a"), "i"]


def test_link_deferred_links_now_and_unread_links_stay_bounded():
    """``link_deferred`` (a Window's idle time) links what was deferred, exactly as a read would; a caller that
    never reads the graph keeps at most 4,096 links waiting (they are linked in batches), and the graph it
    reads at the end is still the eager one."""
    def script(g, ctx, evict):
        for i in range(5):
            g.add_chunk(f"k{i}", i + 1)
        for j in range(5000):  # a long slide: each step re-wears a chunk behind a new context
            g.add_patch(f"k{j % 5}", ctx(f"k{j % 5}", str(j)), [f"k{(j + 1) % 5}"], tokens=j % 5 + 1)
            assert len(g._later) <= 4096
        evict("k0")

    eager, lazy, fn = _both(script)
    assert 0 < len(lazy._later) < 5000 and len(fn.calls) >= 4096  # one batch linked on the way, the rest waits
    lazy.link_deferred()
    assert not lazy._later and len(fn.calls) == 5000
    assert _seen(lazy) == _seen(eager)


def test_stale_indices_is_the_staleness_rule_over_a_window():
    """``stale_indices`` (the planner's and the Window's per-op scan) gives exactly the entries ``entry_is_stale``
    calls stale, within ``first..upto``, skipping pending ones (None)."""
    from windowkit.graph.dependency import entry_is_stale, stale_indices

    ids = ["a", "b", "c", "d", "e"]
    antes = [(), ("a",), ("b", "a"), None, ("a", "b", "c")]  # exact, exact, same length other order, pending, short
    assert stale_indices(ids, antes) == [2, 4]
    assert stale_indices(ids, antes) == [i for i, a in enumerate(antes) if a is not None and entry_is_stale(a, ids, i)]
    assert stale_indices(ids, antes, 3) == [4] and stale_indices(ids, antes, 0, 3) == [2]
    assert stale_indices(ids, antes, 2, 2) == [] and stale_indices(ids, antes, 5) == []
    assert stale_indices(ids, [("x",), ("a", "b"), ("a", "b"), ("a", "b", "c"), ("a", "b", "c", "d")]) == [0, 1]
    assert stale_indices(["a", "b"], [(), ["a"]]) == []  # antecedents as any sequence: a list equals the tuple
