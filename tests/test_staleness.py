"""One staleness rule (windowkit.graph.dependency.entry_is_stale): the Window's stale entries are the ones it
names, and the graph's stale patch set is the eviction-only part of it (a worn stale patch: a stale entry)."""
from __future__ import annotations

import torch

import windowkit as wk
from windowkit.graph import entry_is_stale, stale_indices
from windowkit.trace.backend import CostModelBackend

torch.set_num_threads(1)


def test_rule():
    ids = ["a", "b", "c"]
    assert not entry_is_stale((), ids, 0) and not entry_is_stale(("a", "b"), ids, 2)
    assert entry_is_stale(("b", "a"), ids, 2) and entry_is_stale(("a",), ids, 2) and entry_is_stale(("x",), ids, 1)
    assert entry_is_stale(["a"], ids, 1) is False  # a list of antecedents reads like the tuple
    assert stale_indices(["b", "c"], [("a",), ("a", "b")]) == [0, 1]
    assert stale_indices(["b", "c"], [("a",), None]) == [0]  # None: not formed yet (a pending admission)
    assert stale_indices(ids, [(), ("x",), ("y",)], first=1, upto=2) == [1]


def _window():
    b = CostModelBackend()
    win = wk.Window(b, repair="none")
    for k in "abcd":
        win.admit(CostModelBackend.chunk(k, 16))
    return win


def test_window_stale_ids_follow_the_rule():
    win = _window()
    assert win.stale_ids() == []
    win.evict("head")
    entries = list(win._entries)
    assert win.stale_ids() == [win.ids[i] for i in stale_indices(win.ids, [e.ante for e in entries])]
    assert win.stale_ids() == ["b", "c", "d"]
    win.reorder(["c", "b", "d"])
    assert win.stale_ids() == [x for i, x in enumerate(win.ids) if entry_is_stale(win._entries[i].ante, win.ids, i)]


def test_graph_stale_worn_patch_implies_stale_entry():
    win = _window()
    win.evict("head")
    g = win.graph
    stale = set(win.stale_ids())
    worn_stale = {c for c in win.ids if g.current_patch(c) is not None and g.is_stale(g.current_patch(c))}
    assert worn_stale == {"b", "c", "d"} and worn_stale <= stale



def test_stale_entries_without_a_stale_patch():
    """An insert ahead changes antecedents without evicting any: the entries behind are stale, no patch is."""
    win = _window()
    win.admit(CostModelBackend.chunk("x", 16), at=0)
    assert win.stale_ids() == ["a", "b", "c", "d"] and win.graph.stale_patches() == set()
