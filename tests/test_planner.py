"""The planner's promises, as hypothesis state machines over random op sequences (>= 10,000 ops in all).

Ops: admit (tail or middle), evict (head, tail, middle), recall (any index), reorder, assign (a random wanted
list of live, evicted and new chunks), forward. After every op:

  cost       the model ran no more tokens for the op (``stats.prefill_tokens``; queries excluded) than a prefix
             cache holding the window before it: the tokens of the new window from the first index where the old
             and the new id lists differ (computed here from the two id lists alone)
  positions  ``starts()`` is the running sum of spans after the prefix, ``next_position`` its end
  store      a bounded store never holds more bytes than its budget
  exact      (fidelity="exact", a real tiny Llama) the next-token logits equal transformers' forward over the
             window's token ids (KL <= 1e-6), after every op

The cost machines run the Window on the cost-model backend (what ``windowkit simulate`` drives); the exact
machine on tiny-llama (``windowkit.backends.tiny``), where every op runs real tensors.
"""
from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import windowkit as wk
from windowkit.backends.tiny import build
from windowkit.kv import kl_divergence
from windowkit.store import ChunkStore
from windowkit.trace.backend import CostModelBackend
from windowkit.window.plan import common_prefix

torch.set_num_threads(1)

PROFILES = {"default": dict(cost=(320, 60), exact=(48, 40)), "long": dict(cost=(1000, 80), exact=(200, 50)),
            "quick": dict(cost=(8, 20), exact=(4, 15))}
PROFILE = os.environ.get("WINDOWKIT_TEST_PROFILE", "default")
if PROFILE not in PROFILES:
    raise RuntimeError(f"WINDOWKIT_TEST_PROFILE must be one of {', '.join(PROFILES)}, got {PROFILE!r}")
OPS: dict[str, int] = {}
KL_EXACT = 1e-6
MAX_LIVE = 7


class _WindowMachine(RuleBasedStateMachine):
    """Shared rules: subclasses build ``self.win`` and ``self.make(name)`` (a new chunk)."""

    label = "?"

    def setup(self):
        self.names = 0
        self.chunks: dict[str, wk.Chunk] = {}
        self.evicted: list[str] = []
        self.unseen: list[wk.Chunk] = []  # new chunks a guess named (an agent's own rewrite), not yet in a step

    def new_chunk(self, draw_tokens: int) -> wk.Chunk:
        self.names += 1
        c = self.make(f"c{self.names}", draw_tokens)
        self.chunks[c.id] = c
        return c

    def op(self, fn, *args, **kw):
        """Run one op and check the cost promise against the prefix cache's plan for it."""
        before, t0 = self.win.ids, self.win.stats.prefill_tokens
        out = fn(*args, **kw)
        after = self.win.ids
        ran = self.win.stats.prefill_tokens - t0
        keep = common_prefix(before, after)
        prefix_cache = sum(len(self.chunks[c]) for c in after[keep:])
        assert ran <= prefix_cache, (self.label, fn.__name__, before, after, ran, prefix_cache, self.win.last_choice)
        OPS[self.label] = OPS.get(self.label, 0) + 1
        self.evicted = [c for c in self.chunks if c not in self.win]
        return out

    @rule(n=st.integers(2, 9), where=st.sampled_from(["tail", "middle"]), k=st.integers(0, 100))
    def admit(self, n, where, k):
        if len(self.win) >= MAX_LIVE:
            return
        at = None if where == "tail" or not len(self.win) else k % (len(self.win) + 1)
        self.op(self.win.admit, self.new_chunk(n), at=at)

    @precondition(lambda self: len(self.win) > 0)
    @rule(which=st.sampled_from(["head", "tail", "middle"]), k=st.integers(0, 100))
    def evict(self, which, k):
        self.op(self.win.evict, self.win.ids[k % len(self.win)] if which == "middle" else which)

    @precondition(lambda self: self.evicted)
    @rule(k=st.integers(0, 100), at=st.integers(0, 100), tail=st.booleans())
    def recall(self, k, at, tail):
        if len(self.win) >= MAX_LIVE:
            return
        cid = self.evicted[k % len(self.evicted)]
        self.op(self.win.recall, cid, at=None if tail else at % (len(self.win) + 1))

    @precondition(lambda self: len(self.win) > 1)
    @rule(perm=st.randoms(use_true_random=False))
    def reorder(self, perm):
        ids = self.win.ids
        perm.shuffle(ids)
        self.op(self.win.reorder, ids)

    @rule(data=st.data())
    def assign(self, data):
        pool = list(self.chunks)
        keep = data.draw(st.lists(st.sampled_from(pool), unique=True, max_size=MAX_LIVE - 1) if pool else st.just([]))
        fresh = [self.new_chunk(data.draw(st.integers(2, 9))) for _ in range(data.draw(st.integers(0, 2)))]
        if self.unseen and data.draw(st.booleans()):  # a rewrite a guess named, in a step the guess did not foresee
            fresh.append(self._register(self.unseen.pop()))
        want = [self.chunks[c] for c in keep] + fresh
        order = data.draw(st.permutations(want)) if data.draw(st.booleans()) else want
        self.op(self.win.assign, list(order))

    @precondition(lambda self: len(self.win) > 0)
    @rule()
    def forward(self):
        self.op(self.win.forward, self.query)

    @precondition(lambda self: len(self.chunks) > 0)
    @rule(data=st.data())
    def prefetch_next(self, data):
        """Between steps: prepare a guessed next window (a slide's survivors, or any known chunks in any order).
        Idle work, not a step: the window is unchanged, and the ops after it keep every promise above."""
        slide = data.draw(st.booleans())
        guess = self.win.ids[1:] if slide else data.draw(st.lists(st.sampled_from(list(self.chunks)), unique=True,
                                                                    max_size=MAX_LIVE - 2))
        if data.draw(st.booleans()):  # a new chunk the agent writes itself (a clip of an observation), anywhere
            self.names += 1
            new = self.make(f"c{self.names}", data.draw(st.integers(2, 9)))
            self.unseen.append(new)
            guess.insert(data.draw(st.integers(0, len(guess))), new)
        before = self.win.ids
        self.win.prefetch(next=guess)
        assert self.win.ids == before
        OPS[self.label] = OPS.get(self.label, 0) + 1
        if data.draw(st.booleans()):  # then the step it was made for: the guess and a new observation at the tail
            want = [self._register(x) if isinstance(x, wk.Chunk) else self.chunks[x] for x in guess]
            self.unseen = [c for c in self.unseen if c.id not in self.chunks]
            want.append(self.new_chunk(data.draw(st.integers(2, 9))))
            behind = [c for c in self.win.ids if c not in {x.id for x in want}]
            if behind and data.draw(st.booleans()):  # a live chunk kept behind it (a question after each new frame)
                want.append(self.chunks[behind[data.draw(st.integers(0, len(behind) - 1))]])
            self.op(self.win.assign, want)

    def _register(self, c: wk.Chunk) -> wk.Chunk:
        self.chunks[c.id] = c
        return c

    @invariant()
    def positions_are_contiguous(self):
        win = self.win
        p = win._prefix_span
        for s, e in zip(win.starts(), win._entries):
            assert s == p
            p += e.span
        assert win.next_position == p

    @invariant()
    def store_accounting(self):
        if getattr(self, "win", None) is not None and self.win.store is not None:
            self.win.store.check_integrity()  # tiers, policy and pin ledger agree after every rule


