"""Guess policies: what will the next step's window open with? Prepared between steps, off the critical path.

An agent that knows its next context prepares it itself (``win.prefetch(next=...)``: ``LongVideoAgent`` and
``TextReaderAgent`` with ``anticipate=True``). One that does not can let a guess policy read the window's own
history and prepare the likeliest next window: the survivors of the next slide, made exact in the context they
will have, so the next step prefills only what is new. A wrong guess costs the idle forward and nothing else:
the next step's edits run as they would have (the prepared copies are kept by context and found where they fit).

Every policy has the same few methods:

    reset()             forget the history and zero the counters
    observe(ids)        the window's chunk ids after a step (in order)
    guess() -> ids      the ids the next window is guessed to open with (all seen by the window), or None
    apply(win) -> dict  between steps: observe ``win.ids``, guess, and ``win.prefetch(next=guess)``

    pol = make_guess("slide")
    for obs in stream:
        win.assign(chunks_for(obs)); answer = win.generate(question)
        pol.apply(win)                 # idle time: the next slide's survivors, in the places they will have
    pol.counters                       # {"steps", "guesses", "prepared", "hits", "prefilled", "wasted"}

Policies
  none    guess nothing (``apply`` prepares nothing)
  slide   the last slide again: the chunks that left last time leave from the same places; a look-back is
          one step's (the chunks it pushed out come back with the next slide), and what stands behind the
          newest arrival (a question re-asked after each new frame) is re-placed by the agent, not kept

A guess is a hit when the next observed window opens with it; ``wasted`` counts the tokens prefilled for the
prepared guesses that missed. A policy prepares only while its recent guesses hit (``GuessPolicy.confident``).
"""
from __future__ import annotations

from collections import deque
from typing import Any, Optional, Sequence

from windowkit.errors import PolicyError, PolicyTypeError


class GuessPolicy:
    """Base: ``guess`` decides from what ``observe`` saw; ``apply`` runs it on a Window and counts.

    Every guess is scored against the next window seen, prepared or not. ``apply`` prepares a guess only while the
    policy has been right on at least ``min_hit_rate`` of its last ``memory`` guesses (none yet: it tries), so a
    window that does not slide as the policy thinks (random look-backs, growth) soon stops costing idle forwards,
    and it resumes once its guesses would have hit again.
    """

    name = "guess"

    def __init__(self, memory: int = 4, min_hit_rate: float = 0.5) -> None:
        if int(memory) < 1 or not 0.0 <= float(min_hit_rate) <= 1.0:
            raise PolicyError(f"memory must be >= 1 and min_hit_rate in [0, 1], got {memory}, {min_hit_rate}")
        self.memory, self.min_hit_rate = int(memory), float(min_hit_rate)
        self.reset()

    def reset(self) -> None:
        # steps observed; guesses made; of them prepared (``prefetch``), and the prepared ones that hit; the tokens
        # the prepared ones prefilled, and those of the ones that missed
        self.counters = {"steps": 0, "guesses": 0, "prepared": 0, "hits": 0, "prefilled": 0, "wasted": 0}
        self._record: deque[bool] = deque(maxlen=self.memory)  # the last guesses: hit or not
        self._last: Optional[tuple[list[str], Optional[int]]] = None  # the last guess, its tokens if prepared

    def observe(self, ids: Sequence[str]) -> None:
        """The window after a step: score the last guess against it."""
        ids = list(ids)
        self.counters["steps"] += 1
        if self._last is not None:
            g, tokens = self._last
            hit = ids[:len(g)] == g
            self._record.append(hit)
            if tokens is not None and hit:
                self.counters["hits"] += 1
            elif tokens is not None:
                self.counters["wasted"] += tokens
            self._last = None

    def guess(self) -> Optional[list[str]]:
        raise NotImplementedError

    def confident(self) -> bool:
        """Whether the last guesses hit often enough to spend an idle forward on the next."""
        return not self._record or sum(self._record) >= self.min_hit_rate * len(self._record)

    def apply(self, win: Any) -> dict:
        """Between steps: observe ``win.ids``, guess, and prepare the guess if ``confident()``
        (``win.prefetch(next=...)``). Returns ``{"guess": ids or None, "prefilled": tokens}``: the guess prepared."""
        self.observe(win.ids)
        g = self.guess()
        if not g:
            return {"guess": None, "prefilled": 0}
        self.counters["guesses"] += 1
        if not self.confident():
            self._last = (list(g), None)
            return {"guess": None, "prefilled": 0}
        n = int(win.prefetch(next=g)["prefilled"])
        self.counters["prepared"] += 1
        self.counters["prefilled"] += n
        self._last = (list(g), n)
        return {"guess": list(g), "prefilled": n}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NoGuess(GuessPolicy):
    """Guess nothing: ``apply`` only observes.

        NoGuess().guess()   # None
    """

    name = "none"

    def guess(self) -> Optional[list[str]]:
        return None


