"""Tests for policies.eviction: victim order on hand-checked sequences, pins, and a brute-force cross-check.

Ground truth: orders worked out by hand in the comments, and an O(n) reference that recomputes every
key's priority from the access history (no heap, no lazy deletion).
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import EVICTION_POLICIES, FIFO, LFU, LRU, Belady, EvictionPolicy, SizeAware, make_eviction_policy


def fill(p: EvictionPolicy, *items: tuple[str, int]) -> EvictionPolicy:
    for k, n in items:
        p.insert(k, n)
    return p


# -------------------------------------------------------------------- hand-checked orders
def test_lru_order() -> None:
    p = fill(LRU(), ("a", 1), ("b", 1), ("c", 1))
    assert p.victim() == "a"
    p.touch("a")  # recency now b < c < a
    assert p.victim() == "b"
    p.remove("b", evicted=True)
    assert p.victim() == "c"
    p.touch("c")  # a < c
    assert p.victim() == "a"
    p.pin("a")
    assert p.victim() == "c"
    p.unpin("a")  # release counts as a use: c < a
    assert p.victim() == "c"
    p.pin("a"); p.pin("c")
    assert p.victim() is None


def test_fifo_order_ignores_reads_and_keeps_place_through_pins() -> None:
    p = fill(FIFO(), ("a", 1), ("b", 1), ("c", 1))
    p.touch("a"); p.touch("a")
    assert p.victim() == "a"
    p.pin("a")
    assert p.victim() == "b"
    p.unpin("a")  # still the oldest
    assert p.victim() == "a"
    p.remove("a", evicted=True)
    p.insert("a", 1)  # re-inserted: now the newest
    assert [_drain_one(p) for _ in range(3)] == ["b", "c", "a"]


def test_lfu_order_and_lru_tiebreak() -> None:
    p = fill(LFU(), ("a", 1), ("b", 1), ("c", 1))
    assert p.victim() == "a"  # all at 1 hit: the least recently used
    p.touch("a"); p.touch("a"); p.touch("c")  # hits a=3, b=1, c=2
    assert p.victim() == "b"
    p.remove("b", evicted=True)
    assert p.victim() == "c"
    p.touch("c"); p.touch("c")  # c=4 > a=3
    assert p.victim() == "a" and p.hits("a") == 3 and p.hits("c") == 4
    p.touch("a")  # a=4 == c=4; c was used longer ago
    assert p.victim() == "c"


def test_size_aware_gdsf_order_and_aging() -> None:
    # H = L + hits / nbytes: a = 1/100 = .01, b = 1/1000 = .001, c = 1/10 = .1
    p = fill(SizeAware(), ("a", 100), ("b", 1000), ("c", 10))
    assert p.victim() == "b"  # the largest bytes per hit
    for _ in range(20):
        p.touch("b")  # b: 21 hits / 1000 B = .021 > a's .01
    assert p.victim() == "a"
    p.remove("a", evicted=True)  # the clock L rises to a's H
    assert p.clock == pytest.approx(0.01)
    p.insert("d", 100)  # H = .01 + .01 = .02 < b's .021 < c's .1
    assert p.priority("d") == pytest.approx(0.02)
    assert p.victim() == "d"
    p.remove("d")  # a drop, not an eviction: no aging
    assert p.clock == pytest.approx(0.01)
    assert p.victim() == "b"


def test_size_aware_cost_function() -> None:
    # cost = nbytes makes H = L + hits: LFU in disguise
    p = fill(SizeAware(cost=lambda k, n: float(n)), ("big", 1000), ("small", 10))
    p.touch("big")
    assert p.victim() == "small"


def _drain_one(p: EvictionPolicy):
    k = p.victim()
    p.remove(k, evicted=True)
    return k


# -------------------------------------------------------------------- shared contract
@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
def test_contract(name: str) -> None:
    p = make_eviction_policy(name)
    assert p.victim() is None and len(p) == 0 and p.nbytes == 0
    fill(p, ("a", 10), ("b", 20))
    assert len(p) == 2 and p.nbytes == 30 and "a" in p and "z" not in p
    p.pin("a")
    p.insert("a", 5)  # replacing keeps the pin, updates the size
    assert p.is_pinned("a") and p.nbytes == 25 and p.size_of("a") == 5
    assert p.victim() == "b"
    p.pin("b")
    assert p.victim() is None and p.pinned == {"a", "b"}
    p.unpin("b")
    assert p.victim() == "b"
    p.remove("a")
    assert not p.is_pinned("a") and p.nbytes == 20
    for bad in (p.touch, p.remove, p.pin, p.unpin):
        with pytest.raises(KeyError):
            bad("zz")
    p.discard("zz")  # tolerant variant
    with pytest.raises(ValueError):
        p.insert("c", -1)


def test_make_eviction_policy() -> None:
    assert isinstance(make_eviction_policy(None), LRU)
    assert isinstance(make_eviction_policy("LFU"), LFU)
    assert isinstance(make_eviction_policy(FIFO), FIFO)
    fresh = SizeAware()
    assert make_eviction_policy(fresh) is fresh
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_eviction_policy("arc")
    with pytest.raises(ValueError, match="already tracks"):
        make_eviction_policy(fill(LRU(), ("a", 1)))
    with pytest.raises(TypeError):
        make_eviction_policy(42)


@pytest.mark.parametrize("cls", [FIFO, LFU, SizeAware])
def test_heap_stays_bounded_under_many_touches(cls) -> None:
    p = fill(cls(), ("a", 1), ("b", 2), ("c", 3))
    for i in range(5000):
        p.touch("abc"[i % 3])
        p.pin("b"); p.unpin("b")
    assert len(p._heap) <= 2 * 3 + 64 + 1


# -------------------------------------------------------------------- brute-force reference
class Reference:
    """O(n) recomputation of each policy's victim from the full history."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.t = 0
        self.size: dict[str, int] = {}
        self.born: dict[str, int] = {}
        self.last: dict[str, int] = {}
        self.hits: dict[str, int] = {}
        self.h: dict[str, float] = {}
        self.pinned: set[str] = set()
        self.clock = 0.0

    def _tick(self) -> int:
        self.t += 1
        return self.t

    def _h(self, k: str) -> float:
        return self.clock + self.hits[k] / max(self.size[k], 1)

    def insert(self, k: str, n: int) -> None:
        was_pinned = k in self.pinned
        if k in self.size:
            self.remove(k, False)
        self.size[k] = n
        self.born[k] = self.last[k] = self._tick()
        self.hits[k] = 1
        self.h[k] = self._h(k)
        if was_pinned:
            self.pinned.add(k)

    def touch(self, k: str) -> None:
        self.hits[k] += 1
        self.last[k] = self._tick()
        self.h[k] = self._h(k)

    def remove(self, k: str, evicted: bool) -> None:
        if evicted and self.name == "size":
            self.clock = max(self.clock, self.h[k])
        for d in (self.size, self.born, self.last, self.hits, self.h):
            d.pop(k)
        self.pinned.discard(k)

    def pin(self, k: str) -> None:
        self.pinned.add(k)

    def unpin(self, k: str) -> None:
        if k in self.pinned:
            self.pinned.discard(k)
            if self.name in ("lru", "belady"):  # LRU: the release counts as a use
                self.last[k] = self._tick()

    def victim(self):
        cands = [k for k in self.size if k not in self.pinned]
        if not cands:
            return None
        # belady without a future: every key is "never used again", ties least-recently-used first = LRU
        key = {"lru": lambda k: self.last[k], "belady": lambda k: self.last[k], "fifo": lambda k: self.born[k],
               "lfu": lambda k: (self.hits[k], self.last[k]), "size": lambda k: (self.h[k], self.last[k])}[self.name]
        return min(cands, key=key)


