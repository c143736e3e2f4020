"""The eviction policy protocol of byte-budgeted caches (the chunk store's pluggable victim choice), its
default ``LRU``, and the registry that finds a policy by name.

A policy is a small object in the spirit of cachetools' cache classes but without owning the data: the cache
owns the values and the byte budget; the policy only tracks keys and answers "which key goes next?".
``EvictionPolicy`` does the accounting (sizes, pins, byte total, argument checks) once; a subclass only keeps
its victim order. The contract, as the store uses it:

    insert(key, nbytes)   a new key entered the cache (inserting a known key replaces it; a pin stays a pin)
    touch(key)            the key was read (a hit)
    remove(key, evicted=False)   the key left the cache; ``evicted=True`` when the policy's victim was
                          evicted (GreedyDual-Size ages its clock on evictions only)
    victim() -> key|None  the next key to evict, never a pinned one; does not remove it
    pin(key) / unpin(key) pinned keys are never victims (the chunk store pins the live window's chunks)
    len(p), key in p, p.nbytes

    lru = LRU()
    lru.insert("a", 100); lru.insert("b", 100); lru.touch("a")
    assert lru.victim() == "b"
    lru.pin("b"); assert lru.victim() == "a"

Names: ``register_eviction("name", cls)`` makes ``ChunkStore(policy="name")`` find ``cls``;
``eviction_policy("name")`` returns the class. windowkit itself registers only ``"lru"``; the other policies
(``FIFO``, ``LFU``, ``SizeAware``, ``Belady``) live in the ``policies`` package, which registers them when it
is imported. A name windowkit does not know loads the providers (``windowkit.registry.load_providers``: the
``windowkit.policies`` entry point group, or, where none is installed, the ``policies`` package).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Hashable, Optional, Union

from windowkit.errors import PolicyError, PolicyTypeError
from windowkit.registry import load_providers

Key = Hashable


class EvictionPolicy(ABC):
    """Victim order over keys. Subclasses implement the five abstract methods; pin state is read here.

    The sizes and the byte total are kept here, the pins in a ``PinLedger`` (the policy's own, or the cache's
    after ``use_pins``: then the cache's ledger is the only one), and every public method checks its key before
    calling a hook: ``touch`` / ``remove`` / ``pin`` / ``unpin`` of an unknown key raise ``KeyError``, a negative
    size raises ``PolicyError`` (a ``ValueError``). A pinned key is out of the victim order until unpinned.

        class MRU(LRU):                                   # most recently used first
            def victim(self):
                return next(reversed(self._order), None)
    """

    name: str = "policy"

    def __init__(self) -> None:
        self._sizes: dict[Key, int] = {}
        self._pins = PinLedger(counted=False)  # its own until a cache binds its ledger (``use_pins``)
        self._owns_pins = True
        self._nbytes = 0

    def use_pins(self, ledger: "PinLedger") -> None:
        """Read pins from ``ledger`` (the cache's; the chunk store's) instead of keeping a ledger: the policy
        then holds no pin state of its own. ``pin`` / ``unpin`` write to that ledger, ``remove`` leaves a key's
        pins there (the cache's pins may outlive and precede its entries) and ``insert`` of a key the ledger
        pins takes it out of the victim order at once. Only on a fresh policy."""
        if self._sizes or len(self._pins) or not self._owns_pins:
            raise PolicyError(f"use_pins on a policy that already tracks keys or reads another ledger: {self!r}")
        self._pins, self._owns_pins = ledger, False

    @property
    def pin_ledger(self) -> "PinLedger":
        """The ledger this policy reads pins from: its own, or the store's after ``use_pins``."""
        return self._pins

    @property
    def _pinned(self) -> "PinLedger":
        """The pin ledger (``key in self._pinned``: whether a key is pinned), read by subclasses."""
        return self._pins

    # ---------------------------------------------------------------- contract
    @abstractmethod
    def _on_insert(self, key: Key) -> None:
        """``key`` is new (already in ``_sizes``): give it a place in the victim order."""

    @abstractmethod
    def _on_touch(self, key: Key) -> None:
        """``key`` (known) was read."""

    @abstractmethod
    def _on_remove(self, key: Key, evicted: bool) -> None:
        """``key`` leaves (still in ``_sizes`` during the call)."""

    @abstractmethod
    def _on_pin(self, key: Key) -> None:
        """Take ``key`` out of the victim order (keep its state)."""

    @abstractmethod
    def _on_unpin(self, key: Key) -> None:
        """Put ``key`` back into the victim order."""

    @abstractmethod
    def victim(self) -> Optional[Key]:
        """The next key to evict (never a pinned one), or None when every key is pinned or none is held."""

    # ---------------------------------------------------------------- public API
    def insert(self, key: Key, nbytes: int) -> None:
        if nbytes < 0:
            raise PolicyError(f"nbytes must be >= 0, got {nbytes}")
        pinned = key in self._pins
        if key in self._sizes:  # replacing: a fresh entry, but a pin stays a pin
            self.remove(key)
        self._sizes[key] = int(nbytes)
        self._nbytes += int(nbytes)
        if pinned and self._owns_pins:  # ``remove`` cleared our own ledger's pin
            self._pins.pin(key)
        self._on_insert(key)
        if pinned:
            self._on_pin(key)

    def touch(self, key: Key) -> None:
        if key not in self._sizes:
            raise KeyError(key)
        self._on_touch(key)

    def remove(self, key: Key, evicted: bool = False) -> None:
        if key not in self._sizes:
            raise KeyError(key)
        self._on_remove(key, evicted)
        self._nbytes -= self._sizes.pop(key)
        if self._owns_pins:
            self._pins.clear(key)

    def discard(self, key: Key) -> None:
        """``remove`` that ignores unknown keys."""
        if key in self._sizes:
            self.remove(key)

    def pin(self, key: Key) -> None:
        """Pin a known key (with a bound ledger: one more pin there; the victim order changes on the first)."""
        if key not in self._sizes:
            raise KeyError(key)
        if self._pins.pin(key):
            self._on_pin(key)

    def unpin(self, key: Key) -> None:
        """Release a pin of a known key (a no-op when unpinned); the victim order changes on the last."""
        if key not in self._sizes:
            raise KeyError(key)
        if self._pins.unpin(key):
            self._on_unpin(key)

    def is_pinned(self, key: Key) -> bool:
        return key in self._sizes and key in self._pins

    @property
    def pinned(self) -> frozenset:
        """The tracked keys that are pinned."""
        return frozenset(k for k in self._pins if k in self._sizes)

    @property
    def nbytes(self) -> int:
        """Bytes of every tracked key (pinned included)."""
        return self._nbytes

    def size_of(self, key: Key) -> int:
        return self._sizes[key]

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __repr__(self) -> str:
        return f"{type(self).__name__}(keys={len(self)}, pinned={len(self.pinned)}, nbytes={self._nbytes})"


class PinLedger:
    """Pins per key: the one record of what a cache must not evict. ``counted=True`` (the chunk store's): pins
    count (pin twice, unpin twice) and may name keys the cache does not hold (yet). ``counted=False`` (a
    policy's own): a set, pinning twice is one pin.

        pins = PinLedger(); pins.pin("a"); pins.pin("a")
        assert pins.unpin("a") is False and pins.unpin("a") is True and "a" not in pins
    """

    def __init__(self, counted: bool = True) -> None:
        self.counted = counted
        self._n: dict[Key, int] = {}

    def pin(self, key: Key) -> bool:
        """One more pin; True when ``key`` was not pinned before."""
        n = self._n.get(key, 0)
        if n and not self.counted:
            return False
        self._n[key] = n + 1
        return n == 0

    def unpin(self, key: Key) -> bool:
        """One pin less (a no-op if unpinned); True when that was its last pin."""
        n = self._n.get(key, 0)
        if n <= 1:
            return self._n.pop(key, None) is not None
        self._n[key] = n - 1
        return False

    def clear(self, key: Key) -> None:
        """Forget every pin of ``key``."""
        self._n.pop(key, None)

    def count(self, key: Key) -> int:
        return self._n.get(key, 0)

    def __contains__(self, key: object) -> bool:
        return key in self._n

    def __iter__(self):
        return iter(list(self._n))

    def __len__(self) -> int:
        return len(self._n)

    def __repr__(self) -> str:
        return f"PinLedger({self._n!r})"


class LRU(EvictionPolicy):
    """Least recently used first (the store's default). O(1) per op (an OrderedDict of the unpinned keys,
    oldest first).

    Unpinning counts as a use: the window held the chunk until it released it.

        p = LRU(); p.insert("a", 1); p.insert("b", 1); p.touch("a"); assert p.victim() == "b"
    """

    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self._order: OrderedDict[Key, None] = OrderedDict()

    def _on_insert(self, key: Key) -> None:
        self._order[key] = None

    def _on_touch(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def _on_remove(self, key: Key, evicted: bool) -> None:
        self._order.pop(key, None)

    def _on_pin(self, key: Key) -> None:
        self._order.pop(key, None)

    def _on_unpin(self, key: Key) -> None:
        self._order[key] = None

    def victim(self) -> Optional[Key]:
        return next(iter(self._order), None)


# ---------------------------------------------------------------- registry
# name -> class, in registration order. ``policies`` adds its policies here when imported.
EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRU}


def register_eviction(name: str, cls: type[EvictionPolicy]) -> None:
    """Make ``cls`` the eviction policy called ``name`` (lower case), so ``ChunkStore(policy=name)`` finds it.
    Registering a name again replaces the class.

        register_eviction("mru", MRU)
    """
    if not isinstance(name, str) or not name:
        raise PolicyError(f"an eviction policy name is a non-empty string, got {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, EvictionPolicy)):
        raise PolicyTypeError(f"an eviction policy is an EvictionPolicy subclass, got {cls!r}")
    EVICTION_POLICIES[name.lower()] = cls


def eviction_policy(name: str) -> type[EvictionPolicy]:
    """The eviction policy class registered as ``name`` (case-insensitive); raises ``PolicyError`` for an
    unknown name.

        eviction_policy("lru")   # -> LRU
    """
    if not isinstance(name, str):
        raise PolicyTypeError(f"an eviction policy name is a string, got {name!r}")
    key = name.lower()
    if key not in EVICTION_POLICIES:
        load_providers()
    try:
        return EVICTION_POLICIES[key]
    except KeyError:
        raise PolicyError(f"unknown eviction policy {name!r}; known: {sorted(EVICTION_POLICIES)}") from None


def eviction_names() -> list[str]:
    """Every registered eviction policy name, in registration order, after loading the providers (so the
    ``policies`` package's are listed too).

        eviction_names()   # ["lru", "fifo", "lfu", "size", "belady"]
    """
    load_providers()
    return list(EVICTION_POLICIES)


PolicySpec = Union[None, str, EvictionPolicy, type]


def make_eviction_policy(spec: PolicySpec = None) -> EvictionPolicy:
    """A fresh policy from None (LRU), a registered name ("lru", and from ``policies``: "lfu", "fifo", "size",
    "belady"), a class, or an empty instance.

        make_eviction_policy("lfu")   # -> LFU()
    """
    if spec is None:
        return LRU()
    if isinstance(spec, str):
        return eviction_policy(spec)()
    if isinstance(spec, type) and issubclass(spec, EvictionPolicy):
        return spec()
    if isinstance(spec, EvictionPolicy):
        if len(spec):  # a policy's state describes one cache; sharing it would corrupt both
            raise PolicyError(f"eviction policy {spec!r} already tracks keys; pass a fresh one")
        return spec
    raise PolicyTypeError(f"cannot make an eviction policy from {spec!r}")


__all__ = ["EvictionPolicy", "LRU", "PinLedger", "EVICTION_POLICIES", "PolicySpec", "register_eviction",
           "eviction_policy", "eviction_names", "make_eviction_policy"]