class SlideGuess(GuessPolicy):
    """The last slide again.

    The policy keeps the window's *base*: the window as it would be without look-backs. A step's chunks are its
    arrivals (never seen before), its look-backs (chunks recalled from outside the window, or live ones moved
    behind the newest arrival), its trailers (chunks behind the newest arrival that closed the last window too:
    a question re-asked after each frame) and the base's survivors. When a step both adds arrivals and loses base
    chunks, it is a slide: its first leavers' places in the base (as many as arrived; look-backs may push out
    more, and those come back when the look-back goes) are where the next slide leaves from. The guess is the base without the chunks at those
    places: the survivors of the next slide, in their order. No guess before a first slide, after a step where
    nothing new arrived, or after a rewrite (a new chunk in front of an old one: a screenshot clipped to text
    where it stood, whose successor the agent has not written yet).

        pol = SlideGuess()
        pol.observe(["task", "s0", "s1", "s2"]); pol.observe(["task", "s1", "s2", "s3"])
        pol.guess()                       # ["task", "s2", "s3"]: s1 leaves from where s0 left
        pol = SlideGuess()
        pol.observe(["f0", "f2", "q"]); pol.observe(["f2", "f4", "q"])
        pol.guess()                       # ["f4"]: the question re-asked behind each new frame is not kept
        pol.observe(["f4", "f0", "f6", "q"])   # a slide, with a look-back to f0
        pol.guess()                       # ["f6"]: f4 leaves next; the look-back is one step's
    """

    name = "slide"

    def reset(self) -> None:
        super().reset()
        self._cur: Optional[list[str]] = None
        self._seen: set[str] = set()
        self._base: list[str] = []
        self._arrived = False  # the last step brought a never-seen chunk
        self._rewrite = False  # ... in front of an old one
        self._leave: Optional[list[int]] = None  # the base places the last slide's chunks left from

    def observe(self, ids: Sequence[str]) -> None:
        super().observe(ids)
        cur = list(ids)
        now, prev, seen = set(cur), self._cur or [], self._seen
        was = set(prev)
        arrived = [c for c in cur if c not in seen]  # (never a trailer: a trailer closed the last window)
        recalled = {c for c in cur if c not in was and c in seen}
        newest = max((i for i, c in enumerate(cur) if c not in seen), default=len(cur) - 1)
        behind = [c for c in cur[newest + 1:] if c not in recalled]
        # behind the newest arrival: trailers if they closed the last window too (a question re-asked), else
        # look-backs to live chunks, moved there this step
        trail = set(behind) if behind and prev[-len(behind):] == behind else set()
        moved = set(behind) - trail
        kept = [c for c in cur if c in seen and c not in recalled and c not in behind]
        base = [c for c in self._base if c not in trail]
        left = [i for i, c in enumerate(base) if c not in now or c in moved]
        if arrived and left:
            self._leave = left[:len(arrived)]
            gone = set(self._leave)
            base = [c for i, c in enumerate(base) if i not in gone]
        else:
            base = [c for c in base if c in now and c not in moved]
        at = {c: i for i, c in enumerate(cur)}
        self._rewrite = bool(kept) and bool(arrived) and at[arrived[0]] < at[kept[-1]]
        base += arrived
        if not _in_order(kept + arrived, base):  # the window left the model: start again from what it holds
            base = kept + arrived
        self._base, self._arrived, self._cur = base, bool(arrived), cur
        seen.update(cur)

    def guess(self) -> Optional[list[str]]:
        if self._leave is None or not self._arrived or self._rewrite:
            return None
        drop = set(self._leave)
        kept = [c for i, c in enumerate(self._base) if i not in drop]
        return kept or None


def _in_order(xs: Sequence[str], ys: Sequence[str]) -> bool:
    """Whether ``xs`` is a subsequence of ``ys`` (the same chunks, in the same order, maybe with others between)."""
    it = iter(ys)
    return all(x in it for x in xs)


GUESS_POLICIES: dict[str, type[GuessPolicy]] = {"none": NoGuess, "slide": SlideGuess}


def make_guess(spec: Any = None) -> Optional[GuessPolicy]:
    """A fresh policy from None (None: no guessing), a name ("none", "slide"), a class or an instance (kept).

        make_guess("slide")   # -> SlideGuess()
    """
    if spec is None or isinstance(spec, GuessPolicy):
        return spec
    if isinstance(spec, type) and issubclass(spec, GuessPolicy):
        return spec()
    if isinstance(spec, str):
        cls = GUESS_POLICIES.get(spec.lower())
        if cls is None:
            raise PolicyError(f"unknown guess policy {spec!r}; known: {', '.join(GUESS_POLICIES)}")
        return cls()
    raise PolicyTypeError(f"cannot make a guess policy from {spec!r}")


__all__ = ["GuessPolicy", "NoGuess", "SlideGuess", "GUESS_POLICIES", "make_guess"]
