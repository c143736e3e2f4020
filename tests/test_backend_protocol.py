"""The Backend protocol is complete: every backend the Window runs on has every member, of the right kind
(method vs attribute), and the capability flags say what the optional methods do."""
from __future__ import annotations

import inspect
import typing

import pytest
import torch

import windowkit as wk
from windowkit.backends.base import Backend, BackendStats
from windowkit.backends.sglang.backend import SGLangBackend
from windowkit.backends.tiny import build
from windowkit.errors import UnsupportedModelError
from windowkit.kv.layout import KVLayout
from windowkit.kv.rope import RopeSpec
from windowkit.trace.backend import CostModelBackend

torch.set_num_threads(1)

METHODS = ("fingerprint", "positions", "span", "forward", "encode", "recompute", "query_attention", "forget",
           "make_cache", "check_kv")
FLAGS = ("needs_past", "supports_recompute", "reads_attention")
FACTS = {"layout": KVLayout, "rope": RopeSpec, "stats": BackendStats, "n_axes": int, "dtype": torch.dtype}


class _Engine:  # the SGLang engine is only reached by serve(); the protocol's members never touch it
    def generate(self, **kw):
        raise AssertionError("not served in this test")


@pytest.fixture(scope="module")
def backends():
    llama = wk.HFBackend(build("tiny-llama"))
    return {"hf-llama": llama, "hf-qwen-vl": wk.HFBackend(build("tiny-qwen2.5-vl")),
            "sglang": SGLangBackend(_Engine(), llama, page_size=16), "costmodel": CostModelBackend()}


def test_protocol_lists_every_member():
    members = set(typing.get_type_hints(Backend)) | {n for n in vars(Backend) if not n.startswith("_")}
    assert members == set(METHODS) | set(FLAGS) | set(FACTS)
    for name in METHODS:
        assert (getattr(Backend, name).__doc__ or "").strip(), f"Backend.{name} has no contract docstring"


@pytest.mark.parametrize("name", ["hf-llama", "hf-qwen-vl", "sglang", "costmodel"])
def test_backend_satisfies_protocol(backends, name):
    b = backends[name]
    assert isinstance(b, Backend)
    for m in METHODS:
        assert callable(getattr(b, m)), f"{name}.{m} is not a method"
        assert inspect.isroutine(getattr(type(b), m)), f"{name}.{m} is not defined as a method"
    for f in FLAGS:
        assert isinstance(getattr(b, f), bool), f"{name}.{f} is not a bool flag"
    for f, kind in FACTS.items():
        v = getattr(b, f)
        assert isinstance(v, kind) and not callable(v), f"{name}.{f} is not a {kind.__name__} attribute"


def test_flags_say_what_the_backends_do(backends):
    be = backends
    assert be["hf-llama"].needs_past and be["hf-llama"].supports_recompute and be["hf-llama"].reads_attention
    assert be["hf-qwen-vl"].supports_recompute and not be["hf-qwen-vl"].reads_attention
    assert be["sglang"].supports_recompute and be["sglang"].reads_attention  # read on its kv_backend
    assert not be["costmodel"].needs_past and be["costmodel"].supports_recompute
    assert not be["costmodel"].reads_attention
    q = wk.Chunk.text(torch.tensor([11, 12, 13]), id="q")
    for name in ("hf-qwen-vl", "costmodel"):
        b = be[name]
        past = b.forward([wk.Chunk.text(torch.tensor([20, 21, 22, 23]), id="p")], 0).kv
        with pytest.raises(UnsupportedModelError):
            b.query_attention(past, q, past.num_tokens)


def test_span_and_positions_agree(backends):
    c = wk.Chunk.text(torch.tensor([20, 21, 22, 23, 24]), id="s")
    for name, b in backends.items():
        pos, span = b.positions(c, 7)
        assert b.span(c) == span == 5 and pos.shape == (b.n_axes, 5), name


def test_window_types_its_backend_as_the_protocol():
    hints = typing.get_type_hints(wk.Window.__init__)
    assert hints["backend"] is Backend


def test_window_reads_capabilities_from_the_protocol(backends):
    """The query focus runs where ``reads_attention`` is True and not where it is False (the flag, not a probe
    for the method): same model, same edits, HFBackend vs an SGLangBackend over it that says it reads none."""

    class _NoAttention(SGLangBackend):
        reads_attention = False  # query_attention still works: only the flag may switch the focus off

    got = {}
    for name in ("hf-llama", "no-attention"):
        b = backends[name] if name in backends else _NoAttention(_Engine(), backends["hf-llama"], page_size=16)
        win = wk.Window(b, repair="query:8", focus_budget=None)
        for k in range(3):
            win.admit(wk.Chunk.text(torch.arange(20, 36) + k, id=f"c{k}"))
        win.evict("head")
        got[name] = win.focus([11, 12, 13], tokens=4)
    assert got == {"hf-llama": 4, "no-attention": 0}


def test_sglang_window_focuses_as_its_kv_backend_does(backends):
    """SGLangBackend reads a query's attention on its kv_backend: a Window served by SGLang keeps the default rule's
    question-aware part (no by-position stand-in), and its focus repairs the same tokens, to the same KV, as a Window
    on the kv_backend itself; both land nearer the model's own forward of the window than before the focus."""
    from model_helpers import reference_logits, text
    from windowkit.kv.metrics import kl_divergence

    llama, sg = backends["hf-llama"], backends["sglang"]
    cs = [text(llama, 40, 900 + i, f"s{i}") for i in range(4)]
    q = text(llama, 6, 999, "q")
    wins = [wk.Window(b, fidelity="balanced", focus_budget=None) for b in (llama, sg)]
    assert wins[0].repair.name == wins[1].repair.name and not wins[1].repair.name.endswith("@position")
    for w in wins:
        for c in cs:
            w.admit(c)
        w.evict("head")
    before = wins[1].window_kv()
    picked = [w.focus(q, tokens=16) for w in wins]
    assert picked == [16, 16]
    a, b = wins[0].window_kv(), wins[1].window_kv()
    for (ka, va), (kb, vb) in zip(a.layers, b.layers):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    ref = reference_logits(llama, cs[1:], q.input_ids)
    kl = [kl_divergence(ref, w.forward(q)) for w in wins]
    assert kl[0] == pytest.approx(kl[1], abs=1e-9)
    assert any(not torch.equal(x, y) for (x, _), (y, _) in zip(before.layers, b.layers))  # the focus wrote KV