OPS = st.lists(st.tuples(st.sampled_from(["insert", "touch", "remove", "evict", "pin", "unpin"]),
                         st.sampled_from("abcdef"), st.sampled_from([1, 7, 50, 300])), max_size=80)


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_matches_reference(name: str, ops) -> None:
    p, ref = make_eviction_policy(name), Reference(name)
    for op, k, n in ops:
        if op == "insert":
            p.insert(k, n); ref.insert(k, n)
        elif op == "evict":
            v = p.victim()
            assert v == ref.victim()
            if v is not None:
                p.remove(v, evicted=True); ref.remove(v, True)
        elif k not in ref.size:
            continue
        elif op == "touch":
            p.touch(k); ref.touch(k)
        elif op == "remove":
            p.remove(k); ref.remove(k, False)
        elif op == "pin":
            p.pin(k); ref.pin(k)
        elif op == "unpin":
            p.unpin(k); ref.unpin(k)
        assert p.victim() == ref.victim()
        assert len(p) == len(ref.size) and p.nbytes == sum(ref.size.values())
        assert p.pinned == ref.pinned


# -------------------------------------------------------------------- Belady (offline OPT)
def test_belady_farthest_next_use_first() -> None:
    # uses: a at 1 and 6, b at 3, c at 2 and 4, d never again
    p = fill(Belady({"a": [1, 6], "b": [3], "c": [2, 4]}), ("a", 1), ("b", 1), ("c", 1), ("d", 1))
    assert p.victim() == "d"  # never used again goes first
    p.remove("d", evicted=True)
    p.advance(1)  # next uses now: a 1, b 3, c 2 -> b farthest
    assert p.victim() == "b" and p.next_use("a") == 1
    p.advance(2)  # a 6, b 3, c 2 -> a
    assert p.victim() == "a"
    p.pin("a")
    assert p.victim() == "b"
    p.advance(5)  # b and c are never used again (tie: least recently used first = b, inserted before c)
    assert p.next_use("b") == float("inf") and p.victim() == "b"
    p.touch("b")  # now c is the least recently used of the two
    assert p.victim() == "c"


