"""Eviction policies for byte-budgeted caches (the chunk store's pluggable victim choice).

The protocol (``EvictionPolicy``: the accounting, pins and the method contract), the store's default ``LRU``
and the name registry live in ``windowkit.store.eviction``; this module adds the other policies, subclasses
of that base, registers them by name (``ChunkStore(policy="lfu")``) and re-exports the names it used to
define, so ``from policies.eviction import LRU, EvictionPolicy, make_eviction_policy`` keeps working.

    lfu = LFU()
    lfu.insert("a", 100); lfu.insert("b", 100); lfu.touch("a")
    assert lfu.victim() == "b"
    lfu.pin("b"); assert lfu.victim() == "a"

Policies: ``LRU`` (default; O(1) per op), ``FIFO``, ``LFU`` and ``SizeAware`` (GreedyDual-Size with
frequency, GDSF), the last three on a lazy-deletion heap: O(log n) per op, amortised; ``Belady`` (offline
OPT: needs the future uses of every key from an oracle, ``set_future`` / ``advance``; O(n) per victim).
"""
from __future__ import annotations

import bisect
import heapq
import math
from abc import abstractmethod
from typing import Callable, Iterable, Mapping, Optional

# the protocol, the default LRU and the registry live in windowkit (the store needs them without this package);
# re-exported here, so ``from policies.eviction import LRU, EvictionPolicy, make_eviction_policy`` keeps working
from windowkit.store.eviction import (EVICTION_POLICIES, LRU, EvictionPolicy, Key, PolicySpec,  # noqa: F401
                                      make_eviction_policy, register_eviction)


class _HeapPolicy(EvictionPolicy):
    """Min-heap of ``(priority, push_id, key)`` with lazy deletion: a heap row is live only while it is
    the key's latest push and the key is unpinned. Subclasses define ``_priority(key)``."""

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[tuple] = []
        self._live: dict[Key, int] = {}  # key -> push id of its live heap row (unpinned keys only)
        self._pushes = 0
        self._clock = 0  # logical time: one tick per insert/touch, the tie-breaker (older first)

    @abstractmethod
    def _priority(self, key: Key) -> tuple:
        """Smaller is evicted first."""

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _push(self, key: Key) -> None:
        if key in self._pinned:
            return
        self._pushes += 1
        self._live[key] = self._pushes
        heapq.heappush(self._heap, (self._priority(key), self._pushes, key))
        if len(self._heap) > 2 * len(self._live) + 64:  # stale rows pile up under touches: rebuild
            self._heap = [(self._priority(k), pid, k) for k, pid in self._live.items()]
            heapq.heapify(self._heap)

    def _on_remove(self, key: Key, evicted: bool) -> None:
        self._live.pop(key, None)  # its heap row goes stale

    def _on_pin(self, key: Key) -> None:
        self._live.pop(key, None)

    def _on_unpin(self, key: Key) -> None:
        self._push(key)

    def victim(self) -> Optional[Key]:
        heap = self._heap
        while heap:
            _, pid, key = heap[0]
            if self._live.get(key) == pid:
                return key
            heapq.heappop(heap)
        return None


class FIFO(_HeapPolicy):
    """First inserted, first evicted; reads do not matter. A pinned key keeps its place in the queue.

        p = FIFO(); p.insert("a", 1); p.insert("b", 1); p.touch("a"); assert p.victim() == "a"
    """

    name = "fifo"

    def __init__(self) -> None:
        super().__init__()
        self._born: dict[Key, int] = {}

    def _priority(self, key: Key) -> tuple:
        return (self._born[key],)

    def _on_insert(self, key: Key) -> None:
        self._born[key] = self._tick()
        self._push(key)

    def _on_touch(self, key: Key) -> None:
        pass

    def _on_remove(self, key: Key, evicted: bool) -> None:
        super()._on_remove(key, evicted)
        self._born.pop(key, None)


class LFU(_HeapPolicy):
    """Fewest hits first (an insert counts as one hit), ties broken least-recently-used first. No aging.

        p = LFU(); p.insert("a", 1); p.insert("b", 1); p.touch("a"); p.touch("b"); p.touch("b")
        assert p.victim() == "a"
    """

    name = "lfu"

    def __init__(self) -> None:
        super().__init__()
        self._hits: dict[Key, int] = {}
        self._last: dict[Key, int] = {}

    def _priority(self, key: Key) -> tuple:
        return (self._hits[key], self._last[key])

    def _on_insert(self, key: Key) -> None:
        self._hits[key] = 1
        self._last[key] = self._tick()
        self._push(key)

    def _on_touch(self, key: Key) -> None:
        self._hits[key] += 1
        self._last[key] = self._tick()
        self._push(key)

    def _on_remove(self, key: Key, evicted: bool) -> None:
        super()._on_remove(key, evicted)
        self._hits.pop(key, None)
        self._last.pop(key, None)

    def hits(self, key: Key) -> int:
        return self._hits[key]