class CostMachine(_WindowMachine):
    """Default Window (lazy, balanced, capped) on the cost-model backend, with a bounded store."""

    label = "cost"
    config: dict = {}

    @initialize(budget=st.sampled_from([None, 600, 3000]), fidelity=st.sampled_from(["balanced", "fast", "exact"]),
                prefix=st.booleans())
    def start(self, budget, fidelity, prefix):
        self.setup()
        be = CostModelBackend("cpu-tiny")
        self.budget = budget
        store = ChunkStore(budget_bytes=budget, model_fingerprint=be.fingerprint(), layout=be.layout)
        self.win = wk.Window(be, store=store, fidelity=fidelity,
                             prefix=CostModelBackend.chunk("sys", 5) if prefix else None)
        self.query = CostModelBackend.chunk("q", 3)

    def make(self, cid, n):
        return CostModelBackend.chunk(cid, n)

    @invariant()
    def store_within_budget(self):
        if getattr(self, "budget", None) is not None:
            assert self.win.store.nbytes <= self.budget


_LLAMA = {}


def _llama():
    if "be" not in _LLAMA:
        _LLAMA["be"] = wk.HFBackend(build("tiny-llama"))
    return _LLAMA["be"]


class ExactMachine(_WindowMachine):
    """fidelity="exact" on a real tiny Llama: after every op the window's logits equal re-prefill."""

    label = "exact"

    @initialize(prefix=st.booleans(), seed=st.integers(0, 10_000))
    def start(self, prefix, seed):
        self.setup()
        self.be = _llama()
        self.gen = torch.Generator().manual_seed(seed)
        self.prefix = torch.randint(5, 120, (4,), generator=self.gen) if prefix else None
        self.win = wk.Window(self.be, fidelity="exact", prefix=self.prefix)
        self.query = torch.tensor([11, 12, 13])

    def make(self, cid, n):
        return wk.Chunk.text(torch.randint(5, 120, (n,), generator=self.gen), id=cid)

    @invariant()
    def equals_reprefill(self):
        if not len(self.win):
            return
        parts = ([self.prefix] if self.prefix is not None else []) + [self.chunks[c].input_ids for c in self.win.ids]
        ids = torch.cat(parts + [self.query]).reshape(1, -1)
        with torch.no_grad():
            ref = self.be.model(input_ids=ids).logits[0, -1]
        got = self.win.forward(self.query)
        assert kl_divergence(ref, got) <= KL_EXACT, (self.win.ids, self.win.stats)


def _run(machine, examples, steps):
    s = settings(max_examples=examples, stateful_step_count=steps, deadline=None, derandomize=True,
                 suppress_health_check=list(HealthCheck))
    machine.TestCase.settings = s
    machine.TestCase().runTest()


