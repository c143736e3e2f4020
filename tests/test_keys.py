"""Store keys (windowkit/store/keys.py) pinned to their format: keys are persisted by the disk tier and the
shared tier, so a key that changes between versions orphans every stored canonical and patch.

Expected keys are computed here from the documented format (hex sha256 prefix, 32 chars, of the compact JSON
of a tagged list) and three are pinned as literals.
"""
from __future__ import annotations

import hashlib
import json

import pytest

from windowkit.store import chunk_key, context_hash, context_root, context_step, orbit_context_hash


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, separators=(",", ":")).encode()).hexdigest()[:32]


def test_key_format_is_the_documented_one():
    assert chunk_key("abc", "fp") == digest(["chunk", "abc", "fp"])
    assert chunk_key("abc", None) == chunk_key("abc", "") == digest(["chunk", "abc", ""])
    assert context_root() == digest(["ctx", ""]) and context_root("p") == digest(["ctx", "p"])
    assert context_step("h", "k") == digest(["h", "k"])
    assert context_hash(["a", "b"], prefix="p") == digest([digest([digest(["ctx", "p"]), "a"]), "b"])
    assert orbit_context_hash(["b", "a"], prefix="p") == digest(["orbit", "p", ["a", "b"]])
    # the default prefix is the empty one
    assert orbit_context_hash(["b", "a"]) == digest(["orbit", "", ["a", "b"]])
    assert context_hash(["a"]) == digest([digest(["ctx", ""]), "a"])
    # pinned literals: a change here is a store format change (bump it on purpose, with a migration)
    assert chunk_key("abc", "fp") == "7bceb74465d424548e50975adc279dd7"
    assert context_hash(["a", "b"], prefix="p") == "c9a5851332ad60314d02a20ac41687b2"
    assert orbit_context_hash(["b", "a"], prefix="p") == "f55f7904e34f9bf13d739662ae54dc91"
    assert all(len(k) == 32 and int(k, 16) >= 0 for k in (chunk_key("x", None), context_root(),
                                                          orbit_context_hash([])))


def test_context_hash_properties():
    a, b, c = "ka", "kb", "kc"
    assert context_hash([a, b]) != context_hash([b, a])  # ordered
    assert context_hash([a, b], prefix="p") != context_hash([a, b])  # the prefix is part of the context
    assert context_hash([]) == context_root() and context_hash([], prefix="p") == context_root("p")
    assert context_hash([a, b, c]) == context_step(context_step(context_step(context_root(), a), b), c)
    assert context_hash([a, a]) != context_hash([a])
    assert orbit_context_hash([a, b]) == orbit_context_hash([b, a]) != orbit_context_hash([a, c])
    assert orbit_context_hash([a, a]) != orbit_context_hash([a])  # a multiset
    assert orbit_context_hash([a]) != orbit_context_hash([b])
    assert orbit_context_hash([a], prefix="p") != orbit_context_hash([a])
    assert orbit_context_hash([a, b]) != context_hash([a, b]) and orbit_context_hash([]) != context_hash([])
    assert chunk_key("h", "fp1") != chunk_key("h", "fp2") and chunk_key("h1", "fp") != chunk_key("h2", "fp")


def test_a_lone_string_is_refused():
    with pytest.raises(TypeError, match="^context_hash takes a sequence of chunk keys, not one string$"):
        context_hash("ab")
    with pytest.raises(TypeError, match="^orbit_context_hash takes a sequence of chunk keys, not one string$"):
        orbit_context_hash("ab")


def test_salted_keys_are_the_documented_format_and_the_empty_salt_is_unsalted():
    from windowkit.store import conditioned_key

    assert chunk_key("abc", "fp", salt="t") == digest(["chunk", "abc", "fp", "t"])
    assert context_root("p", salt="t") == digest(["ctx", "p", "t"])
    assert context_hash(["a"], prefix="p", salt="t") == digest([digest(["ctx", "p", "t"]), "a"])
    assert orbit_context_hash(["b", "a"], prefix="p", salt="t") == digest(["orbit", "p", ["a", "b"], "t"])
    assert conditioned_key("k", "c", salt="t") == digest(["conditioned", "k", "c", "t"])
    assert conditioned_key("k", "c", salt="") == conditioned_key("k", "c") == digest(["conditioned", "k", "c"])
    assert chunk_key("abc", "fp", salt="") == chunk_key("abc", "fp") and context_root("p", salt="") == context_root("p")
    assert orbit_context_hash(["a"], salt="") == orbit_context_hash(["a"])