CostFn = Callable[[Key, int], float]


class SizeAware(_HeapPolicy):
    """GreedyDual-Size-Frequency: evict the smallest ``H = L + hits * cost / nbytes`` first.

    With the default ``cost = 1`` this evicts the largest bytes-per-hit first; ``L`` (the clock) rises
    to the evicted key's H on each eviction, so keys that stop being read age out even if small.
    Pass ``cost(key, nbytes)`` to weigh misses (e.g. re-encode milliseconds) instead of counting them.

        p = SizeAware(); p.insert("big", 1000); p.insert("small", 10); assert p.victim() == "big"
    """

    name = "size"

    def __init__(self, cost: Optional[CostFn] = None) -> None:
        super().__init__()
        self._cost = cost
        self._hits: dict[Key, int] = {}
        self._h: dict[Key, float] = {}
        self._last: dict[Key, int] = {}
        self.clock = 0.0  # GreedyDual's L

    def _value(self, key: Key) -> float:
        nbytes = max(self._sizes[key], 1)
        cost = 1.0 if self._cost is None else float(self._cost(key, self._sizes[key]))
        return self.clock + self._hits[key] * cost / nbytes

    def _priority(self, key: Key) -> tuple:
        return (self._h[key], self._last[key])

    def _on_insert(self, key: Key) -> None:
        self._hits[key] = 1
        self._h[key] = self._value(key)
        self._last[key] = self._tick()
        self._push(key)

    def _on_touch(self, key: Key) -> None:
        self._hits[key] += 1
        self._h[key] = self._value(key)
        self._last[key] = self._tick()
        self._push(key)

    def _on_remove(self, key: Key, evicted: bool) -> None:
        super()._on_remove(key, evicted)
        h = self._h.pop(key, None)
        if evicted and h is not None:
            self.clock = max(self.clock, h)
        self._hits.pop(key, None)
        self._last.pop(key, None)

    def priority(self, key: Key) -> float:
        """The key's current H (smaller goes first)."""
        return self._h[key]


class Belady(LRU):
    """Belady (offline): evict the key whose next use is farthest in the future (never used again first).
    It is OPT for the uses it is given; the simulator gives it every read a step *may* make (a superset of
    the real ones), so there it is a strong offline reference, not a bound. The future comes from an oracle:
    ``set_future({key: [times it is used]})`` and ``advance(now)`` as time passes; a use at ``now`` itself counts as upcoming. Ties (e.g. keys never used again, or no
    future given at all) go least-recently-used first, as in ``LRU`` (an unpin counts as a use).

    Time is whatever the caller counts in: the trace simulator uses step indices and fills the future
    from the trace (canonical and patch keys of every chunk at every step). O(n) per ``victim``.

        p = Belady({"a": [5], "b": [2]}); p.insert("a", 1); p.insert("b", 1)
        assert p.victim() == "a"            # a is needed later than b
        p.advance(3); assert p.victim() == "b"   # b is never needed again
    """

    name = "belady"

    def __init__(self, future: Optional[Mapping[Key, Iterable[int]]] = None) -> None:
        super().__init__()  # LRU's bookkeeping: unpinned keys, least recently used first (the tie order)
        self._uses: dict[Key, list[int]] = {}
        self.now = 0
        if future is not None:
            self.set_future(future)

    def set_future(self, future: Mapping[Key, Iterable[int]]) -> None:
        """The times each key will be used (any iterable of ints per key; unknown keys: never again)."""
        self._uses = {k: sorted(set(int(t) for t in v)) for k, v in future.items()}

    def advance(self, now: int) -> None:
        """Move the clock: uses before ``now`` are past."""
        self.now = int(now)

    def next_use(self, key: Key) -> float:
        """The first use of ``key`` at or after ``now``; ``inf`` if none."""
        uses = self._uses.get(key)
        if not uses:
            return math.inf
        i = bisect.bisect_left(uses, self.now)
        return uses[i] if i < len(uses) else math.inf

    def victim(self) -> Optional[Key]:
        best, far = None, -1.0
        for k in self._order:  # LRU order: the first of equally far keys wins
            t = self.next_use(k)
            if t > far:
                best, far = k, t
                if t == math.inf:
                    break
        return best


for _cls in (LRU, FIFO, LFU, SizeAware, Belady):  # registration order is EVICTION_POLICIES' order
    register_eviction(_cls.name, _cls)
del _cls


__all__ = ["EvictionPolicy", "LRU", "FIFO", "LFU", "SizeAware", "Belady", "EVICTION_POLICIES", "make_eviction_policy"]