def test_cost_never_above_the_prefix_cache_and_store_within_budget():
    _run(CostMachine, *PROFILES[PROFILE]["cost"])
    assert OPS["cost"] >= (100 if PROFILE == "quick" else 9_000), OPS


def test_exact_budget_equals_reprefill_after_every_op():
    _run(ExactMachine, *PROFILES[PROFILE]["exact"])
    assert OPS["exact"] >= (30 if PROFILE == "quick" else 1_000), OPS


def test_fidelity_kl_target_picks_the_cheapest_rule_measured_within_it():
    from windowkit.window.plan import measured_front

    front = measured_front()
    assert {"none", "all"} <= set(front)
    be = CostModelBackend("cpu-tiny")
    for target in (1.0, 1.2e-2, 1e-2, 4e-3, 1e-4):
        name = wk.Window(be, fidelity=target).repair.name
        within = {n: v for n, v in front.items() if v["mean_kl"] <= target}
        if not within:
            assert name == "all"
            continue
        assert front[name]["mean_kl"] <= target
        assert front[name]["cost_share"] == min(v["cost_share"] for v in within.values())
    assert wk.Window(be, fidelity=1.0).repair.name == min(front, key=lambda n: front[n]["cost_share"])
    for bad in (-1e-3, float("nan"), "balance", True):
        try:
            wk.Window(be, fidelity=bad)
        except wk.WindowkitError as e:
            assert "fidelity" in str(e)
        else:
            raise AssertionError(f"fidelity={bad!r} accepted")


def test_a_survivor_whose_exact_conditioning_is_stored_costs_nothing():
    """choose_step on a slide [a, b, c] -> [b, c, d] behind a prefix, repair "all": with the survivors' exact
    conditioned KV for their new contexts stored (what ``prefetch(next=...)`` leaves) the edits run only d, and
    win; with one of them, the other is repaired; with none, the edits tie the prefix cache's plan, which wins."""
    from windowkit.window.plan import RepairRule, StepChoice, WindowView, choose_step

    held: set = set()
    view = WindowView(ids=["a", "b", "c"], ante=[(), ("a",), ("a", "b")], tokens=dict.fromkeys("abcd", 8),
                      has_canonical=lambda cid: False, has_patch=lambda cid, ante: False,
                      has_orbit=lambda cid, ante: False, prefix_tokens=3,
                      has_exact=lambda cid, ante: (cid, tuple(ante)) in held)
    rule = RepairRule.parse("all")
    assert choose_step(view, ["b", "c", "d"], rule) == StepChoice("prefill", 0, 24, 24)
    held.add(("b", ()))
    assert choose_step(view, ["b", "c", "d"], rule) == StepChoice("edit", 0, 24, 16)
    held.add(("c", ("b",)))
    assert choose_step(view, ["b", "c", "d"], rule) == StepChoice("edit", 0, 24, 8)
    held.clear()
    held.add(("c", ("b",)))  # c's copy (formed behind the exact b) stands; b itself is repaired
    assert choose_step(view, ["b", "c", "d"], rule).edit_tokens == 16


def test_the_planners_survivor_search_stops_at_the_first_context_nothing_is_stored_under(monkeypatch):
    """A slide of a 64-chunk window: the planner's view hashes the survivors' new contexts only up to the first
    one nothing is stored under (prefix-closed, as the Window's own search stops there), not the whole window, and
    still finds what IS stored: after ``prefetch(next=...)`` of the next slide's survivors every survivor is free
    (the edits run only the new chunk), and without it the plan (repair "all") re-conditions them all: the prefix
    cache's work, so its plan."""
    import windowkit.window.window as window_mod

    be = wk.HFBackend(build("tiny-llama"))
    gen = torch.Generator().manual_seed(0)
    win = wk.Window(be, prefix=wk.Chunk.text(torch.randint(5, 120, (8,), generator=gen), id="sys"), repair="all")
    chunks = [wk.Chunk.text(torch.randint(5, 120, (16,), generator=gen), id=f"c{i}") for i in range(70)]
    win.assign(chunks[:64])
    win.forward([1, 2])
    calls = {"n": 0}
    step = window_mod.context_step

    def counted(h, key):
        calls["n"] += 1
        return step(h, key)

    monkeypatch.setattr(window_mod, "context_step", counted)
    view = win._view(chunks[1:65])
    from windowkit.window.plan import choose_step
    c = choose_step(view, [x.id for x in chunks[1:65]], win.repair)
    assert calls["n"] <= 3, calls  # was one sha256 per survivor (63)
    assert (c.route, c.edit_tokens) == ("prefill", 16 * 64)  # nothing stored: every survivor re-conditioned
    win.prefetch(next=[x.id for x in chunks[1:64]])
    calls["n"] = 0
    view = win._view(chunks[1:65])
    c = choose_step(view, [x.id for x in chunks[1:65]], win.repair)
    assert (c.route, c.edit_tokens) == ("edit", 16)  # every survivor's exact KV is stored: only the new chunk
    assert calls["n"] <= 64  # each stored context once (shared prefixes hashed once)