def test_belady_misses_on_a_paging_sequence() -> None:
    # capacity 2 pages, requests A B C A B C A: hand count (a hit touches, a miss inserts and evicts the victim)
    #   LRU: every request misses (7).  OPT: A B C(evict B: next use 4 > A's 3) A(hit) B(evict A: next 6 > C's 5)
    #   C(hit) A(evict B or C, both never again) -> misses A B C B A = 5
    seq = "ABCABCA"

    def misses(p, oracle: bool) -> int:
        if oracle:
            p.set_future({k: [t for t, x in enumerate(seq) if x == k] for k in set(seq)})
        n = 0
        for t, k in enumerate(seq):
            if oracle:
                p.advance(t)
            if k in p:
                p.touch(k)
                continue
            n += 1
            if len(p) == 2:
                p.remove(p.victim(), evicted=True)
            p.insert(k, 1)
        return n

    assert misses(LRU(), False) == 7
    assert misses(Belady(), True) == 5


# ---------------------------------------------------------------------- guess policies (policies/guess.py)
def _guesses(pol, windows):
    """The policy's guess after each window (observed in turn)."""
    out = []
    for w in windows:
        pol.observe(w)
        out.append(pol.guess())
    return out


def test_slide_guess_follows_a_pinned_head_and_pairs() -> None:
    from policies.guess import SlideGuess

    # a web agent keeps its task at the head and the last 3 screenshots: s_k leaves from place 1
    web = [["task", "s0"], ["task", "s0", "s1"], ["task", "s0", "s1", "s2"], ["task", "s1", "s2", "s3"],
           ["task", "s2", "s3", "s4"]]
    assert _guesses(SlideGuess(), web) == [None, None, None, ["task", "s2", "s3"], ["task", "s3", "s4"]]
    # a browser agent slides a (screenshot, page) pair at a time
    pairs = [["t", "a0", "p0", "a1", "p1"], ["t", "a1", "p1", "a2", "p2"]]
    assert _guesses(SlideGuess(), pairs)[-1] == ["t", "a2", "p2"]


def test_slide_guess_leaves_out_trailers_and_look_backs() -> None:
    from policies.guess import SlideGuess

    # a video agent holds 3 frames and re-asks its question behind each new one; a look-back to f0 pushes out two
    video = [["f0", "f1", "q"], ["f0", "f1", "f2", "q"], ["f1", "f2", "f3", "q"], ["f0", "f4", "q"],
             ["f3", "f4", "f5", "q"], ["f4", "f5", "f6", "q"]]
    got = _guesses(SlideGuess(), video)
    assert got[:2] == [None, None] and got[2] == ["f2", "f3"]
    assert got[3] == ["f3", "f4"]  # the look-back is one step's: f3, pushed out by it, comes back
    assert got[4] == ["f4", "f5"]
    assert video[4][:2] == got[3] and video[5][:2] == got[4]  # (the look-back itself is not guessed: got[2] misses)
    # a text agent recalls an old entry at the tail, pushing out one more; the next step drops the look-back only
    text = [["e0", "e1", "e2", "e3"], ["e1", "e2", "e3", "e4"], ["e3", "e4", "e5", "e0"], ["e3", "e4", "e5", "e6"],
            ["e4", "e5", "e6", "e7"]]
    got = _guesses(SlideGuess(), text)
    assert got[1:] == [["e2", "e3", "e4"], ["e3", "e4", "e5"], ["e4", "e5", "e6"], ["e5", "e6", "e7"]]
    assert text[3][:3] == got[2] and text[4][:3] == got[3]  # after the look-back, the guesses open the next window
    # ... or moves a live one behind the new entry: a look-back too, not a trailer (it did not close the window)
    moved = [["e0", "e1", "e2"], ["e1", "e2", "e3"], ["e3", "e4", "e1"], ["e3", "e4", "e5"]]
    assert _guesses(SlideGuess(), moved)[1:] == [["e2", "e3"], ["e3", "e4"], ["e4", "e5"]]


def test_slide_guess_stays_silent_on_growth_and_rewrites() -> None:
    from policies.guess import SlideGuess

    assert _guesses(SlideGuess(), [["a"], ["a", "b"], ["a", "b", "c"]]) == [None, None, None]  # nothing left yet
    # a screenshot clipped to text where it stood: what replaces the next one is not written yet
    clip = [["t", "s0", "s1"], ["t", "s0", "s1", "s2"], ["t", "c0", "s1", "s2", "s3"]]
    assert _guesses(SlideGuess(), clip)[-1] is None
    # survivors reordered by the agent: the base follows the window as it is, then the slide repeats on it
    assert _guesses(SlideGuess(), [["a", "b", "c", "d"], ["c", "b", "d", "e"]])[-1] == ["b", "d", "e"]
    # a step with no arrival (only a reorder) guesses nothing
    assert _guesses(SlideGuess(), [["a", "b"], ["b", "c"], ["c", "b"]])[-1] is None


class _FakeWindow:
    """What ``GuessPolicy.apply`` reads of a Window: ``ids`` and ``prefetch(next=...)``."""

    def __init__(self) -> None:
        self.ids: list = []
        self.prefetched: list = []

    def prefetch(self, next=None):
        self.prefetched.append(list(next))
        return {"prefilled": 10 * len(next)}


def test_guess_policy_prepares_only_while_its_guesses_hit() -> None:
    from policies.guess import GuessPolicy

    class Always(GuessPolicy):  # always guesses the window opens with "a"
        def guess(self):
            return ["a"]

    pol, win = Always(memory=2, min_hit_rate=0.5), _FakeWindow()
    prepared = []
    for w in (["a", "b"], ["z"], ["z"], ["a"], ["a", "c"]):
        win.ids = w
        prepared.append(pol.apply(win)["guess"])
    pol.observe(["a"])  # the window after the last step scores the last guess
    # a miss stops the idle forwards; the guesses kept in the shadow hit again, and they resume
    assert prepared == [["a"], None, None, ["a"], ["a"]]
    assert pol.counters == {"steps": 6, "guesses": 5, "prepared": 3, "hits": 2, "prefilled": 30, "wasted": 10}
    assert win.prefetched == [["a"]] * 3


def test_make_guess_and_its_errors() -> None:
    from policies.guess import GUESS_POLICIES, NoGuess, SlideGuess, make_guess
    from windowkit.errors import PolicyError
    from windowkit.registry import make_policy, names

    assert make_guess(None) is None and isinstance(make_guess("slide"), SlideGuess)
    assert isinstance(make_policy("guess", "none"), NoGuess) and names("guess") == list(GUESS_POLICIES)
    pol = SlideGuess()
    assert make_guess(pol) is pol and isinstance(make_guess(SlideGuess), SlideGuess)
    with pytest.raises(PolicyError, match="unknown guess policy"):
        make_guess("oracle")
    with pytest.raises(PolicyError):
        SlideGuess(memory=0)
    win = _FakeWindow()
    win.ids = ["a"]
    assert NoGuess().apply(win) == {"guess": None, "prefilled": 0} and not win.prefetched
